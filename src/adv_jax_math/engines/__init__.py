"""Engines execute plans: the registry (order, selection), the scan engine, the shard
layer, the fused Pallas kernel's adapter, and the internal chunked entry.
"""
