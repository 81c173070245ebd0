"""``batch_map(fun, xs, batch_size, reduction=...)``, the fused map-reduce over rows:
the cases. ``bench/accel/compile_targets.py`` compiles every one for real GPUs and TPUs
(deviceless), ``tests/test_lowering.py`` lowers those of ``LOWERING`` for an abstract
H100 and TPU v5e, ``bench/device_check.py`` times the ``roofline_*`` ones.

Each :class:`Case` is one public call ``adv_jax_math.batch_map(fun, xs, batch_size,
reduction=..., chunk_reduction=...)`` (or ``reduction=`` a monoid object or a pytree
of them, with the default ``chunk_reduction``), optionally under ``jax.value_and_grad``;
its plain-JAX oracle is ``Case.program(plain=True)``.

* ``test_*``: the abstract-lowering table of tests/test_lowering.py (there only
  *lowered*: ``LOWERING``), gradients, and the ``(N, 8, 16)`` f32/bf16/int32 blocks.
* ``issue_*``: the cases reported failing on hardware (VMEM OOM on TPU, Triton
  failure on GPU, "Sublane gather not supported" on TPU v4).
* ``monoid_*``: the stateful monoids (arg-extrema, top-k, softmax-weighted sums,
  means and variances, a pytree of monoids) on the shapes users run them on: k-NN
  distances, attention, per-feature statistics; padded blocks (n not a multiple
  of the block), bf16, and one ``value_and_grad`` per differentiable family.

``kernel_on``: targets where the case must take the fused kernel; ``fallback_on``:
targets where its kernel does not compile and the call must fall back to the scan
engine with the compiler's message (the dispatch rule), ``{target: text}``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import adv_jax_math as ajm

from . import oracle

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
V4_GATHER = {"v4": "Sublane gather"}
TPUS = ("v5e", "v6e", "v5p", "v4")
ALL = (*MAIN, "v4")  # lane reductions: v4 lacks the sublane gather


@dataclasses.dataclass(frozen=True)
class Case:
    """One compiled call.

    fun : ``fun(xs)``, or ``fun(params, xs)`` when ``params`` is given (then ``params``
        is a traced argument of the jitted function, closed over by the mapped fun).
    grad : None (forward only), ``"inputs"``, ``"params"`` or ``"both"``: compile
        ``jax.value_and_grad`` of the sum of the outputs w.r.t. those arguments.
    loc : the mean of the floats :meth:`arrays` draws (``loc + N(0, 1)``).
    expect : what tests/test_lowering.py (or the issue) says, for the report only.
    mosaic_gpu : Pallas Mosaic GPU's kernel on Hopper and newer (compute capability
        >= 9.0; ``fun`` row by row, feature by feature), Triton's on older GPUs
        (``--check`` of ``bench/accel/compile_targets.py``).
    mosaic_gpu_forward : Mosaic GPU's forward kernel only, and why its backward
        kernel declines (then Triton's runs; without Triton, the scan engine's).
    """

    name: str
    fun: Callable[..., Any]
    inputs: Any
    batch_size: int | None
    reduction: Any  # a (reduction, chunk_reduction) pair, a Monoid, or a pytree of them
    params: Any = None
    grad: str | None = None
    quick: bool = False
    loc: float = 0.0
    expect: str = ""
    kernel_on: tuple[str, ...] = ()
    fallback_on: dict[str, str] = dataclasses.field(default_factory=dict)
    mosaic_gpu: bool = False
    mosaic_gpu_forward: str = ""  # Mosaic GPU takes the forward only: why not the backward

    @property
    def x64(self) -> bool:
        return any(s.dtype == jnp.float64 for s in jax.tree.leaves((self.params, self.inputs)))

    @property
    def roofline(self) -> bool:
        """The roofline table's cases: the scan engine's forward and ``value_and_grad``
        programs are compiled too, to count their launches."""
        return self.name.startswith("roofline_")

    @property
    def n(self) -> int:
        return int(jax.tree.leaves(self.inputs)[0].shape[0])

    @property
    def reduction_kwargs(self) -> dict[str, Any]:
        """The ``reduction=`` (and ``chunk_reduction=``) arguments of ``batch_map``."""
        red = self.reduction
        is_monoid = lambda r: isinstance(r, ajm.Monoid)
        if isinstance(red, tuple) and len(red) == 2 and not any(map(is_monoid, red)):
            return {"reduction": red[0], "chunk_reduction": red[1]}
        return {"reduction": red}

    def at(self, n: int) -> Case:
        """This case on ``n`` rows (the benchmarks' sizes, the tests' small ones)."""
        rows = lambda s: S((n, *s.shape[1:]), s.dtype)
        return dataclasses.replace(self, inputs=jax.tree.map(rows, self.inputs))

    def arrays(self, seed: int = 0) -> tuple[Any, Any]:
        """``(params, xs)`` drawn at random as NumPy arrays of the cases' shapes and
        dtypes: floats ``loc + N(0, 1)``, integers in [-50, 50)."""
        rng = np.random.default_rng(seed)

        def draw(s):
            if jnp.issubdtype(s.dtype, jnp.integer):
                return rng.integers(-50, 50, s.shape).astype(s.dtype)
            return rng.normal(self.loc, 1.0, s.shape).astype(s.dtype)

        return jax.tree.map(draw, (self.params, self.inputs))

    def bind(self, params: Any) -> Callable[..., Any]:
        """``fun`` of the rows alone, ``params`` closed over (where the case has them)."""
        return self.fun if self.params is None else functools.partial(self.fun, params)

    def program(self, grad: bool = True, plain: bool = False) -> Callable[..., Any]:
        """The function of ``(params, xs)`` to compile: the call (``plain``: its plain-JAX
        oracle, unchunked), or (``grad`` and the case has one) ``jax.value_and_grad`` of
        the sum of its outputs (in float32) w.r.t. the case's ``grad`` arguments."""
        reduce = oracle(self.reduction)

        def call(params, xs):
            if plain:
                return reduce(self.bind(params)(xs))
            return ajm.batch_map(self.bind(params), xs, self.batch_size, **self.reduction_kwargs)

        if self.grad is None or not grad:
            return call
        argnums = {"inputs": 1, "params": 0, "both": (0, 1)}[self.grad]
        loss = lambda p, xs: sum(jnp.sum(v.astype(F32)) for v in jax.tree.leaves(call(p, xs)))
        return jax.value_and_grad(loss, argnums=argnums)


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


