"""What ``batch_size="auto"`` decided (``plan.autotune``), and why: the
:class:`Decision` a plan shows (``explain``: :meth:`Decision.brief`, :meth:`Decision.lines`),
and its JSON form in the disk cache, checked field by field before it is used
(:meth:`Decision.from_json`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .measure import fmt_bytes

__all__ = ["Candidate", "Decision"]


@dataclass(frozen=True)
class Candidate:
    """One chunk size considered: whole-call bytes (measured or modelled) and the
    estimated whole-call seconds (None when not timed)."""

    rows: int
    bytes: int
    measured: bool
    fits: bool
    seconds: float | None = None


@dataclass(frozen=True)
class Decision:
    """What ``batch_size="auto"`` chose, and why (shown by ``explain``)."""

    batch_size: int
    n: int
    budget: int
    budget_source: str
    fixed_bytes: int
    row_bytes: float
    candidates: tuple[Candidate, ...]
    grad: str
    reason: str
    seconds: float = 0.0
    cache: str = "computed"

    def brief(self) -> str:
        planning = f"{self.cache}, {self.seconds * 1e3:.0f} ms planning"
        if not self.candidates:  # nothing measured: the reason is the decision
            return f"auto: {self.reason}; {planning}"
        budget = f"budget {fmt_bytes(self.budget)} ({self.budget_source})"
        return f"auto: {self.batch_size} rows per chunk, {budget}; {planning}"

    def lines(self) -> list[tuple[str, str]]:
        """``(label, text)`` rows for ``Plan.__str__`` (none when nothing was measured)."""
        if not self.candidates:
            return []
        model = (
            f"bytes = {fmt_bytes(self.fixed_bytes)} + {fmt_bytes(self.row_bytes)} x rows "
            f"({self.grad})"
        )
        rows = [("memory model", model)]
        for c in self.candidates:
            t = "not timed" if c.seconds is None else f"{c.seconds * 1e3:9.2f} ms"
            how = "measured" if c.measured else "model   "
            mark = "fits" if c.fits else "over budget"
            rows.append(
                ("candidate", f"{c.rows:>7} rows: {fmt_bytes(c.bytes):>10} {how} {mark:<11} {t}")
            )
        rows.append(("chosen", self.reason))
        return rows

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any, n: int | None = None, budget: int | None = None) -> Decision:
        """The decision in ``data`` (from :meth:`to_json`), checked field by field; with
        ``n`` and ``budget``, they must be the decision's. ValueError says what is wrong."""
        _check(data, _DECISION_FIELDS, "the entry")
        size = data["n"] if n is None else n
        if data["n"] != size:
            raise ValueError(f"n={data['n']!r} is not the call's n={size}")
        if budget is not None and data["budget"] != budget:
            raise ValueError(f"budget={data['budget']!r} is not the call's budget={budget}")
        if not 1 <= data["batch_size"] <= size:
            raise ValueError(f"batch_size={data['batch_size']!r} is not in [1, n={size}]")
        for i, c in enumerate(data["candidates"]):
            _check(c, _CANDIDATE_FIELDS, f"candidates[{i}]")
            if not 1 <= c["rows"] <= size:
                raise ValueError(f"candidates[{i}]: rows={c['rows']!r} is not in [1, n={size}]")
        cands = tuple(Candidate(**c) for c in data["candidates"])
        return cls(**{**data, "candidates": cands})


# What each field of a stored decision must be: "count" an int >= 0 (not a bool),
# "size" an int >= 1, "number" a finite int or float >= 0, "seconds" one or None.
_DECISION_FIELDS = {
    "batch_size": "size",
    "n": "size",
    "budget": "size",
    "budget_source": "str",
    "fixed_bytes": "count",
    "row_bytes": "number",
    "candidates": "list",
    "grad": "str",
    "reason": "str",
    "seconds": "number",
    "cache": "str",
}
_CANDIDATE_FIELDS = {
    "rows": "size",
    "bytes": "count",
    "measured": "bool",
    "fits": "bool",
    "seconds": "seconds",
}
_KINDS = {
    "size": "an int >= 1",
    "count": "an int >= 0",
    "number": "a finite number >= 0",
    "seconds": "a finite number >= 0 or null",
    "str": "a string",
    "bool": "a boolean",
    "list": "a list",
}


def _is(kind: str, v: Any) -> bool:
    if kind == "seconds":
        return v is None or _is("number", v)
    if kind in ("str", "bool", "list"):
        return isinstance(v, {"str": str, "bool": bool, "list": list}[kind])
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    if kind == "number":
        return math.isfinite(v) and v >= 0
    return isinstance(v, int) and v >= (1 if kind == "size" else 0)


def _check(data: Any, fields: dict[str, str], what: str) -> None:
    """ValueError unless ``data`` is a dict with exactly ``fields``, each of its kind."""
    if not isinstance(data, dict):
        raise ValueError(f"{what} is {data!r}, not an object")
    missing = [k for k in fields if k not in data]
    if missing:
        raise ValueError(f"{what} has no {', '.join(missing)}")
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ValueError(f"{what} has unknown fields {', '.join(map(str, unknown))}")
    for k, kind in fields.items():
        if not _is(kind, data[k]):
            where = "" if what == "the entry" else f"{what}: "
            raise ValueError(f"{where}{k}={data[k]!r} is not {_KINDS[kind]}")
