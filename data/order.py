"""The global data order: which instances rank r reads at global batch s.

A pure function of (number of instances, global batch, seed, epoch, step, rank, number of
ranks); no iterator state, no worker state, so it cannot drift on resume or with more loader
workers (DESIGN §4, bugs 1-3). The global batch is a recipe constant: it is never derived from a
device count, and changing the number of ranks only changes who reads which row of a batch.

Follows OLMo-core `NumpyFSLDataLoader` (`data/data_loader.py`): the instance indices are
shuffled with `np.random.Generator(PCG64(seed + epoch))` (OLMo-core numbers epochs from 1, so our
0-based epoch e uses e + 1), the tail is truncated to whole global batches, and rank r of R takes
the strided slice `batch[r::R]`.

Not modelled: OLMo-core's `max_target_sequence_length` (the official stage 1-2 scripts pass 8192).
With `--seq_len` below it, OLMo-core counts instances per 8192-token block and shuffles whole
blocks (`chunk_size = 8192 // seq_len` consecutive instances stay together); here every instance
is shuffled alone. At the recipe's 8192 the two are the same order; only shorter research runs
differ from what OLMo-core would read.
"""
import functools
import threading

import numpy as np
from jaxtyping import Int64, UInt


def steps_per_epoch(num_instances: int, global_batch: int) -> int:
    """Number of whole global batches in one epoch (the tail of the permutation is dropped)."""
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    n = num_instances // global_batch
    if n == 0:
        raise ValueError(
            f"the dataset has {num_instances} instances, fewer than one global batch of {global_batch}; "
            "use more data, a shorter seq_len or a smaller global batch")
    return n


_PERMUTATION_LOCK = threading.Lock()


def _permutation(num_instances: int, seed: int, epoch: int) -> np.ndarray:
    # One at a time: the loader's threads ask for it together on their first batch, and stage 1's
    # (724M instances, 2.9 GB) would otherwise be built twice at once.
    with _PERMUTATION_LOCK:
        return _build_permutation(num_instances, seed, epoch)


def shuffled(num_instances: int, seed: int, epoch: int) -> UInt[np.ndarray, " n"]:
    """The epoch's permutation of instance indices, read-only, built anew on each call."""
    # OLMo-core `get_rng(seed + epoch)` with epoch counted from 1.
    rng = np.random.Generator(np.random.PCG64(seed + epoch + 1))
    dtype = np.uint32 if num_instances < 2**32 else np.uint64
    perm = np.arange(num_instances, dtype=dtype)
    rng.shuffle(perm)
    perm.setflags(write=False)
    return perm


_build_permutation = functools.lru_cache(maxsize=4)(shuffled)   # the training set's, kept


def batch_indices(
    num_instances: int,
    global_batch: int,
    seed: int,
    epoch: int,
    step: int,
    rank: int,
    num_ranks: int,
) -> Int64[np.ndarray, " local_batch"]:
    """Instance indices of rank `rank`'s rows of global batch `step` of epoch `epoch`.

    `step` counts batches within the epoch (0 <= step < steps_per_epoch); a global step number
    is accepted too when it falls inside `epoch`. Over one epoch and all ranks, every instance of
    the truncated permutation appears exactly once, for any `num_ranks` dividing `global_batch`.
    """
    if num_ranks < 1 or global_batch % num_ranks:
        raise ValueError(
            f"num_ranks={num_ranks} must divide global_batch={global_batch}: the global batch is a recipe "
            "constant, pick a rank count that divides it")
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank={rank} out of range for num_ranks={num_ranks}")
    if epoch < 0 or step < 0 or seed < 0:
        raise ValueError(f"seed, epoch and step must be >= 0, got seed={seed}, epoch={epoch}, step={step}")
    spe = steps_per_epoch(num_instances, global_batch)
    if step >= spe:
        if step // spe != epoch:
            raise ValueError(f"step {step} is outside epoch {epoch} ({spe} steps per epoch)")
        step -= epoch * spe
    perm = _permutation(num_instances, seed, epoch)
    batch = perm[step * global_batch : (step + 1) * global_batch]
    return batch[rank::num_ranks].astype(np.int64)
