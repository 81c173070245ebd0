"""adv_jax_math: chunked map/reduce for JAX with bounded memory.

``batch_map`` / ``batch_vmap`` compute ``chunk_reduction(fun(x))`` in chunks;
the front end plans chunks and picks an engine, engines execute the plan.
"""

from .batch.api import batch_map, batch_vmap, explain
from .batch.jacobian import batch_jacfwd, batch_jacrev
from .batch.vectorize import batch_vectorize
from .core.config import Options, config
from .core.targets import target_mesh
from .monoids.base import Monoid, identity
from .monoids.catalog import (
    ADD,
    ARGMAX,
    ARGMIN,
    LOGSUMEXP,
    MAX,
    MAX_ARGMAX,
    MEAN,
    MEAN_VAR,
    MIN,
    MIN_ARGMIN,
    SOFTMAX_WEIGHTED,
    VAR,
    WEIGHTED_LOGSUMEXP,
    softmax_weighted,
    top_k,
    var,
    weighted_logsumexp,
)
from .monoids.reduction import LeafReduction, MonoidReduction
from .pairs.api import PairwisePlan, explain_pairwise, pairwise
from .plan.base import Kind, Plan, Policy

# DESC's names for the same functions (desc.batching), so DESC code runs unchanged.
vmap_chunked = batch_vmap
batched_vectorize = batch_vectorize
jacfwd_chunked = batch_jacfwd
jacrev_chunked = batch_jacrev

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
    "SOFTMAX_WEIGHTED",
    "VAR",
    "WEIGHTED_LOGSUMEXP",
    "Kind",
    "LeafReduction",
    "Monoid",
    "MonoidReduction",
    "Options",
    "PairwisePlan",
    "Plan",
    "Policy",
    "batch_jacfwd",
    "batch_jacrev",
    "batch_map",
    "batch_vectorize",
    "batch_vmap",
    "batched_vectorize",
    "config",
    "explain",
    "explain_pairwise",
    "identity",
    "jacfwd_chunked",
    "jacrev_chunked",
    "pairwise",
    "softmax_weighted",
    "target_mesh",
    "top_k",
    "var",
    "vmap_chunked",
    "weighted_logsumexp",
]
__version__ = "0.1.0"
