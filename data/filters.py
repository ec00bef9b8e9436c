"""OLMo-core's n-gram repetition filter, vectorized: a per-instance loss mask.

OLMo-core `InstanceFilterConfig(repetition_max_period=13, repetition_min_period=1,
repetition_max_count=32)` masks an instance when `data/utils.py:find_periodic_sequences` reports
a span with some period p in 1..13 that repeats `times >= 32` times. That function reshapes the
instance into rows of p tokens, finds runs of rows equal to the row before, widens each run by
the partial matches in its neighbouring rows, and reports `times = span_length // p`.

Unrolled, its span is `[a - p, b)` where `[a, b)` is a maximal run of positions i with
`x[i] == x[i - p]` (positions i < p never match), so `times = (b - a + p) // p`, and
`times >= 32` is exactly "some run of `x[i] == x[i-p]` is at least 31 * p long". (OLMo-core only
reports runs containing a whole aligned row; every run that long does, and its cap
`p <= len // 3` never binds for such a run.) Here: one comparison per period over the whole
batch, and a windowed cumulative sum to find runs of length >= (max_count - 1) * p.

The masked instance still counts in the loss denominator in OLMo-core
(`train_module.py`: `batch_num_tokens_for_loss += (~instance_mask).sum() * tokens_per_instance`);
the trainer applies that, here we only compute the mask. Default off, as in the official 7B
scripts (DESIGN §4).
"""
import numpy as np
from jaxtyping import Bool, Integer

# OLMo-core InstanceFilterConfig(13, 1, 32), as MaxText's OLMo port enables it.
MAX_PERIOD = 13
MIN_PERIOD = 1
MAX_COUNT = 32


def repetition_mask(
    tokens: Integer[np.ndarray, "batch seq"],
    max_period: int = MAX_PERIOD,
    min_period: int = MIN_PERIOD,
    max_count: int = MAX_COUNT,
) -> Bool[np.ndarray, " batch"]:
    """True = keep the instance; False = it holds a p-gram (min_period <= p <= max_period) repeated
    at least `max_count` times in a row."""
    if not 1 <= min_period <= max_period:
        raise ValueError(f"need 1 <= min_period <= max_period, got {min_period}, {max_period}")
    if max_count < 3:
        # find_periodic_sequences cannot see fewer than 3 repeats; below that the semantics differ.
        raise ValueError(f"max_count must be >= 3 (OLMo-core cannot detect fewer repeats), got {max_count}")
    tokens = np.asarray(tokens)
    batch, seq = tokens.shape
    keep = np.ones(batch, dtype=bool)
    for p in range(min_period, max_period + 1):
        need = (max_count - 1) * p  # matching positions needed in a row
        if need > seq - p:
            break  # longer periods need even more tokens
        eq = tokens[:, p:] == tokens[:, :-p]  # (batch, seq - p): x[i] == x[i - p] for i >= p
        # Number of matches in every window of `need` consecutive positions.
        csum = np.zeros((batch, eq.shape[1] + 1), dtype=np.int32)
        np.cumsum(eq, axis=1, out=csum[:, 1:])
        full = (csum[:, need:] - csum[:, :-need]) == need
        keep &= ~full.any(axis=1)
    return keep
