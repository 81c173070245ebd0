"""The monoids: sums, extrema, logsumexp, arg-extrema, top-k, softmax-weighted sums,
means and variances. Each is one object of :class:`~adv_jax_math.monoids.base.Monoid`; its
docstring names the plain-JAX expression it equals. One module per family:
``monoids.sums`` (sums, means, variances), ``monoids.extrema`` (max/min and the
arg-extrema), ``monoids.exponential`` (logsumexp, weighted logsumexp),
``monoids.softmax`` (softmax-weighted sums), ``monoids.topk`` (top-k);
``monoids.numerics`` holds what they share, ``monoids.shifted`` the shifted
exponentials of the logsumexp family.

Written with operations every engine lowers (Pallas kernels included: reductions
over the rows, elementwise ops, comparisons, ``dot_general``), stable and
compensated: float sums carry the rounding error of every merge (TwoSum), so a
chunked sum is as exact as ``jnp.sum``; logsumexp and softmax-weighted sums shift
by their running maximum; means and variances merge by Chan's update.
"""

from __future__ import annotations

from .exponential import LOGSUMEXP, WEIGHTED_LOGSUMEXP, weighted_logsumexp
from .extrema import ARGMAX, ARGMIN, MAX, MAX_ARGMAX, MIN, MIN_ARGMIN, nan_weights
from .softmax import SOFTMAX_WEIGHTED, softmax_weighted
from .sums import ADD, MEAN, MEAN_VAR, VAR, var
from .topk import top_k

__all__ = [
    "ADD",
    "ARGMAX",
    "ARGMIN",
    "LOGSUMEXP",
    "MAX",
    "MAX_ARGMAX",
    "MEAN",
    "MEAN_VAR",
    "MIN",
    "MIN_ARGMIN",
    "MONOIDS",
    "SOFTMAX_WEIGHTED",
    "VAR",
    "WEIGHTED_LOGSUMEXP",
    "nan_weights",
    "softmax_weighted",
    "top_k",
    "var",
    "weighted_logsumexp",
]

MONOIDS = (ADD, MAX, MIN, LOGSUMEXP)  # the ones recognized from plain-JAX reductions
