"""What a compiled program launches and moves, read from its HLO text.

Deviceless GPU compiles have no ``cost_analysis()`` (it returns None), so the
roofline table counts from ``compiled.as_text()`` itself: every instruction that
launches work (a fusion, a custom call, an unfused op; not parameters, tuples,
bitcasts, constants), in the entry computation and, times the loop's trip count
(``known_trip_count``, else the bound of its condition), in each ``while`` body; and
the bytes each one reads and writes (its operands' and result's shapes; a dynamic
slice reads only what it returns, an in-place dynamic update writes only its update).

    python bench/accel/hlo.py COMPILED.txt     # a summary of one dumped program
"""

from __future__ import annotations

import math
import re
import sys

__all__ = ["launches", "summary"]

_ITEMSIZE = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_NOOPS = {
    "parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all",
    "opt-barrier", "partition-id", "replica-id", "add-dependency", "iota",
}  # fmt: skip
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) \(")


def _bytes(type_text: str) -> int:
    """Bytes of an HLO type: an array ``f32[1024,16]{1,0}`` or a tuple of them."""
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        if dtype in _ITEMSIZE:
            shape = [int(d) for d in dims.split(",") if d]
            total += _ITEMSIZE[dtype] * math.prod(shape)
    return total


def _split_type(rest: str) -> tuple[str, str]:
    """``(type, remainder)`` of an instruction's right-hand side (tuples nest)."""
    if not rest.startswith("("):
        head, _, tail = rest.partition(" ")
        return head, tail
    depth = 0
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return rest[: i + 1], rest[i + 1 :].lstrip()
    return rest, ""


def _computations(text: str) -> tuple[dict[str, list[dict]], str | None]:
    """Each computation's instructions (name, type, op, operands, attributes), and
    the entry computation's name."""
    comps: dict[str, list[dict]] = {}
    entry, current = None, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and line.rstrip().endswith("{"):
            current = header.group(2)
            comps[current] = []
            entry = current if header.group(1) else entry
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is None or " = " not in line:
            continue
        lhs, rhs = line.strip().removeprefix("ROOT ").split(" = ", 1)
        type_text, rest = _split_type(rhs)
        op, _, args = rest.partition("(")
        depth, end = 1, len(args)
        for i, ch in enumerate(args):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                end = i
                break
        comps[current].append(
            {
                "name": lhs.lstrip("%"),
                "type": type_text,
                "op": op.strip(),
                "operands": re.findall(r"%([\w.\-]+)", args[:end]),
                "value": args[:end].strip(),  # a constant's literal
                "attrs": args[end + 1 :],
            }
        )
    return comps, entry


def _moved(ins: dict, types: dict[str, str]) -> int:
    out = _bytes(ins["type"])
    ins_bytes = [_bytes(types.get(o, "")) for o in ins["operands"]]
    called = ins["attrs"]
    if ins["op"] == "dynamic-slice" or "dynamic_slice" in called:
        return 2 * out  # reads what it returns
    if ins["op"] == "dynamic-update-slice" or "dynamic_update_slice" in called:
        return 2 * (sum(ins_bytes) - max(ins_bytes, default=0))  # in place: the update
    return out + sum(ins_bytes)


def _bound(comps: dict, name: str) -> int:
    """A loop's trip count read from its condition ``i < constant`` (XLA:TPU's HLO has
    no ``known_trip_count``; our loops count from 0), else 0."""
    instructions = comps.get(name, [])
    constants = {i["name"]: i["value"] for i in instructions if i["op"] == "constant"}
    for ins in instructions:
        if ins["op"] == "compare" and "direction=LT" in ins["attrs"]:
            bound = [constants[o] for o in ins["operands"] if o in constants]
            if len(bound) == 1 and bound[0].lstrip("-").isdigit():
                return int(bound[0])
    return 0


def _walk(comps: dict, name: str, depth: int = 0) -> tuple[int, int, list[dict]]:
    """``(launches, bytes, loops)`` of computation ``name``, loops multiplied out."""
    instructions = comps.get(name, [])
    types = {i["name"]: i["type"] for i in instructions}
    count, moved, loops = 0, 0, []
    for ins in instructions:
        if ins["op"] == "while":
            body = re.search(r"body=%([\w.\-]+)", ins["attrs"])
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins["attrs"])
            cond = re.search(r"condition=%([\w.\-]+)", ins["attrs"])
            n = int(trips.group(1)) if trips else _bound(comps, cond.group(1) if cond else "")
            c, m, inner = _walk(comps, body.group(1), depth + 1) if body else (0, 0, [])
            known = "backend config" if trips else ("condition" if n else "no")
            loops.append({"trips": n or 1, "launches": c, "bytes": m, "known": known})
            loops += inner
            count, moved = count + n * c, moved + n * m
        elif ins["op"] in ("call", "conditional"):
            for callee in re.findall(
                r"(?:to_apply|branch_computations)=\{?%([\w.\-]+)", ins["attrs"]
            ):
                c, m, inner = _walk(comps, callee, depth + 1)
                count, moved, loops = count + c, moved + m, loops + inner
        elif ins["op"] not in _NOOPS:
            count, moved = count + 1, moved + _moved(ins, types)
    return count, moved, loops


def launches(text: str) -> dict:
    """The program's launches and bytes, with its loops (trips, per-trip figures)."""
    comps, entry = _computations(text)
    if entry is None:
        return {"launches": None, "bytes": None, "loops": []}
    count, moved, loops = _walk(comps, entry)
    return {"launches": count, "bytes": moved, "loops": loops}


def summary(text: str) -> str:
    info = launches(text)
    loops = ", ".join(
        f"{lp['trips']} trips x {lp['launches']} launches ({lp['bytes'] / 1e6:.2f} MB)"
        for lp in info["loops"]
    )
    return f"{info['launches']} launches, {info['bytes'] / 1e6:.1f} MB; loops: {loops or 'none'}"


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(summary(f.read()))
