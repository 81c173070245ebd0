"""The public chunked calls: ``batch_map``, ``batch_vmap``, ``explain``, nested calls,
Jacobians and ``batch_vectorize``.
"""
