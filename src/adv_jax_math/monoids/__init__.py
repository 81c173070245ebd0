"""Monoids: the protocol (``base``), shared numerics, one module per family and the
list of public objects (``catalog``). Imports only ``core``.
"""
