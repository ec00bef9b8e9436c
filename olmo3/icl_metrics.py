"""OLMo's in-loop ICL metrics, computed from per-request log-likelihoods: the numbers OLMo-core's
DownstreamEvaluator logs (ai2-olmo-eval `olmo_eval/metrics.py`, class ICLMetric).

For each scored request r of document d with continuation c (S_r = sum of log p over c's tokens):

    acc, f1            ll_r = S_r                  ll'_r = S_r
    len_norm, ce_loss, bpb   ll_r = S_r / chars(c)  ll'_r = S_r / (chars(c) - 1)
    ce_r  = -S_r / chars(c)      ce'_r  = -S_r / (chars(c) - 1)
    bpb_r = -S_r / bytes(c) / ln 2    bpb'_r = -S_r / bytes(c[1:]) / ln 2

    accuracy types:  acc = mean_d [argmax_r ll_r == gold_d]     (reported as <type>_v1 and _v2)
                     ce_loss_v1 / bpb_v1 = mean_d ce'/bpb' of the gold;  _v2 = the same unprimed
                     soft_v1 / soft_v2 = mean_d softmax(ll' / ll)[gold];  soft_log_*: log_softmax
    ce_loss / bpb types: mean_d of the single (gold) continuation's ce' (v1) and ce (v2) / bpb.

The primed ("v1") numbers drop the continuation's first character (usually its leading space),
OLMo's original convention; "v2" is OLMES's. Two quirks of AI2's code are kept on purpose so the
numbers match: acc's v1 and v2 are both the argmax of the unprimed ll, and the per-document
values pass through float32 (ICLMetric stores them in float32 torch tensors). A request id seen
twice keeps its first value; a document whose continuation ids are not 0..n-1 is skipped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
from jaxtyping import Float

# OLMo-core DownstreamEvaluator.metric_type_to_label (train/callbacks/evaluator_callback.py): the
# W&B names AI2's curves carry, "<task> (<label>)" under eval/downstream/.
DISPLAY = {"acc": "accuracy", "len_norm": "length-normalized accuracy", "pmi_dc": "PMI-DC accuracy",
           "f1": "F1 score", "ce_loss": "CE loss", "bpb": "BPB", "soft": "soft loss", "soft_log": "log soft loss"}
METRIC_TYPES = ("acc", "len_norm", "f1", "ce_loss", "bpb")  # pmi_dc needs domain-conditional requests


def display_name(label: str, metric: str) -> str:
    """OLMo-core's logged name of `metric` ("bpb_v2", ...) for task `label`."""
    kind, _, version = metric.rpartition("_v")
    suffix = "" if version == "1" else f" v{version}"
    return f"eval/downstream/{label} ({DISPLAY[kind]}{suffix})"


@dataclass(frozen=True)
class Scored:
    """One scored request: its document, continuation id, gold label, the summed log-probability
    of the continuation's tokens and the continuation's length in characters and UTF-8 bytes."""
    doc_id: int
    cont_id: int
    label: int
    logprob: float
    chars: int
    nbytes: int
    nbytes_no_space: int


def _normalised(s: Scored, metric_type: str) -> tuple[float, float, float, float, float, float]:
    """(ll, ll', ce, ce', bpb, bpb') of one request (module docstring)."""
    S = s.logprob
    with np.errstate(divide="ignore", invalid="ignore"):  # a 1-character continuation: chars - 1 = 0
        c1 = np.float64(s.chars - 1)
        ce, ce1 = -S / s.chars, -S / c1
        bpb, bpb1 = -S / s.nbytes / math.log(2), -S / np.float64(s.nbytes_no_space) / math.log(2)
    if metric_type in ("acc", "f1"):
        return S, S, ce, ce1, bpb, bpb1
    if metric_type in ("len_norm", "ce_loss", "bpb"):
        return S / s.chars, S / c1, ce, ce1, bpb, bpb1
    raise ValueError(f"metric type {metric_type!r} is not supported (one of {METRIC_TYPES})")


