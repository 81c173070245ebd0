"""Block sizing tables (``kernels/fused_reduce/blocks.py``): rows per kernel block
and blocks per kernel program, per platform. Pure functions, no tracing."""

import jax
import jax.numpy as jnp
import pytest
from helpers import needs_abstract_devices

from adv_jax_math.core.targets import target
from adv_jax_math.kernels.fused_reduce.blocks import choose_block, choose_steps, tpu_legal_rows

M = 1_000_000

# (platform, n, max_rows, row_elems, row_bytes, one_d, rows or a piece of the reason)
BLOCKS = [
    # Triton: powers of two, at most 2^13 elements per block, never past max_rows.
    ("cuda", M, None, 1, 4, True, 8192),
    ("cuda", M, None, 4, 16, False, 2048),
    ("cuda", M, None, 3, 12, False, 2048),  # 2730 fit: rounded down to a power of two
    ("cuda", M, 3000, 1, 4, True, 2048),
    ("cuda", M, 1, 4, 16, False, 1),
    ("cuda", 5, None, 1, 4, True, 8),  # one block past n (masked rows)
    ("cuda", 5, 4, 1, 4, True, 4),
    ("cuda", M, None, 1 << 21, 1 << 23, False, "over Triton's 1048576"),
    # Mosaic TPU: about 1 MiB per block; 2-D blocks a multiple of 8 rows, 1-D a power
    # of two >= 128 or a multiple of 1024, or one block spanning the whole array.
    ("tpu", M, None, 1, 4, True, 262144),
    ("tpu", M, 300_000, 1, 4, True, 262144),
    ("tpu", M, 5000, 1, 4, True, 4096),
    ("tpu", M, 300, 1, 4, True, 256),
    ("tpu", M, 300, 4, 16, False, 296),
    ("tpu", M, None, 4, 16, False, 65536),
    ("tpu", 37, None, 4, 16, False, 37),  # whole array
    ("tpu", 100, 150, 1, 4, True, 100),  # whole array, not a power of two
    ("tpu", 1000, 64, 1, 4, True, "1-D inputs need at least 128 rows"),
    ("tpu", 100, 4, 4, 16, False, "inputs need at least 8 rows"),
    ("tpu", M, None, 1 << 20, 1 << 22, False, "only 1 fit"),
    # Interpret mode: up to 2^20 elements, bounded by max_rows and n.
    ("cpu", M, 1000, 4, 16, False, 1000),
    ("cpu", M, None, 1, 4, True, M),
    ("cpu", M, None, 4, 16, False, 1 << 18),
    ("cpu", 3, 7, 4, 16, False, 3),
]


@pytest.mark.parametrize("platform, n, max_rows, row_elems, row_bytes, one_d, expect", BLOCKS)
def test_choose_block(platform, n, max_rows, row_elems, row_bytes, one_d, expect):
    got = choose_block(target(platform), n, max_rows, row_elems, row_bytes, one_d)
    if isinstance(expect, str):
        assert isinstance(got, str) and expect in got, got
    else:
        assert got == expect


@pytest.mark.parametrize("n", [1, 7, 1000, 12345, (1 << 25) + 5])
@pytest.mark.parametrize("max_rows", [None, 1, 100, 5000])
@pytest.mark.parametrize("row_elems", [1, 4, 64])
def test_triton_blocks_are_powers_of_two_within_limits(n, max_rows, row_elems):
    rows = choose_block(target("cuda"), n, max_rows, row_elems, 4 * row_elems, row_elems == 1)
    assert rows & (rows - 1) == 0 and rows * row_elems <= max(8192, row_elems)
    assert max_rows is None or rows <= max_rows


# (platform, n, rows, steps): Triton keeps at most 2048 programs, looping a power of
# two of blocks in each; TPU and interpret mode run one block per program.
STEPS = [
    ("cuda", M, 8192, 1),
    ("cuda", 2048 * 8192, 8192, 1),
    ("cuda", 1 << 25, 8192, 2),
    ("cuda", (1 << 25) + 5, 8192, 4),  # 4097 blocks: 3 per program, rounded up to 4
    ("cuda", 1 << 30, 1, 1 << 19),
    ("tpu", 1 << 25, 1024, 1),
    ("cpu", 1 << 25, 8, 1),
]


@pytest.mark.parametrize("platform, n, rows, steps", STEPS)
def test_choose_steps(platform, n, rows, steps):
    assert choose_steps(target(platform), n, rows) == steps


S = jax.ShapeDtypeStruct


def test_tpu_legal_rows():
    two_d, one_d = [S((9999, 4), jnp.float32)], [S((9999,), jnp.float32)]
    assert [tpu_legal_rows(r, two_d) for r in (1, 8, 303, 296)] == [8, 8, 296, 296]
    assert tpu_legal_rows(303, [S((9999, 4), jnp.bfloat16)]) == 288  # 16 sublanes
    assert [tpu_legal_rows(r, one_d) for r in (1, 200, 512, 1500, 5000)] == [
        128,
        128,
        512,
        1024,
        4096,
    ]


@needs_abstract_devices
@pytest.mark.parametrize(("k", "rows"), [(16, 16), (8, 32), (4, 64)])
def test_triton_blocks_of_a_top_k_shrink_with_k(k, rows):
    """Its merge network holds k slots per element beside the block: 64 rows of 128
    distances spilled on H100 at k = 16 and 8 (blocks.TRITON_TOPK_ROWS)."""
    import adv_jax_math as ajm
    from adv_jax_math.core.targets import abstract_mesh

    pts = jax.ShapeDtypeStruct((100003, 16), jnp.float32)
    queries = jnp.ones((128, 16), jnp.float32)
    fun = lambda p: jnp.sum(p * p, 1, keepdims=True) - 2 * p @ queries.T
    a100 = abstract_mesh("cuda", "NVIDIA A100-SXM4-80GB")
    with jax.sharding.use_abstract_mesh(a100):
        plan = ajm.explain(fun, pts, 4096, reduction=ajm.top_k(k, smallest=True))
    assert plan.engine == "pallas" and plan.block_rows == rows, plan
