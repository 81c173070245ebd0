"""What the tests share: tree comparison, plain-JAX oracles, abstract accelerator
meshes, float64 on demand, the fused kernel's markers in lowered text, a trace
counter. Imported as ``from helpers import ...`` (``pythonpath = ["tests"]`` in
pyproject.toml). Oracles are plain JAX, never the library's own code (``bench/cases``':
``tests/conftest.py`` puts ``bench/`` on ``sys.path``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import cases
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

__all__ = [
    "KERNEL_MARKERS",
    "KERNEL_NAME",
    "TOL",
    "TraceCounter",
    "abstract_mesh",
    "assert_tree_close",
    "contains_kernel",
    "enable_x64",
    "normal",
    "on_abstract_device",
    "oracle",
    "primitives",
    "reduction_kwargs",
]

# ---------------------------------------------------------------------------- #
# Comparing pytrees
# ---------------------------------------------------------------------------- #

TOL = {
    np.dtype(jnp.float64): dict(rtol=1e-12, atol=1e-12),
    np.dtype(jnp.float32): dict(rtol=2e-5, atol=2e-5),
    np.dtype(jnp.float16): dict(rtol=2e-3, atol=2e-3),
    np.dtype(jnp.bfloat16): dict(rtol=2e-2, atol=2e-2),
}
EXACT = dict(rtol=0, atol=0)  # integers and booleans


# ---------------------------------------------------------------------------- #
# Test data
# ---------------------------------------------------------------------------- #


def normal(seed: int, shape: tuple[int, ...], dtype: Any = np.float32) -> jax.Array:
    """Standard normal test data, from NumPy's generator: ``jax.random`` compiles a
    program per shape outside ``jit`` (about 0.2 s each here), a few hundred over
    the suite."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _tolerance(dtype: np.dtype) -> dict[str, float]:
    if dtype in TOL:
        return TOL[dtype]
    if jnp.issubdtype(dtype, jnp.integer) or dtype == np.dtype(bool):
        return EXACT
    return dict(rtol=1e-5, atol=1e-5)


def assert_tree_close(
    actual: Any, expected: Any, *, rtol: float | None = None, atol: float | None = None
) -> None:
    """Leafwise comparison: same structure, shapes and dtypes, values within the
    tolerance of the expected leaf's dtype (integers exact) unless ``rtol``/``atol``
    are given."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected), (
        jax.tree.structure(actual),
        jax.tree.structure(expected),
    )
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = jnp.asarray(a), jnp.asarray(e)
        assert a.shape == e.shape, (a.shape, e.shape)
        assert a.dtype == e.dtype, (a.dtype, e.dtype)
        tol = dict(_tolerance(np.dtype(e.dtype)))
        tol.update({k: v for k, v in dict(rtol=rtol, atol=atol).items() if v is not None})
        wide = np.complex128 if jnp.iscomplexobj(e) else np.float64
        np.testing.assert_allclose(np.asarray(a, wide), np.asarray(e, wide), equal_nan=True, **tol)


# ---------------------------------------------------------------------------- #
# Oracles: the unchunked computation in plain JAX
# ---------------------------------------------------------------------------- #


def oracle(monoid: str, axis: int | None = None) -> Callable[[Any], Any]:
    """The leafwise plain-JAX reduction of a pytree (``"map"``: unchanged): the oracle of
    ``bench/cases``' :func:`~cases.plain_pair`."""
    return (lambda tree: tree) if monoid == "map" else cases.oracle(cases.plain_pair(monoid, axis))


def reduction_kwargs(monoid: str, axis: int | None = None) -> dict[str, Callable]:
    """``batch_map`` keywords that compute ``oracle(monoid, axis)`` chunk by chunk,
    written in plain JAX (leafwise over pytrees)."""
    return dict(zip(("reduction", "chunk_reduction"), cases.plain_pair(monoid, axis), strict=True))


# ---------------------------------------------------------------------------- #
# float64
# ---------------------------------------------------------------------------- #


def enable_x64(enabled: bool = True) -> contextlib.AbstractContextManager:
    """float64 inside the block (restored afterwards); a no-op when not ``enabled``."""
    return jax.enable_x64(True) if enabled else contextlib.nullcontext()


# ---------------------------------------------------------------------------- #
# Accelerators that are not present: abstract meshes and kernel markers
# ---------------------------------------------------------------------------- #

ABSTRACT_DEVICES = {
    "cuda": dict(device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="cuda"),
    "tpu": dict(device_kind="TPU v5 lite", num_cores=1, platform="tpu"),
}


