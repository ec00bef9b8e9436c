"""Preference optimisation: per-sequence log-probabilities and the DPO losses of OLMo 3's recipe.

    logp(y | x)   = sum over the assistant tokens t of log softmax(logits[t - 1])[y_t]   (label mask)
    n(y)          = number of those tokens
    dpo_norm:  l = logp / n       dpo:  l = logp                       (per sequence)
    ratio         = (l_policy(chosen) - l_policy(rejected)) - (l_ref(chosen) - l_ref(rejected))
    loss          = mean over pairs of  -log sigmoid(beta * ratio)       (label smoothing 0)
    reward(y)     = beta * (l_policy(y) - l_ref(y))      accuracy = mean[reward(c) > reward(r)]

open-instruct `dpo_utils.py`: `dpo_loss` (the formula above), `_get_batch_logps` (labels -100
off the assistant turns, logits[:, :-1] against labels[:, 1:], sum or mean over the unmasked
targets) and `dpo_tune_cache.py`, where `dpo_norm` is `dpo_loss` on length-averaged log-probs
(`average_log_prob_loss_types = ["simpo", "dpo_norm"]`) and the logged metrics are
`rewards/{chosen,rejected,average,accuracy,margin}` and `logps/{chosen,rejected}` (the policy's
reduced log-probs). OLMo 3 Think / Instruct DPO: `dpo_norm`, beta 5
(`scripts/train/olmo3/7b_{think,instruct}_dpo.sh` at open-instruct 3af17aacf).

Why it is built this way:
- A batch holds pairs as consecutive rows (row 2i chosen, 2i + 1 rejected), each padded to
  seq_len. Padding behind a causal mask changes no real token's logits, the pairs never split
  across devices or microbatches, and the CE machinery's FSDP gathers are reused unchanged.
- The losses see only per-sequence statistics (sum, count of the policy; the reference's cached
  sum), so a new preference loss (SimPO, IPO) is one entry of `LOSSES`, and RLVR's sequence-level
  objectives can reuse `sequence_logps` as is.
- The lm_head runs in chunks of `chunk` tokens under `jax.checkpoint`, as for the CE loss: at
  seq 16,384 and a 100k vocabulary the [seq, vocab] logits never exist whole.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from jaxtyping import Array, Bool, Float, Int, PyTree, jaxtyped

from olmo3.config import matmul_precision
from olmo3.loss import IGNORE, labels_and_weights
from olmo3.model import OLMo3

BETA = 5.0  # open-instruct 7b_{think,instruct}_dpo.sh: --dpo_beta 5


# --------------------------------------------------------------------------------------------
# Per-sequence log-probabilities
# --------------------------------------------------------------------------------------------
@jaxtyped(typechecker=beartype)
def token_logps(h: Float[Array, "n d_model"], lm_head: Float[Array, "d_model vocab"],
                labels: Int[Array, " n"], *, chunk: int = 1024) -> Float[Array, " n"]:
    """log softmax(h @ lm_head)[label] per position, float32 (0 where the label is IGNORE);
    [chunk, vocab] logits at a time, recomputed chunk by chunk in the backward pass. The logits
    are the matmul's float32 accumulator; open-instruct's bf16 run upcasts bf16 logits
    (`concatenated_forward`: `.logits.to(torch.float32)`), as olmo3/loss.py says for OLMo-core."""
    n, d = h.shape
    chunk = min(chunk, n)
    pad = (-n) % chunk
    hc = jnp.pad(h, ((0, pad), (0, 0))).reshape(-1, chunk, d)                 # (k, chunk, d)
    lc = jnp.pad(labels, (0, pad), constant_values=IGNORE).reshape(-1, chunk)  # (k, chunk)
    w = lm_head.astype(h.dtype)

    @jax.checkpoint
    def one_chunk(_, x):
        hx, lx = x
        logits = jnp.dot(hx, w, preferred_element_type=jnp.float32,
                         precision=matmul_precision(hx.dtype))                 # (chunk, V) fp32
        target = jnp.take_along_axis(logits, jnp.maximum(lx, 0)[:, None], axis=-1)[:, 0]
        return None, jnp.where(lx == IGNORE, 0.0, target - jax.nn.logsumexp(logits, axis=-1))

    _, out = jax.lax.scan(one_chunk, None, (hc, lc))
    return out.reshape(-1)[:n]


@jaxtyped(typechecker=beartype)
def sequence_logps(model: OLMo3, tokens: Int[Array, "rows seq"], label_mask: Bool[Array, "rows seq"], *,
                   chunk: int = 1024, gather: Optional[Callable] = None
                   ) -> tuple[Float[Array, " rows"], Float[Array, " rows"]]:
    """(sum of log p(target), number of targets) per row. Position t predicts token t + 1 and
    counts when label_mask[t + 1] is set (open-instruct `_get_batch_logps`; our `labels_and_weights`)."""
    B, T = tokens.shape
    labels, weights, _ = labels_and_weights(tokens, jnp.ones((B,), bool), label_mask)
    h = jax.vmap(lambda t: model.hidden(t, gather=gather))(tokens)                # (B, T, d)
    logp = token_logps(h.reshape(B * T, -1), model.lm_head, labels.reshape(-1), chunk=chunk)
    return jnp.sum(logp.reshape(B, T) * weights, axis=1), jnp.sum(weights, axis=1)


# --------------------------------------------------------------------------------------------
# Losses: a registry of functions of per-pair statistics
# --------------------------------------------------------------------------------------------
def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta: float, label_smoothing: float = 0.0):
    """Per pair: (loss, chosen reward, rejected reward) from reduced log-probs (open-instruct `dpo_loss`)."""
    logits = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    losses = (-jax.nn.log_sigmoid(beta * logits) * (1.0 - label_smoothing)
              - jax.nn.log_sigmoid(-beta * logits) * label_smoothing)
    return losses, beta * (policy_chosen - ref_chosen), beta * (policy_rejected - ref_rejected)


@dataclasses.dataclass(frozen=True)
class PreferenceLoss:
    """A preference loss: how a sequence's log-prob is reduced, and the per-pair function."""

    length_normalised: bool   # mean over the sequence's targets (dpo_norm, simpo) or their sum (dpo)
    fn: Callable = dpo_loss


