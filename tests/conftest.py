"""Fixtures. Shared helpers live in helpers.py (``from helpers import ...``); the case
lists shared with the benchmarks in bench/cases/ (``from cases.pairwise import ...``)."""

import pathlib
import sys

import pytest

sys.path.append(str(pathlib.Path(__file__).resolve().parent.parent / "bench"))
from helpers import enable_x64


@pytest.fixture
def x64():
    """Run the test with float64 enabled (restored afterwards)."""
    with enable_x64():
        yield
