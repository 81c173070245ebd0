"""Two local processes (coordinator on 127.0.0.1, CPU collectives) run a sharded
batch_map over the global mesh and get the single-process result."""

import json
import pathlib
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import adv_jax_math as ajm

WORKER = pathlib.Path(__file__).with_name("multiprocess_worker.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(timeout=240):
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:  # no leftover processes, whatever happened
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


@pytest.mark.slow
def test_two_processes_match_single_process():
    results = run_workers()
    x = np.linspace(-2, 2, 67 * 3, dtype=np.float32).reshape(67, 3)
    fun = lambda x: jnp.sin(x) * x
    lse_rows = lambda x, y: jax.nn.logsumexp(-jnp.sum((x[:, None] - y[None]) ** 2, -1), axis=1)
    expect = {
        "devices": 4,
        "sum": jnp.sum(fun(x)),
        "logsumexp": jax.nn.logsumexp(fun(x), axis=0),
        "map": fun(x),
        "grad": jax.grad(lambda w: jnp.sum(fun(x * w)))(jnp.float32(0.5)),
        "divisible_map": fun(x[:64]),
        "pairwise": lse_rows(x, x[:41]),
        "pairwise_grad": jax.grad(lambda y: jnp.sum(jnp.sin(lse_rows(x, y))))(x[:41]),
    }
    for got in results:
        assert got.keys() == expect.keys()
        for key, value in expect.items():
            np.testing.assert_allclose(
                np.asarray(got[key]), np.asarray(value), rtol=1e-5, atol=1e-5, err_msg=key
            )
    # The same call in this single process (4 virtual devices) agrees as well.
    single = ajm.batch_map(fun, x, 5, reduction=jnp.add, chunk_reduction=jnp.sum, shard=True)
    np.testing.assert_allclose(single, results[0]["sum"], rtol=1e-6)
