"""Global order: every instance exactly once per epoch, for any rank count (DESIGN §4, bug 1)."""
import numpy as np
import pytest

import data


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 8, 32])
def test_exactly_once_per_epoch(num_ranks):
    n, gb, seed = 10_007, 96, 34521  # 96 is divisible by 1, 2, 3, 8, 32; n is not a multiple of 96
    spe = n // gb
    for epoch in (0, 1):
        seen = np.zeros(n, dtype=np.int64)
        for step in range(spe):
            rows = [data.batch_indices(n, gb, seed, epoch, step, r, num_ranks) for r in range(num_ranks)]
            assert all(len(r) == gb // num_ranks for r in rows)
            np.add.at(seen, np.concatenate(rows), 1)
        # The seen-count histogram: exactly spe * gb instances once, the truncated tail never.
        assert np.bincount(seen).tolist() == [n - spe * gb, spe * gb]


def test_rank_rows_partition_the_global_batch_in_olmo_core_order():
    n, gb, seed = 1000, 64, 7
    for step in (0, 5, 14):
        full = data.batch_indices(n, gb, seed, 0, step, 0, 1)
        # Independent reference: OLMo-core shuffles arange(n) with PCG64(seed + epoch), epochs from 1.
        perm = np.arange(n, dtype=np.uint32)
        np.random.Generator(np.random.PCG64(seed + 1)).shuffle(perm)
        np.testing.assert_array_equal(full, perm[step * gb:(step + 1) * gb])
        for num_ranks in (2, 4, 8):
            for r in range(num_ranks):  # OLMo-core's strided slice batch[r::R]
                np.testing.assert_array_equal(data.batch_indices(n, gb, seed, 0, step, r, num_ranks), full[r::num_ranks])


def test_epochs_and_seeds_differ_and_function_is_pure():
    n, gb = 500, 50
    a = data.batch_indices(n, gb, 1, 0, 3, 0, 1)
    assert not np.array_equal(a, data.batch_indices(n, gb, 1, 1, 3, 0, 1))
    assert not np.array_equal(a, data.batch_indices(n, gb, 2, 0, 3, 0, 1))
    np.testing.assert_array_equal(a, data.batch_indices(n, gb, 1, 0, 3, 0, 1))
    # A global step inside the given epoch means the same batch.
    spe = n // gb
    np.testing.assert_array_equal(data.batch_indices(n, gb, 1, 1, 3, 0, 1), data.batch_indices(n, gb, 1, 1, spe + 3, 0, 1))


def test_a_global_step_on_an_epoch_boundary_is_that_epochs_first_batch():
    """Global step spe * e opens epoch e: OLMo-core's permutation PCG64(seed + e + 1), batch 0 (not
    the truncated tail of the permutation, which is what step spe of it would be)."""
    n, gb, seed = 1000, 64, 7   # 15 steps per epoch, a tail of 40 instances
    spe = n // gb
    for epoch in (1, 2):
        perm = np.arange(n, dtype=np.uint32)
        np.random.Generator(np.random.PCG64(seed + epoch + 1)).shuffle(perm)
        for step in (0, spe - 1):
            want = perm[step * gb:(step + 1) * gb]
            np.testing.assert_array_equal(data.batch_indices(n, gb, seed, epoch, epoch * spe + step, 0, 1), want)
            np.testing.assert_array_equal(data.batch_indices(n, gb, seed, epoch, epoch * spe + step, 1, 4), want[1::4])


def test_bad_arguments():
    with pytest.raises(ValueError, match="must divide global_batch"):
        data.batch_indices(1000, 96, 0, 0, 0, 0, 5)
    with pytest.raises(ValueError, match="rank=4 out of range"):
        data.batch_indices(1000, 96, 0, 0, 0, 4, 4)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        data.batch_indices(10, 96, 0, 0, 0, 0, 1)
    with pytest.raises(ValueError, match="must be >= 0"):   # seed -1, epoch 1 would alias seed 0, epoch 0
        data.batch_indices(1000, 100, -1, 0, 0, 0, 1)
    with pytest.raises(ValueError, match="outside epoch"):
        data.batch_indices(1000, 100, 0, 0, 25, 0, 1)
