"""bench/publish.py, the one writer of the README's generated sections: it replaces
exactly the section named, keeps its markers, is idempotent, and refuses markers
that are missing, doubled or out of order. Standard library only, no jax."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_publish", ROOT / "bench" / "publish.py")
publish = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(publish)

TEXT = """# Title

intro
<!-- bench:begin -->
old bench text
with two lines
<!-- bench:end -->
between
<!-- monoids:begin -->
old monoids text
<!-- monoids:end -->
outro
"""

SWAPPED = (
    TEXT.replace("bench:begin", "@").replace("bench:end", "bench:begin").replace("@", "bench:end")
)


def test_replaces_only_the_named_section():
    out = publish.replace_section(TEXT, "bench", "new\ntext\n")
    assert out == TEXT.replace("old bench text\nwith two lines\n", "new\ntext\n")
    out = publish.replace_section(out, "monoids", "other")  # no final newline: one added
    assert out == (
        "# Title\n\nintro\n<!-- bench:begin -->\nnew\ntext\n<!-- bench:end -->\nbetween\n"
        "<!-- monoids:begin -->\nother\n<!-- monoids:end -->\noutro\n"
    )


def test_idempotent_and_round_trip():
    once = publish.replace_section(TEXT, "bench", "body\n")
    assert publish.replace_section(once, "bench", "body\n") == once
    assert publish.replace_section(once, "bench", "body") == once
    # the section's present body written back changes nothing
    assert publish.replace_section(TEXT, "bench", "old bench text\nwith two lines\n") == TEXT


@pytest.mark.parametrize(
    ("text", "found"),
    [
        (TEXT.replace("<!-- bench:begin -->\n", ""), "<!-- bench:begin --> nowhere"),
        (TEXT.replace("<!-- bench:end -->\n", ""), "<!-- bench:end --> nowhere"),
        (TEXT + "<!-- bench:begin -->\n", "<!-- bench:begin --> on lines 4, 13"),
        (TEXT.replace("between", "<!-- bench:end -->"), "<!-- bench:end --> on lines 7, 8"),
        (SWAPPED, "<!-- bench:begin --> on line 7 and <!-- bench:end --> on line 4"),
    ],
    ids=["no begin", "no end", "two begins", "two ends", "end before begin"],
)
def test_refuses_bad_markers(text, found):
    with pytest.raises(publish.MarkerError, match=re.escape(found)) as e:
        publish.replace_section(text, "bench", "new\n", where="R.md")
    assert str(e.value).startswith("R.md: the section 'bench' (written by bench/report.py)")
    # the other section's markers are fine: it is still written
    assert "new" in publish.replace_section(text, "monoids", "new\n")


def test_refuses_a_body_with_its_markers_and_unknown_sections():
    with pytest.raises(publish.MarkerError, match="holds its markers"):
        publish.replace_section(TEXT, "bench", "x\n<!-- bench:end -->\n")
    with pytest.raises(KeyError, match="SECTIONS"):
        publish.replace_section(TEXT, "nonesuch", "x\n")


def test_write_section_exits_and_leaves_the_file(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(TEXT)
    publish.write_section("monoids", "fresh\n", readme)
    assert readme.read_text() == TEXT.replace("old monoids text", "fresh")
    bad = TEXT.replace("<!-- bench:end -->\n", "")
    readme.write_text(bad)
    with pytest.raises(SystemExit, match=r"README\.md: the section 'bench'"):
        publish.write_section("bench", "fresh\n", readme)
    assert readme.read_text() == bad


def test_publish_policy(tmp_path, capsys):
    """Never from a quick run; from uncommitted changes only with allow_dirty."""
    readme = tmp_path / "README.md"
    readme.write_text(TEXT)
    clean = {"machine": {"uncommitted": [], "commit": "abc1234"}}
    dirty = {"machine": {"uncommitted": [" M src/x.py"], "commit": "abc1234-dirty"}}
    publish.publish("bench", "q\n", clean, quick=True, allow_dirty=True, readme=readme)
    assert readme.read_text() == TEXT
    with pytest.raises(SystemExit) as e:
        publish.publish("bench", "d\n", dirty, quick=False, allow_dirty=False, readme=readme)
    assert e.value.code == 1 and readme.read_text() == TEXT
    assert "--allow-dirty" in capsys.readouterr().err
    publish.publish("bench", "d\n", dirty, quick=False, allow_dirty=True, readme=readme)
    assert readme.read_text() == TEXT.replace("old bench text\nwith two lines", "d")


def test_without_sections_empties_every_section():
    other = TEXT.replace("old bench text", "changed").replace("old monoids text", "too")
    assert other != TEXT
    assert publish.without_sections(other) == publish.without_sections(TEXT)
    assert "between" in publish.without_sections(TEXT)
    assert publish.without_sections(TEXT.replace("intro", "edited")) != publish.without_sections(
        TEXT
    )


def test_readme_has_every_section_once():
    """Each registered section can be rewritten in the repository's README, and writing
    its present body back leaves the README as it is."""
    text = (ROOT / "README.md").read_text()
    for name in publish.SECTIONS:
        begin, end = publish.markers(name)
        body = text.split(begin, 1)[1].split(end, 1)[0].removeprefix("\n")
        assert publish.replace_section(text, name, body) == text


def test_markdown_table():
    rows = [["a", "b", "c"], ["1", "2", "3"]]
    assert publish.markdown_table(rows) == "| a | b | c |\n|---|---|---|\n| 1 | 2 | 3 |"
    assert publish.markdown_table(rows, align="lr").splitlines()[1] == "|---|---:|---|"


def test_generated_note():
    note = publish.generated_note("bench/x.py", "bench/results/x.json", "x.py")
    assert (
        note == "<!-- generated by bench/x.py (bench/results/x.json): edit x.py, not this text -->"
    )


def test_provisional():
    """A section measured at uncommitted changes says so, naming the commit under them."""
    assert publish.provisional({"uncommitted": [], "commit": "abc1234"}) == []
    lines = publish.provisional({"uncommitted": [" M a", " M b"], "commit": "abc1234-dirty"})
    assert lines[0] == "" and "on top of `abc1234` (2 paths in `git status`)" in lines[1]
