"""``post(batch_map(fun, xs, batch_size, reduction=...))`` and its gradient with respect
to closed-over ``params``, compared across engines: the cases of the engine comparison
(``report.py``, ``bench_compare.py``, ``demo.py``, ``compile_floor.py``, ``bench_shard.py``,
``device_check.py``), the one list of that operation.

A :class:`Workload` is ``post(chunk_reduction(fun(params, x)))`` computed over the
rows of ``x`` (mapped over its leading axis; ``params`` is closed over), optionally
differentiated with respect to ``params``. It is written once and run by any
*engine* with ``batch_map``'s signature (:data:`ENGINES`): adv_jax_math, the
original library, ``jax.lax.map`` or the unchunked computation, which is the
plain-JAX oracle (:meth:`Workload.oracle`).

Workloads:

* N-body (:func:`nbody`): one pairwise field, in three variants — ``field`` (summed
  over the sources at each target), ``energy`` (the sum of its squares) and
  ``forces`` (the gradient of the energy with respect to the targets); any number
  of targets and dimensions;
* elementwise reductions (:func:`elementwise`): ``sum``, ``logsumexp`` and the
  memory-bound ``x + 1`` of the GPU check;
* a dict-pytree map, the Gaussian-mixture log-likelihood, MLP per-example gradients.

:data:`COMPARE` are the cases of ``report.py`` and ``bench_compare.py``,
:data:`HEADLINE` those of ``demo.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import adv_jax_math as ajm

import _original
from .map_reduce import LSE_ALL, SUM0, SUM_ALL

# -- engines: batch_map's signature ------------------------------------------------------


def ours(fun, x, batch_size, **reduce):
    return ajm.batch_map(fun, x, batch_size, **reduce)


def ours_no_remat(fun, x, batch_size, **reduce):
    with ajm.config(remat=False):  # read while tracing
        return ours(fun, x, batch_size, **reduce)


def original(fun, x, batch_size, **reduce):
    return _original.load().batch_map(fun, x, batch_size, **reduce)


def _chunk_reduction(reduce: dict) -> Callable:
    return reduce.get("chunk_reduction") or (lambda y: y)


def lax_map(fun, x, batch_size, **reduce):
    """``jax.lax.map`` over rows (vmapped in batches), then one reduction of all rows."""
    row = lambda r: jax.tree.map(lambda y: y[0], fun(jax.tree.map(lambda a: a[None], r)))
    return _chunk_reduction(reduce)(lax.map(row, x, batch_size=batch_size))


def plain(fun, x, batch_size, **reduce):
    """Unchunked: the oracle."""
    return _chunk_reduction(reduce)(fun(x))


ENGINES: dict[str, Callable] = {
    "ours": ours,
    "ours remat=False": ours_no_remat,
    "original 1.3": original,
    "lax.map": lax_map,
    "plain": plain,
}


# -- the workload ------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """``post(chunk_reduction(fun(params, x)))`` over the rows of ``x``; its gradient
    with respect to ``params`` when ``grad``."""

    name: str
    fun: Callable  # fun(params, rows) -> outputs, one per row unless reduced
    make_inputs: Callable  # make_inputs(n, dtype, seed) -> (params, x); x has n rows
    batch_size: int
    sizes: tuple[int, ...]  # a multiple of batch_size first, then (maybe) a non-multiple
    reduction: Any = None  # batch_map's reduction= (None: a map)
    chunk_reduction: Callable | None = None  # batch_map's chunk_reduction= (None: default)
    post: Callable | None = None  # applied to the result (a loss, when grad)
    grad: bool = False

    def replace(self, **changes) -> Workload:
        return dataclasses.replace(self, **changes)

    @property
    def reduce(self) -> dict:
        """The ``reduction``/``chunk_reduction`` keywords of batch_map, those that are set."""
        kw = {"reduction": self.reduction, "chunk_reduction": self.chunk_reduction}
        return {k: v for k, v in kw.items() if v is not None}

    def inputs(self, n: int | None = None, dtype=jnp.float32, seed: int = 0) -> tuple:
        """``(params, x)`` with ``n`` rows (default: the first of ``sizes``), cached."""
        return _inputs(self.make_inputs, self.sizes[0] if n is None else n, dtype, seed)

    def program(
        self,
        engine: Callable | str = ours,
        batch_size: int | None = None,
        count: Callable[[], None] | None = None,
    ) -> Callable:
        """A fresh function of ``(params, x)`` computing this workload with ``engine``
        (an :data:`ENGINES` name or a function with batch_map's signature); ``count()``
        is called each time ``fun`` is traced."""
        run = ENGINES[engine] if isinstance(engine, str) else engine
        b = self.batch_size if batch_size is None else batch_size

        def f(params, x):
            def fun(rows):
                if count is not None:
                    count()
                return self.fun(params, rows)

            out = run(fun, x, b, **self.reduce)
            return out if self.post is None else self.post(out)

        return jax.grad(f) if self.grad else f

    def oracle(self) -> Callable:
        """The plain-JAX computation, unchunked."""
        return self.program(plain)

    def explain(self, params, x, batch_size: int | None = None) -> ajm.Plan:
        """adv_jax_math's plan for the chunked call (of the forward computation)."""
        fun = lambda rows: self.fun(params, rows)
        b = self.batch_size if batch_size is None else batch_size
        return ajm.explain(fun, x, b, **self.reduce)


@functools.cache
def _inputs(make: Callable, n: int, dtype, seed: int) -> tuple:
    return make(n, dtype, seed)


# -- N-body --------------------------------------------------------------------------------


def pair_field(targets, sources, law: str = "biot-savart"):
    """The field of each source at each target, ``(S, T, dim)``: the one N-body kernel.

    ``targets``: ``(T, dim)``. ``law="biot-savart"``: ``sources`` ``(S, 3)``, each a unit
    current along its own position vector, ``d x s / |d|^3``. ``law="gravity"``:
    ``sources = {"pos": (S, dim), "m": (S,)}``, ``m d / |d|^3`` in any dimension (no
    slicing or cross product: the form the fused GPU kernel lowers).
    """
    pos = sources if law == "biot-savart" else sources["pos"]
    d = targets[None, :, :] - pos[:, None, :]
    r2 = jnp.sum(d * d, axis=-1, keepdims=True) + 1e-2
    inv_r3 = lax.rsqrt(r2) ** 3
    if law == "biot-savart":
        return jnp.cross(d, pos[:, None, :]) * inv_r3
    return d * (sources["m"][:, None, None] * inv_r3)


def _energy(field):
    return jnp.sum(field**2)


def nbody(
    variant: str = "field",
    *,
    n_targets: int = 256,
    dim: int = 3,
    law: str = "biot-savart",
    batch_size: int = 1024,
    sizes: tuple[int, ...] = (2**15, 30_001),
    name: str | None = None,
) -> Workload:
    """Sources (the ``n`` mapped rows) acting on ``n_targets`` targets (the params).

    ``variant``: ``"field"`` ``(T, dim)``, ``"energy"`` (the sum of the field's squares)
    or ``"forces"`` (the gradient of the energy with respect to the targets).
    """
    if law == "biot-savart" and dim != 3:
        raise ValueError("the Biot-Savart law needs dim=3")

    def make_inputs(n, dtype, seed):
        k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
        targets = jax.random.normal(k1, (n_targets, dim), dtype)
        pos = jax.random.normal(k2, (n, dim), dtype)
        if law == "biot-savart":
            return targets, pos
        return targets, {"pos": pos, "m": jax.random.uniform(k3, (n,), dtype)}

    return Workload(
        name or f"N-body {variant} ({n_targets}, {dim})",
        lambda targets, sources: pair_field(targets, sources, law),
        make_inputs,
        batch_size,
        sizes,
        *SUM0,
        post=None if variant == "field" else _energy,
        grad=variant == "forces",
    )


# -- elementwise reductions ------------------------------------------------------------------

MONOIDS = {"add": SUM_ALL, "logsumexp": LSE_ALL}


def elementwise(
    name: str,
    fun: Callable,
    param: float,
    *,
    monoid: str = "add",
    scale: float = 1.0,
    batch_size: int = 2**14,
    sizes: tuple[int, ...] = (2**20,),
    grad: bool = False,
) -> Workload:
    """``monoid`` of ``fun(param, x)`` over ``x = scale * normal((n,))``."""

    def make_inputs(n, dtype, seed):
        return jnp.asarray(param, dtype), scale * jax.random.normal(
            jax.random.key(seed), (n,), dtype
        )

    reduction, chunk_reduction = MONOIDS[monoid]
    return Workload(
        name, fun, make_inputs, batch_size, sizes, reduction, chunk_reduction, grad=grad
    )


# -- the rest --------------------------------------------------------------------------------


def _dict_inputs(n, dtype, seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return None, {
        "pos": jax.random.normal(k1, (n, 3), dtype),
        "w": jax.random.uniform(k2, (n,), dtype),
    }


def _dict_fun(_, d):
    r = jnp.sqrt(jnp.sum(d["pos"] ** 2, axis=-1))
    return {"r": r * d["w"], "unit": d["pos"] / (r + 1.0)[:, None]}


def mixture(n_points: int = 64, batch_size: int = 4096, sizes=(2**16,)) -> Workload:
    """Total log-likelihood of ``n_points`` 2-D points under a Gaussian mixture of ``n``
    components (the mapped rows), a logsumexp over components."""

    def make_inputs(n, dtype, seed):
        k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
        params = {
            "mu": jax.random.normal(k1, (n, 2), dtype) * 3,
            "log_w": jax.nn.log_softmax(jax.random.normal(k2, (n,), dtype)),
        }
        return jax.random.normal(k3, (n_points, 2), dtype) * 3, params

    def log_joint(points, p):  # (components, points)
        d2 = jnp.sum((points[None] - p["mu"][:, None]) ** 2, -1)
        return p["log_w"][:, None] - 0.5 * d2 - jnp.log(2 * jnp.pi)

    return Workload(
        f"mixture log-lik, {n_points} points",
        log_joint,
        make_inputs,
        batch_size,
        sizes,
        reduction=jnp.logaddexp,
        chunk_reduction=functools.partial(jax.nn.logsumexp, axis=0),  # over components
        post=jnp.sum,
    )


def per_example_grads(dim: int = 64, batch_size: int = 1024, sizes=(2**14,)) -> Workload:
    """Per-example gradients of a two-layer tanh MLP's loss (``jax.vmap(jax.grad)``)."""

    def make_inputs(n, dtype, seed):
        k1, k2 = jax.random.split(jax.random.key(seed))
        return jax.random.normal(k1, (dim, dim), dtype) / dim**0.5, jax.random.normal(
            k2, (n, dim), dtype
        )

    loss = lambda w, x: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w) ** 2)
    per_example = jax.vmap(jax.grad(loss), (None, 0))
    return Workload(f"per-example grads, dim {dim}", per_example, make_inputs, batch_size, sizes)


