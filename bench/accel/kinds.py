"""The targets of the deviceless compiles and of the models: short name -> the
``device_kind`` JAX reports (imported by scripts that must not set up devices)."""

KINDS = {
    "h100": "NVIDIA H100 80GB HBM3",
    "h200": "NVIDIA H200",
    "a100": "NVIDIA A100-SXM4-80GB",
    "v5e": "TPU v5 lite",
    "v6e": "TPU v6 lite",
    "v5p": "TPU v5",
    "v4": "TPU v4",
}
