"""Hand-written Pallas GPU (Triton) "Splash" attention: block-sparse causal / sliding-window /
document attention for NVIDIA GPUs, forward and backward.

    o = softmax(q k^T * head_dim**-0.5 + mask) v          head h reads kv head h // (heads // kv_heads)
    forward  per (q block i, head h):     for kv block j in [lo_i, hi_i): online softmax  -> o, lse
    dq       per (q block i, head h):     for kv block j in [lo_i, hi_i): dq += dS k
    dk, dv   per (kv block j, kv head):   for head r of the group, for q block i in [lo_j, hi_j):
                                              dv += P^T dO,  dk += dS^T q
    with P = exp(s - lse), dS = P * (dO v^T - D), D = rowsum(dO * o)  (FlashAttention-2, §3.1)

Why a second kernel: the TPU kernel (olmo3/splash.py) is Mosaic TPU and cannot run on a GPU;
cuDNN's fused attention (`--attention=cudnn`) takes a sliding window but no segment ids, and
JAX's own Triton flash kernel (`jax.experimental.pallas.ops.gpu.attention`) has segment ids but
no window and no grouped-query heads. Stage 3 (seq 65,536, intra-document masking) needs both
documents and memory linear in seq; stages 1-2 need the 4096-token window (DESIGN.md §2, §9).

How (Pallas on the Triton backend; every grid point is one CUDA thread block):
  tables    Before any kernel, an XLA step classifies the tiles of each block row
            (`tile_classes`, O(blocks^2) work, never O(seq^2)). Tile (i, j) holds queries
            [q0, q1] and keys [k0, k1]; it is reachable iff k0 <= q1 (causal), q0 - k1 < window
            and the blocks' segment-id ranges [min, max] overlap; it is full (no mask needed)
            iff k1 <= q0, q1 - k0 < window and both blocks hold one and the same id.
            `visit_bounds` turns that into (lo, flo, fhi, hi) per row: [lo, hi) spans the
            reachable tiles, [flo, fhi) the run of full ones. The window bounds the loop from
            below, causality from above, and with packed documents (ids non-decreasing,
            data/loader.py) the loop visits exactly the blocks of the row's own documents: a q
            block in a 4k-token document at seq 65,536 visits <= 64 kv blocks, not up to 1024.
  loops     Each row runs three branch-free fori_loops: masked over [lo, flo), unmasked over
            [flo, fhi), masked over [fhi, hi). The mask (iotas, window, segment ids) costs a
            few integer ops per score and only on the band's edges. Branch-free matters:
            a per-tile lax.cond puts the dots under an scf.if and Triton then does not
            software-pipeline the k/v loads (compiled for sm_90: 64 KiB of shared memory, one
            buffer, with the branch; 128 KiB, three stages, without). With unsorted ids a
            reachable tile can be all masked; it is computed and contributes exactly 0.
  forward   grid (q blocks, heads). q stays in registers/SMEM, k/v tiles stream through the
            Triton software pipeline (num_stages). Online softmax in fp32 in base 2
            (exp2(s * log2 e), the FlashAttention-2 Triton trick that saves a multiply per
            score); running max m and sum l in fp32; writes o and lse = ln(sum exp s) [heads, seq].
  dq        grid (q blocks, heads), same table as the forward, P recomputed from lse.
  dk, dv    grid (kv blocks, kv heads). The G = heads / kv_heads query heads that share this kv
            head loop inside the kernel and accumulate into the same fp32 dk/dv registers, so
            GQA's sum over the group costs nothing extra and dk/dv are written once. The tile is
            computed transposed (keys on rows: s^T = k q^T) so that lse and D broadcast along
            rows and no [bq, bkv] transpose is needed. D = rowsum(dO * o) is one fused XLA op.
  vjp       jax.custom_vjp; residuals q, k, v, segment ids, o and lse (fp32, [heads, seq]):
            linear in seq. `kernels()` exposes forward and backward separately so that
            olmo3.attention can choose per lowering platform inside a single custom_vjp.

Query chunks (context parallelism, olmo3/sharding.py): q holds only the rows [q_offset,
q_offset + q_seq) of the sequence (q_offset a Python int), k, v and segment ids all seq. Every
position is global: the tables are the chunk's rows of the whole table (tile (i, j) holds
queries q_offset + i * bq ..), the masks compare global positions, o, lse and D have q_seq rows,
and the dk/dv grid runs over all seq keys, each visiting only the chunk's q blocks it can reach
(none, for keys after the chunk: dk = dv = 0 there). Keys are padded up to the last padded
query's position, so the query rows' segment ids are read in bounds from the one id array.

Mask semantics (identical to olmo3.attention.reference_attention and the TPU kernel): query i
sees key j iff j <= i, and i - j < window when window is set, and segment_ids[i] ==
segment_ids[j] when segment ids are given. Masked scores become a finite MASK_VALUE, so a row
whose first tile is all masked cannot produce inf - inf; every row reaches its own diagonal.

Shapes: Triton tensors must have power-of-two sizes and tl.dot needs every dimension >= 16, so
head_dim is zero-padded to the next power of two >= 16 (the scale keeps the true head_dim) and
seq is padded to a multiple of the largest block. Padded keys sit after every real query, so
causality hides them; padded query rows are sliced off and get zero cotangents.

Block sizes for H100/H200 (sm_90: 228 KiB shared memory per SM, at most 227 KiB per block; 64K
32-bit registers per SM). Nothing here has been timed on a GPU (none was available when this
was written); the choices follow the public tuned references, and the kernels' Triton IR
(bf16, head_dim 64/128/256) compiles for sm_90 with the pip Triton 3.9 + its ptxas without
register spills (benchmarks/splash_gpu_ptxas.py; an independent check: on a GPU, XLA compiles
it with the Triton in jaxlib). At head_dim 128: forward 226 registers/thread and 128 KiB shared
memory; dq 138-175 registers, 96 KiB; dk/dv 250-254 registers, 97 KiB. The tiles:
  forward  128 x 64, 8 warps (head_dim >= 128) / 4 warps, 3 stages: the Triton fused-attention
           tutorial's and JAX's flash kernel's forward tiles for head_dim 128. SMEM in bf16:
           q 32 KiB + 3 stages x (k + v) 32 KiB = 128 KiB.
  dq       64 x 64, 2 stages; dk/dv 64 (keys) x 64 (queries), 2 stages: the backward keeps two
           fp32 [64, head_dim] accumulators (dk, dv) in registers: 64 KiB at head_dim 128, i.e.
           64 registers per thread at 8 warps. FlashAttention-2's CUDA backward for head_dim 128
           uses 64 x 128 tiles with 8 warps; 64 x 64 leaves the Triton compiler headroom.
  256      head_dim 256 (the 16 x 256 heads variant): forward 64 x 64 and dk/dv 32 keys, which
           halves the fp32 accumulators (at 128 rows ptxas spilled ~700 bytes per thread).
`block_sizes()` shrinks stages, then blocks, until the SMEM estimate fits SMEM_BUDGET (fp32
inputs and head_dim 256 need it); the Triton lowering does not check SMEM at export time, the
CUDA compile on the GPU would fail instead, so the estimate is tested here. fp32 inputs (CPU
tests, not GPU training) compile too, with small dk/dv spills at head_dim 128.
Interpret mode (`interpret=True`) runs the same kernels as plain JAX on any backend (CPU tests).

Lowering for a GPU on a host without one (`jax.export(..., platforms=["cuda"])` on a CPU, the
tests' check of the real target): from JAX 0.11 the Triton lowering asks the device for its
compute capability and refuses without a GPU ("please specify an abstract GPU device");
`with target_gpu():` names one (an H100 by default) through JAX's abstract mesh, on every JAX.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from olmo3.splash import NN, NT, dot as _dot   # a . b, float32 result and float32 inputs exact

# Finite "minus infinity" for masked scores (exp2(MASK_VALUE - m) == 0, never inf - inf).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
LOG2E = math.log2(math.e)
MIN_DIM = 16                          # tl.dot: every matmul dimension >= 16
# Per-block shared memory on sm_90 is 227 KiB (CUDA C Programming Guide, "Compute Capability
# 9.0"); keep ~35 KiB for the Triton compiler's own layout-conversion scratch.
SMEM_BUDGET = 192 * 1024


# ---------------------------------------------------------------------------------------------
# Block sizes
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles, warps and pipeline stages of the three kernels (rows x columns of each tile)."""
    fwd_q: int = 128
    fwd_kv: int = 64
    fwd_warps: int = 8
    fwd_stages: int = 3
    dq_q: int = 64
    dq_kv: int = 64
    dkv_kv: int = 64
    dkv_q: int = 64
    bwd_warps: int = 8
    bwd_stages: int = 2

    def blocks(self) -> tuple[int, ...]:
        return (self.fwd_q, self.fwd_kv, self.dq_q, self.dq_kv, self.dkv_kv, self.dkv_q)

    def clipped(self, seq: int, q_seq: Optional[int] = None) -> "BlockSizes":
        """Every kv block no larger than seq, every q block no larger than q_seq (default seq),
        rounded up to a power of two (>= MIN_DIM)."""
        cap = lambda n: max(MIN_DIM, _next_pow2(n))
        caps = {"_q": cap(seq if q_seq is None else q_seq), "_kv": cap(seq)}
        return dataclasses.replace(self, **{
            f.name: min(getattr(self, f.name), caps[suffix])
            for f in dataclasses.fields(self) for suffix in caps if f.name.endswith(suffix)})


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def smem_bytes(sizes: BlockSizes, head_dim: int, itemsize: int) -> dict[str, int]:
    """Shared-memory estimate per kernel: resident tiles + num_stages copies of streamed tiles,
    plus the fp32 score tile converted to a dot operand (P for P @ V, dS for dS @ K)."""
    d = max(MIN_DIM, _next_pow2(head_dim))
    fwd = (sizes.fwd_q * d * itemsize                                   # q, resident
           + sizes.fwd_stages * 2 * sizes.fwd_kv * d * itemsize         # k, v per stage
           + sizes.fwd_q * sizes.fwd_kv * itemsize)                     # P as dot operand
    dq = (2 * sizes.dq_q * d * itemsize                                 # q, dO resident
          + sizes.bwd_stages * 2 * sizes.dq_kv * d * itemsize           # k, v per stage
          + sizes.dq_q * sizes.dq_kv * itemsize)                        # dS as dot operand
    dkv = (2 * sizes.dkv_kv * d * itemsize                              # k, v resident
           + sizes.bwd_stages * 2 * sizes.dkv_q * d * itemsize          # q, dO per stage
           + 2 * sizes.dkv_kv * sizes.dkv_q * itemsize)                 # P^T, dS^T operands
    return {"fwd": fwd, "dq": dq, "dkv": dkv}


