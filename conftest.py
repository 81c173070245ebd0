"""Session-wide test setup.

Four virtual CPU devices, so sharded calls can be tested in-process (set before
jax initializes its backends). Tests marked ``accelerator`` compile real GPU/TPU
kernels: they run where jax sees a GPU or TPU (bench/device_check.sh) and are
deselected, and counted as such, elsewhere.

The suite checks values, not speed, and compiles a few thousand small programs: XLA:CPU's
LLVM backend at -O0 (``--xla_backend_optimization_level=0``; XLA's own HLO passes, fusion
included, still run) compiled tests/test_pairwise.py's gradient tests with 42% less CPU
time (108 -> 63 s). Set the flag in XLA_FLAGS to choose another level.
"""

import os

_FLAGS = {
    "xla_force_host_platform_device_count": "--xla_force_host_platform_device_count=4",
    "xla_backend_optimization_level": "--xla_backend_optimization_level=0",
}
for _name, _flag in _FLAGS.items():
    if _name not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()


def pytest_collection_modifyitems(config, items):
    import jax

    if jax.default_backend() in ("gpu", "tpu"):
        return
    kept = [item for item in items if "accelerator" not in item.keywords]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept
