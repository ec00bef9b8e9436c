"""Hand-written Pallas "Splash" attention for TPU: block-sparse causal / sliding-window, fwd + bwd.

Why a kernel: OLMo 3 7B trains at seq 8192 with a 4096-token sliding window in 3 of every 4
layers (DESIGN.md §2). A dense kernel computes all seq^2 scores and masks most of them away;
this one cuts the score matrix into (block_q x block_kv) tiles, classifies every tile on the
host as EMPTY (fully masked), PARTIAL (needs the mask) or FULL (no masked entry), and runs a
grid that visits only the non-empty tiles of each row. FULL tiles skip the mask arithmetic.
The MaxText reproduction of OLMo 3 used Splash attention with 2048-token blocks (DESIGN.md §6);
those are the defaults here.

How (the flash-attention recipe, written for Mosaic TPU Pallas):
  forward   grid (head, q block, t): t walks the row's non-empty kv blocks, read from a
            scalar-prefetched table by the k/v index maps. Online softmax in fp32 (running max m,
            running sum l, fp32 accumulator); writes o and the logsumexp m + log(l).
  dq        grid (head, q block, t) on the same table; p = exp(s - lse) is recomputed,
            ds = p * (dO v^T - D) with D = rowsum(dO * o), dq = scale * ds k.
  dk, dv    grid (kv head, kv block, head in group, t) on the transposed table: t walks the
            q blocks that see this kv block; the tile is computed transposed (keys on rows) so
            lse and D arrive lane-dense, and GQA heads of one group accumulate in VMEM.
  chunks    inside a tile, every kernel works on (<= 512) x (<= 512) compute chunks: the fp32
            score chunk stays small in VMEM at 2048-token tiles, and in a PARTIAL tile the
            fully masked chunks are skipped (so compute follows the mask at 512 granularity
            while the DMA moves whole tiles: `computed_score_fraction`).

Mask semantics (identical to transformers' Olmo3 and olmo3.attention.reference_attention):
query i sees key j iff j <= i, and i - j < window when window is set (a query sees itself and
window - 1 keys before it), and segment_ids[i] == segment_ids[j] when segment ids are given.
Segment ids are data, so with them every non-empty tile is treated as PARTIAL.

Mosaic tiling (checked before lowering, see `_check_shapes`): a vreg is 8 sublanes x 128 lanes.
Both block sizes end up on the lane axis of some tile (s is [bq, bkv] in forward/dq, [bkv, bq]
in dk/dv and the lse/D rows are [1, bq]), so both must be multiples of 128; head_dim is the lane
axis of q/k/v tiles: a multiple of 128, or 64 (padded in-register, as JAX's flash kernel allows).
Plain interpret mode (`interpret=True`) emulates generic Pallas and only needs blocks that
divide seq and are multiples of 8, so tiny CPU models can use it. (The model's CPU path
interprets the GPU kernel instead: olmo3/attention.py INTERPRETED_KERNEL.)
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int, Int8

from olmo3.config import matmul_precision

EMPTY, PARTIAL, FULL = 0, 1, 2
LANES, SUBLANES = 128, 8          # TPU vreg shape (Mosaic tiling unit)
# Inside a tile, scores are computed in chunks of at most this many queries x keys, so a
# 2048 x 2048 tile never materializes a 16 MiB fp32 score matrix in VMEM (MaxText base.yml:
# `sa_block_kv_compute: 512`).
COMPUTE_CHUNK = 512
TPU_HEAD_DIMS = "a multiple of 128, or 64"
# Finite "minus infinity" for masked scores: exp(MASK - m) underflows to 0 without producing
# inf - inf = nan when a whole tile row is masked (same trick as JAX's own TPU kernels).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

NT = (((1,), (1,)), ((), ()))      # a @ b.T  (contract the last dims)
NN = (((1,), (0,)), ((), ()))      # a @ b


def dot(a, b, dims):
    """a . b with a float32 result; float32 inputs multiply in float32 (config.matmul_precision:
    Mosaic's default would be bf16 passes, Triton's TF32), bf16 ones as the MXU / tensor cores do."""
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=matmul_precision(b.dtype))


# ---------------------------------------------------------------------------------------------
# Host-side block table
# ---------------------------------------------------------------------------------------------

def block_kinds(seq: int, block_q: int, block_kv: int, window: Optional[int] = None,
                segmented: bool = False, q_seq: Optional[int] = None,
                q_offset: int = 0) -> Int8[np.ndarray, "q_blocks kv_blocks"]:
    """EMPTY / PARTIAL / FULL for every (q block, kv block) tile of the causal(-window) mask.

    From interval bounds, not a dense mask, so it is O(blocks) even at seq 65536.
    Tile (i, j) holds queries [q0, q1] and keys [k0, k1] (inclusive); key k is visible from q iff
    k <= q and q - k < window. FULL: the most distant pair (q1, k0) is visible and the nearest
    (q0, k1) is causal. EMPTY: even the nearest pair is out (k0 > q1, or q0 - k1 >= window).
    With segment ids (data-dependent) no tile can be proven FULL, so FULL becomes PARTIAL.
    A query chunk (context parallelism) has q_seq queries at positions q_offset + 0.. q_seq - 1.
    """
    nq, nk = (seq if q_seq is None else q_seq) // block_q, seq // block_kv
    q0 = (q_offset + np.arange(nq) * block_q)[:, None]
    q1 = q0 + block_q - 1
    k0 = (np.arange(nk) * block_kv)[None, :]
    k1 = k0 + block_kv - 1
    empty, full = _visible_bounds(q0, q1, k0, k1, window)
    kinds = np.where(empty, EMPTY, np.where(full, FULL, PARTIAL)).astype(np.int8)
    if segmented:
        kinds[kinds == FULL] = PARTIAL
    return kinds


def computed_block_fraction(seq: int, window: Optional[int], block_q: int,
                            block_kv: int) -> float:
    """Share of the seq x seq score tiles the kernel computes (non-empty / all)."""
    kinds = block_kinds(seq, block_q, block_kv, window)
    return float(np.count_nonzero(kinds)) / kinds.size


def _compute_chunk(block: int, unit: int, limit: Optional[int] = None) -> int:
    """Largest multiple of `unit` that divides `block` and is <= limit (COMPUTE_CHUNK)."""
    limit = COMPUTE_CHUNK if limit is None else limit
    return next(c for c in range(max(min(block, limit) // unit, 1) * unit, 0, -unit)
                if block % c == 0)


def computed_score_fraction(seq: int, window: Optional[int], block_q: int, block_kv: int,
                            chunk: Optional[int] = None) -> float:
    """Share of the seq x seq scores the kernels compute after skipping empty compute chunks.

    Tiles are DMA'd whole, but inside a PARTIAL tile each (chunk_q x chunk_kv) chunk that is
    fully masked is skipped, so compute follows the mask at chunk (default 512) granularity.
    """
    kinds = block_kinds(seq, _compute_chunk(block_q, SUBLANES, chunk),
                        _compute_chunk(block_kv, SUBLANES, chunk), window)
    return float(np.count_nonzero(kinds)) / kinds.size


def _visit_lists(kinds: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Per row of `kinds`, the column indices of its non-empty tiles, ascending, padded.

    Returns flat int32 (index, kind) tables of shape [rows * width] and the width (the longest
    row). Padding repeats the row's last index (so the pipeline issues no new DMA) with kind
    EMPTY (so the kernel skips compute). Every row has >= 1 tile: each query sees itself.
    """
    rows, _ = kinds.shape
    width = int(max(np.count_nonzero(kinds, axis=1).max(), 1))
    index = np.zeros((rows, width), np.int32)
    kind = np.zeros((rows, width), np.int32)
    for r in range(rows):
        cols = np.flatnonzero(kinds[r])
        index[r, :len(cols)] = cols
        index[r, len(cols):] = cols[-1] if len(cols) else 0
        kind[r, :len(cols)] = kinds[r, cols]
    return index.reshape(-1), kind.reshape(-1), width


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static about one call: shapes, blocks, mask and the host-side tables."""
    heads: int
    kv_heads: int
    seq: int                       # keys
    q_seq: int                     # queries: rows [q_offset, q_offset + q_seq) of the sequence
    q_offset: int
    head_dim: int
    block_q: int
    block_kv: int
    window: Optional[int]
    segmented: bool
    interpret: object
    # forward / dq: per q block, its kv blocks.   dk/dv: per kv block, its q blocks.
    fwd_index: np.ndarray = dataclasses.field(repr=False, compare=False)
    fwd_kind: np.ndarray = dataclasses.field(repr=False, compare=False)
    fwd_width: int
    bwd_index: np.ndarray = dataclasses.field(repr=False, compare=False)
    bwd_kind: np.ndarray = dataclasses.field(repr=False, compare=False)
    bwd_width: int
    tiles: int                     # non-empty tiles (for the cost estimate)
    chunk_q: int                   # compute chunk: queries per chunk (divides block_q)
    chunk_kv: int                  # compute chunk: keys per chunk (divides block_kv)

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


# ---------------------------------------------------------------------------------------------
# In-kernel helpers: chunk classification and masks
# ---------------------------------------------------------------------------------------------

def _visible_bounds(q0, q1, k0, k1, window):
    """(empty, full) for queries [q0, q1] x keys [k0, k1]; numpy arrays or in-kernel scalars."""
    empty = k0 > q1
    full = k1 <= q0
    if window is not None:
        empty = empty | (q0 - k1 >= window)
        full = full & (q1 - k0 < window)
    return empty, full


def _tile_mask(q_start, k_start, shape, window, keys_on_rows, q_seg=None, k_seg=None):
    """Boolean visibility of a tile; `keys_on_rows` for the transposed dk/dv tile [keys, q]."""
    rows = lax.broadcasted_iota(jnp.int32, shape, 0)
    cols = lax.broadcasted_iota(jnp.int32, shape, 1)
    if keys_on_rows:
        k_pos, q_pos = k_start + rows, q_start + cols
    else:
        q_pos, k_pos = q_start + rows, k_start + cols
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (q_pos - k_pos < window)
    if q_seg is not None:
        mask = mask & (q_seg == k_seg)
    return mask


def _for_each_chunk(plan: _Plan, tile_kind, q0, k0, compute):
    """Call compute(qs, ks, masked) for every non-empty (q chunk, kv chunk) of a non-empty tile.

    qs, ks are static slices of the tile's queries and keys. A FULL tile runs every chunk
    unmasked. A PARTIAL tile classifies each chunk from scalars (the host table's interval
    test) and skips the empty ones, so the chunks above the diagonal of a 2048-token diagonal
    tile cost nothing. Segment ids are data: a non-empty segmented chunk is always masked.
    The loops are static Python loops (<= 16 x 16 chunks): every slice is static, tile-aligned.
    """
    cq, ck = plan.chunk_q, plan.chunk_kv

    def run(kind):
        for a in range(plan.block_q // cq):
            for b in range(plan.block_kv // ck):
                qs, ks = slice(a * cq, (a + 1) * cq), slice(b * ck, (b + 1) * ck)
                if kind == FULL:
                    compute(qs, ks, False)
                    continue
                lo_q, lo_k = q0 + a * cq, k0 + b * ck
                empty, full = _visible_bounds(lo_q, lo_q + cq - 1, lo_k, lo_k + ck - 1,
                                              plan.window)
                if plan.segmented:
                    pl.when(jnp.logical_not(empty))(functools.partial(compute, qs, ks, True))
                else:
                    pl.when(jnp.logical_not(empty) & full)(
                        functools.partial(compute, qs, ks, False))
                    pl.when(jnp.logical_not(empty | full))(
                        functools.partial(compute, qs, ks, True))

    pl.when(tile_kind == FULL)(lambda: run(FULL))
    pl.when(tile_kind == PARTIAL)(lambda: run(PARTIAL))           # EMPTY (padding): nothing


# ---------------------------------------------------------------------------------------------
# Forward kernel
# ---------------------------------------------------------------------------------------------

def _fwd_kernel(index_ref, kind_ref, q_ref, k_ref, v_ref, *refs, plan: _Plan):
    if plan.segmented:
        qseg_ref, kseg_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr = refs
    else:
        o_ref, lse_ref, m_scr, l_scr, acc_scr = refs
    i, t = pl.program_id(1), pl.program_id(2)
    step = i * plan.fwd_width + t
    q0, k0 = plan.q_offset + i * plan.block_q, index_ref[step] * plan.block_kv

    @pl.when(t == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, MASK_VALUE, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    def compute(qs, ks, masked):
        q, k, v = q_ref[qs, :], k_ref[ks, :], v_ref[ks, :]
        s = dot(q, k, NT) * plan.scale
        if masked:                                                        # s: [cq, ck]
            seg = (qseg_ref[qs, :1], kseg_ref[:1, ks]) if plan.segmented else ()
            s = jnp.where(_tile_mask(q0 + qs.start, k0 + ks.start, s.shape, plan.window, False,
                                     *seg), s, MASK_VALUE)
        m_prev = m_scr[qs, :]                                             # [cq, 128], lanes equal
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_next)
        # Masked scores give p = 0 exactly, except in a chunk row that is all masked while the
        # row has seen nothing yet (m = MASK_VALUE, p = 1): that junk is wiped by alpha = 0 at
        # the row's first visible key, which always comes (a query sees itself).
        p = jnp.exp(s - m_next[:, :1])
        l_scr[qs, :] = alpha * l_scr[qs, :] + jnp.sum(p, axis=1, keepdims=True)
        m_scr[qs, :] = m_next
        pv = dot(p.astype(v.dtype), v, NN)
        acc_scr[qs, :] = acc_scr[qs, :] * alpha[:, :1] + pv

    _for_each_chunk(plan, kind_ref[step], q0, k0, compute)

    @pl.when(t == plan.fwd_width - 1)
    def _finish():
        l = l_scr[...]
        o_ref[...] = (acc_scr[...] / l[:, :1]).astype(o_ref.dtype)
        lse_ref[...] = m_scr[...] + jnp.log(l)


def _segment_operands(segment_ids, plan: _Plan):
    """Segment ids as columns [n, 128] (tile rows) and as rows [8, n] (tile columns), for the
    queries (n = q_seq) and for the keys (n = seq): (q cols, q rows, k cols, k rows)."""
    seg = segment_ids.astype(jnp.int32)
    q_seg = seg[plan.q_offset:plan.q_offset + plan.q_seq]
    cols = lambda x: jnp.broadcast_to(x[:, None], (x.shape[0], LANES))  # noqa: E731
    rows = lambda x: jnp.broadcast_to(x[None, :], (SUBLANES, x.shape[0]))  # noqa: E731
    return cols(q_seg), rows(q_seg), cols(seg), rows(seg)


def _cost(plan: _Plan, matmuls: int, bytes_accessed: int) -> pl.CostEstimate:
    """Tell XLA's scheduler what a kernel costs: `matmuls` [q, d] x [d, k] products per pair."""
    pairs = plan.tiles * plan.block_q * plan.block_kv * plan.heads
    return pl.CostEstimate(flops=2 * matmuls * pairs * plan.head_dim, transcendentals=pairs,
                           bytes_accessed=bytes_accessed)