def large(monoid: str | None, layers: int = 60, sizes=(10_007,)) -> Workload:
    """A large ``fun`` (6 equations a layer: ``sin(v*1.01+i)*cos(v)+tanh(v)*0.1``),
    where compile time is dominated by ``fun``'s code: a map, or add/logsumexp over
    all axes, of ``(n, 8)`` rows in chunks of 1000."""

    def fun(_, v):
        for i in range(layers):
            v = jnp.sin(v * 1.01 + i) * jnp.cos(v) + jnp.tanh(v) * 0.1
        return v

    def make_inputs(n, dtype, seed):
        return None, jax.random.normal(jax.random.key(seed), (n, 8), dtype)

    reduction, chunk_reduction = MONOIDS[monoid] if monoid else (None, None)
    name = f"large fun ({6 * layers} eqns), {monoid or 'map'}"
    return Workload(name, fun, make_inputs, 1000, sizes, reduction, chunk_reduction)


# -- the registry ----------------------------------------------------------------------------

ELEMENTWISE = elementwise(
    "elementwise sum",
    lambda w, c: jnp.sin(w * c) * jnp.exp(-0.5 * c * c),
    1.3,
    scale=3.0,
    sizes=(2**20, 1_000_003),
)
GRAD_ELEMENTWISE = ELEMENTWISE.replace(name="grad elementwise sum", grad=True)
LOGSUMEXP = elementwise(
    "logsumexp",
    lambda mu, c: -0.5 * (c - mu) ** 2 + jnp.cos(3 * c),
    0.5,
    monoid="logsumexp",
    scale=2.0,
    sizes=(2**18, 250_001),
)
ADD_ONE = elementwise("x + 1, add", jnp.add, 1.0, sizes=(2**28,))
ADD_ONE_LOGSUMEXP = elementwise(
    "x + 1, logsumexp", jnp.add, 1.0, monoid="logsumexp", sizes=(2**28,)
)


