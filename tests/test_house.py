"""The house in layers (docs/guides/architecture.md): every module of the package
imports only from its own subpackage or from a lower layer, without circles, and at
module level; no module grows past 400 lines.

    ott > __init__ > batch > pairs > engines > kernels | plan > analysis > monoids > core

``ott`` is an optional integration (OTT-JAX's geometry on ``pairwise``): on top of
everything, so that no module of the package (its ``__init__`` included) imports it;
it is imported only by a user who imports ``adv_jax_math.ott``.
``kernels`` and ``plan`` share a rank and import neither each other: a kernel is a
function of (jaxpr, terms, target), a plan is data; the engines put them together.
Read from the source with ``ast`` (nothing is imported), so a test failure names the
file and line of the import that breaks the order.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import adv_jax_math

ROOT = pathlib.Path(adv_jax_math.__file__).parent
PACKAGE = "adv_jax_math"
RANK = {
    "core": 0,
    "monoids": 1,
    "analysis": 2,
    "kernels": 3,
    "plan": 3,
    "engines": 4,
    "pairs": 5,
    "batch": 6,
    "": 7,  # the package's __init__: re-exports only
    "ott": 8,  # optional integrations: above the package, which never imports them
}
MAX_LINES = 400
ORDER = " > ".join(n or "__init__" for n in sorted(RANK, key=RANK.get, reverse=True))


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _layer(module: str) -> str:
    return module.split(".")[0] if module else ""


def _imports(module: str, path: pathlib.Path) -> list[tuple[str, int, bool]]:
    """The package modules ``module`` imports: (target, line, at module level)."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    here = module.split(".") if module else []
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = base + (node.module.split(".") if node.module else [])
            elif node.module == PACKAGE or (node.module or "").startswith(PACKAGE + "."):
                target = node.module.split(".")[1:]
            else:
                continue
            names = [".".join([*target, a.name]) for a in node.names]
            for name in names:
                mod = name if name in MODULES else ".".join(target)
                found.append((mod, node.lineno, id(node) in top))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(PACKAGE + "."):
                    found.append((a.name[len(PACKAGE) + 1 :], node.lineno, id(node) in top))
    return [(t, line, top) for t, line, top in found if t in MODULES and t != module]


EDGES = {m: _imports(m, p) for m, p in MODULES.items()}


def test_every_module_has_a_layer():
    unknown = sorted(m for m in MODULES if _layer(m) not in RANK)
    assert not unknown, f"modules outside the layers {sorted(RANK)}: {unknown}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_the_layers(module):
    """Only from the module's own subpackage or a lower layer; never inside a function."""
    path = MODULES[module].relative_to(ROOT.parent)
    mine = _layer(module)
    for target, line, top in EDGES[module]:
        theirs = _layer(target)
        where = f"{path}:{line} imports {target}"
        assert top, f"{where} inside a function: import it at module level"
        assert theirs == mine or RANK[theirs] < RANK[mine], (
            f"{where}: layer {mine!r} may not import layer {theirs!r} (order: {ORDER})"
        )


def test_no_import_circles():
    """Inside a layer too: a depth-first walk of module-level imports finds no cycle."""
    state: dict[str, int] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for target, _, _ in EDGES[module]:
            if state.get(target) == 1:
                cycle = [*trail[trail.index(target) :], target] if target in trail else [target]
                raise AssertionError(f"import circle: {' -> '.join(cycle)}")
            if target not in state:
                visit(target, [*trail, target])
        state[module] = 2

    for module in MODULES:
        if module not in state:
            visit(module, [module])


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_stay_small(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[module].relative_to(ROOT.parent)}: {lines} lines"


def test_the_package_init_only_reexports():
    """``adv_jax_math/__init__.py``: imports, ``__all__``, aliases and the version."""
    tree = ast.parse(MODULES[""].read_text())
    for node in tree.body:
        ok = isinstance(node, ast.ImportFrom | ast.Import | ast.Assign | ast.AnnAssign) or (
            isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        )
        assert ok, f"__init__.py:{node.lineno}: {ast.dump(node)[:80]}"
        if isinstance(node, ast.Assign):
            assert isinstance(node.value, ast.Name | ast.List | ast.Constant), node.lineno


def test_every_public_name_is_exported_and_present():
    assert sorted(adv_jax_math.__all__) == sorted(set(adv_jax_math.__all__))
    missing = [n for n in adv_jax_math.__all__ if not hasattr(adv_jax_math, n)]
    assert not missing, missing