def abstract_mesh(platform: str) -> AbstractMesh:
    """A one-device ``AxisType.Auto`` mesh of an NVIDIA H100 (``"cuda"``) or a TPU v5
    lite (``"tpu"``): jitting under it lowers for that platform on any machine."""
    device = AbstractDevice(**ABSTRACT_DEVICES[platform])
    return AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=device)


@contextlib.contextmanager
def on_abstract_device(platform: str) -> Iterator[None]:
    with jax.sharding.use_abstract_mesh(abstract_mesh(platform)):
        yield


KERNEL_NAME = "adv_jax_math_fused_reduce"  # our pallas_call's name, in jaxprs and lowered text
KERNEL_MARKERS = {
    "cuda": ("__gpu$xla.gpu.triton", "triton_kernel_call", "mosaic_gpu"),  # Triton, Mosaic GPU
    "tpu": ("tpu_custom_call",),  # Pallas Mosaic TPU
}


def contains_kernel(text: str, platform: str) -> bool:
    """Whether lowered text (or a printed jaxpr, with ``platform="cpu"``) contains the
    fused kernel: compiled for ``"cuda"``/``"gpu"`` or ``"tpu"``, or in interpret mode
    (``"cpu"``: our kernel's name and no compiled custom call)."""
    platform = {"gpu": "cuda"}.get(platform, platform)
    if platform == "cpu":
        compiled = [m for markers in KERNEL_MARKERS.values() for m in markers]
        return KERNEL_NAME in text and not any(m in text for m in compiled)
    return any(m in text for m in KERNEL_MARKERS[platform])


# ---------------------------------------------------------------------------- #
# Trace counting
# ---------------------------------------------------------------------------- #


class TraceCounter:
    """Wraps ``fun``; ``calls`` counts Python calls (traces, under jit) and ``shapes``
    records the leading leaf shape of each."""

    def __init__(self, fun: Callable):
        self.fun, self.calls, self.shapes = fun, 0, []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        leaves = jax.tree.leaves((args, kwargs))
        self.shapes.append(tuple(np.shape(leaves[0])) if leaves else ())
        return self.fun(*args, **kwargs)


# ---------------------------------------------------------------------------- #
# What the oldest supported jax (0.9.2) lacks
# ---------------------------------------------------------------------------- #

needs_kernel = pytest.mark.skipif(
    jax.__version_info__ < (0, 10, 0),
    reason="the fused kernel (and even max/min ties) need jax >= 0.10.0: older jax fails "
    "to differentiate a custom_jvp whose tangent is a scan; the library falls back to scan",
)
needs_abstract_devices = pytest.mark.skipif(
    jax.__version_info__ < (0, 10, 1),
    reason="lowering for an absent GPU/TPU needs AbstractDevice(platform=), jax >= 0.10.1",
)


ENGINES = ("scan", "interpret", "shard")  # what :func:`engine` runs under


def each_on_an_engine(cases: Any) -> list[Any]:
    """``(case, engine)`` parameters for every case on every engine of :func:`engine`:
    by default case ``i`` on engine ``i % 3`` (every case once, every engine at least
    once), the rest of the product marked slow (``make test-slow``)."""
    return [
        pytest.param(c, e, marks=() if i % len(ENGINES) == j else pytest.mark.slow)
        for i, c in enumerate(cases)
        for j, e in enumerate(ENGINES)
    ]


@contextlib.contextmanager
def engine(name: str) -> Iterator[dict[str, Any]]:
    """Run under one engine: ``"scan"``, ``"interpret"`` (the fused kernel in
    interpret mode) or ``"shard"`` (4 devices); yields ``batch_map``'s extra keywords.
    Skips where this jax or the device count cannot run it."""
    import adv_jax_math as ajm

    if name == "interpret" and jax.__version_info__ < (0, 10, 0):
        pytest.skip(needs_kernel.kwargs["reason"])
    if name == "shard" and jax.device_count() != 4:
        pytest.skip("needs the 4 virtual CPU devices")
    with ajm.config(backend="interpret") if name == "interpret" else contextlib.nullcontext():
        yield dict(shard=True) if name == "shard" else {}


def primitives(jaxpr):
    """Every primitive's name, into sub-jaxprs but not into kernels; kernels by name."""
    out = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "pallas_call":
            info = eqn.params.get("name_and_src_info") or eqn.params.get("name")
            out.append(f"pallas_call:{getattr(info, 'name', info)}")
            continue
        out.append(name)
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else [p]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += primitives(inner)
    return out
