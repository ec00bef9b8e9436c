"""Loader: order independent of worker count, exact resume, fingerprint guard, segment ids."""
import json

import numpy as np
import pytest

import data
from oracles import olmo_core_epochs, olmo_core_loader

SEQ, GB = 16, 8


@pytest.fixture
def ds(tmp_path):
    """Random instances (all distinct) with some eos tokens, over three files with leftovers."""
    rng = np.random.default_rng(0)
    paths = []
    for k, n in enumerate([11 * SEQ + 3, 9 * SEQ, 7 * SEQ + 9]):
        x = rng.integers(0, 50_000, size=n).astype(np.uint32)
        x[rng.random(n) < 0.05] = data.EOS_ID
        p = tmp_path / f"part-{k}.npy"
        x.tofile(p)
        paths.append(str(p))
    return data.FSLDataset(paths, SEQ)  # 27 instances -> 3 steps per epoch at GB=8


def _take(loader, n):
    out = [next(loader) for _ in range(n)]
    loader.close()
    return out


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_batch_layout_and_exactly_once_per_epoch(ds):
    by_bytes = {ds[i].tobytes(): i for i in range(len(ds))}
    assert len(by_bytes) == len(ds)
    spe = len(ds) // GB
    for num_ranks in (1, 2, 4):
        loaders = [data.Loader(ds, GB, seed=5, rank=r, num_ranks=num_ranks, workers=2) for r in range(num_ranks)]
        batches = [_take(l, 3 * spe) for l in loaders]
        for epoch in range(3):
            seen = []
            for s in range(epoch * spe, (epoch + 1) * spe):
                for r in range(num_ranks):
                    b = batches[r][s]
                    assert b["step"] == s
                    assert b["tokens"].dtype == np.int32 and b["tokens"].shape == (GB // num_ranks, SEQ)
                    assert b["instance_mask"].dtype == bool and b["instance_mask"].all()
                    assert b["segment_ids"].dtype == np.int32 and b["segment_ids"].shape == b["tokens"].shape
                    seen += [by_bytes[row.astype(np.uint32).tobytes()] for row in b["tokens"]]
                    # each epoch its own permutation (data.order), not epoch 0's again
                    assert seen[-len(b["tokens"]):] == data.batch_indices(len(ds), GB, 5, epoch, s - epoch * spe, r,
                                                                          num_ranks).tolist()
            assert len(seen) == len(set(seen)) == spe * GB  # each instance at most once, whole batches only


def test_same_batches_with_1_and_8_workers(ds):
    n = 10  # crosses three epoch boundaries
    ref = [data.get_batch(ds, GB, 3, s, 1, 2, repetition_filter=True) for s in range(n)]
    for workers, prefetch in ((0, 1), (1, 1), (8, 3), (8, 16)):
        got = _take(data.Loader(ds, GB, 3, rank=1, num_ranks=2, workers=workers, prefetch=prefetch,
                                repetition_filter=True), n)
        for a, b in zip(got, ref):
            _same(a, b)


def test_rank_shares_are_strided_rows_of_the_global_batch(ds):
    full = data.get_batch(ds, GB, 9, 4, 0, 1)
    for r in range(4):
        part = data.get_batch(ds, GB, 9, 4, r, 4)
        np.testing.assert_array_equal(part["tokens"], full["tokens"][r::4])


def test_state_restore_mid_epoch_gives_the_uninterrupted_batches(ds):
    uninterrupted = _take(data.Loader(ds, GB, 11, workers=2), 8)
    loader = data.Loader(ds, GB, 11, workers=3, prefetch=5)
    for _ in range(4):  # stop mid-epoch 1 (3 steps per epoch) with batches still prefetched
        next(loader)
    state = json.loads(json.dumps(loader.state()))
    loader.close()
    assert state["step"] == 4 and state["epoch"] == 1 and state["seed"] == 11
    assert state["global_batch"] == GB and state["seq_len"] == SEQ and state["fingerprint"] == ds.fingerprint
    resumed = _take(data.Loader.from_state(ds, state, workers=1), 4)
    for a, b in zip(resumed, uninterrupted[4:]):
        _same(a, b)


def test_fingerprint_mismatch_fails_loudly(ds, tmp_path):
    state = data.Loader(ds, GB, 1).state()
    other_path = tmp_path / "other.npy"
    np.arange(40 * SEQ, dtype=np.uint32).tofile(other_path)
    other = data.FSLDataset([str(other_path)], SEQ)
    with pytest.raises(ValueError, match="fingerprint.*the token files changed.*train.py --allow_data_change"):
        data.Loader.from_state(other, state)
    # A checkpoint of a packed run, resumed without --packed: the flag is named, not the files.
    with pytest.raises(ValueError, match="the checkpoint's run packed documents .--packed.*Add --packed"):
        data.Loader.from_state(other, {**state, "packing": "0" * 64})
    loader = data.Loader.from_state(other, state, allow_fingerprint_mismatch=True, workers=0)
    assert next(loader)["step"] == 0
    with pytest.raises(ValueError, match="seq_len"):
        data.Loader.from_state(data.FSLDataset(ds.paths, SEQ // 2), state)


def test_contents_mismatch_fails_loudly(ds):
    """Same files, names and sizes, other tokens (a prepared corpus edited and rebuilt): the
    contents digest the run recorded tells them apart where the fingerprint cannot."""
    a, b = "a" * 64, "b" * 64
    state = data.Loader(ds, GB, 1, contents=a).state()
    assert state["contents"] == a and state["fingerprint"] == ds.fingerprint
    with pytest.raises(ValueError, match="the token files' contents differ from the checkpoint's"):
        data.Loader.from_state(ds, state, contents=b)
    assert data.Loader.from_state(ds, state, contents=a).state() == state
    older = {k: v for k, v in state.items() if k != "contents"}   # a checkpoint from before the digest
    assert data.Loader.from_state(ds, older, contents=b).state()["contents"] == b
    assert "contents" not in data.Loader.from_state(ds, state).state()   # not known now: not claimed
    assert data.Loader.from_state(ds, state, contents=b, allow_fingerprint_mismatch=True).state()["contents"] == b


def test_segment_ids_oracle():
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 5, size=(6, 40)).astype(np.uint32)
    tokens[tokens == 0] = data.EOS_ID
    got = data.segment_ids(tokens, data.EOS_ID)
    for row, seg in zip(tokens, got):
        doc, want = 0, []
        for t in row:
            want.append(doc)
            if t == data.EOS_ID:  # the eos belongs to the document it ends
                doc += 1
        assert seg.tolist() == want


def test_repetition_filter_masks_only_repetitive_instances(tmp_path):
    rng = np.random.default_rng(4)
    seq = 128
    x = rng.integers(1000, 50_000, size=(16, seq)).astype(np.uint32)
    x[3, 10:10 + 64] = 7  # 64 repeats of a 1-gram
    x[9, 0:2 * 40] = np.tile([5, 6], 40)  # 40 repeats of a 2-gram
    p = tmp_path / "rep.npy"
    x.tofile(p)
    ds = data.FSLDataset([str(p)], seq)
    b = data.get_batch(ds, 16, 0, 0, repetition_filter=True)
    masked = {int(np.flatnonzero(np.all(x == row.astype(np.uint32), axis=1))[0])
              for row, m in zip(b["tokens"], b["instance_mask"]) if not m}
    assert masked == {3, 9}
    assert data.get_batch(ds, 16, 0, 0)["instance_mask"].all()  # default off


def test_bad_loader_arguments(ds):
    with pytest.raises(ValueError, match="must divide"):
        data.Loader(ds, GB, 0, rank=0, num_ranks=3)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        data.Loader(ds, 64, 0)
    with pytest.raises(ValueError, match="not a data.Loader.state"):
        data.Loader.from_state(ds, {"step": 3})


def test_resume_keeps_the_repetition_filter(tmp_path):
    """from_state with repetition_filter=True masks the repetitive instances as the run did
    (DESIGN §4 filter); the state does not carry the flag, so the caller's value must reach it."""
    rng = np.random.default_rng(4)
    seq = 128
    x = rng.integers(1000, 50_000, size=(16, seq)).astype(np.uint32)
    x[5, 0:40] = 7                                    # 40 repeats of a 1-gram
    p = tmp_path / "rep.npy"
    x.tofile(p)
    ds = data.FSLDataset([str(p)], seq)
    loader = data.Loader(ds, 16, 0, workers=0, repetition_filter=True)
    next(loader)
    resumed = data.Loader.from_state(ds, loader.state(), workers=0, repetition_filter=True)
    b = next(resumed)
    assert b["step"] == 1 and b["instance_mask"].sum() == 15
    row = int(np.flatnonzero(~b["instance_mask"])[0])
    np.testing.assert_array_equal(b["tokens"][row].astype(np.uint32), x[5])


def test_held_out_windows_in_olmo_core_first_epoch_order_with_masked_filler(tmp_path):
    """get_eval_batch on fixed-length windows: positions of OLMo-core's seed-0, first-epoch
    permutation (PCG64(0 + 1), as test_data_order's reference), read straight from the file; rows
    past the last window are padding whose labels are all masked, every real window's all kept."""
    n, seq, rows = 5, 8, 4
    x = np.random.default_rng(1).integers(1, 1000, size=n * seq + 3).astype(np.uint32)
    p = tmp_path / "val.npy"
    x.tofile(p)
    ds = data.FSLDataset([str(p)], seq)
    windows = x[:n * seq].reshape(n, seq)
    perm = np.arange(n, dtype=np.uint32)
    np.random.Generator(np.random.PCG64(1)).shuffle(perm)
    got = [data.get_eval_batch(ds, rows, b) for b in (0, 1)]
    toks = np.concatenate([g["tokens"] for g in got]).astype(np.uint32)
    lm = np.concatenate([g["label_mask"] for g in got])
    np.testing.assert_array_equal(toks[:n], windows[perm])
    assert (toks[n:] == data.PAD_ID).all()
    assert lm.shape == (2 * rows, seq) and lm[:n].all() and not lm[n:].any()
    assert [data.eval_batch_instances(n, rows, b) for b in (0, 1, 2)] == [4, 1, 0]


def test_state_names_the_epoch_of_the_next_step(ds):
    """state()["epoch"]: the epoch the next step draws from (3 steps per epoch at GB=8)."""
    spe = data.steps_per_epoch(len(ds), GB)
    assert spe == 3
    got = [data.Loader(ds, GB, 0, start_step=s, workers=0).state()["epoch"] for s in (0, spe - 1, spe, 2 * spe)]
    assert got == [0, 0, 1, 2]


def test_held_out_rank_rows_are_strided(ds):
    """get_eval_batch's rank r takes rows r, r + R, ... of the batch, as training batches deal
    theirs (get_batch, OLMo-core's loader); a padded last batch's filler rows too."""
    for batch in (0, 3):   # batch 3 of 8 rows: instances 24-26, then filler
        full = data.get_eval_batch(ds, 8, batch)
        for R in (2, 4):
            for r in range(R):
                mine = data.get_eval_batch(ds, 8, batch, r, R)
                for k in full:
                    np.testing.assert_array_equal(mine[k], full[k][r::R], err_msg=f"{k} rank {r} of {R}")


@pytest.mark.parametrize("num_ranks", [1, 3])
def test_fixed_length_order_equals_olmo_core_data_loader(ds, tmp_path, num_ranks):
    """Pretraining's data order against OLMo-core's own loader over its NumpyFSLDataset on the
    same files: every rank's rows of every batch of epochs 1 and 2 (27 windows, 4 steps of 6
    per epoch, the 3 left over dropped; the data loader reshuffles with seed + epoch)."""
    olmo_data = pytest.importorskip("olmo_core.data", reason="needs ai2-olmo-core and its imports (test extras)")
    gb, seed = 6, 34521   # 6: divisible by 3 ranks; 27 windows -> 4 steps, 3 left over
    tok = olmo_data.TokenizerConfig(vocab_size=data.VOCAB_SIZE, eos_token_id=data.EOS_ID, pad_token_id=data.PAD_ID)
    theirs = olmo_data.NumpyFSLDatasetConfig(tokenizer=tok, paths=list(ds.paths), sequence_length=SEQ,
                                             dtype=olmo_data.NumpyDatasetDType.uint32,
                                             work_dir=str(tmp_path / "work")).build()
    theirs.prepare()
    spe = data.steps_per_epoch(len(ds), gb)
    assert (len(ds), len(theirs), spe) == (27, 27, 4)
    for r in range(num_ranks):
        dl = olmo_core_loader(theirs, global_batch=gb, seed=seed, num_ranks=num_ranks, rank=r,
                              pad_id=data.PAD_ID, work_dir=tmp_path / f"dl{r}")
        for step, b in olmo_core_epochs(dl):
            np.testing.assert_array_equal(data.get_batch(ds, gb, seed, step, r, num_ranks)["tokens"],
                                          b["input_ids"].numpy(), err_msg=f"step {step} rank {r}")
        assert step == 2 * spe - 1
