"""One process of the two-process test in test_multiprocess.py.

Usage: python multiprocess_worker.py PROCESS_ID PORT. Prints one JSON line.
(Everything runs under ``__main__``: pytest's doctest collection imports this file.)
"""

import json
import os
import sys


def main(process_id: int, port: str) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax

    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=60,
    )
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils

    import adv_jax_math as ajm

    def fun(x):
        return jnp.sin(x) * x

    x = np.linspace(-2, 2, 67 * 3, dtype=np.float32).reshape(67, 3)
    near = lambda a, b: -jnp.sum((a - b) ** 2)
    pair_loss = lambda y: jnp.sum(jnp.sin(ajm.pairwise(near, x, y, ajm.LOGSUMEXP, shard=True)))
    loss = lambda w: ajm.batch_map(
        lambda x: fun(x * w), x, 4, reduction=jnp.add, chunk_reduction=jnp.sum, shard=True
    )
    results = {
        "devices": jax.device_count(),
        "sum": ajm.batch_map(fun, x, 5, reduction=jnp.add, chunk_reduction=jnp.sum, shard=True),
        "logsumexp": ajm.batch_map(fun, x, 5, reduction=ajm.LOGSUMEXP, shard=True),
        "map": ajm.batch_map(fun, x, 5, shard=True),
        "grad": jax.jit(jax.grad(loss))(jnp.float32(0.5)),
        "divisible_map": multihost_utils.process_allgather(
            ajm.batch_map(fun, x[:64], 8, shard=True), tiled=True
        ),
        # the tiles on each device's x rows (pairs.spread), y whole on every device
        "pairwise": multihost_utils.process_allgather(
            ajm.pairwise(near, x, x[:41], ajm.LOGSUMEXP, shard=True), tiled=True
        ),
        "pairwise_grad": jax.jit(jax.grad(pair_loss))(x[:41]),
    }
    print(json.dumps({k: np.asarray(v).tolist() for k, v in results.items()}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
