"""Fixtures. Shared helpers live in helpers.py (``from helpers import ...``)."""

import pytest
from helpers import enable_x64


@pytest.fixture
def x64():
    """Run the test with float64 enabled (restored afterwards)."""
    with enable_x64():
        yield
