"""The package stays readable: no module over 500 lines, and the low layers (the
monoids, the plan, the tracing) never import the kernels above them."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "src" / "adv_jax_math"
MODULES = sorted(PACKAGE.rglob("*.py"))
LOW = ["_monoid.py", "_plan.py", "_trace.py", "_jaxpr_graph.py", "_call.py", "_config.py"]
LOW += [p.name for p in PACKAGE.glob("_monoids*.py")]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_over_500_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= 500, f"{path.name} has {lines} lines: split it by concern"


@pytest.mark.parametrize("name", LOW)
def test_low_layers_do_not_import_kernels(name):
    tree = ast.parse((PACKAGE / name).read_text())
    imported = [
        node.module or ""
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level > 0
    ]
    assert not [m for m in imported if m.split(".")[0] == "kernels"], (name, imported)
