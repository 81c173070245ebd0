"""The front end's plan: how many rows, which chunks, which engine, and why.

A :class:`Plan` is computed from the arguments alone (shapes, the reduction, the
options in force); engines only execute it. :func:`adv_jax_math.explain` returns it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from . import _config, _native, _shard
from ._monoid import LOGSUMEXP, MonoidReduction, identity, recognize
from ._trace import Traced, check_rowwise, rows_aval, trace

__all__ = ["Plan", "make_plan", "mapped_rows", "overlap_rows"]

# Policies: how rows are split into chunks.
SINGLE = "single call"  # no chunking: chunk_reduction(fun(x))
EMPTY = "empty input"  # n == 0: identity / empty outputs
OVERLAP = "overlap"  # chunks of batch_size; the last one overlaps, its repeats are masked
REMAINDER = "remainder"  # full chunks of batch_size, then the remainder evaluated apart
SHARDED = "sharded"  # rows spread over a mesh; see Plan.shard for each device's plan


def mapped_rows(xs: Any, what: str = "fun_input") -> int:
    """The common leading size of the leaves of ``xs``; a clear error otherwise."""
    paths_leaves = jax.tree_util.tree_flatten_with_path(xs)[0]
    if not paths_leaves:
        raise ValueError(f"{what} has no array leaves to map over; pass at least one array")
    sizes: dict[str, int] = {}
    for path, leaf in paths_leaves:
        name = f"{what}{jax.tree_util.keystr(path)}"
        shape = np.shape(leaf)
        if not shape:
            raise ValueError(
                f"{name} is 0-d (shape ()), but mapping needs a leading axis to split; "
                "give it a leading axis, or close over it in fun instead of mapping it"
            )
        sizes[name] = shape[0]
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{k}: {v}" for k, v in sizes.items())
        raise ValueError(
            f"the mapped leaves have different leading sizes ({listing}); "
            "every mapped leaf must have the same number of rows"
        )
    return next(iter(sizes.values()))


def overlap_rows(n: int, batch_size: int) -> int:
    """Rows per chunk for the overlap policy (``n > batch_size``).

    Chunks of ``batch_size`` rows, as the user asked, unless the last chunk would
    repeat more than ``n / 16`` rows; then ``k = ceil(n / batch_size)`` balanced
    chunks of ``ceil(n / k)`` rows (fewer than ``k`` repeated rows).
    """
    k = -(-n // batch_size)
    if k * batch_size - n <= n // 16:
        return batch_size
    return -(-n // k)


@dataclass(frozen=True)
class Plan:
    """How a call is executed. Returned by :func:`adv_jax_math.explain`.

    Attributes
    ----------
    n : int or None
        Mapped rows (None when nothing is mapped: ``batch_size=None``, no sharding).
    batch_size : int or None
        The user's bound on rows per chunk.
    kind : str
        ``"map"`` (outputs concatenated), ``"monoid"`` (a recognized reduction) or
        ``"generic"`` (any other associative reduction).
    monoid : MonoidReduction or None
        The recognized reduction, for ``kind == "monoid"``.
    policy : str
        ``"single call"``, ``"empty input"``, ``"overlap"``, ``"remainder"`` or
        ``"sharded"``.
    chunks, rows : int
        Chunks executed and rows in each.
    masked : int
        Rows of the last chunk (policy ``"overlap"``) that repeat rows of the
        chunk before and are masked out.
    remainder : int
        Rows evaluated apart after the loop (policy ``"remainder"``).
    backend : str
        ``"scan"``, ``"pallas"`` or ``"interpret"``.
    reason : str
        Why that backend, and why any faster one was rejected.
    error : str
        Set when the requested backend cannot run this call; executing the plan
        raises ``NotImplementedError`` with it.
    platform : str
        The platform planned for: the active abstract mesh's device platform
        (when lowering for another platform) or ``jax.default_backend()``.
    notes : tuple of str
        Other facts worth knowing.
    shard : ShardLayout or None
        For ``shard=True``: the mesh, the rows per device and the plans each
        device runs (``shard.local``) and the global remainder runs
        (``shard.remainder``).
    """

    n: int | None
    batch_size: int | None
    kind: str
    monoid: MonoidReduction | None
    policy: str
    chunks: int
    rows: int
    masked: int = 0
    remainder: int = 0
    backend: str = "scan"
    reason: str = ""
    error: str = ""
    platform: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    shard: _shard.ShardLayout | None = None
    traced: Traced | None = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        what = {"map": "none (outputs concatenated)", "generic": "generic (not a known monoid)"}
        lines = [
            ("rows (n)", "not mapped" if self.n is None else str(self.n)),
            ("batch_size", str(self.batch_size)),
            ("reduction", what.get(self.kind) or f"{self.monoid} (monoid)"),
            ("policy", self._policy_text()),
            ("backend", f"{self.backend}: {self.reason}"),
            *((("sharding", str(self.shard)),) if self.shard else ()),
            *(("note", note) for note in self.notes),
        ]
        width = max(len(k) for k, _ in lines)
        return "\n".join(f"{k:<{width}} : {v}" for k, v in lines)

    def _policy_text(self) -> str:
        if self.policy == SHARDED:
            return "sharded over a mesh (see sharding)"
        if self.policy == OVERLAP:
            text = f"{self.chunks} chunks of {self.rows} rows"
            if self.masked:
                text += f"; the last chunk overlaps the one before by {self.masked} rows, masked"
            return text + "; fun traced once"
        if self.policy == REMAINDER:
            text = f"{self.chunks} chunks of {self.rows} rows"
            if self.remainder:
                text += f", then a remainder of {self.remainder} rows (fun traced twice)"
            return text
        return self.policy


def make_plan(
    fun: Callable,
    fun_input: Any,
    batch_size: int | None,
    reduction: Callable | None,
    chunk_reduction: Callable,
    *,
    shard: bool = False,
    mesh: Any = None,
    mapped: bool = False,
) -> Plan:
    """Plan a call from validated arguments (see ``_api.batch_map``).

    Rows are counted when something is split (``batch_size`` or ``shard``) or when
    ``mapped`` says the input's leading axis is mapped (a device's share of rows).
    """
    monoid = recognize(reduction, chunk_reduction)
    kind = "monoid" if monoid else "map" if reduction is None else "generic"
    n = mapped_rows(fun_input) if batch_size is not None or shard or mapped else None
    notes: list[str] = []
    if shard and n:
        mesh = _shard.resolve_mesh(mesh)
        plan_rows = lambda rows: make_plan(
            fun, rows_aval(fun_input, rows), batch_size, reduction, chunk_reduction, mapped=True
        )
        lay = _shard.layout(mesh, n, plan_rows)
        first = lay.local or lay.remainder
        return Plan(
            n=n,
            batch_size=batch_size,
            kind=kind,
            monoid=monoid,
            policy=SHARDED,
            chunks=0,
            rows=0,
            backend=first.backend,
            reason=first.reason,
            error=first.error,
            platform=first.platform,
            shard=lay,
        )

    if n == 0:
        policy, chunks, rows = EMPTY, 0, 0
    elif n is None or batch_size is None or n <= batch_size:
        policy, chunks, rows = SINGLE, 1, n or 0
    elif kind == "generic" or (kind == "map" and chunk_reduction is not identity):
        # Repeated rows cannot be masked out of an unknown reduction or a chunk summary.
        policy, chunks, rows = REMAINDER, n // batch_size, batch_size
    else:
        policy, rows = OVERLAP, overlap_rows(n, batch_size)
        chunks = -(-n // rows)

    platform = target_platform()
    backend, reason, error = _choose_backend(
        fun, fun_input, monoid, n, batch_size, policy, platform
    )
    traced = None
    if policy == OVERLAP and backend == "scan":
        # Trace fun once here; the engine evaluates this jaxpr for every chunk.
        traced = trace(fun, rows_aval(fun_input, rows))
        rowwise = all(s.shape[:1] == (rows,) for s in jax.tree.leaves(traced.out_shape))
        if kind == "map":
            check_rowwise(traced.out_shape, rows, "fun(chunk)")
        elif not rowwise and chunks * rows != n:
            # Repeated rows can only be masked in outputs that keep the row axis.
            notes.append("fun's output has no row axis, so repeated rows cannot be masked")
            policy, chunks, rows, traced = REMAINDER, n // batch_size, batch_size, None
    if backend == "scan" and policy in (SINGLE, OVERLAP) and monoid and monoid.monoid is LOGSUMEXP:
        loaded, why = _native.status()
        notes.append(
            f"chunk logsumexp: native CPU kernel for f32/f64 chunks of >= "
            f"{_native.MIN_ELEMENTS} elements ({why})"
            if loaded
            else f"chunk logsumexp: XLA (native kernel unavailable: {why})"
        )
    return Plan(
        n=n,
        batch_size=batch_size,
        kind=kind,
        monoid=monoid,
        policy=policy,
        chunks=chunks,
        rows=rows,
        masked=chunks * rows - n if policy == OVERLAP else 0,
        remainder=n - chunks * rows if policy == REMAINDER else 0,
        backend=backend,
        reason=reason,
        error=error,
        platform=platform,
        notes=tuple(notes),
        traced=traced,
    )


def target_platform() -> str:
    """The platform being compiled for: an active abstract mesh's device platform
    (cross-platform lowering, e.g. for a GPU from a CPU machine), else the default
    backend."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return getattr(device, "platform", None) or jax.default_backend()


