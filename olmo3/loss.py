"""Cross entropy + z-loss over a 100k vocabulary without materializing [tokens, vocab] logits.

OLMo-core semantics (DESIGN §3): float32 logits; labels -100 are ignored; z-loss =
1e-5 * logsumexp^2 over non-ignored tokens; both are means over the non-ignored tokens of the
global batch. Tokens of instances masked by the repetition filter contribute nothing to the
numerator but still count in the denominator (OLMo-core's InstanceFilter semantics).

The lm_head matmul runs in chunks of `chunk` tokens under `jax.checkpoint`, so the forward keeps
only [chunk, vocab] logits alive and the backward recomputes them chunk by chunk.
"""
from __future__ import annotations

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
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """(sum of weighted CE, sum of weighted logsumexp^2) over n tokens, in float32."""
    n = h.shape[0]
    chunk = min(chunk, n)
    pad = (-n) % chunk
    if pad:
        h = jnp.pad(h, ((0, pad), (0, 0)))
        labels = jnp.pad(labels, (0, pad), constant_values=IGNORE)
        weights = jnp.pad(weights, (0, pad))
    k = (n + pad) // chunk
    xs = (h.reshape(k, chunk, -1), labels.reshape(k, chunk), weights.reshape(k, chunk))
    w = lm_head.astype(h.dtype)

    @jax.checkpoint
    def one_chunk(carry, x):
        hc, lc, wc = x
        logits = jnp.dot(hc, w, preferred_element_type=jnp.float32)         # (chunk, V) fp32
        lse = jax.nn.logsumexp(logits, axis=-1)
        target = jnp.take_along_axis(logits, jnp.maximum(lc, 0)[:, None], axis=-1)[:, 0]
        ce, z = carry
        return (ce + jnp.sum((lse - target) * wc), z + jnp.sum(lse * lse * wc)), None

    zero = jnp.zeros((), jnp.float32)
    (ce, z), _ = jax.lax.scan(one_chunk, (zero, zero), xs)
    return ce, z


def labels_and_weights(tokens: jax.Array, instance_mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Next-token labels for [B, T] tokens, the loss weights, and the denominator mask.

    labels[b, t] = tokens[b, t + 1]; the last position has no target (-100). weights are 0 on
    ignored positions and on instances masked by the repetition filter; `counted` marks the
    positions in the denominator (every non-ignored label, masked instances included).
    """
    B = tokens.shape[0]
    labels = jnp.concatenate([tokens[:, 1:], jnp.full((B, 1), IGNORE, tokens.dtype)], axis=1)
    counted = (labels != IGNORE).astype(jnp.float32)
    weights = counted * instance_mask.astype(jnp.float32)[:, None]
    return labels, weights, counted
