"""Held-out evidence on fixed inputs (DESIGN §5: "reproduced" means held-out evidence, not a
training-loss curve).

    heldout(model, dataset, ...)        held-out CE with the TRAINING loss function
                                        (olmo3.step.eval_loss), and bits per byte
    token_byte_lengths(vocab)           UTF-8 bytes per dolma2 token (the bpb denominator)
    logit_agreement(ref, other)         per-token KL(ref || other), top-1 agreement, top-k overlap
    model_agreement(a, b, tokens)       the same for two models on identical token rows
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Float, Int, Integer

from olmo3.model import OLMo3
from olmo3.step import eval_loss


@functools.lru_cache(maxsize=4)
def token_byte_lengths(vocab_size: int) -> Int[np.ndarray, " vocab"]:
    """UTF-8 bytes of each dolma2 token, for bits per byte. Special tokens (eos, pad...) and rows
    beyond the tokenizer (a padded vocabulary) count 0 bytes: they are not text (Paloma counts
    the bytes of the documents)."""
    import data
    enc = data.dolma2()
    special = set(enc._special_tokens.values())
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


def heldout(model: OLMo3, dataset, *, batch_size: int, max_batches: Optional[int] = None,
            chunk: int = 1024, use_segments: bool = False,
            byte_lengths: Optional[Int[np.ndarray, " vocab"]] = None) -> dict:
    """Held-out CE of fixed batches: {"ce_sum", "tokens", "bytes", "loss", "bpb", "batches"}.

    The batches are `data.get_batch(dataset, batch_size, seed=0, step=b)`, the same fixed order
    train.py's in-run evaluation reads, and the loss is olmo3.step.eval_loss, the training loss
    function itself: eval.py's number on a checkpoint equals the run's own eval/<domain>/loss."""
    import data
    n = len(dataset) // batch_size
    if n == 0:
        raise ValueError(f"held-out set {dataset!r} has {len(dataset)} instances, fewer than one batch of "
                         f"{batch_size}; lower --eval_batch_size")
    if max_batches is not None:
        n = min(n, max_batches)
    fn = _eval_fn(chunk, use_segments)
    ce = tokens = nbytes = 0.0
    for b in range(n):
        rows = data.get_batch(dataset, batch_size, 0, b)
        batch = {"tokens": jnp.asarray(rows["tokens"]), "instance_mask": jnp.asarray(rows["instance_mask"]),
                 "segment_ids": jnp.asarray(rows["segment_ids"])}
        s, c = fn(model, batch)
        ce, tokens = ce + float(s), tokens + float(c)
        if byte_lengths is not None:  # the targets are tokens[:, 1:]
            nbytes += float(byte_lengths[rows["tokens"][:, 1:]].sum())
    out = {"ce_sum": ce, "tokens": tokens, "bytes": nbytes, "loss": ce / tokens, "batches": n}
    out["bpb"] = ce / (math.log(2) * nbytes) if nbytes else float("nan")
    return out


# ---- two models on identical inputs -------------------------------------------------------------
def logit_agreement(ref_logits: Float[np.ndarray, "*tokens vocab"], logits: Float[np.ndarray, "*tokens vocab_b"],
                    top_k: int = 10) -> dict:
    """Per-token KL(ref || other) in float64, top-1 agreement and top-k overlap (fraction of the
    reference's top k found in the other's top k). Inputs [..., vocab]."""
    a = np.asarray(ref_logits, np.float64).reshape(-1, ref_logits.shape[-1])
    b = np.asarray(logits, np.float64).reshape(-1, logits.shape[-1])
    if a.shape != b.shape:
        raise ValueError(f"logit shapes differ: {a.shape} vs {b.shape} (different vocab sizes?)")
    la = a - a.max(-1, keepdims=True)
    la -= np.log(np.exp(la).sum(-1, keepdims=True))
    lb = b - b.max(-1, keepdims=True)
    lb -= np.log(np.exp(lb).sum(-1, keepdims=True))
    kl = np.maximum((np.exp(la) * (la - lb)).sum(-1), 0.0)
    ta = np.argpartition(-a, top_k - 1, axis=-1)[:, :top_k]
    tb = np.argpartition(-b, top_k - 1, axis=-1)[:, :top_k]
    overlap = np.mean([len(np.intersect1d(x, y)) / top_k for x, y in zip(ta, tb)])
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "kl_sum": float(kl.sum()),
            "top1": float(np.mean(a.argmax(-1) == b.argmax(-1))), f"top{top_k}": float(overlap),
            "tokens": int(kl.size)}


def model_agreement(model_a: OLMo3, model_b: OLMo3, token_rows: Integer[np.ndarray, "batch seq"]) -> dict:
    """KL(a || b), top-1, top-10 of two models over [B, T] token rows (means over all tokens)."""
    if model_a.config.vocab_size != model_b.config.vocab_size:
        raise ValueError(f"models have different vocab sizes ({model_a.config.vocab_size} vs "
                         f"{model_b.config.vocab_size}); token-level KL needs the same vocabulary")
    fa, fb = logits_fn(), logits_fn()
    parts = []
    for row in np.asarray(token_rows):
        t = jnp.asarray(row, jnp.int32)
        parts.append(logit_agreement(np.asarray(fa(model_a, t)), np.asarray(fb(model_b, t))))
    n = sum(p["tokens"] for p in parts)
    return {"kl_mean": sum(p["kl_sum"] for p in parts) / n, "kl_max": max(p["kl_max"] for p in parts),
            "top1": sum(p["top1"] * p["tokens"] for p in parts) / n,
            "top10": sum(p["top10"] * p["tokens"] for p in parts) / n, "tokens": n}


@functools.lru_cache(maxsize=1)
def logits_fn():
    """The jitted forward pass `f(model, tokens[T]) -> logits[T, V]`, one per process."""
    return eqx.filter_jit(lambda m, t: m(t))
