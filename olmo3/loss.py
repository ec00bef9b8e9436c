"""Cross entropy + z-loss over a 100k vocabulary without materializing [tokens, vocab] logits.

OLMo-core semantics (DESIGN §3): float32 logits; labels -100 are ignored; z-loss =
1e-5 * logsumexp^2 over non-ignored tokens; both are means over the non-ignored tokens of the
global batch. Tokens of instances masked by the repetition filter contribute nothing to the
numerator but still count in the denominator (OLMo-core's InstanceFilter semantics).
A per-token label mask (packed and padded instances: padding; SFT: prompt tokens) removes
targets from both, as OLMo-core's `get_labels` does.

The lm_head matmul runs in chunks of `chunk` tokens, so only [chunk, vocab] logits are ever alive.
Plain: under `jax.checkpoint`, the backward recomputes them chunk by chunk. Fused (`z_loss=`,
what the train step uses): the forward also turns each chunk into its gradient, no recompute.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Float, Int, jaxtyped

IGNORE = -100


@jaxtyped(typechecker=beartype)
def chunked_cross_entropy(
    h: Float[Array, "n d_model"],
    lm_head: Float[Array, "d_model vocab"],
    labels: Int[Array, " n"],
    weights: Float[Array, " n"],
    *,
    chunk: int = 1024,
    z_loss: Optional[float] = None,
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """(sum of weighted CE, sum of weighted logsumexp^2) over n tokens, in float32.

    `z_loss`: the multiplier the caller will combine the two sums with (loss = ce + z_loss * z).
    With it, the gradient is fused into the forward pass: each chunk's logits are turned into
    their gradient right away (d logits = w * ((1 + 2 z_loss lse) softmax - onehot)), so the
    backward never recomputes the [chunk, vocab] lm_head matmul (1/6 of a small model's step
    FLOPs). The gradient is exact for any cotangents: when they are not in the ratio z_loss the
    backward falls back to differentiating the plain chunked computation.
    """
    if z_loss is None:
        return _chunked_ce(h, lm_head, labels, weights, chunk)
    return _fused_ce(h, lm_head, labels, weights, chunk, float(z_loss))


def _chunks(h, labels, weights, chunk):
    n = h.shape[0]
    chunk = min(chunk, n)
    pad = (-n) % chunk
    if pad:
        h = jnp.pad(h, ((0, pad), (0, 0)))
        labels = jnp.pad(labels, (0, pad), constant_values=IGNORE)
        weights = jnp.pad(weights, (0, pad))
    k = (n + pad) // chunk
    return h.reshape(k, chunk, -1), labels.reshape(k, chunk), weights.reshape(k, chunk)


def _lse_target(hc, w, lc):
    logits = jnp.dot(hc, w, preferred_element_type=jnp.float32)             # (chunk, V) fp32
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, jnp.maximum(lc, 0)[:, None], axis=-1)[:, 0]
    return logits, lse, target


def _chunked_ce(h, lm_head, labels, weights, chunk):
    """The plain version: forward keeps [chunk, vocab] logits, backward recomputes them."""
    w = lm_head.astype(h.dtype)

    @jax.checkpoint
    def one_chunk(carry, x):
        hc, lc, wc = x
        _, lse, target = _lse_target(hc, w, lc)
        ce, z = carry
        return (ce + jnp.sum((lse - target) * wc), z + jnp.sum(lse * lse * wc)), None

    zero = jnp.zeros((), jnp.float32)
    (ce, z), _ = jax.lax.scan(one_chunk, (zero, zero), _chunks(h, labels, weights, chunk))
    return ce, z


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused_ce(h, lm_head, labels, weights, chunk, z_loss):
    return _chunked_ce(h, lm_head, labels, weights, chunk)


def _fused_ce_fwd(h, lm_head, labels, weights, chunk, z_loss):
    n = h.shape[0]
    w = lm_head.astype(h.dtype)

    def one_chunk(carry, x):
        ce, z, dw = carry
        hc, lc, wc = x
        logits, lse, target = _lse_target(hc, w, lc)
        # d(ce + z_loss * z)/d logits, one row per token; onehot subtracted at the label.
        p = jnp.exp(logits - lse[:, None])
        onehot = jax.lax.broadcasted_iota(jnp.int32, p.shape, 1) == lc[:, None]
        dlogits = ((wc * (1.0 + 2.0 * z_loss * lse))[:, None] * p
                   - jnp.where(onehot, wc[:, None], 0.0)).astype(h.dtype)
        dh = jnp.dot(dlogits, w.T, preferred_element_type=jnp.float32)          # (chunk, d)
        dw = dw + jnp.dot(hc.T, dlogits, preferred_element_type=jnp.float32)    # (d, V)
        carry = (ce + jnp.sum((lse - target) * wc), z + jnp.sum(lse * lse * wc), dw)
        return carry, (dh, lse, target)

    zero = jnp.zeros((), jnp.float32)
    (ce, z, dw), (dh, lse, target) = jax.lax.scan(
        one_chunk, (zero, zero, jnp.zeros(lm_head.shape, jnp.float32)),
        _chunks(h, labels, weights, chunk))
    dh, lse, target = dh.reshape(-1, h.shape[1])[:n], lse.reshape(-1)[:n], target.reshape(-1)[:n]
    return (ce, z), (dh, dw, lse, target, h, lm_head, labels, weights)


def _fused_ce_bwd(chunk, z_loss, res, g):
    dh, dw, lse, target, h, lm_head, labels, weights = res
    g_ce, g_z = g
    # The step differentiates ce + z_loss * z: then g_z is exactly g_ce * z_loss (same fp32
    # product as the transpose of that multiply) and the fused gradient is the answer.
    fast = g_z == g_ce * jnp.float32(z_loss)

    def fused(_):
        return (g_ce * dh).astype(h.dtype), (g_ce * dw).astype(lm_head.dtype)

    def general(_):
        _, vjp = jax.vjp(lambda h_, w_: _chunked_ce(h_, w_, labels, weights, chunk), h, lm_head)
        return vjp((g_ce, g_z))

    d_h, d_w = jax.lax.cond(fast, fused, general, None)
    d_weights = (g_ce * (lse - target) + g_z * lse * lse).astype(weights.dtype)
    return d_h, d_w, None, d_weights


_fused_ce.defvjp(_fused_ce_fwd, _fused_ce_bwd)


def labels_and_weights(tokens: jax.Array, instance_mask: jax.Array,
                       label_mask: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Next-token labels for [B, T] tokens, the loss weights, and the denominator mask.

    labels[b, t] = tokens[b, t + 1]; the last position has no target (-100). `label_mask` [B, T]
    (packed / padded instances, SFT label masks) marks the tokens that may be targets: position t
    is ignored when label_mask[b, t + 1] is False, as OLMo-core's `get_labels` masks before the
    shift; padding is never trained on and never counted. weights are 0 on ignored positions and
    on instances masked by the repetition filter; `counted` marks the positions in the
    denominator (every non-ignored label, masked instances included).
    """
    B = tokens.shape[0]
    labels = jnp.concatenate([tokens[:, 1:], jnp.full((B, 1), IGNORE, tokens.dtype)], axis=1)
    if label_mask is not None:
        target_ok = jnp.concatenate([label_mask[:, 1:], jnp.zeros((B, 1), bool)], axis=1)
        labels = jnp.where(target_ok, labels, IGNORE)
    counted = (labels != IGNORE).astype(jnp.float32)
    weights = counted * instance_mask.astype(jnp.float32)[:, None]
    return labels, weights, counted