def block_sizes(head_dim: int, dtype) -> BlockSizes:
    """H100/H200 defaults (module docstring), shrunk per kernel until it fits SMEM_BUDGET:
    first fewer forward pipeline stages (down to 2), then halve the streamed block, then the
    resident one (down to MIN_DIM). Only fp32 inputs and head_dim 256 need it."""
    d = max(MIN_DIM, _next_pow2(head_dim))
    sizes = BlockSizes(fwd_warps=8 if d >= 128 else 4, bwd_warps=8 if d >= 128 else 4)
    if d >= 256:   # halve the register-resident fp32 accumulators (o; dk, dv): ptxas spilled
        sizes = dataclasses.replace(sizes, fwd_q=64, dkv_kv=32)
    itemsize = jnp.dtype(dtype).itemsize
    shrink = {"fwd": ("fwd_stages", "fwd_kv", "fwd_q"), "dq": ("dq_kv", "dq_q"),
              "dkv": ("dkv_q", "dkv_kv")}
    floor = lambda name: 2 if name.endswith("stages") else MIN_DIM
    for kernel, names in shrink.items():
        while smem_bytes(sizes, d, itemsize)[kernel] > SMEM_BUDGET:
            name = next((n for n in names if getattr(sizes, n) > floor(n)), None)
            if name is None:
                break                    # the test of block_sizes() reports what is left over
            value = getattr(sizes, name)
            sizes = dataclasses.replace(
                sizes, **{name: value - 1 if name.endswith("stages") else value // 2})
    return sizes


# ---------------------------------------------------------------------------------------------
# Block tables (outside the kernels, O(blocks^2))
# ---------------------------------------------------------------------------------------------

def _segment_ranges(segment_ids, block):
    """Per block of `block` positions: (min, max) segment id, each int32 [seq // block]."""
    s = segment_ids.reshape(-1, block)
    return s.min(axis=1), s.max(axis=1)


def tile_classes(seq: int, block_q: int, block_kv: int, window: Optional[int],
                 segment_ids=None, q_seq: Optional[int] = None, q_offset: int = 0):
    """(reachable, full), bool [q blocks, kv blocks], from interval bounds (O(blocks^2)).

    reachable: some query of tile (i, j) may see some key: k0 <= q1, q0 - k1 < window, and the
    blocks' segment-id ranges overlap (a reachable tile can still be all masked when ids are
    not sorted). full: every query sees every key: k1 <= q0, q1 - k0 < window, and both blocks
    hold one and the same segment id. Numpy without segment ids (static), jnp with them.
    A query chunk (context parallelism) has q_seq queries at global positions q_offset + 0..
    q_seq - 1, against all seq keys: the bounds are those of its rows of the whole table.
    """
    q_seq = seq if q_seq is None else q_seq
    q0 = (q_offset + np.arange(q_seq // block_q) * block_q)[:, None]
    k0 = (np.arange(seq // block_kv) * block_kv)[None, :]
    q1, k1 = q0 + block_q - 1, k0 + block_kv - 1
    reach, full = k0 <= q1, k1 <= q0
    if window is not None:
        reach, full = reach & (q0 - k1 < window), full & (q1 - k0 < window)
    if segment_ids is None:
        return reach, full
    qmin, qmax = _segment_ranges(segment_ids[q_offset:q_offset + q_seq], block_q)
    kmin, kmax = _segment_ranges(segment_ids, block_kv)
    reach = reach & (kmin[None, :] <= qmax[:, None]) & (qmin[:, None] <= kmax[None, :])
    full = (full & (qmin == qmax)[:, None] & (kmin == kmax)[None, :]
            & (qmin[:, None] == kmin[None, :]))
    return reach, full


def visit_bounds(reach, full):
    """Per row of the tile classes: int32 [rows, 4] = (lo, flo, fhi, hi).

    A row's kernel loop visits columns [lo, hi) (first to last reachable: every row has one,
    the diagonal tile holds query == key), unmasked on [flo, fhi) (the first run of full
    tiles; with sorted segment ids it is every full tile of the row) and masked elsewhere.
    Without full tiles flo = fhi = hi.
    """
    reach, full = jnp.asarray(reach), jnp.asarray(full)
    n = reach.shape[1]
    cols = jnp.arange(n)[None, :]
    first = lambda m: jnp.where(m.any(axis=1), jnp.argmax(m, axis=1), n)
    lo = first(reach)
    hi = n - jnp.argmax(reach[:, ::-1], axis=1)
    flo = jnp.minimum(first(full), hi)
    fhi = jnp.minimum(first(~full & (cols > flo[:, None])), hi)
    return jnp.stack([lo, flo, fhi, hi], axis=1).astype(jnp.int32)


def _three_loops(bounds_ref, row, body, init):
    """body(j, carry, masked) over the row's columns: masked [lo, flo), plain [flo, fhi),
    masked [fhi, hi). Three branch-free loops rather than one loop with a per-tile branch:
    Triton only software-pipelines the k/v loads of a loop whose dots are not under an scf.if
    (measured in shared memory: 64 KiB with the branch, 128 KiB = 3 stages without)."""
    lo, flo, fhi, hi = (bounds_ref[row, c] for c in range(4))
    carry = lax.fori_loop(lo, flo, functools.partial(body, masked=True), init)
    carry = lax.fori_loop(flo, fhi, functools.partial(body, masked=False), carry)
    return lax.fori_loop(fhi, hi, functools.partial(body, masked=True), carry)


def _mask(q0, k0, shape, window, keys_on_rows, q_seg=None, k_seg=None):
    """Visibility of a tile [q, k] (or [k, q] when keys_on_rows)."""
    rows = lax.broadcasted_iota(jnp.int32, shape, 0)
    cols = lax.broadcasted_iota(jnp.int32, shape, 1)
    q_pos, k_pos = (q0 + cols, k0 + rows) if keys_on_rows else (q0 + rows, k0 + cols)
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (q_pos - k_pos < window)
    if q_seg is not None:
        mask = mask & ((q_seg[None, :] == k_seg[:, None]) if keys_on_rows
                       else (q_seg[:, None] == k_seg[None, :]))
    return mask


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static facts of one call (padded shapes)."""
    heads: int
    kv_heads: int
    seq: int               # keys, padded
    q_seq: int             # queries, padded: global rows [q_offset, q_offset + q_seq)
    q_offset: int          # static (the block tables are built from it)
    head_dim: int          # padded
    scale: float           # true head_dim ** -0.5
    window: Optional[int]
    segmented: bool
    sizes: BlockSizes
    interpret: bool

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


def _fwd_kernel(bounds_ref, q_ref, k_ref, v_ref, *refs, plan: _Plan):
    if plan.segmented:
        seg_ref, o_ref, lse_ref = refs
    else:
        o_ref, lse_ref = refs
    bq, bkv = plan.sizes.fwd_q, plan.sizes.fwd_kv
    i = pl.program_id(0)
    q0 = plan.q_offset + i * bq                                           # global position
    q = q_ref[...]                                                        # [bq, d]
    q_seg = seg_ref[pl.ds(q0, bq)] if plan.segmented else None
    c = plan.scale * LOG2E                                                # base-2 logits

    def body(j, carry, masked):
        acc, m, l = carry
        k0 = j * bkv
        k, v = k_ref[pl.ds(k0, bkv), :], v_ref[pl.ds(k0, bkv), :]         # [bkv, d]
        s = _dot(q, k, NT) * c
        if masked:
            k_seg = seg_ref[pl.ds(k0, bkv)] if plan.segmented else None
            s = jnp.where(_mask(q0, k0, s.shape, plan.window, False, q_seg, k_seg),
                          s, MASK_VALUE)
        m_next = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_next)
        p = jnp.exp2(s - m_next[:, None])                                  # [bq, bkv] fp32
        pv = _dot(p.astype(v.dtype), v, NN)
        return acc * alpha[:, None] + pv, m_next, l * alpha + jnp.sum(p, axis=1)

    init = (jnp.zeros((bq, plan.head_dim), jnp.float32),
            jnp.full((bq,), MASK_VALUE, jnp.float32), jnp.zeros((bq,), jnp.float32))
    acc, m, l = _three_loops(bounds_ref, i, body, init)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = (m + jnp.log2(l)) / LOG2E                               # natural log


def _dq_kernel(bounds_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, *refs, plan: _Plan):
    if plan.segmented:
        seg_ref, dq_ref = refs
    else:
        (dq_ref,) = refs
    bq, bkv = plan.sizes.dq_q, plan.sizes.dq_kv
    i = pl.program_id(0)
    q0 = plan.q_offset + i * bq
    q, do = q_ref[...], do_ref[...]                                       # [bq, d]
    lse2, di = lse_ref[...] * LOG2E, di_ref[...]                          # [bq]
    q_seg = seg_ref[pl.ds(q0, bq)] if plan.segmented else None
    c = plan.scale * LOG2E

    def body(j, dq, masked):
        k0 = j * bkv
        k, v = k_ref[pl.ds(k0, bkv), :], v_ref[pl.ds(k0, bkv), :]
        s = _dot(q, k, NT) * c
        p = jnp.exp2(s - lse2[:, None])                                    # [bq, bkv]
        if masked:
            k_seg = seg_ref[pl.ds(k0, bkv)] if plan.segmented else None
            p = jnp.where(_mask(q0, k0, s.shape, plan.window, False, q_seg, k_seg), p, 0.0)
        dp = _dot(do, v, NT)
        ds = p * (dp - di[:, None])
        return dq + _dot(ds.astype(k.dtype), k, NN)

    dq = _three_loops(bounds_ref, i, body, jnp.zeros((bq, plan.head_dim), jnp.float32))
    dq_ref[...] = (dq * plan.scale).astype(dq_ref.dtype)


def _dkv_kernel(bounds_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, *refs, plan: _Plan):
    if plan.segmented:
        seg_ref, dk_ref, dv_ref = refs
    else:
        dk_ref, dv_ref = refs
    bkv, bq = plan.sizes.dkv_kv, plan.sizes.dkv_q
    j = pl.program_id(0)
    k0 = j * bkv
    k, v = k_ref[...], v_ref[...]                                         # [bkv, d]
    k_seg = seg_ref[pl.ds(k0, bkv)] if plan.segmented else None
    c = plan.scale * LOG2E

    def head(r, carry):                      # the group's query heads share this kv head
        def body(i, carry, masked):
            dk, dv = carry
            row = i * bq                                       # local row; q0 is global
            q0 = plan.q_offset + row
            q, do = q_ref[r, pl.ds(row, bq), :], do_ref[r, pl.ds(row, bq), :]   # [bq, d]
            lse2 = lse_ref[r, pl.ds(row, bq)] * LOG2E
            s_t = _dot(k, q, NT) * c
            p_t = jnp.exp2(s_t - lse2[None, :])                            # [bkv, bq]
            if masked:
                q_seg = seg_ref[pl.ds(q0, bq)] if plan.segmented else None
                p_t = jnp.where(_mask(q0, k0, s_t.shape, plan.window, True, q_seg, k_seg),
                                p_t, 0.0)
            dv = dv + _dot(p_t.astype(do.dtype), do, NN)
            dp_t = _dot(v, do, NT)
            ds_t = p_t * (dp_t - di_ref[r, pl.ds(row, bq)][None, :])
            dk = dk + _dot(ds_t.astype(q.dtype), q, NN)
            return dk, dv

        return _three_loops(bounds_ref, j, body, carry)

    zeros = jnp.zeros((bkv, plan.head_dim), jnp.float32)
    dk, dv = lax.fori_loop(0, plan.group, head, (zeros, zeros))
    dk_ref[...] = (dk * plan.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ---------------------------------------------------------------------------------------------
# pallas_calls
# ---------------------------------------------------------------------------------------------

def _whole(shape):
    """BlockSpec handing the kernel the whole (unbatched) array, whatever the grid point."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _operands(plan: _Plan, row_block, col_block, segment_ids, keys_on_rows):
    """The visit bounds [row blocks, 4] (+ segment ids) for a kernel whose grid walks rows."""
    bq, bkv = (col_block, row_block) if keys_on_rows else (row_block, col_block)
    reach, full = tile_classes(plan.seq, bq, bkv, plan.window, segment_ids, plan.q_seq,
                               plan.q_offset)
    if keys_on_rows:
        reach, full = reach.T, full.T
    return [visit_bounds(reach, full)] + ([segment_ids] if plan.segmented else [])


def _params(warps, stages):
    return pltriton.CompilerParams(num_warps=warps, num_stages=stages)


def _forward(plan: _Plan, q, k, v, segment_ids):
    s, t, d, g = plan.seq, plan.q_seq, plan.head_dim, plan.group
    bq = plan.sizes.fwd_q
    bounds, *segs = _operands(plan, bq, plan.sizes.fwd_kv, segment_ids, keys_on_rows=False)
    kv_spec = pl.BlockSpec((None, s, d), lambda i, h: (lax.div(h, g), 0, 0))
    in_specs = ([_whole(bounds.shape), pl.BlockSpec((None, bq, d), lambda i, h: (h, i, 0)),
                 kv_spec, kv_spec] + [_whole(x.shape) for x in segs])
    tiles = int(np.count_nonzero(tile_classes(s, bq, plan.sizes.fwd_kv, plan.window,
                                              q_seq=t, q_offset=plan.q_offset)[0]))
    pairs = tiles * bq * plan.sizes.fwd_kv * plan.heads
    o, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, plan=plan),
        grid=(t // bq, plan.heads),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, bq, d), lambda i, h: (h, i, 0)),
                   pl.BlockSpec((None, bq), lambda i, h: (h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((plan.heads, t), jnp.float32)],
        compiler_params=_params(plan.sizes.fwd_warps, plan.sizes.fwd_stages),
        cost_estimate=pl.CostEstimate(flops=4 * pairs * d, transcendentals=pairs,
                                      bytes_accessed=4 * q.size * q.dtype.itemsize),
        interpret=plan.interpret,
        name="splash_gpu_fwd",
    )(bounds, q, k, v, *segs)
    return o, lse


def _backward(plan: _Plan, q, k, v, segment_ids, o, lse, do):
    s, t, d, g = plan.seq, plan.q_seq, plan.head_dim, plan.group
    sz = plan.sizes
    di = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)   # D: [heads, q_seq]
    params = _params(sz.bwd_warps, sz.bwd_stages)

    bounds, *segs = _operands(plan, sz.dq_q, sz.dq_kv, segment_ids, keys_on_rows=False)
    q_spec = pl.BlockSpec((None, sz.dq_q, d), lambda i, h: (h, i, 0))
    row_spec = pl.BlockSpec((None, sz.dq_q), lambda i, h: (h, i))
    kv_spec = pl.BlockSpec((None, s, d), lambda i, h: (lax.div(h, g), 0, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, plan=plan),
        grid=(t // sz.dq_q, plan.heads),
        in_specs=([_whole(bounds.shape), q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
                  + [_whole(x.shape) for x in segs]),
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params,
        interpret=plan.interpret,
        name="splash_gpu_dq",
    )(bounds, q, k, v, do, lse, di, *segs)

    bounds, *segs = _operands(plan, sz.dkv_kv, sz.dkv_q, segment_ids, keys_on_rows=True)
    group_spec = pl.BlockSpec((g, t, d), lambda j, kh: (kh, 0, 0))     # the group's q heads
    group_rows = pl.BlockSpec((g, t), lambda j, kh: (kh, 0))
    kv_spec = pl.BlockSpec((None, sz.dkv_kv, d), lambda j, kh: (kh, j, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, plan=plan),
        grid=(s // sz.dkv_kv, plan.kv_heads),
        in_specs=([_whole(bounds.shape), group_spec, kv_spec, kv_spec, group_spec, group_rows,
                   group_rows]
                  + [_whole(x.shape) for x in segs]),
        out_specs=[kv_spec, kv_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=params,
        interpret=plan.interpret,
        name="splash_gpu_dkv",
    )(bounds, q, k, v, do, lse, di, *segs)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# Padding, custom_vjp and the public entry points
# ---------------------------------------------------------------------------------------------

def _check(heads, kv_heads, window):
    if heads % kv_heads:
        raise ValueError(f"splash_gpu: heads ({heads}) must be a multiple of kv_heads "
                         f"({kv_heads}) for grouped-query attention")
    if window is not None and window < 1:
        raise ValueError(f"splash_gpu: window={window} must be >= 1 (or None for causal)")


def kernels(heads: int, kv_heads: int, seq: int, head_dim: int, dtype, *,
            window: Optional[int], segmented: bool, sizes: Optional[BlockSizes] = None,
            interpret: bool = False, q_seq: Optional[int] = None, q_offset: int = 0):
    """(forward, backward) for one static shape, on unpadded arrays.

    forward(q, k, v, segment_ids) -> (o, lse): o like q, lse fp32 [heads, q_seq] = ln sum_j e^s_ij.
    backward(q, k, v, segment_ids, o, lse, do) -> (dq, dk, dv).
    The same contract as olmo3.splash.kernels, so that one custom_vjp can pick either per
    lowering platform (olmo3.attention). segment_ids is None unless `segmented`.
    A query chunk (context parallelism): q holds the q_seq (default seq) rows at global
    positions [q_offset, q_offset + q_seq) (a Python int), k, v and segment_ids all seq.
    """
    _check(heads, kv_heads, window)
    q_seq = seq if q_seq is None else q_seq
    if not isinstance(q_offset, (int, np.integer)) or not 0 <= q_offset <= seq - q_seq:
        raise ValueError(f"splash_gpu: q_offset={q_offset!r} must be a Python int in "
                         f"[0, seq - q_seq = {seq - q_seq}] (the block tables are built from it)")
    q_offset = int(q_offset)
    sizes = (sizes or block_sizes(head_dim, dtype)).clipped(seq, q_seq)
    unit_q = max(sizes.fwd_q, sizes.dq_q, sizes.dkv_q)
    unit_kv = max(sizes.fwd_kv, sizes.dq_kv, sizes.dkv_kv)
    q_pad = -(-q_seq // unit_q) * unit_q
    # Keys are padded to cover every padded query's position too, so that a kernel reads the
    # query rows' segment ids in bounds from the one (padded) segment-id array.
    seq_pad = -(-max(seq, q_offset + q_pad) // unit_kv) * unit_kv
    d_pad = max(MIN_DIM, _next_pow2(head_dim))
    window = None if window is not None and window >= seq else window   # same mask as causal
    plan = _Plan(heads=heads, kv_heads=kv_heads, seq=seq_pad, q_seq=q_pad, q_offset=q_offset,
                 head_dim=d_pad, scale=head_dim ** -0.5, window=window, segmented=segmented,
                 sizes=sizes, interpret=interpret)

    def pad(x, n, rows):                 # [n, rows, head_dim] -> [n, padded rows, d_pad]
        return jnp.pad(x, ((0, 0), (0, rows - n), (0, d_pad - head_dim)))

    pad_q = lambda x: pad(x, q_seq, q_pad)
    pad_kv = lambda x: pad(x, seq, seq_pad)

    def pad_rows(x):                     # [heads, q_seq] -> [heads, q_pad]
        return jnp.pad(x, ((0, 0), (0, q_pad - q_seq)))

    def pad_segments(segment_ids):       # padded keys keep the last id: ranges stay sorted
        if segment_ids is None:
            return None
        return jnp.pad(segment_ids.astype(jnp.int32), (0, seq_pad - seq), mode="edge")

    unpad_q = lambda x: x[:, :q_seq, :head_dim]
    unpad_kv = lambda x: x[:, :seq, :head_dim]

    def forward(q, k, v, segment_ids):
        o, lse = _forward(plan, pad_q(q), pad_kv(k), pad_kv(v), pad_segments(segment_ids))
        return unpad_q(o), lse[:, :q_seq]

    def backward(q, k, v, segment_ids, o, lse, do):
        dq, dk, dv = _backward(plan, pad_q(q), pad_kv(k), pad_kv(v), pad_segments(segment_ids),
                               pad_q(o), pad_rows(lse), pad_q(do.astype(q.dtype)))
        return unpad_q(dq), unpad_kv(dk), unpad_kv(dv)

    return forward, backward


def target_gpu(device_kind: str = "NVIDIA H100"):
    """Context manager: lower the kernels for this GPU where no GPU is attached (an export or AOT
    compile for CUDA from a CPU host), via jax.sharding.use_abstract_mesh on a one-device abstract
    mesh whose abstract device is `device_kind` (a name JAX's Pallas gpu_info knows: "NVIDIA H100",
    "NVIDIA H200", "NVIDIA A100", ...)."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=device))


def splash_attention(
    q: Float[Array, "heads q_seq head_dim"],
    k: Float[Array, "kv_heads seq head_dim"],
    v: Float[Array, "kv_heads seq head_dim"],
    *,
    window: Optional[int] = None,
    segment_ids: Optional[Int[Array, " seq"]] = None,
    sizes: Optional[BlockSizes] = None,
    interpret: bool = False,
    q_offset: int = 0,
) -> Float[Array, "heads q_seq head_dim"]:
    """Causal (sliding-window, per-document) attention of one sequence on a GPU; batch with vmap.

    softmax(q k^T * head_dim**-0.5 + mask) v; head h reads kv head h // (heads // kv_heads);
    window=None is plain causal, else query i sees keys i - window + 1 .. i; segment_ids
    (int [seq]) keep attention inside a document. sizes: BlockSizes (default: block_sizes()
    for this head_dim and dtype). interpret=True runs the kernels as plain JAX (CPU tests).
    q_offset (a Python int, context parallelism): q holds only the queries at positions
    [q_offset, q_offset + q_seq) of the sequence; the result is those rows of the whole one.
    """
    heads, q_seq, head_dim = q.shape
    if k.shape != v.shape or k.shape[2] != head_dim:
        raise ValueError(f"splash_gpu: expected q [heads, q_seq, head_dim] and k, v "
                         f"[kv_heads, seq, head_dim]; got q {q.shape}, k {k.shape}, v {v.shape}")
    if segment_ids is not None and segment_ids.shape != (k.shape[1],):
        raise ValueError(f"splash_gpu: segment_ids must be int [seq={k.shape[1]}], got {segment_ids.shape}")
    forward, backward = kernels(heads, k.shape[0], k.shape[1], head_dim, q.dtype, window=window,
                                segmented=segment_ids is not None, sizes=sizes,
                                interpret=interpret, q_seq=q_seq, q_offset=q_offset)

    @jax.custom_vjp
    def attend(q, k, v, segment_ids):
        return forward(q, k, v, segment_ids)[0]

    def fwd(q, k, v, segment_ids):
        o, lse = forward(q, k, v, segment_ids)
        return o, (q, k, v, segment_ids, o, lse)

    def bwd(res, do):
        return (*backward(*res, do), None)            # integer segment ids: no cotangent

    attend.defvjp(fwd, bwd)
    return attend(q, k, v, segment_ids)
