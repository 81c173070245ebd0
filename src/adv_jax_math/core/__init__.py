"""Core: configuration, the validated call, sharding helpers, tracing helpers, the
platform (device table, kernel targets) and progress. Imports nothing of the package.
"""
