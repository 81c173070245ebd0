"""The only place ``bench/`` imports private modules of adv_jax_math.

Everything else in ``bench/`` uses the public API; when the private modules are
renamed, only these imports change.

* ``kernels.native`` (``bench_native.py``): ``TARGET``, ``logsumexp``, ``status``, ``worth_it``.
"""

from adv_jax_math.kernels.native import TARGET as NATIVE_TARGET
from adv_jax_math.kernels.native import logsumexp as native_logsumexp
from adv_jax_math.kernels.native import status as native_status
from adv_jax_math.kernels.native import worth_it as native_worth_it

__all__ = [
    "NATIVE_TARGET",
    "native_logsumexp",
    "native_status",
    "native_worth_it",
]
