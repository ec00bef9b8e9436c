"""Cross entropy + z-loss over a 100k vocabulary without materializing [tokens, vocab] logits.

OLMo-core semantics (DESIGN §3): float32 logits; labels -100 are ignored; z-loss =
1e-5 * logsumexp^2 over non-ignored tokens; both are means over the non-ignored tokens of the
global batch. (In bf16 compute the logits here are the lm_head matmul's float32 accumulator.
OLMo-core's run rounds them to bf16 first: its LM head is an nn.Linear in FSDP's bf16
param_dtype, and `cross_entropy_loss` upcasts its bf16 output, `logits.float()`. Kept as
DESIGN §3 says; the difference is per-token rounding, at most half a bf16 ulp of each logit.)
Instances masked by the repetition filter contribute nothing to the numerator but still count
in the denominator, as seq_len tokens each (OLMo-core's InstanceFilter semantics:
`TransformerTrainModule.train_batch` adds back `batch_num_tokens_per_instance` per masked instance).
A per-token label mask (packed and padded instances: padding; SFT: prompt tokens) removes
targets from both, as OLMo-core's `get_labels` does.

The lm_head matmul runs in chunks of `chunk` tokens, so only [chunk, vocab] logits are ever alive.
Plain: under `jax.checkpoint`, the backward recomputes them chunk by chunk. Fused (`z_loss=`,
what the train step uses): the forward also turns each chunk into its gradient, no recompute.

The softmax over the vocabulary reads the [chunk, vocab] logits as few times as it can. On the
issue-14 CPU config (d_model 512, vocab 100278, 2048 tokens, XLA:CPU 0.10.2) its passes cost as
much as a third of the lm_head matmuls: the row max alone took 200 ms, a sum of exp 170 ms. So:
- the row max is skipped when it cannot matter. It only keeps exp() from overflowing; float32's
  relative precision does not depend on scale. Cauchy-Schwarz bounds every logit of a chunk by
  B = max_i |h_i| * max_j |lm_head[:, j]|; when vocab * e^B is far below float32's largest value
  (B + ln vocab < 80, against ln(FLT_MAX) = 88.7), exp(logits) is summed as is. Otherwise (a
  large model's logits can reach that) the max is taken as usual. Same result either way, to
  float32 rounding; tests/test_loss.py checks both branches against a numpy oracle.
- on the CPU the row sum of exp is a matrix-vector product with ones: XLA:CPU rewrites a long
  row reduction into a tree of reduce-windows (3x slower here than the dot library's matvec).
  Other platforms keep jnp.sum.
Measured in one process, `python benchmarks/bench.py --flagfile=benchmarks/bench_cpu.flags`:
see the README's CPU table.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Bool, Float, Int, jaxtyped

from olmo3.config import matmul_precision

IGNORE = -100
# exp(x) overflows float32 above 88.7 = ln(FLT_MAX); a row of `vocab` terms sums to at most
# vocab * e^B. Below this, with a margin of e^8 for the bound's own rounding, no max is needed.
EXP_SAFE = 80.0


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


@jaxtyped(typechecker=beartype)
def column_norm_max(w: Float[Array, "d_model vocab"]) -> Float[Array, ""]:
    """max_j |w[:, j]|, in float32: with |h_i| it bounds every logit h_i . w[:, j]."""
    w = w.astype(jnp.float32)
    return jnp.sqrt(jnp.max(jnp.sum(w * w, axis=0)))


def _row_sum(e):
    """e.sum(-1); on the CPU as e @ ones (see the module docstring)."""
    return jax.lax.platform_dependent(
        e, cpu=lambda e: jnp.dot(e, jnp.ones(e.shape[-1:], e.dtype), preferred_element_type=jnp.float32,
                                 precision=jax.lax.Precision.HIGHEST),   # a sum: in float32
        default=lambda e: jnp.sum(e, axis=-1))


def _exp_lse_target(hc, w, lc, w_norm):
    """(e, s, lse, target) of one chunk: e = exp(logits - m) with m = 0 or the row max (module
    docstring), s = e.sum(-1), lse = m + log s, target = the label's logit."""
    logits = jnp.dot(hc, w, preferred_element_type=jnp.float32, precision=matmul_precision(hc.dtype))  # (chunk, V)
    h_norm = jnp.sqrt(jnp.max(jnp.sum(jnp.square(hc.astype(jnp.float32)), axis=-1)))
    safe = h_norm * w_norm + math.log(logits.shape[-1]) < EXP_SAFE
    m = jax.lax.stop_gradient(jax.lax.cond(
        safe, lambda x: jnp.zeros(x.shape[:-1], x.dtype), lambda x: jnp.max(x, axis=-1), logits))
    e = jnp.exp(logits - m[:, None])
    s = _row_sum(e)
    target = jnp.take_along_axis(logits, jnp.maximum(lc, 0)[:, None], axis=-1)[:, 0]
    return e, s, m + jnp.log(s), target


def _chunked_ce(h, lm_head, labels, weights, chunk):
    """The plain version: forward keeps [chunk, vocab] logits, backward recomputes them."""
    w = lm_head.astype(h.dtype)
    w_norm = column_norm_max(w)

    @jax.checkpoint
    def one_chunk(carry, x):
        hc, lc, wc = x
        _, _, lse, target = _exp_lse_target(hc, w, lc, w_norm)
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
    w_norm = column_norm_max(w)

    def one_chunk(carry, x):
        ce, z, dw = carry
        hc, lc, wc = x
        e, s, lse, target = _exp_lse_target(hc, w, lc, w_norm)
        # d(ce + z_loss * z)/d logits, one row per token: softmax = e / s; onehot at the label.
        onehot = jax.lax.broadcasted_iota(jnp.int32, e.shape, 1) == lc[:, None]
        dlogits = ((wc * (1.0 + 2.0 * z_loss * lse) / s)[:, None] * e
                   - jnp.where(onehot, wc[:, None], 0.0)).astype(h.dtype)
        exact = matmul_precision(h.dtype)
        dh = jnp.dot(dlogits, w.T, preferred_element_type=jnp.float32, precision=exact)        # (chunk, d)
        dw = dw + jnp.dot(hc.T, dlogits, preferred_element_type=jnp.float32, precision=exact)  # (d, V)
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
    denominator: every non-ignored label, and every position (T) of a masked instance, as
    OLMo-core adds back seq_len tokens per masked instance.
    """
    B = tokens.shape[0]
    labels = jnp.concatenate([tokens[:, 1:], jnp.full((B, 1), IGNORE, tokens.dtype)], axis=1)
    if label_mask is not None:
        target_ok = jnp.concatenate([label_mask[:, 1:], jnp.zeros((B, 1), bool)], axis=1)
        labels = jnp.where(target_ok, labels, IGNORE)
    return (labels, *loss_weights(labels, instance_mask))


def loss_weights(labels: Int[Array, "B T"], instance_mask: Bool[Array, " B"]) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """(weights, counted) for next-token `labels` (see `labels_and_weights`): a masked instance
    trains no target and counts all its T positions."""
    counted = (labels != IGNORE).astype(jnp.float32)
    weights = counted * instance_mask.astype(jnp.float32)[:, None]
    return weights, jnp.where(instance_mask[:, None], counted, 1.0)
