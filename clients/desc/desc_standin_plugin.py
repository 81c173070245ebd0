"""pytest plugin: run DESC's tests with ``desc.batching`` replaced by adv_jax_math.

Load with ``-p desc_standin_plugin`` (``clients/desc`` on ``PYTHONPATH``). pytest
loads ``-p`` plugins before collecting, so the stand-in is in place before any
test module imports DESC. ``ADV_DESC_STANDIN=0`` leaves DESC's own batching in
place (the baseline run).
"""

from __future__ import annotations

import os
import sys

ACTIVE = os.environ.get("ADV_DESC_STANDIN", "1") != "0"

if ACTIVE:
    if "desc" in sys.modules:
        raise RuntimeError("DESC was imported before the stand-in plugin was loaded")
    import desc_batching_standin

    desc_batching_standin.install()


def pytest_configure(config):
    # DESC's CI has pytest-mpl and pytest-monitor; their markers are all we need.
    config.addinivalue_line("markers", "mpl_image_compare: pytest-mpl image test")


def pytest_report_header(config):
    if not ACTIVE:
        return "desc.batching: DESC's own (ADV_DESC_STANDIN=0)"
    import adv_jax_math

    return f"desc.batching: adv_jax_math stand-in ({adv_jax_math.__file__})"


def pytest_sessionfinish(session, exitstatus):
    if ACTIVE and "desc.batching" in sys.modules:
        mod = sys.modules["desc.batching"]
        assert getattr(mod, "_ADV_STANDIN", False), "DESC used its own batching module"
