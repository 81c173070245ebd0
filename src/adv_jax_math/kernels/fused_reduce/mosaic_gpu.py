"""The fused kernel on Pallas Mosaic GPU (Hopper and newer): ``plgpu.kernel``.

The same :class:`~.kernel.Kernel` record as the Triton and TPU kernel, built another
way (DESIGN.md §10): one program (a warpgroup) per tile of ``steps`` blocks, its
blocks streamed from global to shared memory by ``plgpu.emit_pipeline`` (TMA copies
of at most 256 rows, two in flight), each block's ``fun`` and fold merged into the
states it carries; each program writes its states, merged in XLA as the other
kernels' are (``kernel.forward``).

Mosaic GPU lays out one value per row well, and ``(Bk, d)`` blocks not at all (its
layout inference searched a minute and failed), so the kernel goes feature by
feature: XLA splits each input ``(n, *s)`` into ``prod(s)`` vectors of rows before
the kernel (one more pass over the inputs), ``fun`` runs with its own axes unrolled
(``unrolled.evaluate`` with ``rows``: it must work row by row), each term folds
every element of its items on its own, and XLA stacks the elements' states after.
A thread holds a row, so the elements go in groups whose values fit its registers
(``groups``), a kernel each: ``fun`` is unrolled once outside the kernels
(:meth:`Features.grouped`) and each kernel evaluates what its group needs of that.
Mosaic GPU has no ``pallas_call`` grid or block specs and no 0-d loads (constants
are read element by element), and lowers neither ``is_finite`` nor
``log1p``/``expm1``: ``fun`` and the folds are evaluated with those rewritten
(``interpreter.portable``). On CPU the kernel runs in Mosaic GPU's interpreter
(``plgpu.InterpretGPUParams``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...core.targets import KERNEL_NAME
from ..unrolled import evaluate, objects
from . import groups as _groups
from .fold import partial_shape, term_state
from .groups import Group, grouped, run, words
from .interpreter import portable

__all__ = ["AXIS", "Features", "element", "elements_of", "features", "mosaic_gpu_call"]

AXIS = "programs"  # the grid axis of the programs
_GROUPED: dict = {}  # Features.grouped's, by kernel and budget (the oldest dropped)


def element(ref: Any, aval: Any, idx: tuple) -> Any:
    """Element ``idx`` of a constant, loaded on its own from its global-memory ref
    (``kernel.kernel_const_aval``: ``(1, 1)``, ``(1, n)`` or whole)."""
    v = ref[idx if len(aval.shape) > 1 else (0, *idx) if idx else (0, 0)]
    return v != 0 if aval.dtype == bool else v


def elements_of(ref: Any, aval: Any) -> list:
    """A constant's elements (C order), each loaded on its own (:func:`element`)."""
    return [element(ref, aval, idx) for idx in np.ndindex(*aval.shape)]


def features(x: Any) -> list:
    """``x`` of shape ``(n, *s)`` as ``prod(s)`` vectors of its rows (in XLA), as the
    pipeline's TMA copies carry them (:func:`wired`)."""
    flat = wired(x.reshape(x.shape[0], -1))
    return [flat[:, f] for f in range(flat.shape[1])]


def scalar_items(t: Any) -> list[jax.ShapeDtypeStruct]:
    """The items of one element of term ``t`` (each folded on its own): scalars."""
    return [jax.ShapeDtypeStruct((), i.dtype) for i in t.items]


def wire_dtype(dtype: Any) -> np.dtype:
    """The dtype TMA copies carry values of ``dtype`` as: float64's bits as int64
    (Mosaic GPU's TMA takes no float64), others as they are."""
    return np.dtype(np.int64) if np.dtype(dtype) == np.float64 else np.dtype(dtype)


def wired(x: Any, dtype: Any = None) -> Any:
    """``x`` in :func:`wire_dtype`; with ``dtype``, back from it (in a kernel: a bitcast
    of registers)."""
    to = wire_dtype(x.dtype) if dtype is None else np.dtype(dtype)
    return x if x.dtype == to else lax.bitcast_convert_type(x, to)


