"""The front end's plan: how many rows, which chunks, which reduction, and why.

A :class:`Plan` is plain data computed from the arguments (shapes, what the
reduction computes, the options in force); :func:`make_plan` fills in everything
but the engine, which the registry in ``_engines`` picks. Engines only execute
plans. :func:`adv_jax_math.explain` returns one.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from . import _autotune, _config
from ._call import Call
from ._monoid import Monoid, MonoidReduction, identity
from ._recognize import recognize
from ._trace import Traced, rows_aval, trace
from ._validate import check_rowwise, mapped_rows

__all__ = [
    "Call",
    "Kind",
    "Plan",
    "Policy",
    "Rejection",
    "ShardLayout",
    "make_plan",
    "target_platform",
]


class Kind(enum.Enum):
    """What the call computes."""

    MAP = "map"  # outputs concatenated
    MONOID = "monoid"  # a recognized monoid reduction
    GENERIC = "generic"  # any other associative reduction


class Policy(enum.Enum):
    """How rows are split into chunks."""

    SINGLE = "single call"  # no chunking: chunk_reduction(fun(x))
    EMPTY = "empty input"  # n == 0: identity / empty outputs
    OVERLAP = "overlap"  # equal chunks; the last overlaps, its repeated rows masked
    REMAINDER = "remainder"  # full chunks of batch_size, then the remainder apart
    SHARDED = "sharded"  # rows spread over a mesh; see Plan.shard


@dataclass(frozen=True)
class Rejection:
    """Why an engine cannot run a plan; ``error`` when the user forced that engine
    for a call it is meant for (running the plan then raises)."""

    reason: str
    error: bool = False


@dataclass(frozen=True)
class ShardLayout:
    """How rows are spread over the mesh; ``local`` and ``remainder`` are the plans
    each device runs on its rows and the one run for the global remainder."""

    mesh: Mesh
    prefix: int
    local_rows: int
    global_remainder: int
    local: Plan | None
    remainder: Plan | None

    @property
    def devices(self) -> int:
        return self.mesh.size

    @property
    def axis(self) -> str:
        return self.mesh.axis_names[0]

    def __str__(self) -> str:
        text = f"{self.devices} devices on mesh axis {self.axis!r}: "
        if self.local is not None:
            text += f"prefix of {self.prefix} rows, {self.local_rows} per device "
            text += f"({self.local.brief()})"
        else:
            text += "no divisible prefix"
        if self.remainder is not None:
            text += f"; global remainder of {self.global_remainder} rows on the first device"
            text += f" ({self.remainder.brief()})"
        return text


@dataclass(frozen=True)
class Plan:
    """How a call is executed. Returned by :func:`adv_jax_math.explain`.

    Attributes
    ----------
    n : int or None
        Mapped rows (None when nothing is mapped: ``batch_size=None``, no sharding).
    batch_size : int, "auto" or None
        The user's bound on rows per chunk; with ``batch_size="auto"``, the size
        chosen (``"auto"`` on a sharded plan: each device's plan chooses its own).
    kind : Kind
        ``MAP`` (outputs concatenated), ``MONOID`` (a recognized reduction) or
        ``GENERIC`` (any other associative reduction).
    reduction : MonoidReduction or None
        The recognized reduction, for ``kind == Kind.MONOID``.
    recognition : str
        How the reduction was recognized, or why it was not.
    policy : Policy
        ``SINGLE``, ``EMPTY``, ``OVERLAP``, ``REMAINDER`` or ``SHARDED``.
    chunks, rows_per_chunk : int
        Chunks executed and rows in each.
    masked : int
        Rows of the last chunk (``OVERLAP``) that repeat rows of the chunk before.
    remainder : int
        Rows evaluated apart after the loop (``REMAINDER``).
    engine : str
        ``"scan"``, ``"pallas"``, ``"interpret"`` or ``"shard"``.
    block_rows, block_steps : int
        The fused kernel's rows per block and blocks per program (fused engines).
    reason : str
        Why that engine.
    rejected : tuple of (str, str)
        Every engine tried before it, with the reason it could not run the call.
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
        device runs (``shard.local``) and the global remainder runs.
    autotune : Decision or None
        For ``batch_size="auto"``: the memory model (fixed and per-row bytes), the
        candidate sizes with their bytes and times, and why the chosen one won.
    """

    n: int | None
    batch_size: int | str | None
    kind: Kind
    reduction: MonoidReduction | None
    policy: Policy
    chunks: int
    rows_per_chunk: int
    masked: int = 0
    remainder: int = 0
    recognition: str = ""
    engine: str = ""
    block_rows: int = 0
    block_steps: int = 1
    reason: str = ""
    rejected: tuple[tuple[str, str], ...] = ()
    error: str = ""
    platform: str = ""
    notes: tuple[str, ...] = ()
    shard: ShardLayout | None = None
    autotune: _autotune.Decision | None = None
    traced: Traced | None = field(default=None, repr=False, compare=False)
    block_traced: Any = field(default=None, repr=False, compare=False)  # fused engine's jaxpr

    def __str__(self) -> str:
        what = {Kind.MAP: "none (outputs concatenated)", Kind.GENERIC: "generic (not a monoid)"}
        lines = [
            ("rows (n)", "not mapped" if self.n is None else str(self.n)),
            ("batch_size", str(self.batch_size)),
            *((("autotune", self.autotune.brief()),) if self.autotune else ()),
            *(self.autotune.lines() if self.autotune else ()),
            ("reduction", what.get(self.kind) or f"{self.reduction} (monoid)"),
            *((("recognized", self.recognition),) if self.recognition else ()),
            ("policy", self._policy_text()),
            ("engine", f"{self.engine}: {self.reason}"),
            *(("rejected", f"{name}: {why}") for name, why in self.rejected),
            *((("sharding", str(self.shard)),) if self.shard else ()),
            *(("note", note) for note in self.notes),
        ]
        width = max(len(k) for k, _ in lines)
        return "\n".join(f"{k:<{width}} : {v}" for k, v in lines)

    def brief(self) -> str:
        text = f"{self.engine}, {self.chunks} chunk(s) of {self.rows_per_chunk} rows"
        if self.masked:
            text += f", {self.masked} masked"
        if self.remainder:
            text += f", local remainder of {self.remainder}"
        return text

    def _policy_text(self) -> str:
        text = f"{self.chunks} chunks of {self.rows_per_chunk} rows"
        if self.policy is Policy.SHARDED:
            return "sharded over a mesh (see sharding)"
        if self.policy is Policy.OVERLAP:
            if self.masked:
                text += (
                    f"; the last chunk overlaps the one before by {self.masked} rows, counted once"
                )
            return text + "; fun traced once"
        if self.policy is Policy.REMAINDER:
            if self.remainder:
                text += f", then a remainder of {self.remainder} rows (fun traced twice)"
            return text
        return self.policy.value


def target_platform() -> str:
    """The platform being compiled for: an active abstract mesh's device platform
    (cross-platform lowering, e.g. for a GPU from a CPU machine), else the default
    backend."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return getattr(device, "platform", None) or jax.default_backend()


def split_rows(n: int, batch_size: int, mode: str) -> tuple[int, str]:
    """Rows per chunk for ``n > batch_size`` rows, and whether the last rows
    ``"overlap"`` the chunk before or run ``"separate"`` (see ``config(remainder=)``).

    Overlapping chunks have ``batch_size`` rows, as the user asked, while the last
    chunk repeats at most ``n / 16`` rows (XLA:CPU measured a (1024, 256, 3) N-body
    chunk 10-40% faster than balanced 1001- or 1008-row chunks); otherwise they are
    balanced: ``k = ceil(n / batch_size)`` chunks of ``ceil(n / k)`` rows repeat
    fewer than ``k`` rows.
    """
    k = -(-n // batch_size)
    rows = -(-n // k)
    repeats = k * rows - n
    if mode == "separate" or (mode == "auto" and repeats * 8 > n):
        return batch_size, "separate"
    if k * batch_size - n <= n // 16:
        return batch_size, "overlap"
    return rows, "overlap"


def _rows_if_reduced(call: Call) -> int | None:
    """Unchunked reductions are planned like chunked ones (one chunk of all rows),
    so a recognized reduction runs the same way (e.g. leafwise on a pytree, or a
    Monoid passed as reduction reducing the mapped axis); None if not mappable."""
    if call.reduction is None:
        return None
    if isinstance(call.reduction, Monoid) and call.chunk_reduction is identity:
        return mapped_rows(call.xs)
    try:
        return mapped_rows(jax.tree.map(jnp.asarray, call.xs))
    except (ValueError, TypeError):
        return None


def _kind(call: Call, reduction: MonoidReduction | None) -> Kind:
    if reduction is not None:
        return Kind.MONOID
    return Kind.MAP if call.reduction is None else Kind.GENERIC


def _recognized(call: Call, traced: Traced) -> tuple[MonoidReduction | None, str]:
    rec = recognize(call.reduction, call.chunk_reduction, traced.out_shape)
    if rec.leaves is None:
        return None, rec.how
    return MonoidReduction(rec.leaves, rec.out_tree, rec.prologue, rec.how), rec.how


def make_plan(call: Call, *, mapped: bool = False) -> Plan:
    """Plan a call (everything but the engine; see ``_engines.plan``).

    Rows are counted when something is split (``batch_size`` or ``shard``) or when
    ``mapped`` says the input's leading axis is mapped (a device's share of rows).
    ``fun`` is traced once here, on one chunk; engines reuse that trace.
    """
    b = call.batch_size
    decision = None
    if b == "auto":
        n: int | None = mapped_rows(call.xs)
        if call.shard and n:
            return _sharded_plan(call, n)  # each device's plan chooses for its rows
        if n:
            decision = _autotune.choose(call, n, target_platform())
        b = decision.batch_size if decision else None
        call = dataclasses.replace(call, batch_size=b)
    assert not isinstance(b, str)  # "auto", the only str batch_size, was resolved above
    # A Monoid passed as reduction (default chunk_reduction) reduces the mapped axis.
    n = mapped_rows(call.xs) if b is not None or call.shard or mapped else _rows_if_reduced(call)
    if call.shard and n:
        return _sharded_plan(call, n)
    if n is None:  # nothing is split: one plain call, as the user wrote it
        kind = Kind.MAP if call.reduction is None else Kind.GENERIC
        return Plan(n, b, kind, None, Policy.SINGLE, 1, 0, platform=target_platform())
    notes: list[str] = []
    if b is None or n <= b:
        policy, chunks, rows = (Policy.EMPTY, 0, 1) if n == 0 else (Policy.SINGLE, 1, n)
    else:
        mode = _config.current().remainder
        rows, split = split_rows(n, b, mode)
        policy, chunks = Policy.OVERLAP, -(-n // rows)
        if split == "separate":
            policy, chunks = Policy.REMAINDER, n // rows
        if n % b and (call.reduction is not None or call.chunk_reduction is identity):
            notes.append(_split_note(n, b, rows, split, mode))

    avals = rows_aval(call.xs, rows)
    raw = trace(call.fun, avals)
    reduction, how = _recognized(call, raw) if call.reduction is not None else (None, "")
    kind = _kind(call, reduction)
    traced = raw
    if reduction is not None and policy is not Policy.EMPTY:
        traced = trace(reduction.prepare(raw), avals)  # the prologue joins fun's jaxpr
    if policy is Policy.OVERLAP:
        if kind is Kind.MAP and call.chunk_reduction is identity:
            check_rowwise(traced.out_shape, rows, "fun(chunk)")
        elif kind is not Kind.MONOID:
            # Repeated rows cannot be left out of an unknown reduction or a chunk summary:
            # chunks of at most batch_size rows, then the remainder rows apart.
            policy, chunks = Policy.REMAINDER, n // rows
            notes = [note for note in notes if not note.startswith("remainder=")]
        elif chunks * rows != n and not all(
            s.shape[:1] == (rows,) for s in jax.tree.leaves(traced.out_shape)
        ):
            notes.append("fun's output has no row axis, so repeated rows cannot be left out")
            policy, chunks = Policy.REMAINDER, n // rows
    if policy is Policy.REMAINDER and kind is not Kind.MONOID:
        traced = raw  # the engine runs chunk_reduction(fun(chunk)) on fun's own jaxpr
    return Plan(
        n=n,
        batch_size=b,
        kind=kind,
        reduction=reduction,
        recognition=how,
        policy=policy,
        chunks=chunks,
        rows_per_chunk=rows,
        masked=chunks * rows - n if policy is Policy.OVERLAP else 0,
        remainder=n - chunks * rows if policy is Policy.REMAINDER else 0,
        platform=target_platform(),
        notes=tuple(notes),
        autotune=decision,
        traced=traced,
    )


def _split_note(n: int, b: int, rows: int, split: str, mode: str) -> str:
    k = -(-n // b)
    share = lambda repeats: f"{repeats} of {n} rows ({repeats / n:.1%})"
    if split == "overlap":
        kind = "chunks of batch_size" if rows == b else "balanced chunks"
        return (
            f"remainder={mode!r}: {k} {kind} ({rows} rows), the last repeating "
            f"{share(k * rows - n)}: one copy of fun, traced once"
        )
    if mode == "separate":
        return f"remainder='separate': the last {n % b} rows run apart (fun compiled twice)"
    return (
        f"remainder='auto': overlapping chunks would repeat {share(k * -(-n // k) - n)}, "
        f"over 1/8, so the last {n % b} rows run apart (fun compiled twice)"
    )


def _sharded_plan(call: Call, n: int) -> Plan:
    mesh = call.mesh
    assert mesh is not None  # shard=True calls get a mesh (_api._prepare)
    d = mesh.size
    prefix, rest = n - n % d, n % d
    local = lambda rows: make_plan(call.with_rows(rows_aval(call.xs, rows)), mapped=True)
    lay = ShardLayout(
        mesh=mesh,
        prefix=prefix,
        local_rows=prefix // d,
        global_remainder=rest,
        local=local(prefix // d) if prefix else None,
        remainder=local(rest) if rest else None,
    )
    first = lay.local or lay.remainder
    assert first is not None  # n > 0 rows: a divisible prefix, a remainder or both
    return Plan(
        n=n,
        batch_size=call.batch_size,
        kind=first.kind,
        reduction=first.reduction,
        recognition=first.recognition,
        policy=Policy.SHARDED,
        chunks=0,
        rows_per_chunk=0,
        platform=first.platform,
        shard=lay,
    )