def _layer_inputs(n: int, dtype: Any, seed: int) -> tuple:
    kw, kx = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kw, (16, 32), dtype) * 0.25, jax.random.normal(kx, (n, 16), dtype)


def _wide_inputs(n: int, dtype: Any, seed: int) -> tuple:
    return None, jax.random.normal(jax.random.key(seed), (n, 8, 16), dtype)


# Wide rows: Mosaic GPU folds them in element groups, a kernel each (a layer's groups
# each read every feature; an elementwise fun's, features of their own).
LAYER = Workload(
    "tanh(x @ w), 16 -> 32, add", lambda w, x: jnp.tanh(x @ w), _layer_inputs, 1 << 16,
    (2**22,), *SUM_ALL,
)  # fmt: skip
WIDE = Workload(
    "tanh(x) * x, rows of 8 x 16, add", lambda _, x: jnp.tanh(x) * x, _wide_inputs, 1 << 16,
    (2**21,), *SUM_ALL,
)  # fmt: skip
NBODY = nbody(name="N-body (256, 3)")
NBODY_FORCES = nbody("forces", name="grad N-body")
DICT_MAP = Workload("dict map", _dict_fun, _dict_inputs, 4096, (98_304, 100_000))
MIXTURE = mixture()
PER_EXAMPLE_GRADS = per_example_grads()

LARGE = (large(None), large("add"), large("logsumexp"))

COMPARE = (ELEMENTWISE, NBODY, LOGSUMEXP, DICT_MAP, GRAD_ELEMENTWISE, NBODY_FORCES, *LARGE)
HEADLINE = (NBODY, MIXTURE, PER_EXAMPLE_GRADS, NBODY_FORCES)


@dataclass(frozen=True)
class Case:
    """One workload at one size, for the engine comparison."""

    workload: Workload
    n: int

    def __str__(self) -> str:
        return f"{self.workload.name}, n={self.n}"

    @property
    def divisible(self) -> bool:
        return self.n % self.workload.batch_size == 0

    @property
    def engines(self) -> tuple[str, ...]:
        # Rematerialization only changes gradients.
        return tuple(e for e in ENGINES if self.workload.grad or e != "ours remat=False")

    def args(self) -> tuple:
        return self.workload.inputs(self.n)

    def function(self, engine: str, count: Callable[[], None] | None = None) -> Callable:
        """A fresh function object computing this case with ``engine``."""
        return self.workload.program(engine, count=count)


CASES = tuple(Case(w, n) for w in COMPARE for n in w.sizes)
