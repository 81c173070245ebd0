"""The pairwise tile policy: every size ``(bi, bj)`` (x rows by y rows) a pairwise
engine runs at is chosen here, and checked here when given: the "auto" tiles
(:func:`rows`), the CPU tiles' and the matmul tiles' (:func:`xla`: larger for a top-k),
the GPU/TPU tile kernel's (:func:`kernel`, :func:`device`;
``bench/accel/pairwise_model.py`` models it at these),
``shard="y"``'s chunks (:func:`shard_y`), the column pass's (:func:`swapped`), a
chunked ``batch_map`` read as pairwise (:func:`chunk`, for ``pairs.rows_engine``) and
nested calls read as pairwise (:func:`batch_sizes`, for ``batch.nested``). The choice
depends on the target and on whether a monoid sorts (top-k), not on ``f``'s features.
"""

from __future__ import annotations

from typing import Any

from ..monoids.reduction import MonoidReduction
from ..plan.base import target_platform

__all__ = [
    "batch_sizes",
    "check",
    "chunk",
    "device",
    "kernel",
    "reverse",
    "rows",
    "shard_y",
    "swapped",
    "triton_matmul",
    "xla",
]

TILE_ELEMENTS = 1 << 18  # bi * bj of an "auto" tile: 1 MiB per float32 output leaf
MAX_Y_TILE = 2048  # bj of an "auto" tile
SORT_TILE_ELEMENTS, SORT_MAX_Y_TILE = 1 << 21, 16384  # the same for top-k on the CPU tiles
# (bi, bj) of an "auto" tile kernel ("gpu": Pallas Triton's)
DEVICE_TILES = {"gpu": (64, 64), "mosaic_gpu": (64, 64), "tpu": (512, 256)}
# of an "auto" matmul tile kernel. TPU v5e, attention N = M = 16384, d = 64, bf16:
# (512, 256) 4.1 ms, (256, 512) 3.2, (512, 512) 2.5, (1024, 512) 2.2, (512, 1024) 2.05,
# (1024, 1024) 2.0, (256, 2048) 2.0 (min of 5; XLA's dot_product_attention 5.1 ms)
MATMUL_TILES = {"gpu": (64, 64), "tpu": (512, 1024)}
SMALL_VMEM = 32 << 20  # a TPU with less (v4: 16 MiB) takes half the "auto" kernel tiles


def check(tiles: Any, who: str, auto: bool = True) -> None:
    """Raise unless ``tiles`` is ``(bi, bj)``, two ints >= 1 (or ``"auto"``)."""
    if auto and tiles == "auto":
        return
    if (
        not isinstance(tiles, tuple | list)
        or len(tiles) != 2
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in tiles)
    ):
        raise ValueError(
            f"{who}: tiles={tiles!r}; pass (bi, bj), two ints >= 1" + (", or 'auto'" * auto)
        )


