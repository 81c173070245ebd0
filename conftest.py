"""Session-wide test setup.

Four virtual CPU devices, so sharded calls can be tested in-process (set before
jax initializes its backends). Tests marked ``accelerator`` compile real GPU/TPU
kernels: they run where jax sees a GPU or TPU (bench/device_check.sh) and are
deselected, and counted as such, elsewhere.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=4"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()


def pytest_collection_modifyitems(config, items):
    import jax

    if jax.default_backend() in ("gpu", "tpu"):
        return
    kept = [item for item in items if "accelerator" not in item.keywords]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept
