"""Rotary position embeddings: plain RoPE and YaRN, rotate-half layout.

OLMo 3 uses theta 5e5 and rotate-half (not interleaved) RoPE. Stage 3 extends the context with
YaRN (Peng et al. 2023, arXiv:2309.00071) on the full-attention layers only; sliding layers keep
plain RoPE (OLMo-core; transformers' per-layer-type `rope_parameters`). Frequencies are computed
in float32 on the host, like transformers' `_compute_yarn_parameters`, including its
floor/ceil-truncated correction range. theta ** (i / head_dim) is rounded once to float32
(computed in float64): numpy's float32 power is off by an ulp in 13 of the 7B's 64 entries, which
moved the angles by up to 5e-4 below position 8192 and sin by 5e-3 at 65,535; rounded once they
equal transformers' and OLMo-core's (torch) bit for bit at head_dim 128, theta 5e5
(tests/test_rope.py). torch's float32 power is not correctly rounded everywhere: at some other
head dims and thetas an entry or two differ by an ulp.

Positions run over the whole instance, packed documents included (stage 3, SFT): a document
packed at offset 40,000 is rotated from 40,000, while attention stays inside it. That is what
OLMo 3 was trained with: the long-context script (OLMo-core 6b73ba050, 2025-11-17, #458) ran a
RotaryEmbedding with no per-document positions. OLMo-core added intra-document RoPE later
(60d2487ab, 2026-05-07, #663: positions restart at each document whenever doc lengths are
given). The two are the same model: RoPE is relative, so with attention kept inside documents
a document's scores depend only on distances within it. They differ in rounding only (float32
angles at positions up to 65,536; tests/test_rope.py).
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, jaxtyped
from beartype import beartype

from olmo3.config import YaRN


def inv_frequencies(head_dim: int, theta: float, yarn: Optional[YaRN] = None) -> tuple[np.ndarray, float]:
    """Inverse frequencies [head_dim // 2] (float32) and the cos/sin scale (YaRN's mscale)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)   # as torch: float32
    pos_freqs = (np.float64(np.float32(theta)) ** exponents.astype(np.float64)).astype(np.float32)
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if yarn is None:
        return inv_freq, 1.0

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength makes `num_rotations` turns over the original context.
        return (head_dim * math.log(yarn.original_max_position / (num_rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolate = (1 - ramp).astype(np.float32)  # 1: keep the original frequency (high freq)
    interp = (np.float32(1.0) / (np.float32(yarn.factor) * pos_freqs)).astype(np.float32)
    inv_freq = interp * (1 - extrapolate) + inv_freq * extrapolate
    return inv_freq.astype(np.float32), yarn.mscale


@jaxtyped(typechecker=beartype)
def cos_sin(positions: Int[Array, " seq"], head_dim: int, theta: float,
            yarn: Optional[YaRN] = None) -> tuple[Float[Array, "seq head_dim"], Float[Array, "seq head_dim"]]:
    """cos and sin tables in float32 for the given positions, already scaled by YaRN's mscale.

    The rotate-half layout repeats each frequency in both halves of a head: table = [t(f), t(f)].
    That repetition is written as a matrix product, [cos f; sin f] @ [I I], so that the tables
    leave this function as one materialized buffer. XLA:CPU fuses elementwise producers into
    every consumer: written as cos(concat([f, f])) the tables were recomputed for each batch
    row and head inside the RoPE fusions of every layer, forward and backward (50 sine ops in
    the CPU benchmark's step; an isolated RoPE forward + backward of q and k took 30 ms that
    way and 6.6 ms with the tables precomputed). XLA:CPU does not fuse a dot into an
    elementwise consumer (tests/test_rope.py checks the compiled step). The product is exact:
    one nonzero term per output, at HIGHEST precision (full float32 on TPU and GPU: not a
    single bf16 pass, not TF32).
    """
    inv_freq, scale = inv_frequencies(head_dim, theta, yarn)
    half, T = head_dim // 2, positions.shape[0]
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # (T, hd/2)
    both = jnp.concatenate([jnp.cos(freqs), jnp.sin(freqs)], axis=0) * scale       # (2T, hd/2)
    repeat = np.concatenate([np.eye(half), np.eye(half)], axis=1).astype(np.float32)  # [I I]
    tables = jnp.dot(both, jnp.asarray(repeat), precision=jax.lax.Precision.HIGHEST)  # (2T, hd)
    return tables[:T], tables[T:]


@jaxtyped(typechecker=beartype)
def apply_rope(x: Float[Array, "seq heads head_dim"], cos: Float[Array, "seq head_dim"],
               sin: Float[Array, "seq head_dim"]) -> Float[Array, "seq heads head_dim"]:
    """x * cos + rotate_half(x) * sin, computed in float32 and cast back to x's dtype."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, None, :] + rotated * sin[:, None, :]
    return out.astype(x.dtype)
