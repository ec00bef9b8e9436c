"""Attention behind one small interface: `xla` (portable reference), `splash`, `cudnn`.

Layout per sequence: q [heads, seq, head_dim], k and v [kv_heads, seq, head_dim]. Masks:
causal; with `window`, query i sees key j iff 0 <= i - j < window (itself and window-1 keys
before it: transformers' `kv > q - sliding_window`); with `segment_ids`, only keys of the same
segment (stage 3 intra-document masking). Scale head_dim**-0.5, softmax in float32.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Float, Int, jaxtyped


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
    heads, seq, head_dim = q.shape
    kv_heads = k.shape[0]
    qg = q.reshape(kv_heads, heads // kv_heads, seq, head_dim)            # (KV, G, T, hd)
    scores = jnp.einsum("kgqd,ksd->kgqs", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (head_dim ** -0.5)
    mask = dense_mask(seq, window, segment_ids)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("kgqs,ksd->kgqd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(heads, seq, head_dim).astype(q.dtype)


def _cudnn_attention(q, k, v, *, window, segment_ids):
    if segment_ids is not None:  # cuDNN's fused kernel takes lengths, not segment ids
        return reference_attention(q, k, v, window=window, segment_ids=segment_ids)
    to_bthd = lambda x: jnp.swapaxes(x, 0, 1)[None]                        # (1, T, N, hd)
    out = jax.nn.dot_product_attention(
        to_bthd(q), to_bthd(k), to_bthd(v), is_causal=True,
        local_window_size=None if window is None else (window - 1, 0),
        implementation="cudnn")
    return jnp.swapaxes(out[0], 0, 1)


def attention(q, k, v, *, window: Optional[int], segment_ids, impl: str,
              block_q: int = 2048, block_kv: int = 2048):
    """Dispatch to the configured implementation (Config.attention)."""
    if impl == "xla":
        return reference_attention(q, k, v, window=window, segment_ids=segment_ids)
    if impl == "splash":
        from olmo3 import splash  # imported lazily: Pallas is only needed when asked for
        seq = q.shape[1]
        return splash.splash_attention(
            q, k, v, window=window, segment_ids=segment_ids,
            block_q=min(block_q, seq), block_kv=min(block_kv, seq),
            interpret=jax.default_backend() == "cpu")
    if impl == "cudnn":
        return _cudnn_attention(q, k, v, window=window, segment_ids=segment_ids)
    raise ValueError(f"Unknown attention implementation {impl!r}; choose xla, splash or cudnn")