def _fill(elements: int, bj: int, n: int) -> tuple[int, int]:
    """``bi`` the power of two that makes tiles of ``bj`` y rows hold at most
    ``elements`` pairs, at most ``n`` (and at least 1); and ``bj``."""
    return max(1, min(n, 1 << (elements // bj).bit_length() - 1)), bj


def rows(tiles: Any, n: int, m: int) -> tuple[int, int]:
    """The tiles of ``n`` x rows by ``m`` y rows: "auto" (at most 2^18 pairs, at most
    2048 y rows), or the given ones (checked) no larger than the rows."""
    if tiles == "auto":
        return _fill(TILE_ELEMENTS, max(1, min(m, MAX_Y_TILE)), n)
    check(tiles, "pairwise")
    return min(tiles[0], max(n, 1)), min(tiles[1], max(m, 1))


def _sorts(red: MonoidReduction) -> bool:
    """Whether a term of ``red`` sorts (a top-k): the CPU tiles take larger tiles."""
    return any(leaf.monoid.sorts for leaf in red.leaves)


def xla(tiles: Any, n: int, m: int, red: MonoidReduction) -> tuple[int, int]:
    """The CPU tiles' and the matmul tiles': :func:`rows`', but for a top-k's "auto"
    the y rows split evenly into tiles of at most 16384 (a multiple of 8: no last tile
    mostly padding), ``bi`` the power of two that makes a tile of at most 2^21 pairs:
    each tile is one call of the native top-k fold (or one ``lax.top_k`` and a merge),
    and each y tile more a loop step. Against tiles of at most 8192 y rows and 2^20
    pairs (min of 7, native fold, ``top_k(10)``): 1.12x faster at 8192 x 10000, D = 128;
    1.11x at 1e4 x 3e4, D = 16; 1.23x at 3e4 x 3e4, D = 3; 1.00-1.04x at 1e4 x 1e4 and
    1e4 x 5e3, D = 3 and 128. Other monoids gained nothing consistent from larger tiles
    (0.6-1.4x, depending on the sizes' alignment)."""
    if tiles != "auto" or not _sorts(red):
        return rows(tiles, n, m)
    bj = -(-m // -(-m // SORT_MAX_Y_TILE))
    return _fill(SORT_TILE_ELEMENTS, min(m, -(-bj // 8) * 8), n)


def kernel(kind: str, vmem: int, matmul: bool = False) -> tuple[int, int]:
    """The tile kernel's (or the ``matmul`` tile kernel's) "auto" tiles on ``kind``
    (``"gpu"``, ``"tpu"``) with ``vmem`` bytes of VMEM (a TPU's): halved on TPU v4
    (16 MiB), where the reverse pass's D sums overflow."""
    bi, bj = (MATMUL_TILES if matmul else DEVICE_TILES)[kind]
    return (bi // 2, bj // 2) if kind == "tpu" and vmem < SMALL_VMEM else (bi, bj)


def _aligned(kind: str, rows: int) -> int:
    """The least tile that holds ``rows`` rows on ``kind``: on GPU a power of two of
    at least 16, on TPU a multiple of 128."""
    if kind == "tpu":
        return 128 * max(1, -(-rows // 128))
    return max(16, 1 << max(rows - 1, 0).bit_length())


# Values per x row that a Mosaic GPU "auto" tile holds across its loop over y tiles: x's
# features and the states (each a vector of the tile's bi columns, bi / 4 registers per
# thread in the WGMMA layout). H100, 64 x 64 tiles: D = 16 (a sum, logsumexp,
# min-argmin, variance) spilled 400-1100 bytes and k-NN top-10 at D = 3 (20 state
# vectors) 7.3 KB; at 16 x 64 neither did (123-160 and 254 registers).
MOSAIC_GPU_HELD = 96


def _mosaic_gpu(tiles: Any, rows: tuple[int, int], held: int) -> tuple[int, int] | str:
    """:func:`device` on Mosaic GPU: ``bj`` a multiple of 64 (the tile's y rows are a
    warpgroup's four warps' 16 each), ``bi`` of 8; "auto": 64 y rows by the most x rows
    up to 64 (a power of two, at least 8) at which the ``held`` values per x row (x's
    features, the states) take at most :data:`MOSAIC_GPU_HELD` registers, no more than
    the least multiple of 8 holding ``n``."""
    if tiles != "auto":
        bi, bj = tiles
        if bi % 8 or bj % 64:
            return (
                f"tiles={tiles!r}: on Mosaic GPU bj is a multiple of 64 (a warpgroup's rows) "
                f"and bi of 8 (default {DEVICE_TILES['mosaic_gpu']})"
            )
        return bi, bj
    bi, bj = DEVICE_TILES["mosaic_gpu"]
    while bi > 8 and held * bi // 4 > MOSAIC_GPU_HELD:
        bi //= 2
    n = rows[0]
    return (min(bi, 8 * max(1, -(-n // 8))) if n else bi), bj


def device(
    kind: str,
    tiles: Any,
    vmem: int,
    matmul: bool = False,
    rows: tuple[int, int] = (0, 0),
    held: int = 1,
) -> tuple[int, int] | str:
    """The tile kernel's tiles on ``kind``: "auto" :func:`kernel`'s, no larger than
    the least that hold the ``rows`` (``(n, m)``; 0: any) (TPU v5e, 37 x 53 pairs
    with a per-pair L1 distance over 64 features: 121 s to compile at 512 x 1024,
    most of every tile padding), or the given ``tiles``; or why those cannot be: on
    GPU powers of two, on TPU multiples of 128 (x and y rows on lanes). On Mosaic GPU
    (:func:`_mosaic_gpu`) the "auto" tiles depend on the values ``held`` per x row."""
    if kind == "mosaic_gpu":
        return _mosaic_gpu(tiles, rows, held)
    if tiles == "auto":
        bi, bj = kernel(kind, vmem, matmul)
        n, m = rows
        return (min(bi, _aligned(kind, n)) if n else bi), (min(bj, _aligned(kind, m)) if m else bj)
    bi, bj = tiles
    if kind == "gpu" and (bi & (bi - 1) or bj & (bj - 1)):
        return f"tiles={tiles!r}: Triton needs powers of two (default {DEVICE_TILES['gpu']})"
    if kind == "tpu" and (bi % 128 or bj % 128):
        return f"tiles={tiles!r}: on TPU bi and bj are multiples of 128 (x and y rows on lanes)"
    return bi, bj


# Pairs per Triton matmul tile ("auto"), x rows halved first (each holds its states
# across the loop): of a top-k, and of f with squared distances over 64+ features
# (expanded: f32 dot products at full precision, no tensor cores). ptxas -v on H100,
# spill stores per thread: k-NN top-8 at D = 128 forward 24 KB at 64 x 64 and 17.6 KB
# at 64 x 32 (both at 32 registers), 980 bytes at 32 x 32, none at 16 x 64 or 16 x 32
# (top-2, 4, 8 and 16 none at 16 x 32; top-2 804 and top-4 852 bytes at 16 x 64);
# Sinkhorn at D = 64, value_and_grad: the reverse kernels 31 and 28 KB at 64 x 64 (32
# registers), 0 and 708 bytes at 32 x 32, 0 and 720 at 16 x 64, 0 and 4 at 16 x 32
# (forward 380 bytes at 64 x 64, none at 32 x 32 and 16 x 64).
TRITON_TOPK_PAIRS = 512
TRITON_DISTANCE_PAIRS = 1024


def _within(bi: int, bj: int, width: int, least: int) -> tuple[int, int]:
    """The "auto" matmul kernel tiles halved (the larger side first, down to
    ``least``) until a value of ``width`` elements per pair holds no more elements
    than a score of the tiles given (on a TPU v5e, before such values went to XLA's
    loops there: 4096 x 4096 pairs with an L1 distance over 64 features beside a
    squared one, probing 512 x 1024, then its halves, took 341 s; at 128 x 128, 10 s)."""
    pairs = bi * bj
    while bi * bj * width > pairs and max(bi, bj) > least:
        bi, bj = (bi, max(least, bj // 2)) if bj >= bi else (max(least, bi // 2), bj)
    return bi, bj


def triton_matmul(
    tiles: tuple[int, int], red: MonoidReduction, width: int, distances: bool, least: int = 16
) -> tuple[int, int]:
    """Triton's "auto" matmul ``tiles``: no more elements of ``f``'s widest value per
    pair (``width``) than scores of the tiles given (:func:`_within`), then halved,
    x rows first (down to ``least``), until they hold at most
    :data:`TRITON_TOPK_PAIRS` pairs for a reduction with a top-k,
    :data:`TRITON_DISTANCE_PAIRS` where ``f`` has wide squared ``distances``."""
    most = TRITON_TOPK_PAIRS if _sorts(red) else TRITON_DISTANCE_PAIRS if distances else None
    bi, bj = _within(*tiles, width, least)
    while most and bi * bj > most and max(bi, bj) > least:
        bi, bj = (bi // 2, bj) if bi > least else (bi, bj // 2)
    return bi, bj


def shard_y(tiles: Any, n: int, m: int, devices: int) -> int:
    """``bj`` of ``shard="y"``'s chunks (each every x row by ``bj`` y rows): the given
    tiles', or "auto": at most 2^18 pairs and a device's share of the ``m`` y rows."""
    return max(1, min(-(-m // devices), TILE_ELEMENTS // n)) if tiles == "auto" else tiles[1]


# The reverse pass's tiles on Mosaic GPU (its kernels, x or y rows across): 8 rows
# across, 64 down. Its per-pair VJP holds many tile values, each 32 registers per
# thread at 64 x 64: a logsumexp's gradient kernels for H100 took 255 registers and
# spilled 588 bytes at D = 3 and 14 KB at D = 16; at 16 x 64, none at D = 3 and
# 512-576 bytes at D = 16; at 8 x 64, 201-217 registers and none at D = 16.
MOSAIC_GPU_REVERSE = (8, 64)


def reverse(kind: str | None, tiles: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """The tiles of the reverse pass's two kernels, after a forward kernel of ``kind``
    (None: the interpret kernel) at ``tiles``: the pass over x tiles (dx; a max's
    tally before it) at the same tiles and the pass over y tiles (dy) at them swapped;
    on Mosaic GPU all at :data:`MOSAIC_GPU_REVERSE`."""
    if kind == "mosaic_gpu":
        return MOSAIC_GPU_REVERSE, MOSAIC_GPU_REVERSE
    return tiles, (tiles[1], tiles[0])


def swapped(tiles: Any) -> Any:
    """The column pass's tiles (x and y swapped): ``(bj, bi)``; "auto" stays "auto".
    Called after the row pass has checked ``tiles``."""
    return tiles if tiles == "auto" else tuple(tiles)[::-1]


def chunk(
    n: int, rows_per_chunk: int, red: MonoidReduction, autotuned: bool
) -> tuple[int, int] | str:
    """A chunk's pairs (``rows_per_chunk`` y rows by every one of the ``n`` x rows) as
    one tile, when that is fewer than an "auto" tile's (of the CPU tiles); else "auto".
    With ``batch_size="auto"`` (``autotuned``): "auto" (a tile of at most 2^18 pairs
    holds a few MiB, N-body's gradient 5 MiB)."""
    limit = SORT_TILE_ELEMENTS if _sorts(red) else TILE_ELEMENTS
    if autotuned or rows_per_chunk * n >= limit:
        return "auto"
    return n, rows_per_chunk


def batch_sizes(bi: Any, bj: Any, x: list, y: list) -> tuple[int, int] | str:
    """The pairwise tiles from the outer and inner batch sizes of nested calls (None:
    every row; "auto" on either side: "auto"). On GPU/TPU "auto": the tile kernel's own
    (the batch sizes bound memory; its tiles follow the hardware's rules)."""
    if bi == "auto" or bj == "auto" or target_platform() != "cpu":
        return "auto"
    n, m = x[0].shape[0], y[0].shape[0]
    return max(1, bi or n), max(1, bj or m)