LOSSES = {
    "dpo": PreferenceLoss(length_normalised=False),
    "dpo_norm": PreferenceLoss(length_normalised=True),   # OLMo 3 Think / Instruct
}


TERMS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/average", "rewards/accuracy",
         "rewards/margin", "logps/chosen", "logps/rejected", "logps/accuracy")


@jaxtyped(typechecker=beartype)
def pair_terms(loss: str, beta: float, sums: Float[Array, " rows"], counts: Float[Array, " rows"],
               ref_sums: Float[Array, " rows"]) -> dict[str, Float[Array, " pairs"]]:
    """Per-pair loss and the quantities open-instruct logs, from rows (chosen, rejected, ...)."""
    spec = LOSSES[loss]
    norm = jnp.maximum(counts, 1.0) if spec.length_normalised else 1.0
    policy, ref = (sums / norm).reshape(-1, 2), (ref_sums / norm).reshape(-1, 2)   # (pairs, 2)
    losses, chosen_r, rejected_r = spec.fn(policy[:, 0], policy[:, 1], ref[:, 0], ref[:, 1], beta)
    return {"loss": losses, "rewards/chosen": chosen_r, "rewards/rejected": rejected_r,
            "rewards/average": (chosen_r + rejected_r) / 2,
            "rewards/accuracy": (chosen_r > rejected_r).astype(jnp.float32),
            "rewards/margin": chosen_r - rejected_r,
            "logps/chosen": policy[:, 0], "logps/rejected": policy[:, 1],
            # Not in open-instruct: does the policy itself rank chosen above rejected (before any
            # DPO step the rewards are all 0; this one is not).
            "logps/accuracy": (policy[:, 0] > policy[:, 1]).astype(jnp.float32)}


# --------------------------------------------------------------------------------------------
# The sharded training step and per-row scoring (FSDP gathers of olmo3/sharding.py)
# --------------------------------------------------------------------------------------------
def make_train_step(optimizer, mesh, specs: PyTree, *, loss: str = "dpo_norm", beta: float = BETA,
                    microbatches: int = 1, chunk: int = 1024):
    """`step(model, opt_state, batch) -> (model, opt_state, metrics)`, jitted, buffers donated.

    batch: tokens int32 [2P, T], label_mask bool [2P, T], ref_logps float32 [2P] (reference sums),
    rows split over every device. The objective is the mean per-pair loss over the GLOBAL batch,
    so microbatches and device counts change nothing (DESIGN §4, bug 4)."""
    from olmo3 import sharding
    if loss not in LOSSES:
        raise ValueError(f"unknown preference loss {loss!r}; choose one of {sorted(LOSSES)}")
    P = sharding.P

    def local(params, static, batch):
        rows = batch["tokens"].shape[0]
        if rows % (2 * microbatches):
            raise ValueError(f"{rows // 2} pairs per device do not split into microbatches={microbatches}")
        n_pairs = rows * mesh.size // 2          # every device holds the same number of rows

        def objective(p, mb):
            model, gather = sharding.gathered(eqx.combine(p, static), specs)
            sums, counts = sequence_logps(model, mb["tokens"], mb["label_mask"], chunk=chunk, gather=gather)
            terms = pair_terms(loss, beta, sums, counts, mb["ref_logps"])
            return jnp.sum(terms["loss"]) / n_pairs, {k: jnp.sum(v) for k, v in terms.items()}

        grad = jax.grad(objective, has_aux=True)
        split = jax.tree.map(lambda x: x.reshape(microbatches, -1, *x.shape[1:]), batch)

        def body(acc, mb):
            g, stats = grad(params, mb)
            return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, (g, stats)), None

        zeros = (jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params),
                 {k: jnp.zeros((), jnp.float32) for k in TERMS})
        (grads, stats), _ = jax.lax.scan(body, zeros, split)
        if mesh.shape[sharding.DATA] > 1:   # fsdp shards are already reduce-scattered
            grads = jax.lax.psum(grads, sharding.DATA)
        stats = jax.lax.psum(stats, (sharding.DATA, sharding.FSDP))
        return grads, {k: v / n_pairs for k, v in stats.items()}

    inner = sharding.pinned(optimizer, mesh, specs)

    def step(model, opt_state, batch):
        params, static = eqx.partition(model, eqx.is_inexact_array)
        batch = {k: batch[k] for k in ("tokens", "label_mask", "ref_logps")}
        grads, stats = jax.shard_map(lambda p, b: local(p, static, b), mesh=mesh,
                                     in_specs=(specs, {k: sharding.ROWS for k in batch}),
                                     out_specs=(specs, P()), check_vma=False)(params, batch)
        model, opt_state, m = inner.update(grads, opt_state, model, stats["loss"])
        return model, opt_state, {f"train/{k}": v for k, v in stats.items()} | m

    return eqx.filter_jit(step, donate="all")