@dataclasses.dataclass(frozen=True)
class Features:
    """``fun`` (``k.jaxpr`` on blocks of ``k.rows`` rows, of inputs ``k.in_avals`` and
    constants ``k.const_avals``) evaluated feature by feature in a Mosaic GPU kernel."""

    k: Any

    @property
    def widths(self) -> list[int]:
        """The features (vectors of rows) of each input."""
        return [math.prod(a.shape[1:]) for a in self.k.in_avals]

    def feature_avals(self) -> list[jax.ShapeDtypeStruct]:
        """Every feature's vector of all ``n`` rows (flat over the inputs), as split."""
        k = self.k
        return [
            jax.ShapeDtypeStruct((k.n,), a.dtype)
            for w, a in zip(self.widths, k.in_avals, strict=True)
            for _ in range(w)
        ]

    @property
    def layout(self) -> Any:
        """Every vector of rows' layout, set by hand (Lane semantics): Warpgroup
        semantics' layout inference searched 475 s on a 16-feature logsumexp. Each
        of a warpgroup's 128 threads holds ``rows // 128`` rows."""
        from jax.experimental.pallas import mosaic_gpu as plgpu

        return plgpu.Layout.WG_STRIDED((self.k.rows,), vec_size=self.k.rows // 128)

    def load(self, block: Any, dtype: Any) -> Any:
        """A pipeline block of a feature's rows in registers (:attr:`layout`), as
        ``dtype`` (its TMA copy carried it as :func:`wire_dtype`)."""
        from jax.experimental.pallas import mosaic_gpu as plgpu

        return wired(plgpu.load(block, layout=self.layout), dtype)

    def iota(self, dtype: Any, shape: Any, dim: int) -> Any:
        """``lax.broadcasted_iota`` in :attr:`layout` (Lane semantics needs one)."""
        from jax.experimental.pallas import mosaic_gpu as plgpu

        return plgpu.broadcasted_iota(dtype, shape, dim, layout=self.layout)

    def strided(self, v: Any) -> Any:
        """``v``, a vector of rows, in :attr:`layout`: a constant's or a cotangent's
        that is the same on every row comes as a splat, which Mosaic GPU's reductions
        over the rows do not take ("Unsupported layout WGSplatFragLayout")."""
        return jnp.where(self.iota(jnp.int32, (self.k.rows,), 0) >= 0, v, v)

    def elements(self) -> list[tuple[Any, tuple]]:
        """Every term's elements, each folded on its own (items of one shape:
        ``rules.mosaic_gpu_features_problem``)."""
        return [(t, cell) for t in self.k.terms for cell in np.ndindex(*t.items[0].shape)]

    def grouped(
        self,
        budget: int | None = None,
        held: Sequence[int] | None = None,
        only: Sequence[int] | None = None,
    ) -> tuple[Any, int, list, list[Group] | int]:
        """:meth:`unrolled_groups`, kept for the same kernel (the plan's check, its
        roofline model and the kernel's build each ask); ``budget`` registers per thread,
        by default ``groups.REGISTERS`` (read at the call: tests lower it)."""
        budget = _groups.REGISTERS if budget is None else budget
        key = (self.k.key(), budget, *(None if a is None else tuple(a) for a in (held, only)))
        if key not in _GROUPED:
            while len(_GROUPED) >= 64:
                _GROUPED.pop(next(iter(_GROUPED)))
            _GROUPED[key] = self.unrolled_groups(budget, held, only)
        return _GROUPED[key]

    def unrolled_groups(
        self, budget: int, held: Sequence[int] | None, only: Sequence[int] | None = None
    ) -> tuple[Any, int, list, list[Group] | int]:
        """``fun`` unrolled into a jaxpr from the constants' elements and the inputs'
        features to each element's sources (a vector of rows each, in
        :meth:`elements` order), its number of constants' elements, each element's
        outputs of it, and the elements in groups of at most ``budget`` registers
        per thread (``groups.grouped``; an int: what one element alone needs), each
        element holding ``held`` values besides (default: its monoid's state); ``only``:
        the elements grouped (default: all)."""
        k, elements = self.k, self.elements()
        scalar = lambda a: [jax.ShapeDtypeStruct((), a.dtype)] * math.prod(a.shape)
        consts = [scalar(a) for a in k.const_avals]
        vectors = [jax.ShapeDtypeStruct((k.rows,), a.dtype) for a in self.feature_avals()]

        def unrolled(consts: list, vectors: list) -> list:
            outs = self.outputs(consts, vectors)
            return [
                self.row(outs[s][(0, *cell)], i.dtype)
                for t, cell in elements
                for s, i in zip(t.leaf.sources, t.items, strict=True)
            ]

        closed = jax.make_jaxpr(unrolled)(consts, vectors)
        at = np.cumsum([0, *(len(t.leaf.sources) for t, _ in elements)])
        reads = [tuple(range(at[e], at[e + 1])) for e in range(len(elements))]
        init = lambda t: jax.tree.leaves(jax.eval_shape(t.leaf.monoid.init, scalar_items(t)))
        size = lambda t: sum(math.prod(a.shape) * words(a.dtype) for a in init(t))
        states = list(held) if held is not None else [size(t) for t, _ in elements]
        n_consts = sum(map(len, consts))
        vec = k.rows // 128
        picked = range(len(elements)) if only is None else only
        found = grouped(
            closed.jaxpr,
            n_consts,
            [reads[e] for e in picked],
            [states[e] for e in picked],
            vec,
            budget,
        )
        if not isinstance(found, int):
            found = [
                dataclasses.replace(g, elements=tuple(picked[i] for i in g.elements)) for g in found
            ]
        return closed, n_consts, reads, found

    def const_elements(self, refs: Sequence[Any], wanted: Sequence[int]) -> list:
        """The constants' elements ``wanted`` (flat over every constant, C order), each
        loaded on its own (:func:`element`)."""
        avals = self.k.const_avals
        at = [(r, a, i) for r, a in zip(refs, avals, strict=True) for i in np.ndindex(*a.shape)]
        return [element(*at[j]) for j in wanted]

    def outputs(self, consts: list, vectors: list) -> list[np.ndarray]:
        """``fun``'s outputs as object arrays ``(1, *s)`` of vectors of rows, from each
        constant's elements (lists) and every input's features (flat)."""
        k, it = self.k, iter(vectors)
        args = [
            objects([next(it) for _ in range(w)], (1, *a.shape[1:]))
            for w, a in zip(self.widths, k.in_avals, strict=True)
        ]
        cs = [objects(c, a.shape) for c, a in zip(consts, k.const_avals, strict=True)]
        return evaluate(k.jaxpr, cs, args, rows=k.rows)

    def row(self, e: Any, dtype: Any) -> Any:
        """An element of an output as a vector of rows."""
        return jnp.broadcast_to(jnp.asarray(e, dtype), (self.k.rows,))

    def stacked(self, parts: Sequence[Any], aval: Any) -> Any:
        """One program partial per element of ``aval`` (each ``(grid, 1, 1)``, C order)
        as the programs' partials of ``aval`` (``kernel.forward``'s layout)."""
        return jnp.concatenate(parts, axis=-1).reshape(self.k.grid, *partial_shape(aval))

    def kernel(
        self,
        body: Callable[..., None],
        dtypes: list,
        name: str,
        out_type: Sequence[Any] = (),
        scratch_types: Sequence[Any] = (),
    ) -> Any:
        """``plgpu.kernel`` of ``body`` over the programs: its outputs ``out_type``, then
        one ``(1, 1)`` partial per program of each of ``dtypes``, then the scratch refs."""
        from jax.experimental.pallas import mosaic_gpu as plgpu

        k = self.k
        partials = [jax.ShapeDtypeStruct((k.grid, 1, 1), d) for d in dtypes]
        return plgpu.kernel(
            body,
            out_type=[*out_type, *partials],
            grid=(k.grid,),
            grid_names=(AXIS,),
            kernel_name=name,
            interpret=plgpu.InterpretGPUParams() if k.interpret else None,
            compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
            scratch_types=scratch_types,
        )


def mosaic_gpu_call(k: Any) -> Callable[..., Any]:
    """The kernels of ``k`` (a ``kernel.Kernel`` for Mosaic GPU), one per element group
    (``groups``): the arguments and outputs of ``kernel.pallas_call``'s."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    f, nc = Features(k), len(k.const_avals)
    elements, (closed, n_consts, reads, groups) = f.elements(), f.grouped()
    assert not isinstance(groups, int), groups  # (fused._check declines it)
    init = lambda g: [
        elements[e][0].leaf.monoid.init(scalar_items(elements[e][0])) for e in g.elements
    ]
    dtypes = [a.dtype for a in f.feature_avals()]  # (each feature's)

    def group_kernel(g: Group) -> Any:
        states = jax.eval_shape(lambda: init(g))  # (in the kernel: no capture)
        tree = jax.tree.structure(states)

        def fold(carry: list, vectors: list, consts: list, start: Any, offset: Any) -> list:
            outs = run(closed, n_consts, g, consts, vectors)
            merged = []
            for e, acc in zip(g.elements, jax.tree.unflatten(tree, carry), strict=True):
                t, _ = elements[e]
                ys = {s: f.strided(outs[o]) for s, o in zip(t.leaf.sources, reads[e], strict=True)}
                state = term_state(k, t, ys, start, offset, f.iota)
                merged.append(t.leaf.monoid.merge(acc, state))
            return jax.tree.leaves(merged)

        def body(offset_ref: Any, *refs: Any) -> None:
            nx = len(g.features)
            c_refs, x_refs, o_refs = refs[:nc], refs[nc : nc + nx], refs[nc + nx :]
            consts = f.const_elements(c_refs, g.consts)
            offset, program = offset_ref[0, 0], lax.axis_index(AXIS)

            def step(index: tuple, *blocks: Any) -> list:
                *x_blocks, carry = blocks
                start = (program * k.steps + index[0]) * k.rows
                vectors = [f.load(b, dtypes[j]) for b, j in zip(x_blocks, g.features, strict=True)]
                return portable(fold, carry, vectors, consts, start, offset)

            spec = plgpu.BlockSpec((k.rows,), lambda j: (program * k.steps + j,))
            pipeline = plgpu.emit_pipeline(
                step,
                grid=(k.steps,),
                in_specs=[spec] * nx,
                init_carry=jax.tree.leaves(init(g)),
                max_concurrent_steps=min(2, k.steps),
            )
            for part, o_ref in zip(pipeline(*x_refs), o_refs, strict=True):
                o_ref[program] = part.reshape(o_ref.shape[1:]).astype(o_ref.dtype)

        return f.kernel(body, [a.dtype for a in jax.tree.leaves(states)], KERNEL_NAME)

    kernels = [group_kernel(g) for g in groups]

    def call(first: Any, *args: Any) -> list:
        """Each group's kernel on the features it reads, the states stacked by term."""
        vectors = [v for x in args[nc:] for v in features(x)]
        per_element: dict[int, list] = {}
        for g, kernel in zip(groups, kernels, strict=True):
            parts = iter(kernel(first, *args[:nc], *(vectors[j] for j in g.features)))
            for e in g.elements:
                t, _ = elements[e]
                per_element[e] = [next(parts) for _ in jax.tree.leaves(t.state)]
        out = []
        for t in k.terms:
            mine = [per_element[e] for e, (u, _) in enumerate(elements) if u is t]
            for i, a in enumerate(jax.tree.leaves(t.state)):
                out.append(f.stacked([p[i] for p in mine], a))
        return out

    return call
