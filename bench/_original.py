"""The original library, ``adv-jax-math==1.3`` from PyPI, importable next to ours.

Both distributions use the import name ``adv_jax_math``. The original is installed
on first use with ``pip install --no-deps --target bench/.cache/orig`` (git-ignored)
and loaded as the package ``adv_jax_math_orig``. Only its ``_batch`` module is
imported: the package ``__init__`` also imports ``_sparse``, which needs equinox,
a dependency that ``batch_map``/``batch_vmap`` never use and that we do not install.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

VERSION = "1.3"
NAME = "adv_jax_math_orig"
TARGET = Path(__file__).resolve().parent / ".cache" / "orig"


def _install() -> Path:
    root = TARGET / "adv_jax_math"
    if not (root / "_batch.py").exists():
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run(
            [*pip, "--no-deps", "--target", str(TARGET), f"adv-jax-math=={VERSION}"], check=True
        )
    return root


def load() -> ModuleType:
    """The original's ``_batch`` module (``batch_map``, ``batch_vmap``); installs it if missing."""
    if f"{NAME}._batch" in sys.modules:
        return sys.modules[f"{NAME}._batch"]
    root = _install()
    spec = importlib.util.spec_from_file_location(
        NAME, root / "__init__.py", submodule_search_locations=[str(root)]
    )
    # Register the package without executing its __init__ (see the module docstring).
    sys.modules[NAME] = importlib.util.module_from_spec(spec)
    return importlib.import_module(f"{NAME}._batch")