def make_logps_fn(mesh, specs: PyTree, *, chunk: int = 1024):
    """`logps_fn(model, batch) -> (sums, counts)` numpy [rows] for a WHOLE batch given on every
    process (held-out pairs, the reference cache): the rows are split over every device
    (`sharding.whole_batch`), and the per-row results come back to every process in row order."""
    from jax.experimental import multihost_utils

    from olmo3 import sharding

    @eqx.filter_jit
    def sharded(model: OLMo3, batch: dict):
        params, static = eqx.partition(model, eqx.is_inexact_array)

        def local(p, b):
            m, gather = sharding.gathered(eqx.combine(p, static), specs)
            return sequence_logps(m, b["tokens"], b["label_mask"], chunk=chunk, gather=gather)

        return jax.shard_map(local, mesh=mesh, in_specs=(specs, {k: sharding.ROWS for k in batch}),
                             out_specs=(sharding.ROWS, sharding.ROWS), check_vma=False)(params, batch)

    def logps_fn(model: OLMo3, batch: dict):
        out = sharded(model, sharding.whole_batch({k: batch[k] for k in ("tokens", "label_mask")}, mesh))
        if jax.process_count() > 1:
            out = [multihost_utils.process_allgather(x, tiled=True) for x in out]
        return tuple(np.asarray(x, np.float64) for x in out)

    return logps_fn


def pair_batch(dataset, start: int, rows: int) -> dict:
    """Pairs [start, start + rows // 2) of `dataset` in order as a batch of `rows` rows; past the
    end, filler pairs with an all-False label mask (their results are dropped)."""
    pairs = [dataset[i] for i in range(start, min(start + rows // 2, len(dataset)))]
    T = dataset.seq_len
    filler = {"tokens": np.full((2, T), dataset.pad_id, np.uint32), "label_mask": np.zeros((2, T), bool)}
    pairs += [filler] * (rows // 2 - len(pairs))
    return {"tokens": np.concatenate([p["tokens"] for p in pairs]).astype(np.int32),
            "label_mask": np.concatenate([p["label_mask"] for p in pairs])}


def score_pairs(logps_fn, model: OLMo3, dataset, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(sums, counts) float64 [pairs, 2] of every pair of `dataset`, in order, `rows` rows a batch."""
    sums, counts = [], []
    for start in range(0, len(dataset), rows // 2):
        s, c = logps_fn(model, pair_batch(dataset, start, rows))
        keep = 2 * min(rows // 2, len(dataset) - start)
        sums.append(s[:keep])
        counts.append(c[:keep])
    return np.concatenate(sums).reshape(-1, 2), np.concatenate(counts).reshape(-1, 2)


def evaluate_pairs(logps_fn, model: OLMo3, dataset, ref_sums: np.ndarray, *, loss: str = "dpo_norm",
                   beta: float = BETA, rows: int = 8) -> dict[str, float]:
    """Mean of every `pair_terms` quantity over all pairs of a held-out dataset."""
    sums, counts = score_pairs(logps_fn, model, dataset, rows)
    terms = pair_terms(loss, beta, jnp.asarray(sums.reshape(-1), jnp.float32),
                       jnp.asarray(counts.reshape(-1), jnp.float32),
                       jnp.asarray(np.asarray(ref_sums).reshape(-1), jnp.float32))
    return {k: float(jnp.mean(v)) for k, v in terms.items()}
