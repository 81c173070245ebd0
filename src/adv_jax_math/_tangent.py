"""The tangent of a chunked monoid reduction: a checkpointed scan over chunks of
``jax.jvp(fun)``, each row weighted by its leaf's monoid (see ``Monoid.tangent_*``).

Used as the JVP rule of a ``jax.custom_jvp`` around a forward pass that has no
transpose of its own (the Pallas kernel), or whose autodiff would not split ties
evenly (max/min through a scan). Forward mode uses it as is; reverse mode
transposes it, recomputing every chunk, so gradient memory is O(rows per chunk).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from ._monoid import Monoid

__all__ = ["SUPPORTED", "UNSUPPORTED", "chunked_tangent", "even_ties", "nonzero"]

SUPPORTED = jax.__version_info__ >= (0, 10, 0)
"""Whether this jax can differentiate a ``custom_jvp`` whose tangent runs a scan."""
UNSUPPORTED = (
    f"jax {jax.__version__} fails to differentiate a custom_jvp whose tangent is a scan "
    "(fixed in jax 0.10.0)"
)


def nonzero(t: Any) -> bool:
    """A tangent that is neither a symbolic zero nor float0."""
    return not isinstance(t, SymbolicZero) and getattr(t, "dtype", None) != jax.dtypes.float0


def _pad_rows(x: Any, rows: int) -> Any:
    """Pad the leading axis to ``rows`` by repeating the last row (no NaNs from padding)."""
    extra = rows - x.shape[0]
    if not extra:
        return x
    return jnp.concatenate([x, jnp.broadcast_to(x[-1:], (extra, *x.shape[1:]))])


def _pad_zeros(t: Any, rows: int) -> Any:
    extra = rows - t.shape[0]
    return t if not extra else jnp.pad(t, [(0, extra)] + [(0, 0)] * (t.ndim - 1))


def even_ties(
    forward: Callable,
    jaxpr: Any,
    monoids: Sequence[tuple[Monoid, int | None]],
    n: int,
    rows: int,
    blocks: int,
) -> Callable:
    """``forward(consts, leaves, extra)`` whose tangent is :func:`chunked_tangent` of
    ``jaxpr`` (``fun`` on a block, its constants first): every row tied for a
    max/min shares its derivative evenly, as in ``jax.grad(jnp.max)``. ``extra`` is
    passed through without a tangent (values that repeat ``consts``)."""
    block_fun = lambda consts, xb: jax.core.eval_jaxpr(jaxpr, consts, *xb)

    @jax.custom_jvp
    def run(consts: list, leaves: list, extra: list) -> Any:
        return forward(consts, leaves, extra)

    def run_jvp(primals: tuple, tangents: tuple) -> tuple:
        totals = run(*primals)
        dt = chunked_tangent(block_fun, monoids, n, rows, blocks, primals[:2], tangents[:2], totals)
        return totals, dt

    run.defjvp(run_jvp, symbolic_zeros=True)
    return run


def chunked_tangent(
    block_fun: Callable[[Sequence[Any], Sequence[Any]], list[Any]],
    monoids: Sequence[tuple[Monoid, int | None]],
    n: int,
    rows: int,
    blocks: int,
    primals: tuple[Sequence[Any], Sequence[Any]],
    tangents: tuple[Sequence[Any], Sequence[Any]],
    totals: Sequence[Any],
) -> list[Any]:
    """Tangent of ``[reduce_i(fun(xs)_i)]`` given the primal ``totals``.

    Parameters
    ----------
    block_fun : callable
        ``block_fun(consts, xs_block)``: the prepared ``fun`` (one array per result
        leaf) on a block of exactly ``rows`` rows.
    monoids : sequence of (Monoid, axis)
        Per result leaf.
    n, rows, blocks : int
        Rows in all; rows per block; blocks evaluated (vmapped) per scan step.
    primals, tangents : (consts, xs)
        Primal and tangent values; tangents may be symbolic zeros or float0.
    totals : sequence of arrays
        The reduced primal outputs (accumulator dtypes).
    """
    consts, leaves = primals
    dconsts, dleaves = tangents
    c_idx = [i for i, t in enumerate(dconsts) if nonzero(t)]
    x_idx = [i for i, t in enumerate(dleaves) if nonzero(t)]
    zeros = [
        jnp.zeros(t.shape, t.dtype)
        if jnp.issubdtype(t.dtype, jnp.inexact)
        else np.zeros(t.shape, jax.dtypes.float0)
        for t in totals
    ]
    if not c_idx and not x_idx:
        return zeros
    chunk = blocks * rows
    steps = -(-n // chunk)
    padded = steps * chunk

    def chunks(x):
        return x.reshape(steps, blocks, rows, *x.shape[1:])

    xs = [chunks(_pad_rows(x, padded)) for x in leaves]
    dxs = [chunks(_pad_zeros(dleaves[i], padded)) for i in x_idx]
    dcs = [jnp.asarray(dconsts[i], jnp.result_type(consts[i])) for i in c_idx]

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def contributions(consts, x_chunk, dc, dx, totals, step):
        def fun_chunk(c_nz, x_nz):
            cvals, xvals = list(consts), list(x_chunk)
            for i, v in zip(c_idx, c_nz, strict=True):
                cvals[i] = v
            for i, v in zip(x_idx, x_nz, strict=True):
                xvals[i] = v
            return jax.vmap(lambda *xb: block_fun(cvals, xb))(*xvals)

        primals = ([consts[i] for i in c_idx], [x_chunk[i] for i in x_idx])
        ys, dys = jax.jvp(fun_chunk, primals, (dc, dx))
        valid = step * chunk + lax.iota(jnp.int32, chunk) < n
        parts = []
        for y, dy, (monoid, axis), t in zip(ys, dys, monoids, totals, strict=True):
            if dy.dtype == jax.dtypes.float0:
                parts.append(())
                continue
            y = y.reshape(chunk, *y.shape[2:]).astype(t.dtype)
            dy = dy.reshape(chunk, *dy.shape[2:]).astype(t.dtype)
            parts.append(monoid.tangent_part(y, dy, valid, t, 0 if axis == 0 else None))
        return parts

    def step_fn(carry, inp):
        x_chunk, dx_chunk, step = inp
        new = contributions(consts, x_chunk, dcs, dx_chunk, list(totals), step)
        return [
            m.tangent_merge(a, b) for (m, _), a, b in zip(monoids, carry, new, strict=True)
        ], None

    inputs = (xs, dxs, jnp.arange(steps, dtype=jnp.int32))
    first = jax.tree.map(lambda v: v[0], inputs)
    shapes = jax.eval_shape(contributions, consts, first[0], dcs, first[1], list(totals), first[2])
    start = [m.tangent_start(s) for (m, _), s in zip(monoids, shapes, strict=True)]
    sums, _ = lax.scan(step_fn, start, inputs)
    return [
        m.tangent_finish(parts) if parts else zero
        for (m, _), parts, zero in zip(monoids, sums, zeros, strict=True)
    ]
