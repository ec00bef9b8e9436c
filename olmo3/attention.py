"""Attention behind one small interface: `xla` (portable reference), `splash`, `cudnn`.

`xla` is `reference_attention` (dense scores), or `local_attention` (banded blocks) for
sliding-window layers whose sequence spans more than two windows; above DENSE_MAX_SEQ it refuses
rather than materialise seq^2 scores. `splash` is a block-sparse Pallas kernel chosen by the
platform being lowered for: olmo3/splash.py (Mosaic) on TPU, olmo3/splash_gpu.py (Triton) on
CUDA, interpret mode elsewhere. `cudnn` is cuDNN's fused kernel; with segment ids (documents,
which its API cannot take) it is the GPU Splash kernel.

Layout per sequence: q [heads, seq, head_dim], k and v [kv_heads, seq, head_dim]. Masks:
causal; with `window`, query i sees key j iff 0 <= i - j < window (itself and window-1 keys
before it: transformers' `kv > q - sliding_window`); with `segment_ids`, only keys of the same
segment (stage 3 intra-document masking). Scale head_dim**-0.5, softmax in float32.

Query chunks (context parallelism, olmo3/sharding.py): with `q_offset`, q holds only the rows
[q_offset, q_offset + q_seq) of the sequence whose keys are k, v (all seq of them) and whose
segment ids are `segment_ids`; the result equals those rows of the whole-sequence attention.
splash and cudnn run the Splash kernel of the lowering platform over the chunk's rows only
(static q_offset; no Tq x seq scores); xla runs `chunk_attention` (offset may be traced).
"""
from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp
from jax import lax
from beartype import beartype
from jaxtyping import Array, Float, Int, jaxtyped

from olmo3.config import matmul_precision


def unusable_here(impl: str, platform: str, tile_flags: tuple[str, ...] = ()) -> Optional[str]:
    """Why attention `impl`, with the TPU Splash tile flags named in `tile_flags` given, cannot run
    on devices of `platform` ("cpu", "gpu", "tpu"); None when it can. cuDNN's fused kernel exists on
    NVIDIA GPUs only: elsewhere the first step died in jax.nn.dot_product_attention ("cuDNN is not
    detected.", a traceback, exit 1). The splash_block_* tiles are the Mosaic (TPU) kernel's; the
    GPU kernel and the CPU's interpret mode of it pick their own (splash_gpu.block_sizes), so
    elsewhere the flags were accepted and silently did nothing."""
    if impl == "cudnn" and platform != "gpu":
        return (f"--attention=cudnn is cuDNN's fused attention, for NVIDIA GPUs; this run's devices are {platform}: "
                "use --attention=xla (or splash)")
    for name in tile_flags:
        if platform != "tpu" or impl != "splash":
            fix = (f"add --attention=splash, or drop --{name}" if platform == "tpu" else
                   f"the GPU Splash kernel picks its own (olmo3/splash_gpu.py block_sizes): drop --{name}")
            return (f"--{name} sets the tiles of the TPU (Mosaic) Splash kernel, which this run does not use "
                    f"(devices: {platform}, --attention={impl}); {fix}")
    return None


def dense_mask(seq: int, window: Optional[int], segment_ids=None) -> jax.Array:
    """Boolean [seq, seq] mask, True where query i may attend to key j."""
    i = jnp.arange(seq)[:, None]
    j = jnp.arange(seq)[None, :]
    mask = j <= i
    if window is not None:
        mask &= (i - j) < window
    if segment_ids is not None:
        mask &= segment_ids[:, None] == segment_ids[None, :]
    return mask


@jaxtyped(typechecker=beartype)
def reference_attention(
    q: Float[Array, "heads seq head_dim"],
    k: Float[Array, "kv_heads seq head_dim"],
    v: Float[Array, "kv_heads seq head_dim"],
    *,
    window: Optional[int] = None,
    segment_ids: Optional[Int[Array, " seq"]] = None,
) -> Float[Array, "heads seq head_dim"]:
    """Materialized-scores attention in plain XLA; the semantics every kernel must match."""
    return _masked(q, k, v, dense_mask(q.shape[1], window, segment_ids))


