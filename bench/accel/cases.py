"""Cases compiled for real GPUs/TPUs by ``compile_targets.py`` (deviceless).

Each :class:`Case` is one public call ``adv_jax_math.batch_map(fun, xs, batch_size,
reduction=..., chunk_reduction=...)``, optionally under ``jax.value_and_grad``.

* ``test_*``: the abstract-lowering table and gradient cases of tests/test_lowering.py
  (there they are only *lowered*; here they are compiled), plus the ``(N, 8, 16)``
  f32/bf16/int32 blocks.
* ``issue_*``: the cases reported failing on hardware (VMEM OOM on TPU, Triton
  failure on GPU, "Sublane gather not supported" on TPU v4).

``kernel_on``: targets where the case must take the fused kernel; ``fallback_on``:
targets where its kernel does not compile and the call must fall back to the scan
engine with the compiler's message (the dispatch rule), ``{target: text}``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

S = jax.ShapeDtypeStruct
F32, BF16, I32 = jnp.float32, jnp.bfloat16, jnp.int32

# (reduction, chunk_reduction) pairs recognized as monoids
SUM_ALL = (jnp.add, jnp.sum)
SUM0 = (jnp.add, jnp.add.reduce)
MAX_ALL = (jnp.maximum, jnp.max)
MAX0 = (jnp.maximum, jnp.maximum.reduce)
LSE_ALL = (jnp.logaddexp, jax.nn.logsumexp)
DESC_SUM0 = (jnp.add, lambda x: x.sum(axis=0))  # DESC's singular-integral call form
MAIN = ("h100", "h200", "a100", "v5e", "v6e", "v5p")  # the kernel must compile on these
V4_GATHER = {"v4": "Sublane gather"}  # lane reductions: v4 lacks the sublane gather


@dataclasses.dataclass(frozen=True)
class Case:
    """One compiled call.

    fun : ``fun(xs)``, or ``fun(params, xs)`` when ``params`` is given (then ``params``
        is a traced argument of the jitted function, closed over by the mapped fun).
    grad : None (forward only), ``"inputs"``, ``"params"`` or ``"both"``: compile
        ``jax.value_and_grad`` of the sum of the outputs w.r.t. those arguments.
    expect : what tests/test_lowering.py (or the issue) says, for the report only.
    """

    name: str
    fun: Callable[..., Any]
    inputs: Any
    batch_size: int | None
    reduction: tuple[Callable, Callable]
    params: Any = None
    grad: str | None = None
    x64: bool = False
    quick: bool = False
    expect: str = ""
    kernel_on: tuple[str, ...] = ()
    fallback_on: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def n(self) -> int:
        return int(jax.tree.leaves(self.inputs)[0].shape[0])


# --------------------------------------------------------------------------- #
# Functions
# --------------------------------------------------------------------------- #

W4 = np.array([0.5, -1.0, 2.0, 0.25], np.float32)
# 128 fixed probe points (4 coordinates, the 4th zero-padded as in the tests)
PROBES = np.linspace(-1, 1, 128 * 4, dtype=np.float32).reshape(128, 4)
MEANS = np.linspace(-3, 3, 16, dtype=np.float32)  # 16 mixture components


def field_of_sources(src):
    """Field of point sources at 128 fixed probes: {"pos": (B,4), "m": (B,)} -> (B,128,4)."""
    d = PROBES[None, :, :] - src["pos"][:, None, :]
    r2 = jnp.sum(d * d, axis=-1, keepdims=True) + 1e-3
    return d * (src["m"][:, None, None] / (r2 * jnp.sqrt(r2)))


def potential_at_probes(p):
    """(n, 4) N-body: potential of each body at the 128 probes, summed -> (B,)."""
    d = PROBES[None, :, :] - p[:, None, :]
    r2 = jnp.sum(d * d, axis=-1) + 1e-3
    return jnp.sum(1.0 / jnp.sqrt(r2), axis=-1)


def mixture_components(x):
    """Mixture log-likelihood terms: x (B,) -> (B, 16) log N(x; mu_k, 1) - log 16."""
    return -0.5 * (x[:, None] - MEANS[None, :]) ** 2 - (0.5 * np.log(2 * np.pi) + np.log(16.0))


def mixture_rows(x):
    """Per-row mixture log-likelihood: x (B,) -> (B,) (logsumexp over the 16 means)."""
    return jax.nn.logsumexp(mixture_components(x), axis=1)


# --------------------------------------------------------------------------- #
# Cases
# --------------------------------------------------------------------------- #

CASES: list[Case] = [
    # --- tests/test_lowering.py table -------------------------------- #
    Case("test_elementwise_1d", jnp.sin, S((4096,), F32), 1024, LSE_ALL, quick=True),
    Case(
        "test_2p25_rows_looped",
        lambda x: x + 1.0,
        S((1 << 25,), F32),
        1 << 25,
        LSE_ALL,
        expect="blocks looped in-kernel",
    ),
    Case("test_closure_n4", lambda x: x * W4, S((1000, 4), F32), 64, SUM0, quick=True),
    Case("test_n48_max", jnp.cos, S((300, 4, 8), F32), 128, MAX_ALL),
    Case(
        "test_pytree_bf16_int",
        lambda d: (d["a"] * 2, d["i"] + 1),
        {"a": S((999, 4), BF16), "i": S((999, 4), I32)},
        256,
        MAX0,
    ),
    Case(
        "test_nbody_field_5000",
        field_of_sources,
        {"pos": S((5000, 4), F32), "m": S((5000,), F32)},
        2048,
        SUM0,
    ),
    Case("test_n3_fallback", jnp.sin, S((1000, 3), F32), 256, LSE_ALL, expect="GPU: power-of-two"),
    Case(
        "test_f64", jnp.sin, S((1000, 4), jnp.float64), 256, LSE_ALL, x64=True, expect="TPU: 64-bit"
    ),
    Case(
        "test_sort",
        lambda x: jnp.sort(x, axis=1),
        S((1000, 4), F32),
        256,
        LSE_ALL,
        expect="both: lowering failed",
    ),
    Case(
        "test_slice",
        lambda x: x[:, 1:3] * x[:, :2],
        S((1000, 4), F32),
        256,
        LSE_ALL,
        expect="GPU: slice",
    ),
    Case("test_bs4_n4", jnp.sin, S((100, 4), F32), 4, LSE_ALL, expect="TPU: at least 8 rows"),
    Case("test_bs64_1d", jnp.sin, S((1000,), F32), 64, LSE_ALL, expect="TPU: at least 128 rows"),
    # --- (N, 8, 16) blocks in three dtypes ---------------------------------- #
    Case("test_n816_f32", lambda x: x * x - 0.5, S((10007, 8, 16), F32), 1024, SUM0, quick=True),
    Case("test_n816_bf16", lambda x: x * x - 0.5, S((10007, 8, 16), BF16), 1024, SUM0),
    Case("test_n816_i32", lambda x: x * 3 - 7, S((10007, 8, 16), I32), 1024, MAX0),
    # --- gradients ---------------------------------------------------------- #
    Case(
        "test_grad_params_lse",
        lambda w, x: x * w,
        S((4096, 4), F32),
        1024,
        LSE_ALL,
        params=S((4,), F32),
        grad="params",
        quick=True,
    ),
    Case(
        "test_grad_both_tanh",
        lambda p, x: jnp.tanh(x * p["w"]) + p["b"] * x,
        S((4099, 4), F32),
        1024,
        SUM0,
        params={"w": S((4,), F32), "b": S((), F32)},
        grad="both",
    ),
    # --- the issue ---------------------------------------------------------- #
    Case(
        "issue_field",
        field_of_sources,
        {"pos": S((20001, 4), F32), "m": S((20001,), F32)},
        2048,
        SUM0,
        quick=True,
        expect="TPU: CompileTimeScopedVmemOom 62.24M/16M (v4 67.99M)",
        kernel_on=MAIN,
    ),
    Case(
        "issue_field_vg",
        field_of_sources,
        {"pos": S((20001, 4), F32), "m": S((20001,), F32)},
        2048,
        SUM0,
        grad="inputs",
        expect="TPU: VMEM OOM",
        kernel_on=MAIN,
    ),
    Case(
        "issue_tanh_bf16",
        lambda v: jnp.tanh(v) * v,
        S((100003, 8, 16), BF16),
        8192,
        SUM0,
        quick=True,
        expect="GPU: Failed to compile Triton kernel; v5e VMEM",
        kernel_on=MAIN,
    ),
    Case(
        "issue_tanh_bf16_upcast",
        lambda v: (jnp.tanh(v.astype(F32)) * v).astype(BF16),
        S((100003, 8, 16), BF16),
        8192,
        SUM0,
        expect="(workaround: tanh evaluated in f32)",
    ),
    Case(
        "issue_tanh_f32",
        lambda v: jnp.tanh(v) * v,
        S((100003, 8, 16), F32),
        8192,
        SUM0,
        expect="(contrast to issue_tanh_bf16)",
    ),
    Case(
        "issue_mixture",
        mixture_components,
        S((100003,), F32),
        4096,
        LSE_ALL,
        quick=True,
        expect="v4: Sublane gather not supported",
    ),
    Case(
        "issue_mixture_rows",
        mixture_rows,
        S((100003,), F32),
        4096,
        LSE_ALL,
        expect="v4: Sublane gather not supported",
        fallback_on=V4_GATHER,
    ),
    Case(
        "issue_nbody4",
        potential_at_probes,
        S((20001, 4), F32),
        2048,
        SUM_ALL,
        quick=True,
        expect="v4: Sublane gather not supported",
        fallback_on=V4_GATHER,
    ),
    Case(
        "issue_nbody4_vg",
        potential_at_probes,
        S((20001, 4), F32),
        2048,
        SUM_ALL,
        grad="inputs",
        expect="v4: Sublane gather not supported",
        fallback_on=V4_GATHER,
    ),
]

CASES.append(
    Case(
        "desc_lambda_sum0",
        lambda x: jnp.sin(x) * x,
        S((6001, 8), F32),
        300,
        DESC_SUM0,
        quick=True,
        kernel_on=MAIN,
        expect="DESC's call form: chunk_reduction=lambda x: x.sum(axis=0)",
    )
)

BY_NAME = {c.name: c for c in CASES}
assert len(BY_NAME) == len(CASES), "case names must be unique"


def select(names: list[str] | None = None, quick: bool = False) -> list[Case]:
    """Cases by name (exact or prefix ``issue_``/``test_``...), or the quick subset."""
    if names:
        out = []
        for name in names:
            hits = [c for c in CASES if c.name == name] or [
                c for c in CASES if c.name.startswith(name)
            ]
            if not hits:
                raise SystemExit(f"unknown case {name!r}; known: {', '.join(BY_NAME)}")
            out += [c for c in hits if c not in out]
        return out
    return [c for c in CASES if c.quick] if quick else list(CASES)