def _forward(plan: _Plan, q, k, v, segment_ids):
    bq, bkv, d, g = plan.block_q, plan.block_kv, plan.head_dim, plan.group
    w = plan.fwd_width
    # Index maps get the grid indices, then the prefetched tables. lax.div, not //: floor
    # division lowers through `sign`, which Mosaic cannot lower without a TPU attached.
    q_map = lambda h, i, t, idx, kind: (h, i, 0)
    kv_map = lambda h, i, t, idx, kind: (lax.div(h, g), idx[i * w + t], 0)
    in_specs = [pl.BlockSpec((None, bq, d), q_map), pl.BlockSpec((None, bkv, d), kv_map),
                pl.BlockSpec((None, bkv, d), kv_map)]
    operands = [q, k, v]
    if plan.segmented:
        q_cols, _, _, k_rows = _segment_operands(segment_ids, plan)
        in_specs += [pl.BlockSpec((bq, LANES), lambda h, i, t, idx, kind: (i, 0)),
                     pl.BlockSpec((SUBLANES, bkv), lambda h, i, t, idx, kind: (0, idx[i * w + t]))]
        operands += [q_cols, k_rows]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(plan.heads, plan.q_seq // bq, w),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, bq, d), q_map), pl.BlockSpec((None, bq, LANES), q_map)],
        scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32),   # running max m
                        pltpu.VMEM((bq, LANES), jnp.float32),   # running sum l
                        pltpu.VMEM((bq, d), jnp.float32)],      # fp32 output accumulator
    )
    nbytes = 2 * q.size * q.dtype.itemsize + plan.heads * plan.q_seq * LANES * 4
    o, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, plan=plan),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   # lane-broadcast lse: a [bq, 1] column would pad to 128 lanes anyway
                   jax.ShapeDtypeStruct((plan.heads, plan.q_seq, LANES), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=_cost(plan, 2, nbytes),
        interpret=plan.interpret,
        name="splash_fwd",
    )(jnp.asarray(plan.fwd_index), jnp.asarray(plan.fwd_kind), *operands)
    return o, lse[..., 0]                                                # lse: [heads, q_seq]