def _choose_backend(
    fun: Callable,
    fun_input: Any,
    monoid: MonoidReduction | None,
    n: int | None,
    batch_size: int | None,
    policy: str,
    platform: str,
) -> tuple[str, str, str]:
    """Pick the engine: ``(backend, why, error)``.

    Calls that no kernel exists for (maps, generic reductions, empty or unmapped
    inputs) always run on the scan engine. For the others, a forced backend that
    cannot run sets ``error`` instead of silently falling back.
    """
    requested = _config.current().backend
    if requested == "scan":
        return "scan", "requested (backend='scan')", ""
    if monoid is None:
        return "scan", "no fused kernel: the reduction is not a recognized monoid", ""
    if policy == EMPTY:
        return "scan", "empty input: the result is the monoid identity", ""
    if n is None:
        return "scan", "nothing mapped (batch_size=None): one plain call of fun", ""
    if requested == "auto" and platform == "cpu":
        return (
            "scan",
            (
                "on CPU the fused kernel only runs in interpret mode (slow); "
                "backend='interpret' forces it"
            ),
            "",
        )
    if requested == "pallas" and platform == "cpu":
        problem = "Pallas has no compiled CPU lowering; use backend='interpret' on CPU"
    else:
        from . import _pallas

        target = "cpu" if requested == "interpret" else platform
        problem = _pallas.kernel_problem(
            fun, fun_input, monoid, platform=target, max_rows=batch_size
        )
    if problem is None:
        if requested == "interpret":
            return "interpret", "fused Pallas kernel in interpret mode (requested)", ""
        return "pallas", f"fused Pallas kernel compiled for {platform}", ""
    if requested == "auto":
        return "scan", f"fused kernel not used: {problem}", ""
    return requested, "", f"backend={requested!r} was requested but cannot run: {problem}"
