"""The documentation site's structure (no build; ``make docs`` builds and executes it).

Every public name has an API reference entry, every guide and example is reachable
from a toctree, and the build is configured to fail on warnings and on a cell that
raises.
"""

from __future__ import annotations

import pathlib
import re

import pytest

import adv_jax_math

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
GUIDES = (
    "getting_started",
    "chunking",
    "reductions",
    "gradients",
    "autotune",
    "accelerators",
    "sharding",
    "migrating",
    "configuration",
    "decisions",
)


def _directive_bodies(text: str, name: str) -> list[list[str]]:
    """The entry lines of every ``name`` directive: MyST fences (```{toctree}```) and
    reST directives inside ``{eval-rst}`` blocks (``.. autosummary::``)."""
    bodies = []
    for fence in re.finditer(r"^```\{" + name + r"\}[^\n]*\n(.*?)^```", text, re.S | re.M):
        lines = [ln.strip() for ln in fence.group(1).splitlines()]
        bodies.append([ln for ln in lines if ln and not ln.startswith(":")])
    for rst in re.finditer(r"^\.\. " + name + r"::[^\n]*\n((?:[ \t]+[^\n]*\n|\n)*)", text, re.M):
        lines = [ln.strip() for ln in rst.group(1).splitlines()]
        bodies.append([ln for ln in lines if ln and not ln.startswith(":")])
    return bodies


def _api_entries() -> list[str]:
    names = []
    for page in sorted((DOCS / "api").glob("*.md")):
        for body in _directive_bodies(page.read_text(), "autosummary"):
            names += body
    return names


def _toctree_targets() -> set[pathlib.Path]:
    """Every page some toctree lists, as a path under docs/ without its suffix."""
    targets = set()
    for page in DOCS.rglob("*.md"):
        if "_build" in page.parts:
            continue
        for body in _directive_bodies(page.read_text(), "toctree"):
            targets |= {(page.parent / entry).resolve().relative_to(DOCS) for entry in body}
    return targets


def test_every_public_name_has_an_api_entry():
    entries = _api_entries()
    missing = sorted(set(adv_jax_math.__all__) - set(entries))
    assert not missing, f"no API reference entry in docs/api/ for {missing}"


def test_api_entries_are_public_and_listed_once():
    entries = _api_entries()
    stale = sorted(set(entries) - set(adv_jax_math.__all__))
    twice = sorted({e for e in entries if entries.count(e) > 1})
    assert not stale, f"docs/api/ documents names not in adv_jax_math.__all__: {stale}"
    assert not twice, f"docs/api/ lists these names more than once: {twice}"


@pytest.mark.parametrize("guide", GUIDES)
def test_guide_exists_and_is_in_a_toctree(guide):
    assert (DOCS / "guides" / f"{guide}.md").is_file(), f"docs/guides/{guide}.md is missing"
    assert pathlib.Path("guides", guide) in _toctree_targets(), f"guides/{guide} is in no toctree"


def test_every_page_is_in_a_toctree_and_every_entry_exists():
    targets = _toctree_targets()
    pages = {
        p.relative_to(DOCS).with_suffix("")
        for folder in ("guides", "examples", "api")
        for p in (DOCS / folder).glob("*.md")
    }
    assert not sorted(pages - targets), f"pages in no toctree: {sorted(map(str, pages - targets))}"
    for target in targets:
        assert (DOCS / target).with_suffix(".md").is_file(), f"toctree entry {target} has no page"


def test_pages_with_code_cells_are_executed_notebooks():
    for page in DOCS.rglob("*.md"):
        if "_build" in page.parts:
            continue
        text = page.read_text()
        if "```{code-cell}" in text:
            head = text.split("\n---\n", 1)[0]
            assert text.startswith("---\n") and "file_format: mystnb" in head, (
                f"{page.relative_to(DOCS)} has code cells but no mystnb front matter: "
                "its cells would not run"
            )
            assert "kernelspec:" in head, f"{page.relative_to(DOCS)} names no kernel"


def test_build_fails_on_warnings_and_on_cells_that_raise():
    conf = (DOCS / "conf.py").read_text()
    assert re.search(r"^nb_execution_raise_on_error = True", conf, re.M)
    assert re.search(r'^nb_execution_mode = .*"cache"', conf, re.M)
    makefile = (DOCS.parent / "Makefile").read_text()
    recipe = makefile.split("\ndocs:", 1)[1].split("\n\n", 1)[0]
    assert "sphinx-build" in recipe and " -W " in recipe, "make docs must turn warnings into errors"
