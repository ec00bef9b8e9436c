"""Repetition filter vs a plain-Python transcription of OLMo-core's row algorithm."""
import numpy as np
import pytest

from data.filters import MAX_COUNT, MAX_PERIOD, MIN_PERIOD, repetition_mask


def oracle_keep(x, max_period=13, min_period=1, max_count=32):
    """OLMo-core `find_periodic_sequences` + `_validate_instance`, written out with plain loops:
    rows of p tokens, padded with -1; a row 'repeats' when equal to the previous row (row 0 is
    compared with the last row, as np.roll does); each run of repeating rows is widened by the
    trailing matches of the row before and the leading matches of the row after."""
    x = [int(v) for v in x]
    n = len(x)
    for p in range(min_period, min(max_period, n // 3) + 1):
        padded = x + [-1] * (p - n % p)
        rows = [padded[r * p:(r + 1) * p] for r in range(len(padded) // p)]
        R = len(rows)
        eq = [[rows[r][c] == rows[r - 1][c] for c in range(p)] for r in range(R)]
        full = [all(e) for e in eq]
        r = 0
        while r < R:
            if not full[r]:
                r += 1
                continue
            start_row = r
            while r + 1 < R and full[r + 1]:
                r += 1
            end_row = r
            trailing = 0
            while trailing < p and eq[start_row - 1][p - 1 - trailing]:
                trailing += 1
            start_offset = trailing if 0 < trailing < p else 0
            leading = 0
            while leading < p and eq[end_row + 1][leading]:
                leading += 1
            start = (start_row - 1) * p - start_offset
            end = (end_row + 1) * p + leading
            times = (end - start) // p
            if times > 2 and times >= max_count:
                return False
            r += 1
    return True


def _check(rows):
    batch = np.stack(rows)
    got = repetition_mask(batch)
    want = np.array([oracle_keep(row) for row in rows])
    np.testing.assert_array_equal(got, want)
    return got


def _planted(rng, length, period, reps, at, vocab=100278):
    """Random tokens with `reps` copies of a random `period`-gram (plus partial copies) at `at`."""
    x = rng.integers(1000, vocab, size=length)
    gram = rng.integers(0, 1000, size=period)  # disjoint from the background: no accidental extension
    run = np.tile(gram, int(reps) + 2)[: int(round(reps * period))]
    x[at: at + len(run)] = run[: length - at]
    return x


def test_random_with_planted_runs_matches_oracle():
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(300):
        p = int(rng.integers(1, 16))
        reps = float(rng.choice([30, 31, 31.5, 32, 32.99, 33, 40]))
        length = 600
        at = int(rng.integers(0, length))
        rows.append(_planted(rng, length, p, reps, at))
    _check(rows)


def test_small_vocab_natural_repetition_matches_oracle():
    rng = np.random.default_rng(1)
    for vocab, length in ((2, 200), (3, 400), (1, 50), (2, 40)):
        rows = [rng.integers(0, vocab, size=length) for _ in range(40)]
        _check(rows)


@pytest.mark.parametrize("period", [1, 2, 7, 13])
def test_exact_threshold(period):
    rng = np.random.default_rng(period)
    L = 512
    mid = (L - 32 * period) // 2  # a 32-repeat run fits with random tokens on both sides
    cases = {
        "31 repeats, middle": (_planted(rng, L, period, 31, mid), True),
        "32 repeats, middle": (_planted(rng, L, period, 32, mid), False),
        "32 repeats minus one token": (_planted(rng, L, period, 32 - 1 / period, mid), True),
        "32 repeats at the start": (_planted(rng, L, period, 32, 0), False),
        "32 repeats ending at the last token": (_planted(rng, L, period, 32, L - 32 * period), False),
        "31 repeats ending at the last token": (_planted(rng, L, period, 31, L - 31 * period), True),
        "32 repeats cut by the instance end": (_planted(rng, L, period, 32, L - 32 * period + 1), True),
    }
    got = _check([x for x, _ in cases.values()])
    assert dict(zip(cases, got.tolist())) == {k: v for k, (_, v) in cases.items()}


def test_period_14_is_not_filtered_and_short_instances():
    rng = np.random.default_rng(3)
    gram14 = rng.permutation(1000)[:14]
    x = np.concatenate([np.tile(gram14, 40), rng.integers(1000, 5000, size=40)])
    assert _check([x]).tolist() == [True]
    # Instances shorter than 32 repeats can never be masked; OLMo-core caps p at len // 3.
    assert _check([np.zeros(31, dtype=np.int64)]).tolist() == [True]
    assert _check([np.zeros(32, dtype=np.int64)]).tolist() == [False]


def test_uint32_input_and_bad_config():
    x = np.zeros((2, 64), dtype=np.uint32)
    x[1] = np.arange(64)
    assert repetition_mask(x).tolist() == [False, True]
    with pytest.raises(ValueError, match="max_count"):
        repetition_mask(x, max_count=2)
    for lo, hi in ((0, 13), (5, 4)):   # a period of 0 tokens, an empty range
        with pytest.raises(ValueError, match="min_period"):
            repetition_mask(x, hi, lo)


def test_matches_olmo_core_validate_instance():
    """Against OLMo-core itself: `NumpyDatasetBase._validate_instance` with the default
    `InstanceFilterConfig(13, 1, 32)` (the unbound method never reads self), on uint32 instances of
    odd lengths with runs of every period 1..13 one token short of, at and past the threshold,
    at the start, the end and in the middle, plus small-vocabulary noise; then the generic
    `find_periodic_sequences` under other periods and counts."""
    torch = pytest.importorskip("torch")
    ds = pytest.importorskip("olmo_core.data.numpy_dataset")
    from olmo_core.data.utils import find_periodic_sequences
    cfg = ds.InstanceFilterConfig()
    assert (cfg.repetition_max_period, cfg.repetition_min_period,
            cfg.repetition_max_count) == (MAX_PERIOD, MIN_PERIOD, MAX_COUNT)
    rng = np.random.default_rng(7)
    rows = []
    for p in range(1, 14):
        for reps in (32 - 1 / p, 32, 32 + (p - 1) / p, 33):
            span = int(round(reps * p))
            for at in (0, 997 - span, int(rng.integers(0, 997 - span))):
                rows.append(_planted(rng, 997, p, reps, at, vocab=2**32 - 1))
    rows += [rng.integers(0, v, size=997) for v in (1, 2, 3, 4) for _ in range(10)]
    batch = np.stack(rows).astype(np.uint32)
    want = [ds.NumpyDatasetBase._validate_instance(None, torch.from_numpy(x.astype(np.int64)), cfg)
            for x in batch]
    np.testing.assert_array_equal(repetition_mask(batch), want)
    assert 0 < sum(want) < len(want)
    for _ in range(300):            # other configurations, short noisy instances
        x = rng.integers(0, int(rng.integers(1, 4)), size=int(rng.integers(1, 120)))
        lo = int(rng.integers(1, 6))
        hi, count = int(rng.integers(lo, 14)), int(rng.integers(3, 10))
        keep = all(m.times < count for m in find_periodic_sequences(x, hi, lo))
        assert repetition_mask(x[None], hi, lo, count).tolist() == [keep], (x.tolist(), lo, hi, count)
    for p in range(1, 14):   # a run one short of the count at the start, its gram again at the very end:
        for n in (32 * p + 40, 32 * p + 41, 32 * p + 39 + p):   # a comparison that wrapped around joined them
            x = rng.integers(1000, 50000, size=n)
            gram = rng.integers(0, 1000, size=p)
            x[:31 * p], x[n - p:] = np.tile(gram, 31), gram
            keep = all(m.times < MAX_COUNT for m in find_periodic_sequences(x, MAX_PERIOD, MIN_PERIOD))
            assert repetition_mask(x[None].astype(np.uint32)).tolist() == [keep], (p, n)
