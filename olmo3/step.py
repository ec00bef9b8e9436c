"""The training step as a pure function: (model, opt_state, batch) -> (model, opt_state, metrics).

The global batch arrives whole (a recipe constant); it is split into `microbatches` equal parts
whose gradients are summed in float32 (gradient accumulation). Every loss term is a SUM divided by
the number of counted tokens of the WHOLE global batch, so the result does not depend on how the
batch is split across microbatches or devices (DESIGN §4, bug 4).

Where OLMo-core differs: its train module divides each data-parallel rank's loss sum by that rank's
own counted tokens and then averages gradients over ranks (`TransformerTrainModule.train_batch`,
`loss_div_factor=batch_num_tokens_for_loss`). With every target counted (stages 1-2: T - 1 per
instance) the two are the same number. With padding or label masks (stage 3's packed instances,
SFT) OLMo-core weighs a token by 1 / (its rank's count), so its loss depends on the number of ranks
and on which instances land together; ours weighs every counted token of the global batch equally.
"""
from __future__ import annotations

from typing import Callable, Optional

import equinox as eqx
import jax
import jax.numpy as jnp

from olmo3.loss import chunked_cross_entropy, labels_and_weights
from olmo3.model import OLMo3

Z_LOSS = 1e-5  # OLMo-core z_loss_multiplier (OLMo-3-1025-7B-pretrain-1.py)


def loss_sums(model: OLMo3, batch: dict, *, chunk: int, use_segments: bool,
              gather: Optional[Callable] = None,
              z_loss: Optional[float] = Z_LOSS) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(CE sum, logsumexp^2 sum, counted tokens) over a [B, T] batch. `z_loss`: the multiplier
    the caller differentiates ce + z_loss * z with (fuses the lm_head gradient, olmo3/loss.py)."""
    tokens = batch["tokens"]
    labels, weights, counted = labels_and_weights(tokens, batch["instance_mask"], batch.get("label_mask"))
    segs = batch["segment_ids"] if use_segments else None

    def one(t, s):
        return model.hidden(t, segment_ids=s, gather=gather)

    h = jax.vmap(one)(tokens, segs) if use_segments else jax.vmap(lambda t: one(t, None))(tokens)
    B, T, d = h.shape
    ce, z = chunked_cross_entropy(h.reshape(B * T, d), model.lm_head, labels.reshape(-1),
                                  weights.reshape(-1), chunk=chunk, z_loss=z_loss)
    return ce, z, jnp.sum(counted)


def accumulate_grads(model: OLMo3, batch: dict, n_tokens: jax.Array, *, microbatches: int,
                     chunk: int, z_loss: float, use_segments: bool,
                     gather: Optional[Callable] = None):
    """Gradient of (CE + z_loss * z) / n_tokens summed over microbatches; returns
    (grads fp32, CE sum, z sum) where the sums are NOT yet divided by n_tokens."""
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def objective(p, mb):
        ce, z, _ = loss_sums(eqx.combine(p, static), mb, chunk=chunk, use_segments=use_segments,
                             gather=gather, z_loss=z_loss)
        return (ce + z_loss * z) / n_tokens, (ce, z)

    grad_fn = jax.grad(objective, has_aux=True)
    split = jax.tree.map(lambda x: x.reshape(microbatches, x.shape[0] // microbatches, *x.shape[1:]),
                         batch)

    def body(carry, mb):
        g_acc, ce_acc, z_acc = carry
        g, (ce, z) = grad_fn(params, mb)
        g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
        return (g_acc, ce_acc + ce, z_acc + z), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    zero = jnp.zeros((), jnp.float32)
    (grads, ce, z), _ = jax.lax.scan(body, (zeros, zero, zero), split)
    return grads, ce, z


def make_train_step(optimizer, *, microbatches: int = 1, chunk: int = 1024, z_loss: float = Z_LOSS,
                    use_segments: bool = False, grad_fn: Optional[Callable] = None):
    """Build the jitted step. `grad_fn(model, batch) -> (grads, ce_mean, z_mean)` replaces the
    single-program gradient (olmo3/sharding.py passes its shard_map version)."""

    def default_grad_fn(model, batch):
        counted = labels_and_weights(batch["tokens"], batch["instance_mask"], batch.get("label_mask"))[2]
        n = jnp.maximum(jnp.sum(counted), 1.0)
        grads, ce, z = accumulate_grads(model, batch, n, microbatches=microbatches, chunk=chunk,
                                        z_loss=z_loss, use_segments=use_segments)
        return grads, ce / n, z / n

    compute = grad_fn or default_grad_fn

    def step(model, opt_state, batch):
        grads, ce, z = compute(model, batch)
        model, opt_state, metrics = optimizer.update(grads, opt_state, model, ce)
        metrics = {"train/loss": ce, "train/z_loss": z_loss * z, **metrics}
        return model, opt_state, metrics

    # The old model and optimizer state are dead after the step: donate their buffers.
    return eqx.filter_jit(step, donate="all")


def eval_loss(model: OLMo3, batch: dict, *, chunk: int = 1024, use_segments: bool = False):
    """(CE sum, counted tokens) of a batch, no gradient: held-out evaluation."""
    ce, _, n = loss_sums(model, batch, chunk=chunk, use_segments=use_segments, z_loss=None)
    return ce, n