# 128 queries of 16 coordinates (k-NN), 32 attention queries of 64 features
QUERIES = np.linspace(-1, 1, 128 * 16, dtype=np.float32).reshape(128, 16)
QUERY_NORMS = np.sum(QUERIES * QUERIES, axis=1)
ATTN_Q = np.linspace(-1, 1, 32 * 64, dtype=np.float32).reshape(32, 64)


def knn_distances(p, queries=QUERIES, norms=QUERY_NORMS):
    """Squared distances of points (B, 16) to 128 queries -> (B, 128), written as
    k-NN libraries do: |p|^2 - 2 p.q + |q|^2 (one matmul, no (B, 128, 16) array;
    the queries' norms computed once)."""
    sq = jnp.sum(p * p, axis=1, keepdims=True)
    return sq - 2.0 * (p @ queries.T) + norms[None, :]


def attention(kv, queries=ATTN_Q):
    """Attention scores of keys (B, d) for the queries (32 of d = 64 by default), over
    sqrt(d), and the values: {"k": (B, d), "v": (B, e)} -> ((B, 32), (B, e));
    softmax-weighted: (32, e)."""
    return (kv["k"] @ queries.T) / queries.shape[1] ** 0.5, kv["v"]


def attention_bf16(kv):
    """:func:`attention` of bf16 keys and values with bf16 queries, the scores
    accumulated and returned in float32 (as attention kernels do)."""
    q = jnp.asarray(ATTN_Q, BF16)
    return jnp.matmul(kv["k"], q.T, preferred_element_type=F32) * 0.125, kv["v"]


# The roofline table's layer: 16 features to 32, and 8 mixture means of 16 features
W16 = np.linspace(-0.5, 0.5, 16 * 32, dtype=np.float32).reshape(16, 32)


def layer(w, x):
    """tanh(x @ w): (B, 16) -> (B, 32)."""
    return jnp.tanh(x @ w)


def mixture_of_means(mu, x):
    """Per-row log-likelihood under a unit-variance mixture: x (B, 16), mu (8, 16) -> (B,)."""
    return jax.nn.logsumexp(-jnp.sum((x[:, None, :] - mu[None]) ** 2, axis=-1), axis=1)