def _masked(q, k, v, mask):
    """softmax(q k^T / sqrt(hd), where mask) v for q [H, Tq, hd], k, v [KV, Tk, hd], mask [Tq, Tk]."""
    heads, tq, head_dim = q.shape
    kv_heads = k.shape[0]
    qg = q.reshape(kv_heads, heads // kv_heads, tq, head_dim)             # (KV, G, Tq, hd)
    scores = jnp.einsum("kgqd,ksd->kgqs", qg, k, preferred_element_type=jnp.float32,
                        precision=matmul_precision(q.dtype))
    scores = scores * (head_dim ** -0.5)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("kgqs,ksd->kgqd", probs, v, preferred_element_type=jnp.float32,
                     precision=matmul_precision(v.dtype))
    return out.reshape(heads, tq, head_dim).astype(q.dtype)


@jaxtyped(typechecker=beartype)
def chunk_attention(
    q: Float[Array, "heads q_seq head_dim"],
    k: Float[Array, "kv_heads seq head_dim"],
    v: Float[Array, "kv_heads seq head_dim"],
    *,
    q_offset: Union[int, Int[Array, ""]],
    window: Optional[int] = None,
    segment_ids: Optional[Int[Array, " seq"]] = None,
) -> Float[Array, "heads q_seq head_dim"]:
    """Rows [q_offset, q_offset + q_seq) of `reference_attention` over the whole sequence; the
    offset may be traced (a context rank's). Sliding windows read only the keys the chunk can
    reach, a static span of q_seq + window keys: queries [o, o + Tq) see keys [o - window + 1,
    o + Tq), inside [s, s + Tq + window) for s = clip(o - window, 0, seq - Tq - window)."""
    tq, seq = q.shape[1], k.shape[1]
    q_pos = q_offset + jnp.arange(tq)
    k_start, span = 0, seq
    if window is not None and seq > tq + window:
        span = tq + window
        k_start = jnp.clip(q_offset - window, 0, seq - span)
        k, v = (jax.lax.dynamic_slice_in_dim(x, k_start, span, axis=1) for x in (k, v))
    k_pos = k_start + jnp.arange(span)
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= (q_pos[:, None] - k_pos[None, :]) < window
    if segment_ids is not None:
        q_seg = jax.lax.dynamic_slice_in_dim(segment_ids, q_offset, tq)
        k_seg = jax.lax.dynamic_slice_in_dim(segment_ids, k_start, span)
        mask &= q_seg[:, None] == k_seg[None, :]
    return _masked(q, k, v, mask)


@jaxtyped(typechecker=beartype)
def local_attention(
    q: Float[Array, "heads seq head_dim"],
    k: Float[Array, "kv_heads seq head_dim"],
    v: Float[Array, "kv_heads seq head_dim"],
    *,
    window: int,
    segment_ids: Optional[Int[Array, " seq"]] = None,
) -> Float[Array, "heads seq head_dim"]:
    """Sliding-window attention computing only the scores the window can reach: queries in
    blocks of `window`, each against its own block and the one before (a query's window never
    reaches further back). Scores [seq, 2 * window] instead of [seq, seq]: on the CPU benchmark
    config (seq 512, window 128) layers fwd+bwd 3.11 s -> 2.86 s (mean of 2 runs). Same as
    `reference_attention(..., window=window)`, which the tests hold it to."""
    heads, seq, head_dim = q.shape
    kv_heads, B = k.shape[0], window
    G, nb = heads // kv_heads, -(-seq // B)
    pad = nb * B - seq   # padded keys sit after every real query, so the causal mask drops them
    blocks = lambda x: jnp.pad(x, ((0, 0), (0, pad), (0, 0))).reshape(x.shape[0], nb, B, head_dim)

    def with_previous(xb):   # (KV*N, 2B, hd): block n-1 (zeros before the first), then block n
        prev = jnp.pad(xb, ((0, 0), (1, 0), (0, 0), (0, 0)))[:, :-1]
        return jnp.concatenate([prev, xb], axis=2).reshape(kv_heads * nb, 2 * B, head_dim)

    # One batch dim (kv head, block) for the dots: XLA:CPU has no bf16 x bf16 -> f32 dot with two.
    qb = blocks(q).reshape(kv_heads, G, nb, B, head_dim).transpose(0, 2, 1, 3, 4)
    qb = qb.reshape(kv_heads * nb, G * B, head_dim)                        # (KV*N, G*B, hd)
    kb, vb = with_previous(blocks(k)), with_previous(blocks(v))
    scores = jnp.einsum("bqd,bsd->bqs", qb, kb, preferred_element_type=jnp.float32,
                        precision=matmul_precision(q.dtype))
    scores = scores.reshape(kv_heads, nb, G, B, 2 * B) * (head_dim ** -0.5)
    i = jnp.arange(nb)[:, None, None] * B + jnp.arange(B)[None, :, None]             # (N, B, 1)
    j = jnp.arange(nb)[:, None, None] * B - B + jnp.arange(2 * B)[None, None, :]     # (N, 1, 2B)
    mask = (j >= 0) & (j <= i) & (i - j < window)
    if segment_ids is not None:
        sq = jnp.pad(segment_ids, (0, pad), constant_values=-1).reshape(nb, B)
        sk = jnp.concatenate([jnp.pad(sq, ((1, 0), (0, 0)), constant_values=-1)[:-1], sq], axis=1)
        mask &= sq[:, :, None] == sk[:, None, :]
    scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)          # (KV, N, G, B, 2B)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(kv_heads * nb, G * B, 2 * B)
    out = jnp.einsum("bqs,bsd->bqd", probs, vb, preferred_element_type=jnp.float32,
                     precision=matmul_precision(v.dtype))
    out = out.reshape(kv_heads, nb, G, B, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(heads, nb * B, head_dim)[:, :seq].astype(q.dtype)


# Above this many positions the dense path's scores ([heads, seq, seq] fp32: 16 GiB per head
# at stage 3's 65,536) are refused instead of silently materialised.
DENSE_MAX_SEQ = 16384
# What "splash" runs where no native kernel exists (CPU): the GPU kernel in Pallas interpret
# mode. It pads any shape to Triton's power-of-two tiles, so tiny test models run it too.
INTERPRETED_KERNEL = "gpu"


def _splash(q, k, v, *, window, segment_ids, block_q, block_kv, q_offset=None):
    """Splash attention, the kernel chosen by the platform being LOWERED for (not the host's):
    TPU -> Mosaic kernel (olmo3.splash), CUDA -> Triton kernel (olmo3.splash_gpu), anything
    else -> INTERPRETED_KERNEL in interpret mode. So `jax.export(..., platforms=["cuda"])` on a
    CPU host lowers the Triton kernel. block_q/block_kv are the Mosaic tiles (Config's
    splash_block_*); the Triton kernel picks its own (splash_gpu.block_sizes). q_offset (a
    Python int): q is a query chunk (module docstring); every kernel builds its block tables
    for those rows only, so a chunk of Tq rows costs what its rows of the whole would.

    One custom_vjp with `lax.platform_dependent` inside its forward and its backward: both
    kernels share one residual contract (q, k, v, segment_ids, o, lse [heads, q_seq] fp32), so
    differentiating never carries another platform's residuals (around two custom_vjps, JAX's
    partial evaluation of the switch would join every branch's residuals, zero-filled).
    """
    from olmo3 import splash, splash_gpu  # imported lazily: Pallas is only needed when asked for
    heads, q_seq, head_dim = q.shape
    shape = dict(heads=heads, kv_heads=k.shape[0], seq=k.shape[1], head_dim=head_dim,
                 window=window, segmented=segment_ids is not None, q_seq=q_seq,
                 q_offset=0 if q_offset is None else q_offset)
    gpu = lambda interpret: splash_gpu.kernels(dtype=q.dtype, interpret=interpret, **shape)
    tpu = lambda interpret: splash.kernels(block_q=block_q, block_kv=block_kv,
                                           interpret=interpret, **shape)
    kernels = {"cuda": gpu(False),
               "default": gpu(True) if INTERPRETED_KERNEL == "gpu" else tpu(True)}
    try:
        kernels["tpu"] = tpu(False)
    except ValueError:       # Mosaic cannot tile this shape (tiny test models)
        if jax.default_backend() == "tpu":
            raise            # ... and we are on a TPU: say so rather than emulate
    pick = lambda which, *args: lax.platform_dependent(
        *args, **{name: pair[which] for name, pair in kernels.items()})

    @jax.custom_vjp
    def attend(q, k, v, segment_ids):
        return pick(0, q, k, v, segment_ids)[0]

    def fwd(q, k, v, segment_ids):
        o, lse = pick(0, q, k, v, segment_ids)
        return o, (q, k, v, segment_ids, o, lse)

    def bwd(res, do):
        return (*pick(1, *res, do), None)            # integer segment ids: no cotangent

    attend.defvjp(fwd, bwd)
    return attend(q, k, v, segment_ids)


def _cudnn_attention(q, k, v, *, window, segment_ids):
    """cuDNN's fused flash attention. Its API takes a window but no segment ids (a mask would
    become a dense O(seq^2) bias, DESIGN §9), so documents go to the GPU Splash kernel."""
    if segment_ids is not None:
        return _splash(q, k, v, window=window, segment_ids=segment_ids,
                       block_q=2048, block_kv=2048)
    to_bthd = lambda x: jnp.swapaxes(x, 0, 1)[None]                        # (1, T, N, hd)
    out = jax.nn.dot_product_attention(
        to_bthd(q), to_bthd(k), to_bthd(v), is_causal=True,
        local_window_size=None if window is None else (window - 1, 0),
        implementation="cudnn")
    return jnp.swapaxes(out[0], 0, 1)


def attention(q, k, v, *, window: Optional[int], segment_ids, impl: str,
              block_q: int = 2048, block_kv: int = 2048, q_offset=None):
    """Dispatch to the configured implementation (Config.attention). `q_offset`: q is the query
    chunk starting there (module docstring); splash and cudnn need it static (a Python int)."""
    if q_offset is not None:
        return _chunk(q, k, v, window=window, segment_ids=segment_ids, impl=impl,
                      block_q=block_q, block_kv=block_kv, q_offset=q_offset)
    seq = q.shape[1]
    if impl == "xla":
        if window is not None and seq > 2 * window:   # blocks save work from 3 blocks on
            return local_attention(q, k, v, window=window, segment_ids=segment_ids)
        if seq > DENSE_MAX_SEQ:
            raise ValueError(
                f"attention='xla' at seq {seq} would materialise {q.shape[0]} x {seq} x {seq} "
                f"fp32 scores ({q.shape[0] * seq * seq * 4 / 2**30:.0f} GiB); use "
                f"--attention=splash (any platform) or --attention=cudnn (GPU)")
        return reference_attention(q, k, v, window=window, segment_ids=segment_ids)
    if impl == "splash":
        return _splash(q, k, v, window=window, segment_ids=segment_ids,
                       block_q=block_q, block_kv=block_kv)
    if impl == "cudnn":
        return _cudnn_attention(q, k, v, window=window, segment_ids=segment_ids)
    raise ValueError(f"Unknown attention implementation {impl!r}; choose xla, splash or cudnn")


def _chunk(q, k, v, *, window, segment_ids, impl, block_q, block_kv, q_offset):
    """A query chunk. splash: the same per-platform dispatch as the whole sequence (`_splash`),
    each kernel's block-sparse grid over the chunk's rows only. cudnn: the GPU Splash kernel too,
    since cuDNN's fused causal mask is aligned to the chunk's own first row (and takes no
    segment ids); its dense fallback would be Tq x seq scores per head (64 GiB at stage 3 with
    context:8). xla: `chunk_attention`, which refuses Tq x span > DENSE_MAX_SEQ**2 scores."""
    if impl in ("splash", "cudnn"):
        return _splash(q, k, v, window=window, segment_ids=segment_ids, block_q=block_q,
                       block_kv=block_kv, q_offset=q_offset)
    if impl != "xla":
        raise ValueError(f"Unknown attention implementation {impl!r}; choose xla, splash or cudnn")
    tq, seq = q.shape[1], k.shape[1]
    span = seq if window is None or seq <= tq + window else tq + window
    if tq * span > DENSE_MAX_SEQ ** 2:
        raise ValueError(
            f"attention='xla' on a {tq}-row query chunk would materialise {q.shape[0]} x {tq} x "
            f"{span} fp32 scores ({q.shape[0] * tq * span * 4 / 2**30:.0f} GiB); use "
            f"--attention=splash (any platform) or --attention=cudnn (GPU)")
    return chunk_attention(q, k, v, q_offset=q_offset, window=window, segment_ids=segment_ids)