def _f1(labels: Sequence[int], preds: Sequence[int], pos: int = 0) -> float:
    """F1 of class `pos` (ICLMetric scores NLI tasks with the first continuation as positive)."""
    tp = sum(y == pos and p == pos for y, p in zip(labels, preds))
    fp = sum(y != pos and p == pos for y, p in zip(labels, preds))
    fn = sum(y == pos and p != pos for y, p in zip(labels, preds))
    if tp + fp == 0 or tp + fn == 0:
        return 0.0
    precision, recall = tp / (tp + fp), tp / (tp + fn)
    return 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall)


def _softmax(x: Float[np.ndarray, " n"], log: bool) -> Float[np.ndarray, " n"]:
    z = x - x.max()
    lse = np.log(np.exp(z).sum())
    return (z - lse) if log else np.exp(z - lse)


def compute(scored: Sequence[Scored], metric_type: str) -> dict[str, float]:
    """ICLMetric.compute() of these requests: {"acc_v1": ..., "bpb_v2": ...} (module docstring)."""
    docs: dict[int, dict[int, tuple]] = {}
    gold: dict[int, int] = {}
    for s in scored:
        gold.setdefault(s.doc_id, s.label)
        docs.setdefault(s.doc_id, {}).setdefault(s.cont_id, _normalised(s, metric_type))
    cols: dict[str, list] = {k: [] for k in ("correct", "ce", "ce1", "bpb", "bpb1", "soft", "soft1",
                                             "slog", "slog1", "pred", "pred1", "label")}
    for d, conts in docs.items():
        n = len(conts)
        if max(conts) >= n:  # ICLMetric: a continuation id past the count is an IndexError, skip
            continue
        v = np.full((n, 6), np.nan, np.float32)  # float32, as ICLMetric's tensors
        for c, vals in conts.items():
            v[c] = vals
        ll, ll1, ce, ce1, bpb, bpb1 = v.T
        g = gold[d] if metric_type not in ("ce_loss", "bpb") else 0
        if metric_type in ("ce_loss", "bpb"):
            cols["ce"].append(ce[0]), cols["ce1"].append(ce1[0])
            cols["bpb"].append(bpb[0]), cols["bpb1"].append(bpb1[0])
            continue
        if metric_type == "f1":
            cols["pred"].append(int(np.argmax(ll))), cols["pred1"].append(int(np.argmax(ll1)))
            cols["label"].append(g)
            continue
        cols["correct"].append(1.0 if int(np.argmax(ll)) == g else 0.0)
        cols["ce"].append(ce[g]), cols["ce1"].append(ce1[g]), cols["bpb"].append(bpb[g]), cols["bpb1"].append(bpb1[g])
        cols["soft"].append(_softmax(ll, False)[g]), cols["soft1"].append(_softmax(ll1, False)[g])
        cols["slog"].append(_softmax(ll, True)[g]), cols["slog1"].append(_softmax(ll1, True)[g])
    mean = lambda k: float(np.mean(np.asarray(cols[k], np.float64))) if cols[k] else float("nan")  # noqa: E731
    if metric_type == "f1":
        return {"f1_v1": _f1(cols["label"], cols["pred"]), "f1_v2": _f1(cols["label"], cols["pred1"])}
    if metric_type == "ce_loss":
        return {"ce_loss_v1": mean("ce1"), "ce_loss_v2": mean("ce")}
    if metric_type == "bpb":
        return {"bpb_v1": mean("bpb1"), "bpb_v2": mean("bpb")}
    return {f"{metric_type}_v1": mean("correct"), f"{metric_type}_v2": mean("correct"),
            "ce_loss_v1": mean("ce1"), "ce_loss_v2": mean("ce"), "bpb_v1": mean("bpb1"), "bpb_v2": mean("bpb"),
            "soft_v1": mean("soft1"), "soft_v2": mean("soft"), "soft_log_v1": mean("slog1"), "soft_log_v2": mean("slog")}


def primary(metric_type: str) -> Optional[str]:
    """The metric a task is read by (its OLMES primary metric), in ICLMetric's keys."""
    return {"acc": "acc_v2", "len_norm": "len_norm_v2", "f1": "f1_v2", "ce_loss": "ce_loss_v2",
            "bpb": "bpb_v2"}.get(metric_type)
