"""The front end's plan: how many rows, which chunks, which reduction, and why.

A :class:`Plan` is plain data computed from the arguments (shapes, what the
reduction computes, the options in force); ``plan.planner.make_plan`` fills in
everything but the engine, which the registry in ``engines.registry`` picks. Engines only
execute plans. :func:`adv_jax_math.explain` returns one.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jax

from ..core.call import Call
from ..core.sharding import Lanes
from ..core.trace import Traced, rebind
from ..monoids.reduction import MonoidReduction
from .decision import Decision

__all__ = [
    "Call",
    "Kind",
    "Plan",
    "Policy",
    "Rejection",
    "ShardLayout",
    "target_platform",
]


class Kind(enum.Enum):
    """What the call computes."""

    #: No reduction: the chunks' outputs are concatenated.
    MAP = "map"
    #: A recognized monoid reduction (fused kernels and exact merges apply).
    MONOID = "monoid"
    #: Any other associative reduction, applied to the chunk results in order.
    GENERIC = "generic"


class Policy(enum.Enum):
    """How rows are split into chunks."""

    #: No chunking: ``chunk_reduction(fun(x))`` in one call.
    SINGLE = "single call"
    #: ``n == 0``: the identity, or empty outputs.
    EMPTY = "empty input"
    #: Equal chunks; the last overlaps the one before, its repeated rows masked.
    OVERLAP = "overlap"
    #: Full chunks of ``batch_size``, then the remainder apart.
    REMAINDER = "remainder"
    #: Rows spread over a mesh; see ``Plan.shard``.
    SHARDED = "sharded"


@dataclass(frozen=True)
class Rejection:
    """Why an engine cannot run a plan; ``error`` when the user forced that engine
    for a call it is meant for (running the plan then raises)."""

    reason: str
    error: bool = False


@dataclass(frozen=True)
class ShardLayout:
    """How rows are spread over the mesh; ``local`` and ``remainder`` are the plans
    each device runs on its rows and the one run for the global remainder.

    ``axes`` are the mesh axes the rows are split over (all of them, or those an
    already sharded input uses); ``implicit`` when the input's own sharding chose
    them (``shard=False``, rows already spread over devices).
    """

    mesh: Any  # jax.sharding.Mesh, or AbstractMesh inside jit (an input's own mesh)
    axes: tuple[str, ...]
    prefix: int
    local_rows: int
    global_remainder: int
    local: Plan | None
    remainder: Plan | None
    implicit: bool = False

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.axes)

    @property
    def axis(self) -> str | tuple[str, ...]:
        """The axis name for collectives (one name, or a tuple of them)."""
        return self.axes[0] if len(self.axes) == 1 else self.axes

    def __str__(self) -> str:
        names = ", ".join(map(repr, self.axes))
        text = f"{self.devices} devices on mesh axis {names}: "
        if self.implicit:
            text = f"{self.devices} devices on mesh axis {names}, where fun_input's rows live: "
        if self.local is not None:
            text += f"prefix of {self.prefix} rows, {self.local_rows} per device "
            text += f"({self.local.brief()})"
        else:
            text += "no divisible prefix"
        if self.remainder is not None:
            text += f"; global remainder of {self.global_remainder} rows, replicated"
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
    chunks : int
        Chunks executed.
    rows_per_chunk : int
        Rows in each chunk.
    masked : int
        Rows of the last chunk (``OVERLAP``) that repeat rows of the chunk before.
    remainder : int
        Rows evaluated apart after the loop (``REMAINDER``).
    engine : str
        ``"scan"``, ``"pallas"``, ``"interpret"`` or ``"shard"``.
    block_rows : int
        The fused kernel's rows per block (fused engines).
    block_steps : int
        The fused kernel's blocks per program (fused engines).
    block_backend : str
        The Pallas backend the fused kernel is built with (``"triton"``,
        ``"mosaic_gpu"``, ``"mosaic_tpu"``; ``"interpret"`` in interpret mode).
    reason : str
        Why that engine.
    backward : str
        How reverse mode runs: the backward kernels, or why the scan engine's chunks
        are transposed instead (``explain`` only; fused engines); for a map run
        whole, whether its derivatives run whole too or in chunks, and why.
    roofline : tuple
        The roofline model's verdicts (``kernels.fused_reduce.model.Verdict``) on
        the fused kernel's passes against the scan engine's (compiled kernels on
        devices the model knows; the backward from ``explain`` only).
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
        For ``shard=True`` (or rows already spread over devices): the mesh, the
        rows per device and the plans each device runs (``shard.local``) and the
        global remainder runs.
    lanes : Lanes or None
        A device's plan run by all devices at once (``shard.local``): ``n`` and the
        chunk fields count one device's rows; each chunk of ``fun`` takes that many
        rows of every device.
    autotune : Decision or None
        For ``batch_size="auto"``: the memory model (fixed and per-row bytes), the
        candidate sizes with their bytes and times, and why the chosen one won.
    derivatives : Plan or None
        For a map run whole (``SINGLE``) whose reverse mode, run whole too, would keep
        ``fun``'s intermediates for all rows: the chunked plan its derivatives run
        (``jax.jvp`` chunk by chunk; reverse mode transposes those chunks, each
        recomputed, so gradient memory stays O(batch_size)).
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
    block_backend: str = ""
    reason: str = ""
    backward: str = ""
    roofline: tuple = ()
    rejected: tuple[tuple[str, str], ...] = ()
    error: str = ""
    platform: str = ""
    notes: tuple[str, ...] = ()
    shard: ShardLayout | None = None
    autotune: Decision | None = None
    lanes: Lanes | None = None
    derivatives: Plan | None = None
    traced: Traced | None = field(default=None, repr=False, compare=False)
    tail: Traced | None = field(default=None, repr=False, compare=False)  # fun on the remainder
    block_traced: Any = field(default=None, repr=False, compare=False)  # fused engine's jaxpr
    # Smaller blocks for the backward kernel, where the forward's may not hold its
    # VJP (TPU VMEM): per block (fun's jaxpr, its output avals, rows, steps).
    reverse_traced: tuple = field(default=(), repr=False, compare=False)
    pairing: Any = field(default=None, repr=False, compare=False)  # the pairwise engine's x

    def consts(self) -> list[Any]:
        """The constants of every trace the engine evaluates (this plan's and, when
        sharded, the device plans')."""
        out = [
            *(self.traced.consts if self.traced else ()),
            *(self.tail.consts if self.tail else ()),
        ]
        for block in (self.block_traced, *self.reverse_traced):
            out += list(block[0].consts) if block is not None else []
        subs = (self.shard.local, self.shard.remainder) if self.shard else ()
        for sub in (*subs, self.derivatives):
            out += sub.consts() if sub is not None else []
        return out

    def with_consts(self, values: Mapping[int, Any]) -> Plan:
        """The plan with each trace constant ``c`` replaced by ``values[id(c)]`` (when
        present): the same computation on other copies of its constants."""
        again = lambda block: (rebind(block[0], values), *block[1:]) if block else block
        sub = lambda p: p.with_consts(values) if p is not None else None
        lay = self.shard
        if lay is not None:
            lay = dataclasses.replace(lay, local=sub(lay.local), remainder=sub(lay.remainder))
        return dataclasses.replace(
            self,
            traced=self.traced.with_consts(values) if self.traced else None,
            tail=self.tail.with_consts(values) if self.tail else None,
            block_traced=again(self.block_traced),
            reverse_traced=tuple(map(again, self.reverse_traced)),
            shard=lay,
            derivatives=sub(self.derivatives),
        )

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
            *((("gradient", self.backward),) if self.backward else ()),
            *((f"model ({v.name})", f"{v} (a roofline model)") for v in self.roofline),
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
