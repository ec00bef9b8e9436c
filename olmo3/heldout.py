"""Held-out evidence on fixed inputs (DESIGN §5: "reproduced" means held-out evidence, not a
training-loss curve).

    heldout(model, dataset, ...)        held-out CE with the TRAINING loss function
                                        (olmo3.step.eval_loss), and bits per byte
    olmo_core_ce(ce, targets, n)        the same as OLMo-core's LMEvaluator reports it
    token_byte_lengths(vocab)           UTF-8 bytes per dolma2 token (the bpb denominator)
    by_position(model, dataset, bounds) held-out CE per position bucket [bounds[k], bounds[k+1]):
                                        ce[row, k] = sum_{t in bucket k} w[row, t] * CE(row, t),
                                        loss_k = sum_row ce[row, k] / sum_row n[row, k],
                                        with its standard error over rows (long-context evidence)
    logit_agreement(ref, other)         per-token KL(ref || other), top-1 agreement, top-k overlap
    model_agreement(a, b, tokens)       the same for two models on identical token rows
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Float, Int, Integer

from olmo3.loss import chunked_cross_entropy, labels_and_weights
from olmo3.model import OLMo3
from olmo3.step import eval_loss


@functools.lru_cache(maxsize=4)
def token_byte_lengths(vocab_size: int) -> Int[np.ndarray, " vocab"]:
    """UTF-8 bytes of each dolma2 token, for bits per byte. Special tokens (eos, pad...) and rows
    beyond the tokenizer (a padded vocabulary) count 0 bytes: they are not text (Paloma counts
    the bytes of the documents); the added tokens matched in text (Dolma's PII masks) count theirs."""
    import data
    enc = data.dolma2()
    special = {i for name, i in data.tokenizer.ADDED_TOKENS.items() if name not in data.tokenizer.IN_TEXT}
    out = np.zeros(vocab_size, np.int64)
    for i in range(min(vocab_size, enc.n_vocab)):
        if i not in special:
            try:
                out[i] = len(enc.decode_single_token_bytes(i))
            except KeyError:  # a hole in the rank table
                pass
    return out


@functools.lru_cache(maxsize=8)
def _eval_fn(chunk: int, use_segments: bool):
    return eqx.filter_jit(functools.partial(eval_loss, chunk=chunk, use_segments=use_segments))


def _device_batch(rows: dict) -> dict:
    """The fields of a loader batch the loss reads, as arrays (label_mask: packed / padded sets,
    whose padding is no target)."""
    return {k: jnp.asarray(rows[k]) for k in ("tokens", "instance_mask", "segment_ids", "label_mask") if k in rows}


def _target_bytes(rows: dict, byte_lengths: Int[np.ndarray, " vocab"]) -> Int[np.ndarray, "rows targets"]:
    """UTF-8 bytes of the target of each position t < T - 1 (tokens[t + 1]), 0 where the label
    mask makes it no target."""
    nb = byte_lengths[rows["tokens"][:, 1:]]
    return np.where(rows["label_mask"][:, 1:], nb, 0) if "label_mask" in rows else nb


def heldout(model: OLMo3, dataset, *, batch_size: int, max_batches: Optional[int] = None,
            chunk: int = 1024, use_segments: bool = False,
            byte_lengths: Optional[Int[np.ndarray, " vocab"]] = None) -> dict:
    """Held-out CE of fixed batches: {"ce_sum", "tokens", "bytes", "loss", "bpb", "batches",
    "batch_losses"} (the last: each batch's mean loss, for the noise of a two-run comparison).

    The batches are `data.get_eval_batch(dataset, batch_size, b)`, the order train.py's in-run
    evaluation reads (every instance, a last batch filled with rows that count nothing), and the
    loss is olmo3.step.eval_loss, the training loss function itself: eval.py's number on a
    checkpoint equals the run's own eval/<domain>/loss for the same instances."""
    import data
    n = -(-len(dataset) // batch_size)
    if max_batches is not None:
        n = min(n, max_batches)
    fn = _eval_fn(chunk, use_segments)
    ce = tokens = nbytes = 0.0
    per_batch = []
    for b in range(n):
        rows = data.get_eval_batch(dataset, batch_size, b)
        s, c = fn(model, _device_batch(rows))
        ce, tokens = ce + float(s), tokens + float(c)
        per_batch.append(float(s) / max(float(c), 1.0))
        if byte_lengths is not None:
            nbytes += float(_target_bytes(rows, byte_lengths).sum())
    out = {"ce_sum": ce, "tokens": tokens, "bytes": nbytes, "loss": ce / tokens, "batches": n,
           "batch_losses": per_batch}
    out["bpb"] = ce / (math.log(2) * nbytes) if nbytes else float("nan")
    return out


def olmo_core_ce(ce_sum: float, targets: float, instances: int) -> float:
    """OLMo-core's in-loop held-out "CE loss" (`LMEvaluator` on `NumpyPaddedFSLDataset`) from ours.

    It averages the per-position losses that each padded instance's label mask selects before the
    shift: the instance's L tokens, of which L - 1 have a target and the last (its label is padding
    or past the end) a loss of 0. So its number is ce_sum / (targets + instances), lower than the
    true CE (ours, `loss`) by the fraction instances / (targets + instances): 0.2% for documents
    of 500 tokens. Logged beside ours so a run compares with AI2's curves as they were logged."""
    return ce_sum / (targets + instances)


# ---- held-out loss by position (stage 3's long-context evidence) --------------------------------
def bucket_bounds(fractions, seq_len: int) -> tuple[int, ...]:
    """Bucket edges in token positions from the buckets' upper ends as fractions of `seq_len`:
    (0.25, 0.5, 1) at 1024 -> (0, 256, 512, 1024). Every edge must be a whole position."""
    try:
        fr = [float(f) for f in fractions]
    except ValueError:
        raise ValueError(f"position buckets {list(fractions)}: give fractions of the sequence, e.g. 0.25,0.5,1") from None
    edges = [f * seq_len for f in fr]
    if not fr or not all(math.isfinite(f) for f in fr) or any(b <= a for a, b in zip([0.0, *edges], edges)) \
            or fr[-1] != 1.0:
        raise ValueError(f"position buckets {fr}: give increasing fractions of the sequence in (0, 1], the last 1")
    if any(abs(e - round(e)) > 1e-9 * seq_len for e in edges):   # 0.55 x 100 is 55.00000000000001
        raise ValueError(f"position buckets {fr} at sequence length {seq_len}: edges {edges} are not whole positions")
    return (0, *(int(round(e)) for e in edges))


def position_sums(model: OLMo3, batch: dict, *, bounds: tuple[int, ...], chunk: int = 1024,
                  use_segments: bool = False) -> tuple[Float[jax.Array, "rows buckets"], Float[jax.Array, "rows buckets"]]:
    """(CE sum, counted targets) per row and position bucket. Position t is the token that
    predicts tokens[t + 1] (t + 1 tokens of context); bucket k holds bounds[k] <= t < bounds[k+1].
    The same labels, weights and float32 cross entropy as the training loss (olmo3/loss.py), so
    the buckets' sums add up to olmo3.step.eval_loss's."""
    tokens = batch["tokens"]
    labels, weights, counted = labels_and_weights(tokens, batch["instance_mask"], batch.get("label_mask"))
    if use_segments:
        h = jax.vmap(lambda t, s: model.hidden(t, segment_ids=s))(tokens, batch["segment_ids"])
    else:
        h = jax.vmap(lambda t: model.hidden(t))(tokens)
    ce, n = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        row_ce = functools.partial(chunked_cross_entropy, lm_head=model.lm_head, chunk=min(chunk, hi - lo))
        s, _ = jax.vmap(lambda hb, lb, wb: row_ce(hb, labels=lb, weights=wb))(
            h[:, lo:hi], labels[:, lo:hi], weights[:, lo:hi])
        ce.append(s)
        n.append(jnp.sum(counted[:, lo:hi], axis=1))
    return jnp.stack(ce, axis=1), jnp.stack(n, axis=1)


@functools.lru_cache(maxsize=8)
def _position_fn(bounds: tuple[int, ...], chunk: int, use_segments: bool):
    return eqx.filter_jit(functools.partial(position_sums, bounds=bounds, chunk=chunk, use_segments=use_segments))


def ratio_se(num: Float[np.ndarray, " rows"], den: Float[np.ndarray, " rows"]) -> float:
    """Standard error of sum(num) / sum(den) over independent rows (the delta method's ratio
    estimator: rows are the sampling unit, the tokens inside a row are not independent)."""
    num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
    keep = den > 0
    num, den = num[keep], den[keep]
    m = len(den)
    if m < 2:
        return float("nan")
    r = num.sum() / den.sum()
    return float(math.sqrt(m / (m - 1) * np.sum((num - r * den) ** 2)) / den.sum())


def by_position(model: OLMo3, dataset, bounds: tuple[int, ...], *, batch_size: int,
                max_batches: Optional[int] = None, chunk: int = 1024, use_segments: bool = True,
                byte_lengths: Optional[Int[np.ndarray, " vocab"]] = None) -> dict:
    """Held-out CE per position bucket: {"bounds", "ce" [rows, K], "tokens" [rows, K], "bytes"
    [rows, K], "loss" [K], "se" [K], "bpb" [K]}. The rows are a padded dataset's documents in file
    order (each scored from its first token, so position = tokens of the same document before
    it; data/padded.py), or a fixed-length dataset's windows (seed-0 order, as `heldout`).
    `se` is each bucket's standard error over rows (`ratio_se`)."""
    import data
    if bounds[-1] != dataset.seq_len:
        raise ValueError(f"position buckets end at {bounds[-1]} but the held-out instances are "
                         f"{dataset.seq_len} tokens; the last bucket must end at the sequence length")
    n = -(-len(dataset) // batch_size)
    if max_batches is not None:
        n = min(n, max_batches)
    fn = _position_fn(tuple(bounds), chunk, use_segments)
    ce, tok, nbytes = [], [], []
    for b in range(n):
        rows = data.get_eval_batch(dataset, batch_size, b)
        s, c = fn(model, _device_batch(rows))
        keep = np.asarray(c).sum(1) > 0  # filler rows count nothing
        ce.append(np.asarray(s, np.float64)[keep])
        tok.append(np.asarray(c, np.float64)[keep])
        if byte_lengths is not None:
            nb = _target_bytes(rows, byte_lengths)
            nbytes.append(np.stack([nb[:, lo:min(hi, nb.shape[1])].sum(1)
                                    for lo, hi in zip(bounds[:-1], bounds[1:])], axis=1)[keep].astype(np.float64))
    ce, tok = np.concatenate(ce), np.concatenate(tok)
    out = {"bounds": tuple(bounds), "ce": ce, "tokens": tok, "rows": len(ce),
           "loss": _per_bucket(ce.sum(0), tok.sum(0)),   # NaN where no row reaches a bucket
           "se": np.array([ratio_se(ce[:, k], tok[:, k]) for k in range(ce.shape[1])])}
    if byte_lengths is not None:
        out["bytes"] = np.concatenate(nbytes)
        out["bpb"] = _per_bucket(ce.sum(0), math.log(2) * out["bytes"].sum(0))
    return out


def _per_bucket(num: Float[np.ndarray, " k"], den: Float[np.ndarray, " k"]) -> Float[np.ndarray, " k"]:
    return np.divide(num, den, out=np.full(num.shape, np.nan), where=den > 0)


# ---- two models on identical inputs -------------------------------------------------------------
# Positions compared at a time. One position costs the float64 log-probabilities of both models over
# the whole vocabulary and their temporaries, ~6.5x both models' float32 logits: a whole 65,536-token
# row of the 7B (vocab 100,352; 26 GB of float32 logits per model) needed ~320 GB of host memory
# above them (5.0 GB for 1,024 positions, measured, x 64), and each model's logits of the row
# 26 GB of device memory beside the weights. 512 positions: 0.2 GB of logits per model on the device
# and ~2 GB of host temporaries (measured: 2.3 GB at 1,024 positions, 1.9 GB at 2,048).
AGREEMENT_CHUNK = 512


def logit_agreement(ref_logits: Float[np.ndarray, "*tokens vocab"], logits: Float[np.ndarray, "*tokens vocab_b"],
                    top_k: int = 10, chunk: int = AGREEMENT_CHUNK) -> dict:
    """Per-token KL(ref || other) in float64, top-1 agreement and top-k overlap (fraction of the
    reference's top k found in the other's top k). Inputs [..., vocab], compared `chunk`
    positions at a time (AGREEMENT_CHUNK), so the float64 temporaries do not grow with the input."""
    a, b = np.asarray(ref_logits), np.asarray(logits)
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    if a.shape != b.shape:
        raise ValueError(f"logit shapes differ: {a.shape} vs {b.shape} (different vocab sizes?)")
    kl_sum, kl_max, top1, overlap = 0.0, -math.inf, 0, 0.0
    for s in range(0, len(a), chunk):
        kl, same, common = _agreement_block(a[s:s + chunk], b[s:s + chunk], top_k)
        kl_sum, kl_max = kl_sum + float(kl.sum()), max(kl_max, float(kl.max()))
        top1, overlap = top1 + int(same), overlap + common
    n = len(a)
    return {"kl_mean": kl_sum / n, "kl_max": kl_max, "kl_sum": kl_sum, "top1": top1 / n,
            f"top{top_k}": overlap / (top_k * n), "tokens": n}


def _agreement_block(a: Float[np.ndarray, "n vocab"], b: Float[np.ndarray, "n vocab"], top_k: int
                     ) -> tuple[Float[np.ndarray, " n"], int, int]:
    """(per-token KL(a || b) in float64, tokens whose top-1 agree, top-k ids in common) of a block."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    la = a - a.max(-1, keepdims=True)
    la -= np.log(np.exp(la).sum(-1, keepdims=True))
    lb = b - b.max(-1, keepdims=True)
    lb -= np.log(np.exp(lb).sum(-1, keepdims=True))
    kl = np.maximum((np.exp(la) * (la - lb)).sum(-1), 0.0)
    ta = np.argpartition(-a, top_k - 1, axis=-1)[:, :top_k]
    tb = np.argpartition(-b, top_k - 1, axis=-1)[:, :top_k]
    common = sum(len(np.intersect1d(x, y)) for x, y in zip(ta, tb))
    return kl, int(np.sum(a.argmax(-1) == b.argmax(-1))), common


def model_agreement(model_a: OLMo3, model_b: OLMo3, token_rows: Integer[np.ndarray, "batch seq"],
                    chunk: int = AGREEMENT_CHUNK) -> dict:
    """KL(a || b), top-1, top-10 of two models over [B, T] token rows (means over all tokens).
    Each row's hidden states are computed whole; its logits `chunk` positions at a time."""
    if model_a.config.vocab_size != model_b.config.vocab_size:
        raise ValueError(f"models have different vocab sizes ({model_a.config.vocab_size} vs "
                         f"{model_b.config.vocab_size}); token-level KL needs the same vocabulary")
    hidden, head = _hidden_fn(), _head_fn()
    parts = []
    for row in np.asarray(token_rows):
        t = jnp.asarray(row, jnp.int32)
        ha, hb = hidden(model_a, t), hidden(model_b, t)
        for s in range(0, len(row), chunk):
            parts.append(logit_agreement(np.asarray(head(model_a, ha[s:s + chunk])),
                                         np.asarray(head(model_b, hb[s:s + chunk]))))
    n = sum(p["tokens"] for p in parts)
    return {"kl_mean": sum(p["kl_sum"] for p in parts) / n, "kl_max": max(p["kl_max"] for p in parts),
            "top1": sum(p["top1"] * p["tokens"] for p in parts) / n,
            "top10": sum(p["top10"] * p["tokens"] for p in parts) / n, "tokens": n}


@functools.lru_cache(maxsize=1)
def _hidden_fn():
    """The jitted `f(model, tokens[T]) -> final-normed hidden states [T, d_model]`."""
    return eqx.filter_jit(lambda m, t: m.hidden(t))


@functools.lru_cache(maxsize=1)
def _head_fn():
    """The jitted LM head `f(model, h[n, d_model]) -> logits[n, V]`, as OLMo3.__call__ applies it."""
    return eqx.filter_jit(lambda m, h: m.head(h))