# ---------------------------------------------------------------------------------------------
# Backward kernels
# ---------------------------------------------------------------------------------------------

def _dq_kernel(index_ref, kind_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, *refs,
               plan: _Plan):
    if plan.segmented:
        qseg_ref, kseg_ref, dq_ref, acc_scr = refs
    else:
        dq_ref, acc_scr = refs
    i, t = pl.program_id(1), pl.program_id(2)
    step = i * plan.fwd_width + t
    q0, k0 = plan.q_offset + i * plan.block_q, index_ref[step] * plan.block_kv

    @pl.when(t == 0)
    def _init():
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    def compute(qs, ks, masked):
        q, k, v, do = q_ref[qs, :], k_ref[ks, :], v_ref[ks, :], do_ref[qs, :]
        lse = jnp.expand_dims(lse_ref[0][qs], -1)                        # [cq, 1]
        di = jnp.expand_dims(di_ref[0][qs], -1)                          # [cq, 1]
        s = dot(q, k, NT) * plan.scale
        p = jnp.exp(s - lse)                                             # [cq, ck]
        if masked:
            seg = (qseg_ref[qs, :1], kseg_ref[:1, ks]) if plan.segmented else ()
            p = jnp.where(_tile_mask(q0 + qs.start, k0 + ks.start, s.shape, plan.window, False,
                                     *seg), p, 0.0)
        dp = dot(do, v, NT)
        ds = p * (dp - di)
        acc_scr[qs, :] += dot(ds.astype(k.dtype), k, NN)

    _for_each_chunk(plan, kind_ref[step], q0, k0, compute)

    @pl.when(t == plan.fwd_width - 1)
    def _finish():
        dq_ref[...] = (acc_scr[...] * plan.scale).astype(dq_ref.dtype)


