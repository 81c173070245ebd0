"""The fused kernel on Pallas Mosaic GPU (Hopper and newer): ``plgpu.kernel``.

The same :class:`~.kernel.Kernel` record as the Triton and TPU kernel, built another
way (DESIGN.md §10): one program (a warpgroup) per tile of ``steps`` blocks, its
blocks streamed from global to shared memory by ``plgpu.emit_pipeline`` (TMA copies
of at most 256 rows, two in flight), each block's ``fun`` and fold merged into the
states it carries; each program writes its states, merged in XLA as the other
kernels' are (``kernel.forward``). Mosaic GPU has no ``pallas_call`` grid or block
specs, no 0-d loads, and lowers neither ``is_finite`` nor ``log1p``/``expm1``:
``fun`` and the monoids' folds are evaluated with those rewritten
(``interpreter.portable``). On CPU the kernel runs in Mosaic GPU's interpreter
(``plgpu.InterpretGPUParams``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import lax

from ...core.targets import KERNEL_NAME
from .fold import partial_shape, term_state
from .interpreter import evaluate, portable

__all__ = ["mosaic_gpu_call"]

_AXIS = "programs"


def _load(ref: Any, aval: Any) -> Any:
    """A constant from its ``(1, 1)``/``(1, n)``/whole global-memory ref
    (``kernel.kernel_const_aval``); Mosaic GPU loads no 0-d value with ``[...]``."""
    if not aval.shape:
        value = ref[0, 0]
    elif len(aval.shape) == 1:
        value = ref[0]
    else:
        value = ref[...]
    return value != 0 if aval.dtype == bool else value


def mosaic_gpu_call(k: Any) -> Callable[..., Any]:
    """The kernel of ``k`` (a ``kernel.Kernel`` for Mosaic GPU): the arguments and
    outputs of ``kernel.pallas_call``'s."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    nc, nx = len(k.const_avals), len(k.in_avals)
    init = lambda: [t.leaf.monoid.init(t.items) for t in k.terms]  # in the kernel: no capture
    tree = jax.tree.structure(jax.eval_shape(init))

    def fold(carry: list, ys: list, start: Any, offset: Any) -> list:
        states = [term_state(k, t, ys, start, offset) for t in k.terms]
        acc = jax.tree.unflatten(tree, carry)
        merged = [t.leaf.monoid.merge(a, b) for t, a, b in zip(k.terms, acc, states, strict=True)]
        return jax.tree.leaves(merged)

    def body(offset_ref: Any, *refs: Any) -> None:
        c_refs, x_refs, o_refs = refs[:nc], refs[nc : nc + nx], refs[nc + nx :]
        consts = [_load(r, a) for r, a in zip(c_refs, k.const_avals, strict=True)]
        offset, program = offset_ref[0, 0], lax.axis_index(_AXIS)

        def step(index: tuple, *blocks: Any) -> list:
            *x_blocks, carry = blocks
            ys = evaluate(k.jaxpr, consts, [b[...] for b in x_blocks], upcast=False, portable=True)
            start = (program * k.steps + index[0]) * k.rows
            return portable(fold, carry, ys, start, offset)

        block = lambda j: program * k.steps + j
        specs = [
            plgpu.BlockSpec((k.rows, *a.shape[1:]), lambda j, t=(0,) * (a.ndim - 1): (block(j), *t))
            for a in k.in_avals
        ]
        pipeline = plgpu.emit_pipeline(
            step,
            grid=(k.steps,),
            in_specs=specs,
            init_carry=jax.tree.leaves(init()),
            max_concurrent_steps=min(2, k.steps),
        )
        for part, o_ref in zip(pipeline(*x_refs), o_refs, strict=True):
            o_ref[program] = part.reshape(o_ref.shape[1:]).astype(o_ref.dtype)

    out_type = [jax.ShapeDtypeStruct((k.grid, *partial_shape(a)), a.dtype) for a in k.state_avals()]
    return plgpu.kernel(
        body,
        out_type=out_type,
        grid=(k.grid,),
        grid_names=(_AXIS,),
        kernel_name=KERNEL_NAME,
        interpret=plgpu.InterpretGPUParams() if k.interpret else None,
    )