# --------------------------------------------------------------------------- #
# Cases
# --------------------------------------------------------------------------- #

# the issue's cases, forward and value_and_grad w.r.t. the inputs
ISSUE_FIELD = Case(
    "issue_field",
    field_of_sources,
    {"pos": S((20001, 4), F32), "m": S((20001,), F32)},
    2048,
    SUM0,
    expect="TPU: CompileTimeScopedVmemOom 62.24M/16M (v4 67.99M)",
    kernel_on=MAIN,
)
ISSUE_NBODY4 = Case(
    "issue_nbody4",
    potential_at_probes,
    S((20001, 4), F32),
    2048,
    SUM_ALL,
    expect="v4: Sublane gather not supported",
    fallback_on=V4_GATHER,
)


def vg(case: Case, **changes) -> Case:
    """``case`` under ``jax.value_and_grad`` with respect to its inputs."""
    return dataclasses.replace(case, name=f"{case.name}_vg", grad="inputs", **changes)


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
    Case("test_closure_n4", lambda x: x * W4, S((1000, 4), F32), 64, SUM0),
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
    Case(
        "test_n3_fallback",
        jnp.sin,
        S((1000, 3), F32),
        256,
        LSE_ALL,
        expect="A100: power-of-two; Hopper: Mosaic GPU, feature by feature",
    ),
    Case("test_f64", jnp.sin, S((1000, 4), jnp.float64), 256, LSE_ALL, expect="TPU: 64-bit"),
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
    Case("test_n816_f32", lambda x: x * x - 0.5, S((10007, 8, 16), F32), 1024, SUM0),
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
    ISSUE_FIELD,
    vg(ISSUE_FIELD, expect="TPU: VMEM OOM"),
    Case(
        "issue_tanh_bf16",
        lambda v: jnp.tanh(v) * v,
        S((100003, 8, 16), BF16),
        8192,
        SUM0,
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
    ISSUE_NBODY4,
    vg(ISSUE_NBODY4),
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

# --- stateful monoids --------------------------------------------------------- #
KNN = S((10007, 16), F32)  # 10007 points: no block size divides it
KV = {"k": S((10007, 64), F32), "v": S((10007, 64), F32)}
KV_BF16 = {"k": S((10007, 64), BF16), "v": S((10007, 64), BF16)}
CASES += [
    Case(
        "monoid_knn_topk16",
        knn_distances,
        KNN,
        1024,
        ajm.top_k(16, smallest=True),
        expect="k-NN: the 16 nearest of 10007 points per query",
        kernel_on=ALL,
    ),
    Case(
        "monoid_knn_argmin",
        knn_distances,
        KNN,
        1024,
        ajm.ARGMIN,
        quick=True,
        expect="k-NN: the nearest point per query",
        kernel_on=ALL,
    ),
    Case(
        "monoid_knn_min_argmin_vg",
        knn_distances,
        KNN,
        1024,
        ajm.MIN_ARGMIN,
        grad="inputs",
        expect="nearest distances and indices; gradient of the distances",
        kernel_on=ALL,
    ),
    Case(
        "monoid_knn_topk8_vg",
        lambda q, p: knn_distances(p, q, jnp.sum(q * q, axis=1)),  # trained queries
        KNN,
        1024,
        ajm.top_k(8, smallest=True),
        params=S((128, 16), F32),
        grad="both",
        expect="8 nearest; gradient w.r.t. points and queries",
        kernel_on=MAIN,
        fallback_on=V4_GATHER,  # |q|^2 of the traced queries: a lane reduction
    ),
    Case(
        "monoid_topk4_bf16",
        lambda x: x * x - 0.5,
        S((10007, 8, 16), BF16),
        1024,
        ajm.top_k(4),
        expect="the 4 largest bf16 rows per element",
        kernel_on=ALL,
    ),
    Case(
        "monoid_argmax_i32",
        lambda x: x * 3 - 7,
        S((10007, 8, 16), I32),
        1024,
        ajm.ARGMAX,
        expect="integer argmax",
        kernel_on=ALL,
    ),
    Case(
        "monoid_argmin_1d_bf16",
        jnp.sin,
        S((100003,), BF16),
        4096,
        ajm.ARGMIN,
        expect="1-D bf16 rows, the last block padded: v5e/v6e/v5p Mosaic 'Sublane broadcast'",
        kernel_on=("h100", "h200", "a100", "v4"),
        fallback_on=dict.fromkeys(("v5e", "v6e", "v5p"), "Sublane broadcast"),
    ),
    Case(
        "monoid_max_argmax_1d",
        lambda x: jnp.sin(x) * x,
        S((100003,), F32),
        4096,
        ajm.MAX_ARGMAX,
        expect="1-D rows: a 0-d state",
        kernel_on=ALL,
    ),
    Case(
        "monoid_attention",
        attention,
        KV,
        1024,
        ajm.SOFTMAX_WEIGHTED,
        expect="attention over 10007 keys, 32 queries",
        kernel_on=ALL,
    ),
    Case(
        "monoid_attention_lse_bf16",
        attention_bf16,
        KV_BF16,
        1024,
        ajm.softmax_weighted(return_lse=True),
        expect="bf16 keys, values and queries (f32 scores), with the logsumexp",
        kernel_on=ALL,
    ),
    Case(
        "monoid_attention_bf16_scores",
        lambda kv: attention(kv, jnp.asarray(ATTN_Q, BF16)),
        KV_BF16,
        1024,
        ajm.SOFTMAX_WEIGHTED,
        expect="TPU: a bf16 matmul result (Mosaic accumulates in 32 bits): declined statically",
        fallback_on=dict.fromkeys(TPUS, "matmuls accumulate in 32 bits"),
        kernel_on=("h100", "h200", "a100"),
    ),
    Case(
        "monoid_attention_pool",
        lambda sv: (jnp.tanh(sv["s"]), sv["v"]),
        {"s": S((10007,), F32), "v": S((10007, 64), F32)},
        1024,
        ajm.SOFTMAX_WEIGHTED,
        expect="attention pooling: one score per row (given), (n, 64) values",
        kernel_on=ALL,
    ),
    Case(
        "monoid_attention_vg",
        lambda q, kv: attention(kv, q),
        KV,
        1024,
        ajm.SOFTMAX_WEIGHTED,
        params=S((32, 64), F32),
        grad="both",
        expect="gradient w.r.t. queries, keys and values",
        kernel_on=ALL,
    ),
    Case(
        "monoid_mean_var4",
        lambda x: x * W4 + 100.0,
        S((10007, 4), F32),
        1024,
        ajm.MEAN_VAR,
        quick=True,
        expect="per-feature mean and variance of (n, 4)",
        kernel_on=ALL,
    ),
    Case(
        "monoid_mean_bf16",
        lambda x: x * x - 0.5,
        S((10007, 8, 16), BF16),
        1024,
        ajm.MEAN,
        expect="bf16 mean (f32 accumulation)",
        kernel_on=ALL,
    ),
    Case(
        "monoid_var_ddof1_vg",
        lambda w, x: jnp.tanh(x * w),
        S((10007, 16), F32),
        1024,
        ajm.var(ddof=1),
        params=S((16,), F32),
        grad="both",
        quick=True,
        expect="sample variance; gradient w.r.t. inputs and params",
        kernel_on=ALL,
    ),
    Case(
        "monoid_pytree",
        lambda p: {"a": p * 2.0, "b": knn_distances(p)},
        KNN,
        1024,
        {"a": ajm.MEAN, "b": ajm.ARGMIN},
        quick=True,
        expect="a pytree of monoids: one kernel, two states",
        kernel_on=ALL,
    ),
]

# The roofline table (bench/accel/table.py): value_and_grad through the
# fused kernels next to the scan engine's programs for the same call.
ROWS = S((100003, 16), F32)


def roofline(name: str, fun, params: tuple, reduction, grad: str, expect: str) -> Case:
    return Case(f"roofline_{name}", fun, ROWS, 1024, reduction, S(params, F32), grad, expect=expect)


CASES += [
    roofline(
        "add_params",
        layer,
        (16, 32),
        SUM0,
        "params",
        "a layer's weights: the constants' cotangents summed per program",
    ),
    roofline("add_inputs", layer, (16, 32), SUM0, "inputs", "the inputs' cotangents, one row each"),
    roofline(
        "mixture_means",
        mixture_of_means,
        (8, 16),
        SUM0,
        "params",
        "a mixture's means through a logsumexp inside fun",
    ),
    roofline(
        "max_vector",
        lambda v, x: jnp.sin(x @ W16) * v,
        (32,),
        MAX0,
        "params",
        "max over rows: the tied rows tallied first",
    ),
]

# The cases Pallas Mosaic GPU's kernel takes on Hopper and newer (row by row, products
# by constant matrices included, wide rows in element groups, float64 as int64 bits,
# blocks of at least 128 rows; a gradient's backward kernel too): 31 of the 48 cases in
# the deviceless H100 compile, and the forward of one more (MOSAIC_GPU_FORWARD); the
# others take Triton or the scan engine, each with its reason.
MOSAIC_GPU = {
    "test_elementwise_1d", "test_n48_max", "test_pytree_bf16_int", "test_n3_fallback", "test_f64",
    "test_n816_f32", "test_n816_bf16", "test_n816_i32",
    "test_grad_params_lse", "test_grad_both_tanh", "issue_field", "issue_field_vg",
    "issue_tanh_bf16", "issue_tanh_bf16_upcast", "issue_tanh_f32",
    "issue_mixture", "issue_mixture_rows", "desc_lambda_sum0",
    "monoid_knn_argmin", "monoid_knn_min_argmin_vg", "monoid_topk4_bf16", "monoid_argmax_i32",
    "monoid_argmin_1d_bf16", "monoid_max_argmax_1d", "monoid_mean_var4", "monoid_mean_bf16",
    "monoid_var_ddof1_vg", "monoid_pytree",
    "roofline_add_params", "roofline_add_inputs", "roofline_max_vector",
}  # fmt: skip
# Mosaic GPU's forward kernel, not its backward kernel (k-NN top-8's VJP: one distance
# needs 74 values of its row at once, with its 8 slots' cotangents, rows and values).
MOSAIC_GPU_FORWARD = {"monoid_knn_topk8_vg": "a thread may hold in a VJP"}
CASES = [
    dataclasses.replace(
        c, mosaic_gpu=c.name in MOSAIC_GPU, mosaic_gpu_forward=MOSAIC_GPU_FORWARD.get(c.name, "")
    )
    for c in CASES
]

# bench/bench_monoids.py's cases against plain JAX, at the issue's sizes (its quick run
# and the tests take them smaller: Case.at): the 16 nearest and the nearest of 2^20
# rows to 256 queries, softmax-weighted sums of 2^20 value rows (16 floats) by 64
# queries' scores, the variance of 2^24 values 1000 + N(0, 1).
KNN_QUERIES, SOFTMAX_QUERIES = S((256, 16), F32), S((64, 16), F32)
knn_of_params = lambda q, p: knn_distances(p, q, jnp.sum(q * q, axis=1))
MONOIDS_BENCH = {
    "topk": Case(
        "bench_knn_topk16",
        knn_of_params,
        S((2**20, 16), F32),
        2**14,
        ajm.top_k(16, smallest=True),
        params=KNN_QUERIES,
    ),
    "argmin": Case(
        "bench_knn_argmin", knn_of_params, S((2**20, 16), F32), 2**14, ajm.ARGMIN, KNN_QUERIES
    ),
    "close": Case(
        "bench_softmax_weighted",
        lambda q, kv: attention(kv, q),
        {"k": S((2**20, 16), F32), "v": S((2**20, 16), F32)},
        2**14,
        ajm.SOFTMAX_WEIGHTED,
        params=SOFTMAX_QUERIES,
    ),
    "var": Case("bench_var", lambda x: x, S((2**24,), F32), 2**16, ajm.VAR, loc=1000.0),
}

# tests/test_lowering.py's cases: (GPU, TPU) expectations of the plan on an abstract H100
# and TPU v5e with the roofline model's veto off: None the kernel, else what the scan
# engine's reason says (for sort the lowering's own message, naming the primitive)
LOWERING = {
    "test_elementwise_1d": (None, None),
    "test_2p25_rows_looped": (None, None),
    "test_closure_n4": (None, None),
    "test_n48_max": (None, None),
    "test_pytree_bf16_int": (None, None),
    "test_nbody_field_5000": (None, None),
    "test_n3_fallback": (None, None),  # H100: Mosaic GPU (A100: Triton's power-of-two)
    "test_f64": (None, "64-bit"),
    "test_sort": ("sort", "sort"),
    "test_slice": ("slice", None),
    "test_bs4_n4": (None, "at least 8"),
    "test_bs64_1d": (None, "at least 128"),
}

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
