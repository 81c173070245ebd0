"""Stand-in for ``desc.batching`` backed by adv_jax_math (test harness only).

DESC (``desc-opt``) imports five names from ``desc.batching``::

    batch_map, vmap_chunked, batched_vectorize, jacfwd_chunked, jacrev_chunked

``install()`` puts a meta-path finder in front of the import system so that
``import desc.batching`` loads THIS file under that name; DESC's own module is
never executed (it imports ``jax._src.api._vjp``, gone in jax 0.10).

The names are plain aliases of ours (``chunk_size=`` is our documented alias of
``batch_size=``), exactly the aliases our package is going to export.

With ``ADV_DESC_RECORD=<file>`` every call is also recorded (function, keyword
names, ``in_axes``, kind of ``chunk_reduction``, whether the vectorized function
got keyword arguments, argument types) and written as JSON at interpreter exit,
so the run reports which argument forms DESC really uses.
"""

from __future__ import annotations

import atexit
import collections
import functools
import importlib.abc
import importlib.util
import json
import os
import sys

import adv_jax_math as _ajm

# ---- the aliases (what DESC sees) ------------------------------------------- #
_ALIASES = {
    "batch_map": _ajm.batch_map,
    "vmap_chunked": _ajm.batch_vmap,
    "batched_vectorize": _ajm.batch_vectorize,
    "jacfwd_chunked": _ajm.batch_jacfwd,
    "jacrev_chunked": _ajm.batch_jacrev,
}
__all__ = list(_ALIASES)

# ---- optional call-form recorder -------------------------------------------- #
_RECORD = os.environ.get("ADV_DESC_RECORD")
_FORMS: collections.Counter = collections.Counter()


def _caller() -> str:
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename == __file__:
        f = f.f_back
    if f is None:
        return "?"
    path = f.f_code.co_filename
    i = path.rfind("/desc/")
    return f"{path[i + 1 :] if i >= 0 else os.path.basename(path)}:{f.f_lineno}"


def _describe(value: object) -> str:
    if value is None:
        return "None"
    name = getattr(value, "__name__", type(value).__name__)
    mod = getattr(value, "__module__", "") or ""
    if name == "<lambda>":
        return "lambda"
    return f"{mod}.{name}" if mod else name


def _kinds(args: tuple) -> str:
    out = []
    for a in args:
        t = type(a)
        out.append(t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__name__}")
    return ",".join(out)


def _recording(name: str, target):
    @functools.wraps(target)
    def wrapper(*args, **kwargs):
        site = _caller()
        keys = sorted(kwargs)
        if name == "batch_map":
            form = {
                "fn": name,
                "site": site,
                "positional": len(args),
                "kw": keys,
                "input": type(args[1]).__name__ if len(args) > 1 else "?",
                "chunk_reduction": _describe(kwargs.get("chunk_reduction")),
                "reduction": _describe(kwargs.get("reduction")),
            }
            _FORMS[json.dumps(form, sort_keys=True)] += 1
            return target(*args, **kwargs)
        form = {
            "fn": name,
            "site": site,
            "positional": len(args),
            "kw": keys,
        }
        if name == "vmap_chunked":
            in_axes = kwargs.get("in_axes", args[1] if len(args) > 1 else 0)
            form["in_axes"] = repr(in_axes)
            form["chunk_reduction"] = _describe(kwargs.get("chunk_reduction"))
            form["reduction"] = _describe(kwargs.get("reduction"))
        if name == "batched_vectorize":
            form["signature"] = kwargs.get("signature")
            form["excluded"] = repr(kwargs.get("excluded", frozenset()))
        inner = target(*args, **kwargs)

        @functools.wraps(inner)
        def called(*cargs, **ckwargs):
            f2 = dict(form, call_kw=sorted(ckwargs), arg_types=_kinds(cargs))
            _FORMS[json.dumps(f2, sort_keys=True)] += 1
            return inner(*cargs, **ckwargs)

        return called

    return wrapper


def _dump() -> None:
    forms = [dict(json.loads(k), count=v) for k, v in sorted(_FORMS.items())]
    old = []
    if os.path.exists(_RECORD):
        try:
            with open(_RECORD) as fh:
                old = json.load(fh)
        except ValueError:
            old = []
    with open(_RECORD, "w") as fh:
        json.dump(old + forms, fh, indent=1)


if _RECORD:
    for _name, _target in _ALIASES.items():
        globals()[_name] = _recording(_name, _target)
    atexit.register(_dump)
else:
    globals().update(_ALIASES)


# ---- installing the stand-in ------------------------------------------------ #
class _Finder(importlib.abc.MetaPathFinder):
    """Resolve ``desc.batching`` to this file; everything else is untouched."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "desc.batching":
            return None
        return importlib.util.spec_from_file_location(fullname, __file__)


def install() -> None:
    """Make ``import desc.batching`` load this module. Call before importing DESC."""
    if "desc.batching" in sys.modules and not getattr(
        sys.modules["desc.batching"], "_ADV_STANDIN", False
    ):
        raise RuntimeError("desc.batching was imported before the stand-in was installed")
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


_ADV_STANDIN = True
