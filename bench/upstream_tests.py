"""The original library's own ``tests/test_batch.py`` (adv-jax-math 1.3), run against ours.

``make test-upstream`` (extra arguments go to pytest). The file is read from the
original's sdist, downloaded at run time (``pip download``) into the git-ignored
``bench/.cache/upstream/``: it is the original's code, so it is never committed here.
Only the test file is extracted (the original package must not shadow ours), then
adapted in the cache, nothing else changed:

- ``from adv_jax_math._batch import ...`` (also inside its subprocess snippets) reads
  our public names from ``adv_jax_math``, and ``_SUPPORTS_SHARDED_BATCHING = True``
  (sharded batching is always supported here);
- ``import equinox as eqx`` uses ``upstream_equinox.py`` (``tree_equal`` only).

Tests of the original's private internals, and two documented differences, are
deselected (``DESELECTED``, with reasons); everything else runs. pytest runs in a
subprocess rooted in the cache (its own ``pytest.ini``: the ``unit`` marker; none of
our pytest settings), without our conftest's 4-device XLA flag: these tests expect
the default single CPU device, and force 4 devices in subprocesses of their own.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "1.3"
HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache" / "upstream"
MEMBER = f"adv_jax_math-{VERSION}/tests/test_batch.py"

DESELECTED = {
    "test_sharded_batching_falls_back_when_unsupported": "monkeypatches the original's "
    "private _batch._SUPPORTS_SHARDED_BATCHING",
    "test_explicit_split_partition_logic": "monkeypatches the original's private "
    "_batch._shard and helpers",
    "test_sharded_evaluation_combines_remainders": "calls the original's private "
    "_batch._evaluate_sharded_on_mesh",
    "test_older_jax_fallbacks": "imports jax._src and re-executes the original's _batch module",
    "test_explicit_input_replicates_only_global_remainder": "calls the original's private "
    "_batch._split_shardable",
    "test_batch_vmap_rejects_unsupported_axes": "the original raises NotImplementedError "
    "for in_axes=1; ours maps any axis, like jax.vmap (a documented design decision)",
    "test_sharded_chunked_batching": "its last assertion counts the original's execution "
    "layout (full chunks then a remainder per device, the global remainder on one device); "
    "ours runs equal overlapping chunks (one compiled copy of fun) and the global remainder "
    "replicated; every value it checks before that agrees (run it with -k to see)",
}

# (pattern, replacement, how many times it must match)
REWRITES = (
    (r"^import equinox as eqx$", "import upstream_equinox as eqx", 1),
    (
        r"^from adv_jax_math\._batch import \(\n    _SUPPORTS_SHARDED_BATCHING,\n(.*?)^\)$",
        r"from adv_jax_math import (\n\1)\n\n_SUPPORTS_SHARDED_BATCHING = True",
        1,
    ),
    (
        r"^( *)from adv_jax_math\._batch import (batch_map, batch_vmap)$",
        r"\1from adv_jax_math import \2",
        2,
    ),
)

PYTEST_INI = """\
[pytest]
markers =
    unit: marks small unit tests
timeout = 300
"""


def fetch() -> str:
    """The original ``tests/test_batch.py``, from its sdist (downloaded on first use)."""
    sdist = CACHE / "sdist" / f"adv_jax_math-{VERSION}.tar.gz"
    if not sdist.exists():
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check"]
        spec = [f"adv-jax-math=={VERSION}", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*pip, *spec, "-d", str(sdist.parent)], check=True)
    with tarfile.open(sdist) as tar:
        file = tar.extractfile(MEMBER)
        assert file is not None, MEMBER
        return file.read().decode()


def adapt(source: str) -> str:
    """The import rewrite (the module docstring); fails if the file has changed shape."""
    for pattern, replacement, count in REWRITES:
        source, n = re.subn(pattern, replacement, source, flags=re.M | re.S)
        assert n == count, (pattern, n)
    return source


def prepare() -> Path:
    """The cache's run folder: the adapted test file, the stand-in, the pytest.ini."""
    source = adapt(fetch())
    tests = {node.name for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}
    tests = {name for name in tests if name.startswith("test_")}
    assert set(DESELECTED) <= tests, set(DESELECTED) - tests
    # --deselect matches node-id prefixes: no selected test may start with a deselected name.
    assert not any(t.startswith(d) for t in tests - set(DESELECTED) for d in DESELECTED)
    run = CACHE / "run"
    shutil.rmtree(run, ignore_errors=True)
    (run / "tests").mkdir(parents=True)
    (run / "pytest.ini").write_text(PYTEST_INI)
    (run / "tests" / "test_batch.py").write_text(source)
    shutil.copy(HERE / "upstream_equinox.py", run / "tests")
    return run


def main() -> int:
    run = prepare()
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = flags.strip()
    pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--confcutdir", str(run)]
    pytest += [f"--deselect=tests/test_batch.py::{name}" for name in DESELECTED]
    collected = subprocess.run(
        [*pytest, "--collect-only", "-q", "tests/test_batch.py"],
        cwd=run,
        env=env,
        capture_output=True,
        text=True,
    )
    selected = sum("::" in line for line in collected.stdout.splitlines())
    print(f"upstream tests/test_batch.py (adv-jax-math {VERSION}): {selected} tests selected;")
    print("deselected, each with all its parameters:")
    for name, reason in DESELECTED.items():
        print(f"  {name}: {reason}")
    sys.stdout.flush()
    if collected.returncode != 0:
        print(collected.stdout + collected.stderr)
        return collected.returncode
    return subprocess.run(
        [*pytest, "-q", "-rfE", "tests/test_batch.py", *sys.argv[1:]], cwd=run, env=env
    ).returncode


if __name__ == "__main__":
    sys.exit(main())