def _dkv_kernel(index_ref, kind_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, *refs,
                plan: _Plan):
    if plan.segmented:
        kseg_ref, qseg_ref, dk_ref, dv_ref, dk_scr, dv_scr = refs
    else:
        dk_ref, dv_ref, dk_scr, dv_scr = refs
    j, r, t = pl.program_id(1), pl.program_id(2), pl.program_id(3)
    step = j * plan.bwd_width + t
    q0, k0 = plan.q_offset + index_ref[step] * plan.block_q, j * plan.block_kv

    @pl.when((r == 0) & (t == 0))
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    def compute(qs, ks, masked):
        q, k, v, do = q_ref[qs, :], k_ref[ks, :], v_ref[ks, :], do_ref[qs, :]
        s_t = dot(k, q, NT) * plan.scale
        p_t = jnp.exp(s_t - lse_ref[:, qs])                              # [ck, cq]
        if masked:
            seg = (qseg_ref[:1, qs], kseg_ref[ks, :1]) if plan.segmented else ()
            p_t = jnp.where(_tile_mask(q0 + qs.start, k0 + ks.start, s_t.shape, plan.window,
                                       True, *seg), p_t, 0.0)
        dv_scr[ks, :] += dot(p_t.astype(do.dtype), do, NN)
        dp_t = dot(v, do, NT)
        ds_t = p_t * (dp_t - di_ref[:, qs])
        dk_scr[ks, :] += dot(ds_t.astype(q.dtype), q, NN)

    _for_each_chunk(plan, kind_ref[step], q0, k0, compute)

    @pl.when((r == plan.group - 1) & (t == plan.bwd_width - 1))
    def _finish():
        dk_ref[...] = (dk_scr[...] * plan.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _backward(plan: _Plan, q, k, v, segment_ids, o, lse, do):
    bq, bkv, d, g = plan.block_q, plan.block_kv, plan.head_dim, plan.group
    # D_i = rowsum(dO * o): the softmax-Jacobian term, cheap in XLA, fp32.
    di = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
    lse_rows, di_rows = lse[:, None, :], di[:, None, :]                # [heads, 1, seq]
    if plan.segmented:
        q_cols, q_rows, k_cols, k_rows = _segment_operands(segment_ids, plan)
    params = pltpu.CompilerParams
    nbytes = 4 * q.size * q.dtype.itemsize

    # dq: same grid and table as the forward.
    w = plan.fwd_width
    kv_map = lambda h, i, t, idx, kind: (lax.div(h, g), idx[i * w + t], 0)
    q_map = lambda h, i, t, idx, kind: (h, i, 0)
    row_map = lambda h, i, t, idx, kind: (h, 0, i)
    in_specs = [pl.BlockSpec((None, bq, d), q_map), pl.BlockSpec((None, bkv, d), kv_map),
                pl.BlockSpec((None, bkv, d), kv_map), pl.BlockSpec((None, bq, d), q_map),
                pl.BlockSpec((None, 1, bq), row_map), pl.BlockSpec((None, 1, bq), row_map)]
    operands = [q, k, v, do, lse_rows, di_rows]
    if plan.segmented:
        in_specs += [pl.BlockSpec((bq, LANES), lambda h, i, t, idx, kind: (i, 0)),
                     pl.BlockSpec((SUBLANES, bkv), lambda h, i, t, idx, kind: (0, idx[i * w + t]))]
        operands += [q_cols, k_rows]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, plan=plan),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(plan.heads, plan.q_seq // bq, w), in_specs=in_specs,
            out_specs=pl.BlockSpec((None, bq, d), q_map),
            scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=_cost(plan, 3, nbytes),
        interpret=plan.interpret,
        name="splash_dq",
    )(jnp.asarray(plan.fwd_index), jnp.asarray(plan.fwd_kind), *operands)

    # dk, dv: per (kv head, kv block), loop over the group's q heads and the visiting q blocks.
    w = plan.bwd_width
    q_map = lambda kh, j, r, t, idx, kind: (kh * g + r, idx[j * w + t], 0)
    kv_map = lambda kh, j, r, t, idx, kind: (kh, j, 0)
    row_map = lambda kh, j, r, t, idx, kind: (kh * g + r, 0, idx[j * w + t])
    in_specs = [pl.BlockSpec((None, bq, d), q_map), pl.BlockSpec((None, bkv, d), kv_map),
                pl.BlockSpec((None, bkv, d), kv_map), pl.BlockSpec((None, bq, d), q_map),
                pl.BlockSpec((None, 1, bq), row_map), pl.BlockSpec((None, 1, bq), row_map)]
    operands = [q, k, v, do, lse_rows, di_rows]
    if plan.segmented:
        in_specs += [pl.BlockSpec((bkv, LANES), lambda kh, j, r, t, idx, kind: (j, 0)),
                     pl.BlockSpec((SUBLANES, bq),
                                  lambda kh, j, r, t, idx, kind: (0, idx[j * w + t]))]
        operands += [k_cols, q_rows]
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, plan=plan),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(plan.kv_heads, plan.seq // bkv, g, w),
            in_specs=in_specs,
            out_specs=[pl.BlockSpec((None, bkv, d), kv_map), pl.BlockSpec((None, bkv, d), kv_map)],
            scratch_shapes=[pltpu.VMEM((bkv, d), jnp.float32), pltpu.VMEM((bkv, d), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=params(
            dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary")),
        cost_estimate=_cost(plan, 4, nbytes),
        interpret=plan.interpret,
        name="splash_dkv",
    )(jnp.asarray(plan.bwd_index), jnp.asarray(plan.bwd_kind), *operands)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# custom_vjp wiring and the public entry point
# ---------------------------------------------------------------------------------------------

def _attention_fn(plan: _Plan):
    """A custom_vjp (q, k, v, segment_ids) -> o closed over the static plan."""

    @jax.custom_vjp
    def attend(q, k, v, segment_ids):
        return _forward(plan, q, k, v, segment_ids)[0]

    def fwd(q, k, v, segment_ids):
        o, lse = _forward(plan, q, k, v, segment_ids)
        return o, (q, k, v, segment_ids, o, lse)

    def bwd(res, do):
        q, k, v, segment_ids, o, lse = res
        dq, dk, dv = _backward(plan, q, k, v, segment_ids, o, lse, do)
        return dq, dk, dv, None  # segment ids are integers: no cotangent

    attend.defvjp(fwd, bwd)
    return attend


def _check_shapes(heads, kv_heads, seq, head_dim, block_q, block_kv, window, tpu, q_seq=None):
    """Raise a ValueError naming the violated constraint (before any lowering)."""
    if heads % kv_heads:
        raise ValueError(f"splash_attention: heads ({heads}) must be a multiple of kv_heads "
                         f"({kv_heads}) for grouped-query attention")
    if window is not None and window < 1:
        raise ValueError(f"splash_attention: window={window} must be >= 1 (or None for causal)")
    unit = LANES if tpu else SUBLANES
    why = ("Mosaic TPU tiling: both block sizes become the 128-lane axis of a score tile"
           if tpu else "interpret mode needs sublane-aligned blocks")
    for name, b in (("block_q", block_q), ("block_kv", block_kv)):
        if b <= 0 or b % unit:
            raise ValueError(f"splash_attention: {name}={b} must be a positive multiple of "
                             f"{unit} ({why}); pass e.g. {name}={max(unit, b - b % unit)}")
        n = q_seq if name == "block_q" and q_seq is not None else seq
        if n % b:
            raise ValueError(f"splash_attention: seq={n} must be a multiple of {name}={b}; "
                             f"pad the sequence or pick a block size that divides it")
    if tpu and not (head_dim % LANES == 0 or head_dim == 64):
        raise ValueError(f"splash_attention: head_dim={head_dim} must be {TPU_HEAD_DIMS} "
                         f"(Mosaic TPU tiling: head_dim is the 128-lane axis of q/k/v tiles)")


def splash_attention(
    q: Float[Array, "heads q_seq head_dim"],
    k: Float[Array, "kv_heads seq head_dim"],
    v: Float[Array, "kv_heads seq head_dim"],
    *,
    window: Optional[int] = None,
    segment_ids: Optional[Int[Array, " seq"]] = None,
    block_q: int = 2048,
    block_kv: int = 2048,
    interpret: Union[bool, pltpu.InterpretParams] = False,
    q_offset: int = 0,
) -> Float[Array, "heads q_seq head_dim"]:
    """Causal (sliding-window) attention of one sequence, block-sparse, with a Pallas backward.

    softmax(q k^T * head_dim**-0.5 + mask) v; head h reads kv head h // (heads // kv_heads).
    window=None is plain causal; otherwise query i sees keys i - window + 1 .. i. segment_ids
    (int [seq]) additionally restricts attention to keys of the same segment (document).
    Block sizes are clipped to seq (default 2048 = the write-up's Splash blocks). Batch with
    jax.vmap. interpret: False on TPU; True (plain) or pltpu.InterpretParams() (TPU semantics)
    to run on CPU. q_offset (a Python int, context parallelism): q holds only the queries at
    positions [q_offset, q_offset + q_seq) of the sequence; the grid walks those rows only.
    """
    heads, q_seq, head_dim = q.shape
    kv_heads, seq = k.shape[:2]
    if k.shape != v.shape or k.shape[2] != head_dim:
        raise ValueError(f"splash_attention: expected q [heads, q_seq, head_dim] and k, v "
                         f"[kv_heads, seq, head_dim]; got q {q.shape}, k {k.shape}, v {v.shape}")
    if not isinstance(q_offset, (int, np.integer)) or not 0 <= q_offset <= seq - q_seq:
        raise ValueError(f"splash_attention: q_offset={q_offset!r} must be a Python int in "
                         f"[0, seq - q_seq = {seq - q_seq}] (the host builds the block table from it)")
    q_offset = int(q_offset)
    if segment_ids is not None and segment_ids.shape != (seq,):
        raise ValueError(f"splash_attention: segment_ids must be int [seq={seq}], "
                         f"got {segment_ids.shape}")
    plan = _plan(heads, kv_heads, seq, head_dim, window=window,
                 segmented=segment_ids is not None, block_q=block_q, block_kv=block_kv,
                 interpret=interpret, q_seq=q_seq, q_offset=q_offset)
    return _attention_fn(plan)(q, k, v, segment_ids)


def _plan(heads, kv_heads, seq, head_dim, *, window, segmented, block_q, block_kv,
          interpret, q_seq=None, q_offset=0) -> _Plan:
    q_seq = seq if q_seq is None else q_seq
    block_q, block_kv = min(block_q, q_seq), min(block_kv, seq)
    tpu = interpret is not True
    _check_shapes(heads, kv_heads, seq, head_dim, block_q, block_kv, window, tpu, q_seq)
    unit = LANES if tpu else SUBLANES
    window = None if window is not None and window >= seq else window    # same mask as causal
    kinds = block_kinds(seq, block_q, block_kv, window, segmented=segmented,
                        q_seq=q_seq, q_offset=q_offset)
    fwd_index, fwd_kind, fwd_width = _visit_lists(kinds)
    bwd_index, bwd_kind, bwd_width = _visit_lists(kinds.T)
    return _Plan(heads=heads, kv_heads=kv_heads, seq=seq, q_seq=q_seq, q_offset=q_offset,
                 head_dim=head_dim, block_q=block_q,
                 block_kv=block_kv, window=window, segmented=segmented,
                 interpret=interpret, fwd_index=fwd_index, fwd_kind=fwd_kind,
                 fwd_width=fwd_width, bwd_index=bwd_index, bwd_kind=bwd_kind,
                 bwd_width=bwd_width, tiles=int(np.count_nonzero(kinds)),
                 chunk_q=_compute_chunk(block_q, unit), chunk_kv=_compute_chunk(block_kv, unit))


def kernels(heads: int, kv_heads: int, seq: int, head_dim: int, *, window: Optional[int],
            segmented: bool, block_q: int = 2048, block_kv: int = 2048,
            interpret: Union[bool, pltpu.InterpretParams] = False,
            q_seq: Optional[int] = None, q_offset: int = 0):
    """(forward, backward) for one static shape, on unpadded arrays; ValueError if Mosaic cannot
    tile it (block sizes, head_dim).

    forward(q, k, v, segment_ids) -> (o, lse fp32 [heads, q_seq]); backward(q, k, v,
    segment_ids, o, lse, do) -> (dq, dk, dv): the contract of olmo3.splash_gpu.kernels, so
    olmo3.attention can pick the kernel per lowering platform inside one custom_vjp.
    Any seq runs, as on the GPU kernel: queries are padded at the end to whole q tiles (a block
    clipped to seq, rounded up to 128 lanes), keys to whole kv tiles covering every padded
    query. Padded keys sit after every real query, so causality hides them; padded query rows
    are zeros that see themselves (segment ids padded with the last id), are sliced off and
    get zero cotangents. So the scorer's buckets of 64 tokens (olmo3/scoring.py) or OLMo's 128
    (olmo3/oe_tasks.py) run on a TPU: Mosaic refused 192 (a 192-token block) and 2560
    (not a multiple of 2048).
    """
    q_seq = seq if q_seq is None else q_seq
    unit = LANES if interpret is not True else SUBLANES
    up = lambda n, m: -(-n // m) * m   # noqa: E731  (n rounded up to a multiple of m)
    bq, bkv = min(block_q, up(q_seq, unit)), min(block_kv, up(seq, unit))
    q_pad = up(q_seq, bq)
    seq_pad = up(max(seq, q_offset + q_pad), bkv)
    plan = _plan(heads, kv_heads, seq_pad, head_dim, window=window, segmented=segmented,
                 block_q=bq, block_kv=bkv, interpret=interpret, q_seq=q_pad,
                 q_offset=q_offset)

    def pad(x, n):                       # rows (axis 1) of [heads, rows, ...] up to n, zeros
        return jnp.pad(x, ((0, 0), (0, n - x.shape[1])) + ((0, 0),) * (x.ndim - 2))

    def pad_segments(s):                 # padded keys keep the last id: they see themselves
        return None if s is None else jnp.pad(s, (0, seq_pad - seq), mode="edge")

    def forward(q, k, v, segment_ids):
        o, lse = _forward(plan, pad(q, q_pad), pad(k, seq_pad), pad(v, seq_pad),
                          pad_segments(segment_ids))
        return o[:, :q_seq], lse[:, :q_seq]

    def backward(q, k, v, segment_ids, o, lse, do):
        dq, dk, dv = _backward(plan, pad(q, q_pad), pad(k, seq_pad), pad(v, seq_pad),
                               pad_segments(segment_ids), pad(o, q_pad), pad(lse, q_pad),
                               pad(do, q_pad))
        return dq[:, :q_seq], dk[:, :seq], dv[:, :seq]

    return forward, backward
