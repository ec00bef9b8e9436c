"""Oracles shared by the tests: float64 references for what the model computes in float32, and
OLMo-core's own data loader walked batch by batch (imported when called: it needs ai2-olmo-core)."""
import numpy as np


def log_softmax64(x):
    """log softmax over the last axis, in float64 (the max subtracted first)."""
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def olmo_core_loader(dataset, *, global_batch: int, seed: int, num_ranks: int, rank: int, pad_id: int, work_dir):
    """OLMo-core's own data loader over its numpy `dataset` for one data-parallel rank, as its
    NumpyDataLoaderConfig builds one (the global batch given in instances, passed in tokens)."""
    import olmo_core.data as olmo_data
    from olmo_core.data.data_loader import NumpyDataLoaderBase
    return NumpyDataLoaderBase.wrap_numpy_dataset(
        dataset, global_batch_size=global_batch * dataset.sequence_length, work_dir=str(work_dir), seed=seed,
        collator=olmo_data.DataCollator(pad_token_id=pad_id), dp_world_size=num_ranks, dp_rank=rank, fs_local_rank=0)


def olmo_core_epochs(loader, epochs=(1, 2)):
    """(step, batch) for every batch OLMo-core's `loader` gives in `epochs`, each reshuffled with
    seed + epoch and its partial global batch dropped; steps counted from 0 across the epochs."""
    step = 0
    for epoch in epochs:
        loader.reshuffle(epoch=epoch)
        for batch in loader:
            yield step, batch
            step += 1
        loader.reset()
