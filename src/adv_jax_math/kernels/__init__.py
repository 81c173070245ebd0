"""Kernels: the fused Pallas map-reduce (``fused_reduce``) and the native CPU
logsumexp's Python loader (``native``; its C++ source is the top-level
``kernels/cpu/``)."""
