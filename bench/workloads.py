"""Headline workloads shared by the demo and the benchmarks.

Each workload is a pair of functions of the same arguments: ``chunked`` (through
adv_jax_math) and ``plain`` (the unchunked JAX computation, the oracle).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

import adv_jax_math as ajm


@dataclass
class Workload:
    name: str
    chunked: Callable
    plain: Callable
    args: tuple[Any, ...]
    explain: Callable[..., ajm.Plan] | None = None  # the plan of the chunked call


def field_contributions(targets, sources):
    """Biot–Savart-style field of each source (S, 3) at each target (T, 3): (S, T, 3)."""
    d = targets[None, :, :] - sources[:, None, :]
    r2 = jnp.sum(d * d, axis=-1, keepdims=True) + 1e-2
    return jnp.cross(d, sources[:, None, :]) * jax.lax.rsqrt(r2) ** 3


def nbody(n_sources=2**15, n_targets=256, batch_size=1024):
    k1, k2 = jax.random.split(jax.random.key(0))
    targets = jax.random.normal(k1, (n_targets, 3))
    sources = jax.random.normal(k2, (n_sources, 3))

    def chunked(targets, sources, run=ajm.batch_map):
        return run(
            lambda s: field_contributions(targets, s),
            sources,
            batch_size,
            reduction=jnp.add,
            chunk_reduction=jnp.add.reduce,
        )

    def plain(targets, sources):
        return field_contributions(targets, sources).sum(0)

    return Workload(
        f"N-body field, n={n_sources}, B={batch_size}",
        chunked,
        plain,
        (targets, sources),
        lambda t, s: chunked(t, s, run=ajm.explain),
    )


def nbody_grad(n_sources=2**15, n_targets=256, batch_size=1024):
    w = nbody(n_sources, n_targets, batch_size)
    loss = lambda f: lambda t, s: jnp.sum(f(t, s) ** 2)
    return Workload(
        f"grad of N-body energy, n={n_sources}",
        jax.grad(loss(w.chunked)),
        jax.grad(loss(w.plain)),
        w.args,
        w.explain,
    )


def mixture(n_components=2**16, n_points=64, batch_size=4096):
    """Log-likelihood of points under a Gaussian mixture with many components."""
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    params = {
        "mu": jax.random.normal(k1, (n_components, 2)) * 3,
        "log_w": jax.nn.log_softmax(jax.random.normal(k2, (n_components,))),
    }
    points = jax.random.normal(k3, (n_points, 2)) * 3

    def log_joint(points, p):  # (components, points)
        d2 = jnp.sum((points[None] - p["mu"][:, None]) ** 2, -1)
        return p["log_w"][:, None] - 0.5 * d2 - jnp.log(2 * jnp.pi)

    def per_point(points, params, run=ajm.batch_map):
        return run(lambda p: log_joint(points, p), params, batch_size, reduction=ajm.LOGSUMEXP)

    chunked = lambda points, params: per_point(points, params).sum()

    def plain(points, params):
        return jax.nn.logsumexp(log_joint(points, params), axis=0).sum()

    return Workload(
        f"mixture log-lik, K={n_components}",
        chunked,
        plain,
        (points, params),
        lambda p, q: per_point(p, q, run=ajm.explain),
    )


def per_example_grads(n=2**14, dim=64, batch_size=1024):
    k1, k2 = jax.random.split(jax.random.key(2))
    w = jax.random.normal(k1, (dim, dim)) / dim**0.5
    xs = jax.random.normal(k2, (n, dim))
    loss = lambda w, x: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w) ** 2)
    chunked = lambda w, xs: ajm.batch_vmap(jax.grad(loss), (None, 0), batch_size=batch_size)(w, xs)
    plain = lambda w, xs: jax.vmap(jax.grad(loss), (None, 0))(w, xs)
    return Workload(f"per-example grads, n={n}", chunked, plain, (w, xs))


HEADLINE = (nbody, mixture, per_example_grads, nbody_grad)
