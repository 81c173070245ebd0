"""Session-wide test setup: four virtual CPU devices, so sharded calls can be
tested in-process. Must run before jax initializes its backends."""

import os

_FLAG = "--xla_force_host_platform_device_count=4"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()
