"""adv_jax_math: chunked map/reduce for JAX with bounded memory.

``batch_map`` / ``batch_vmap`` compute ``chunk_reduction(fun(x))`` in chunks;
the front end plans chunks and the backend, engines execute the plan.
"""

from ._api import batch_map, batch_vmap, explain
from ._config import Options, config
from ._jacobian import batch_jacfwd, batch_jacrev
from ._monoid import ADD, LOGSUMEXP, MAX, MIN, Monoid, MonoidReduction, identity
from ._plan import Plan
from ._vectorize import batch_vectorize

__all__ = [
    "ADD",
    "LOGSUMEXP",
    "MAX",
    "MIN",
    "Monoid",
    "MonoidReduction",
    "Options",
    "Plan",
    "batch_jacfwd",
    "batch_jacrev",
    "batch_map",
    "batch_vectorize",
    "batch_vmap",
    "config",
    "explain",
    "identity",
]
__version__ = "0.1.0"
