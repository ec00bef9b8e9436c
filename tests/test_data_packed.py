"""Packed and padded instances equal OLMo-core's, instance for instance.

The reference is OLMo-core itself: `NumpyPackedFSLDatasetConfig` / `NumpyPaddedFSLDatasetConfig`
from the installed `ai2-olmo-core` package (built as its stage-3 script builds them) on the same
token files. Compared per instance: token ids, label masks, document lengths. The files hold
documents longer than seq_len, empty documents (an eos alone), runs of eos, a tail without eos,
and random per-token label masks; several data seeds, sequence lengths, group sizes and
permutation seeds.
"""
import os

import numpy as np
import pytest

import data
from data import packing
from data.packed import PackedFSLDataset, batch_fields, label_mask_path
from data.padded import PaddedFSLDataset
from oracles import olmo_core_epochs, olmo_core_loader

olmo_data = pytest.importorskip("olmo_core.data", reason="needs ai2-olmo-core and its imports (setup.cfg test extras)")

EOS, PAD, VOCAB = data.EOS_ID, data.PAD_ID, data.VOCAB_SIZE


def write_files(d, seed, n_files=5, max_len=300):
    """Token files of random documents (lengths 1..max_len, some eos-only, some back to back)
    and matching one-byte label-mask files; the last file ends without an eos."""
    rng = np.random.default_rng(seed)
    paths, masks = [], []
    for f in range(n_files):
        docs = []
        for _ in range(rng.integers(5, 40)):
            n = int(rng.choice([1, 1, 2, rng.integers(1, max_len), rng.integers(1, 40)]))
            docs.append(np.append(rng.integers(0, 1000, n - 1), EOS))  # n tokens, eos last
        ids = np.concatenate(docs).astype(np.uint32)
        if f == n_files - 1:
            ids = np.append(ids, rng.integers(0, 1000, 7)).astype(np.uint32)  # tail: no document
        ids[rng.random(len(ids)) < 0.01] = PAD  # pad ids inside documents are ordinary tokens
        paths.append(str(d / f"token_ids_part_{f:04d}.npy"))
        masks.append(str(d / f"labels_mask_part_{f:04d}.npy"))
        ids.tofile(paths[-1])
        (rng.random(len(ids)) < 0.7).tofile(masks[-1])
    return paths, masks


def tokenizer():
    return olmo_data.TokenizerConfig(vocab_size=VOCAB, eos_token_id=EOS, pad_token_id=PAD)


def assert_same(ours, theirs):
    assert len(ours) == len(theirs)
    for i in range(len(theirs)):
        a, b = ours[i], theirs[i]
        np.testing.assert_array_equal(a["tokens"], b["input_ids"].numpy(), err_msg=f"instance {i}")
        np.testing.assert_array_equal(a["label_mask"], b["label_mask"].numpy(), err_msg=f"instance {i}")
        if "doc_lens" in b:
            np.testing.assert_array_equal(a["doc_lens"], b["doc_lens"].numpy(), err_msg=f"instance {i}")
        assert a["tokens"].dtype == np.uint32 and len(a["tokens"]) == ours.seq_len


@pytest.mark.parametrize("seed,seq_len,group,perm,masks", [
    (0, 64, 1, None, False),
    (1, 128, 2, 123, True),
    (2, 256, 8, 123, False),   # stage 3's group size and permutation seed (long-context script)
    (3, 64, 3, 7, True),
    (4, 64, 2, 0, False),      # seed 0 permutes too (OLMo-core tests `is not None`, not truth)
])
def test_packed_equals_olmo_core(tmp_path, monkeypatch, seed, seq_len, group, perm, masks):
    monkeypatch.setenv("OLMO_DATA_PREP_WORKERS", "1")
    paths, mask_paths = write_files(tmp_path, seed)
    lm = mask_paths if masks else None
    theirs = olmo_data.NumpyPackedFSLDatasetConfig(
        tokenizer=tokenizer(), paths=paths, sequence_length=seq_len, generate_doc_lengths=True,
        source_group_size=group, source_permutation_seed=perm, label_mask_paths=lm,
        dtype=olmo_data.NumpyDatasetDType.uint32, work_dir=str(tmp_path / "work")).build()
    theirs.prepare()
    ours = PackedFSLDataset(paths, seq_len, source_group_size=group, source_permutation_seed=perm,
                            label_mask_paths=lm)
    assert len(ours) > 10
    assert_same(ours, theirs)
    # Same answer from the on-disk cache of the packing.
    cached = PackedFSLDataset(paths, seq_len, source_group_size=group, source_permutation_seed=perm,
                              label_mask_paths=lm, cache_dir=tmp_path / "cache")
    again = PackedFSLDataset(paths, seq_len, source_group_size=group, source_permutation_seed=perm,
                             label_mask_paths=lm, cache_dir=tmp_path / "cache")
    assert len(os.listdir(tmp_path / "cache")) == len(ours._groups)
    for i in range(len(ours)):
        for other in (cached, again):
            np.testing.assert_array_equal(ours[i]["tokens"], other[i]["tokens"])
    assert ours.fingerprint == again.fingerprint


@pytest.mark.parametrize("seed,seq_len,masks", [(0, 64, False), (1, 128, True), (4, 32, True)])
def test_padded_equals_olmo_core(tmp_path, monkeypatch, seed, seq_len, masks):
    monkeypatch.setenv("OLMO_DATA_PREP_WORKERS", "1")
    paths, mask_paths = write_files(tmp_path, seed)
    lm = mask_paths if masks else None
    theirs = olmo_data.NumpyPaddedFSLDatasetConfig(
        tokenizer=tokenizer(), paths=paths, sequence_length=seq_len, label_mask_paths=lm,
        dtype=olmo_data.NumpyDatasetDType.uint32, work_dir=str(tmp_path / "work")).build()
    theirs.prepare()
    ours = PaddedFSLDataset(paths, seq_len, label_mask_paths=lm)
    assert_same(ours, theirs)
    # Every instance is one document: its length is the first doc_len, padding never in the mask.
    for i in range(len(ours)):
        x = ours[i]
        assert not x["label_mask"][x["doc_lens"][0]:].any()


def test_padded_file_without_eos_is_refused_as_olmo_core(tmp_path, monkeypatch):
    """A held-out file with tokens but no eos holds no document: OLMo-core's padded dataset stops
    (`segment_documents_into_instances`: "Failed to produce any documents"); ours dropped the whole
    file and scored the others. An empty file (a converter's last part) still holds no token."""
    monkeypatch.setenv("OLMO_DATA_PREP_WORKERS", "1")
    docs, no_eos = str(tmp_path / "token_ids_0.npy"), str(tmp_path / "token_ids_1.npy")
    np.array([5, EOS, 6, 7, EOS], np.uint32).tofile(docs)
    np.array([5, 6, 7, PAD, 8], np.uint32).tofile(no_eos)
    with pytest.raises(RuntimeError, match="Failed to produce any documents"):
        olmo_data.NumpyPaddedFSLDatasetConfig(
            tokenizer=tokenizer(), paths=[docs, no_eos], sequence_length=8,
            dtype=olmo_data.NumpyDatasetDType.uint32, work_dir=str(tmp_path / "work")).build().prepare()
    with pytest.raises(ValueError, match="token_ids_1.npy.*no eos"):
        PaddedFSLDataset([docs, no_eos], 8)
    (tmp_path / "token_ids_2.npy").write_bytes(b"")
    assert len(PaddedFSLDataset([docs, str(tmp_path / "token_ids_2.npy")], 8)) == 2


def test_padded_repetition_filter_reads_the_document_as_olmo_core(tmp_path, monkeypatch):
    """OLMo-core's padded dataset filters each document before padding it; ours filtered the
    padded row, whose run of pad ids (a document 32+ tokens short of seq_len) read as a repetition."""
    from olmo_core.data.numpy_dataset import InstanceFilterConfig
    monkeypatch.setenv("OLMO_DATA_PREP_WORKERS", "1")
    rng = np.random.default_rng(0)
    docs = [rng.integers(10, 50000, n) for n in (20, 100, 60)]
    docs[2][:40] = 7   # a repetition of its own: filtered by both
    path = str(tmp_path / "token_ids_0.npy")
    np.concatenate([np.append(d, EOS) for d in docs]).astype(np.uint32).tofile(path)
    theirs = olmo_data.NumpyPaddedFSLDatasetConfig(
        tokenizer=tokenizer(), paths=[path], sequence_length=128, dtype=olmo_data.NumpyDatasetDType.uint32,
        work_dir=str(tmp_path / "work"), instance_filter_config=InstanceFilterConfig()).build()
    theirs.prepare()
    want = [bool(theirs[i]["instance_mask"]) for i in range(len(theirs))]
    assert want == [True, True, False]
    ours = PaddedFSLDataset([path], 128)
    assert data.loader._rows(ours, [ours[i] for i in range(3)], repetition_filter=True)["instance_mask"].tolist() == want


def test_padded_and_packed_honour_another_tokenizers_ids_as_olmo_core(tmp_path, monkeypatch):
    """eos, pad and the vocabulary of another tokenizer (every other test uses dolma2's): the same
    instances as OLMo-core given those ids, and an id past that vocabulary refused."""
    monkeypatch.setenv("OLMO_DATA_PREP_WORKERS", "1")
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 50, 400).astype(np.uint32)
    ids[rng.random(400) < 0.1] = 9
    ids = np.append(ids, 9).astype(np.uint32)
    path = str(tmp_path / "token_ids_0.npy")
    ids.tofile(path)
    other = olmo_data.TokenizerConfig(vocab_size=50, eos_token_id=9, pad_token_id=3)
    for ours, config in ((PaddedFSLDataset, olmo_data.NumpyPaddedFSLDatasetConfig),
                         (PackedFSLDataset, olmo_data.NumpyPackedFSLDatasetConfig)):
        theirs = config(tokenizer=other, paths=[path], sequence_length=16, dtype=olmo_data.NumpyDatasetDType.uint32,
                        work_dir=str(tmp_path / f"work_{ours.kind}")).build()
        theirs.prepare()
        assert_same(ours([path], 16, vocab_size=50, eos_id=9, pad_id=3), theirs)
        with pytest.raises(ValueError, match="token id 49 >= vocab size 49"):
            ours([path], 16, vocab_size=49, eos_id=9, pad_id=3)
    ds = PaddedFSLDataset([path], 16, vocab_size=50, eos_id=9, pad_id=3)
    tails = [ds[i]["tokens"][ds[i]["doc_lens"][0]:] for i in range(len(ds))]
    assert sum(map(len, tails)) and all((t == 3).all() for t in tails)   # padded with 3


def test_segment_ids_and_doc_lengths(tmp_path):
    paths, _ = write_files(tmp_path, 5)
    ds = PackedFSLDataset(paths, 64)
    b = batch_fields([ds[i] for i in range(4)])
    for row in range(4):
        lens = ds[row]["doc_lens"]
        assert lens.sum() == 64
        assert (np.diff(b["segment_ids"][row]) >= 0).all() and b["segment_ids"][row][-1] == len(lens) - 1
    # OLMo-core's doc lengths from eos positions agree on these files (every document ends in eos).
    for i in range(len(ds)):
        np.testing.assert_array_equal(ds[i]["doc_lens"], packing.document_lengths(ds[i]["tokens"], EOS))


def test_document_boundaries_fuzz_equal_olmo_core(tmp_path, monkeypatch):
    """Random token runs over 5 symbols with a frequent eos (none, all eos, eos first or last,
    runs of eos, pad inside): where attention may look is what OLMo-core derives. Fixed-length
    instances (--doc_lengths): our segment ids against its `get_document_lengths` per instance,
    collated (`DataCollator` pads them with 0) into the `cu_doc_lens` its model attends with.
    Document spans of a file, truncated to seq_len, against `iter_document_indices_with_max_sequence_length`.
    Packed instances with pad == eos: one "document" per padding token, as its rescan gives."""
    import torch
    from olmo_core.data.collator import DataCollator
    from olmo_core.data.utils import (get_cumulative_document_lengths, get_document_lengths,
                                      iter_document_indices_with_max_sequence_length)
    from data import storage
    monkeypatch.setenv("OLMO_DATA_PREP_WORKERS", "1")
    rng = np.random.default_rng(0)

    def tokens(n):
        x = rng.integers(1, 6, n).astype(np.uint32)
        x[rng.random(n) < rng.choice([0.0, 0.1, 0.3, 0.7, 1.0])] = EOS
        x[rng.random(n) < 0.1] = PAD
        return x

    collate = DataCollator(pad_token_id=PAD)
    for _ in range(1000):
        B, T = int(rng.integers(1, 5)), int(rng.integers(1, 24))
        rows = np.stack([tokens(T) for _ in range(B)])
        ours = data.segment_ids(rows, EOS)
        for r in rows:
            assert packing.document_lengths(r, EOS).tolist() == get_document_lengths(r, EOS).tolist(), r
        batch = collate([{"input_ids": torch.tensor(r.astype(np.int64)), "doc_lens": get_document_lengths(r, EOS)}
                         for r in rows])
        cu = get_cumulative_document_lengths(batch["doc_lens"]).numpy()
        theirs = np.searchsorted(cu, np.arange(B * T), side="right") - 1   # document of each token, batch flattened
        first = np.concatenate([[0], np.cumsum(ours.max(axis=1) + 1)[:-1]])   # our rows' first document there
        assert (ours + first[:, None]).ravel().tolist() == theirs.tolist(), rows
    for c in range(300):   # a file read in one piece, then in pieces of 1, 3 and 7 tokens (a multi-GB file's reads)
        path = str(tmp_path / f"span_{c}.npy")
        tokens(int(rng.integers(1, 40))).tofile(path)
        seq_len = int(rng.integers(1, 12))
        monkeypatch.setattr(packing, "SCAN_TOKENS", [1 << 26, 1, 3, 7][c % 4])
        want = iter_document_indices_with_max_sequence_length(path, seq_len, eos_token_id=EOS, dtype=np.uint32)
        ours = packing.document_spans(storage.open_token_files([path])[0], EOS, seq_len, VOCAB)
        assert ours.tolist() == [list(s) for s in want], (np.fromfile(path, np.uint32), packing.SCAN_TOKENS)
    x = np.array([1, EOS] * 5, np.uint32)
    x[9] = VOCAB   # the first id past the vocabulary, in the third piece of 4
    x.tofile(tmp_path / "past.npy")
    with pytest.raises(ValueError, match=f"token 9: token id {VOCAB} >= vocab size {VOCAB}"):
        packing.document_spans(storage.open_token_files([str(tmp_path / "past.npy")])[0], EOS, 5, VOCAB)
    monkeypatch.setattr(packing, "SCAN_TOKENS", 1 << 26)
    paths = [str(tmp_path / f"token_ids_{f}.npy") for f in range(3)]
    for p in paths:
        np.concatenate([tokens(int(rng.integers(1, 60))), [EOS]]).astype(np.uint32).tofile(p)
    for seq_len in (4, 16):
        theirs = olmo_data.NumpyPackedFSLDatasetConfig(
            tokenizer=olmo_data.TokenizerConfig(vocab_size=VOCAB, eos_token_id=EOS, pad_token_id=EOS), paths=paths,
            sequence_length=seq_len, generate_doc_lengths=True, source_group_size=2,
            dtype=olmo_data.NumpyDatasetDType.uint32, work_dir=str(tmp_path / f"work{seq_len}")).build()
        theirs.prepare()
        assert_same(PackedFSLDataset(paths, seq_len, source_group_size=2, pad_id=EOS), theirs)


def test_pack_is_best_fit_decreasing():
    """A hand-checked case: 5, 4, 3, 3, 2, 1 into 8: [5, 3], [4, 3, 1], [2]."""
    order, inst = packing.pack(np.array([3, 5, 1, 4, 3, 2]), 8)
    lens = np.array([3, 5, 1, 4, 3, 2])[order]
    assert sorted(sorted(lens[k] for k in b) for b in inst) == [[1, 3, 4], [2], [3, 5]]
    for bad in ([0, 3], [5, 9]):   # an empty document opened an empty instance; a long one overfilled one
        with pytest.raises(ValueError, match=r"document lengths must be in 1\.\.8"):
            packing.pack(np.array(bad), 8)


def test_bad_inputs(tmp_path):
    paths, masks = write_files(tmp_path, 6)
    assert [label_mask_path(p) for p in paths] == masks  # train.py --label_masks: open-instruct's names
    with pytest.raises(ValueError, match="token_ids_"):
        label_mask_path(str(tmp_path / "train-00000.npy"))
    with pytest.raises(ValueError, match="label-mask files"):
        PackedFSLDataset(paths, 64, label_mask_paths=masks[:2])
    with pytest.raises(FileNotFoundError, match="labels_mask"):
        PackedFSLDataset(paths, 64, label_mask_paths=[str(tmp_path / "nope.npy")] * len(paths))
    n = os.path.getsize(paths[0]) // 4
    for wrong in (3, n + 1):   # shorter or longer than its token file: not the mask written with it
        np.ones(wrong, np.bool_).tofile(masks[0])
        with pytest.raises(ValueError, match="written together"):
            PackedFSLDataset(paths, 64, label_mask_paths=masks)
    no_eos = tmp_path / "no_eos.npy"
    np.arange(100, dtype=np.uint32).tofile(no_eos)
    with pytest.raises(ValueError, match="no document"):
        PackedFSLDataset([str(no_eos)], 64)


def test_files_that_cannot_train_are_refused_before_the_run(tmp_path, monkeypatch):
    """What the packing scan reads anyway decides it before the first step; each was found only
    when its instance was drawn (a token past the vocabulary: mid-run, exit 2 and the run lost),
    or never (masks of all 0: every step's loss 0.0, exit 0)."""
    paths, masks = write_files(tmp_path, 7, n_files=2)
    ids = np.fromfile(paths[1], np.uint32)
    ids[5] = VOCAB + 3
    ids.tofile(paths[1])
    for kind in (PackedFSLDataset, PaddedFSLDataset):
        with pytest.raises(ValueError, match=f"token file '{paths[1]}', token 5: token id {VOCAB + 3} >= vocab size "
                                             f"{VOCAB}; the file was written with another tokenizer"):
            kind(paths, 64)
    np.save(paths[1], ids[ids < VOCAB])   # np.save: a header the uint32 reader takes for tokens
    with pytest.raises(ValueError, match=r"token 0: .* the file starts with a \.npy header \(np\.save\); token files "
                                         r"are headerless uint32"):
        PackedFSLDataset(paths, 64)
    np.save(tmp_path / "fixed.npy", np.full(256, 7, np.uint32))   # fixed-length instances: when read
    with pytest.raises(ValueError, match=r"instance 0: token id \d+ >= vocab size .* a \.npy header"):
        data.FSLDataset([str(tmp_path / "fixed.npy")], 64)[0]
    # int64 ids (np.array(ids).tofile): every other uint32 a 0; they trained, silently.
    np.fromfile(paths[0], np.uint32).astype(np.int64).tofile(paths[1])
    with pytest.raises(ValueError, match=f"token file '{paths[1]}': every other uint32 is 0, as in a file of 64-bit"):
        PackedFSLDataset(paths, 64)
    np.arange(1, 257, dtype=np.int64).tofile(tmp_path / "wide.npy")
    with pytest.raises(ValueError, match="instance 1: every other uint32 is 0"):
        data.FSLDataset([str(tmp_path / "wide.npy")], 64)[1]
    paths, masks = write_files(tmp_path, 8, n_files=2)
    monkeypatch.setattr(data.packed, "MASK_SCAN", 64)   # the scan reads on past chunks of 0s
    only_last = np.zeros(os.path.getsize(masks[1]), np.bool_)
    only_last[-1] = True
    only_last.tofile(masks[1])
    assert len(PackedFSLDataset(paths, 64, label_mask_paths=masks))
    np.zeros(os.path.getsize(masks[1]), np.bool_).tofile(masks[1])
    with pytest.raises(ValueError, match=f"label-mask file '{masks[1]}' marks no token for the loss"):
        PackedFSLDataset(paths, 64, label_mask_paths=masks)


# --- the loader over packed instances: same guarantees as over fixed-length ones ---------------

@pytest.mark.parametrize("num_ranks", [1, 2, 4])
def test_packed_exactly_once_per_epoch(tmp_path, num_ranks):
    paths, _ = write_files(tmp_path, 7)
    ds = PackedFSLDataset(paths, 64, source_group_size=2, source_permutation_seed=123)
    gb = 4
    spe = data.steps_per_epoch(len(ds), gb)
    seen = []
    for step in range(spe):
        for r in range(num_ranks):
            b = data.get_batch(ds, gb, 3, step, r, num_ranks)
            seen += [row.tobytes() for row in b["tokens"]]
            for row, seg, lm in zip(b["tokens"], b["segment_ids"], b["label_mask"]):
                assert lm[row == PAD].sum() <= (row == PAD).sum()
    epoch = data.batch_indices(len(ds), spe * gb, 3, 0, 0, 0, 1)  # the whole truncated permutation
    want = sorted(ds[i]["tokens"].astype(np.int32).tobytes() for i in epoch)
    assert sorted(seen) == want  # every instance of the truncated permutation exactly once


@pytest.mark.parametrize("num_ranks", [1, 5])
def test_two_epochs_equal_olmo_core_data_loader(tmp_path, monkeypatch, num_ranks):
    """SFT's data order against OLMo-core's own loader (`NumpyDataLoaderConfig` over its
    `NumpyPackedFSLDataset`, the SFT script's pair): every rank's rows of every batch of epochs 1
    and 2 (reshuffled with seed + epoch, the partial global batch at the end dropped: 24 instances,
    4 batches of 5), and a loader restored in the middle of epoch 2 as OLMo-core restores its own."""
    monkeypatch.setenv("OLMO_DATA_PREP_WORKERS", "1")
    paths, masks = write_files(tmp_path, 5)
    seq_len, gb, seed = 64, 5, 34521
    theirs = olmo_data.NumpyPackedFSLDatasetConfig(
        tokenizer=tokenizer(), paths=paths, sequence_length=seq_len, generate_doc_lengths=True,
        label_mask_paths=masks, dtype=olmo_data.NumpyDatasetDType.uint32, work_dir=str(tmp_path / "work")).build()
    theirs.prepare()
    ours = PackedFSLDataset(paths, seq_len, label_mask_paths=masks)
    spe = data.steps_per_epoch(len(ours), gb)
    assert (len(ours), spe) == (24, 4)

    def loader(rank, work):
        return olmo_core_loader(theirs, global_batch=gb, seed=seed, num_ranks=num_ranks, rank=rank, pad_id=PAD,
                                work_dir=tmp_path / work)

    for r in range(num_ranks):
        dl = loader(r, "dl")
        for step, b in olmo_core_epochs(dl):
            mine = data.get_batch(ours, gb, seed, step, r, num_ranks)
            np.testing.assert_array_equal(mine["tokens"], b["input_ids"].numpy(), err_msg=f"step {step}")
            np.testing.assert_array_equal(mine["label_mask"], b["label_mask"].numpy(), err_msg=f"step {step}")
        assert dl.total_batches == spe and step == 2 * spe - 1
    dl = loader(0, "dl2")   # OLMo-core's state after 2 batches of epoch 2, and ours after spe + 2 steps
    dl.load_state_dict({"dataset_fingerprint_version": theirs.fingerprint_version, "dataset_type": "fsl",
                        "dataset_fingerprint": theirs.fingerprint, "batches_processed": 2,
                        "tokens_processed": 2 * gb * seq_len, "seed": seed, "epoch": 2,
                        "sequence_length": seq_len, "max_target_sequence_length": None})
    dl.reshuffle(epoch=2)
    state = data.Loader(ours, gb, seed, num_ranks=num_ranks, workers=0).state() | {"step": spe + 2}
    with data.Loader.from_state(ours, state, num_ranks=num_ranks, workers=0) as resumed:
        for b in dl:
            np.testing.assert_array_equal(next(resumed)["tokens"], b["input_ids"].numpy())
        assert resumed.step == 2 * spe


def test_packed_loader_state_and_fingerprint(tmp_path):
    paths, masks = write_files(tmp_path, 8)
    ds = PackedFSLDataset(paths, 64, source_group_size=2)
    with data.Loader(ds, 4, seed=5, workers=2) as loader:
        for _ in range(3):
            next(loader)
        state = loader.state()
        want = next(loader)
    with data.Loader.from_state(ds, state, workers=0) as resumed:
        got = next(resumed)
    for k in ("tokens", "label_mask", "segment_ids"):
        np.testing.assert_array_equal(got[k], want[k])
    for other in (PackedFSLDataset(paths, 64, source_group_size=1),         # another grouping
                  PackedFSLDataset(paths, 64, source_group_size=2, source_permutation_seed=1),
                  PackedFSLDataset(paths, 64, source_group_size=2, label_mask_paths=masks),
                  data.FSLDataset(paths, 64)):                                # fixed-length instances
        assert other.fingerprint != ds.fingerprint
        with pytest.raises(ValueError, match="fingerprint"):
            data.Loader.from_state(other, state)


def test_a_packing_from_another_cpu_is_refused_on_resume(tmp_path, monkeypatch):
    """numpy's argsort orders equal-length documents by the CPU's instruction set, so the same
    files can pack to other instances on another host: the loader state carries a digest of the
    packing, and a resume that packed differently is refused (the fingerprint, names and sizes,
    cannot see it). A shared cache gives every CPU the first packing."""
    paths, _ = write_files(tmp_path, 8)
    ds = PackedFSLDataset(paths, 64, source_group_size=2, cache_dir=tmp_path / "cache")
    with data.Loader(ds, 4, seed=5, workers=0) as loader:
        next(loader)
        state = loader.state()
    assert state["packing"] == ds.packing_digest
    argsort = np.argsort   # another CPU: ties in the reverse order
    monkeypatch.setattr(packing.np, "argsort", lambda a: len(a) - 1 - argsort(np.asarray(a)[::-1], kind="stable"))
    other = PackedFSLDataset(paths, 64, source_group_size=2)
    assert other.fingerprint == ds.fingerprint and other.packing_digest != ds.packing_digest
    assert len(other) == len(ds)   # the same lengths in every instance, other documents in some
    assert all(sorted(other[i]["doc_lens"]) == sorted(ds[i]["doc_lens"]) for i in range(len(ds)))
    assert any(not np.array_equal(other[i]["tokens"], ds[i]["tokens"]) for i in range(len(ds)))
    with pytest.raises(ValueError, match="packed instances differ from the checkpoint's .* --packing_cache"):
        data.Loader.from_state(other, state)
    data.Loader.from_state(other, state, allow_fingerprint_mismatch=True).close()
    cached = PackedFSLDataset(paths, 64, source_group_size=2, cache_dir=tmp_path / "cache")
    assert cached.packing_digest == ds.packing_digest
    data.Loader.from_state(cached, state).close()
    legacy = {k: v for k, v in state.items() if k != "packing"}   # a checkpoint from before the digest
    data.Loader.from_state(other, legacy).close()


def test_label_mask_reaches_the_loss_as_olmo_core(tmp_path):
    """Our (labels, weights, counted) against OLMo-core's `get_labels` on packed batches with
    label-mask files and the repetition filter's instance mask."""
    import jax.numpy as jnp
    import torch
    from olmo_core.data.utils import get_labels

    from olmo3.loss import IGNORE, labels_and_weights
    paths, masks = write_files(tmp_path, 9)
    ds = PackedFSLDataset(paths, 64, label_mask_paths=masks)
    b = data.get_batch(ds, 4, 0, 0)
    b["instance_mask"][1] = False
    labels, weights, counted = labels_and_weights(jnp.asarray(b["tokens"]), jnp.asarray(b["instance_mask"]),
                                                  jnp.asarray(b["label_mask"]))
    batch = {"input_ids": torch.tensor(b["tokens"], dtype=torch.long), "label_mask": torch.tensor(b["label_mask"])}
    ref = get_labels(batch).numpy()
    np.testing.assert_array_equal(np.asarray(labels), ref)
    kept = b["instance_mask"]
    np.testing.assert_array_equal(np.asarray(counted)[kept], (ref != IGNORE)[kept])  # padding: never counted
    # The masked instance: no target trained, seq_len tokens in the denominator, as
    # TransformerTrainModule.train_batch counts `batch_num_tokens_for_loss`.
    ref_masked = get_labels(dict(batch, instance_mask=torch.tensor(kept))).numpy()
    np.testing.assert_array_equal(np.asarray(weights), ref_masked != IGNORE)
    T = b["tokens"].shape[1]
    assert float(counted.sum()) == (ref_masked != IGNORE).sum() + (~kept).sum() * T


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_eval_batch_covers_a_small_domain(tmp_path, num_ranks):
    """3 documents, 4 rows per batch over 2 ranks: every document once, the filler row masked."""
    d = np.array([5, 6, EOS, 7, EOS, 8, 9, 10, EOS], np.uint32)
    d.tofile(tmp_path / "val.npy")
    ds = PaddedFSLDataset([str(tmp_path / "val.npy")], 8)
    assert len(ds) == 3
    rows = [data.get_eval_batch(ds, 4, 0, r, num_ranks) for r in range(num_ranks)]
    lm = np.concatenate([b["label_mask"] for b in rows])
    assert lm.sum() == 9 and sorted(lm.sum(1).tolist()) == [0, 2, 3, 4]
    toks = np.concatenate([b["tokens"] for b in rows])
    assert sorted(t[m].tolist() for t, m in zip(toks, lm)) == [[], [5, 6, EOS], [7, EOS], [8, 9, 10, EOS]]


@pytest.mark.parametrize("n", [1, 3, 8, 31, 64, 65, 200])
@pytest.mark.parametrize("eval_batches", [0, 1, 4])
def test_eval_plan_reads_each_instance_once_on_any_device_count(n, eval_batches):
    """Held-out plans: rows a multiple of the devices, at most a global batch, at most
    --eval_batches batches (0: as many as the domain fills, so every instance); the batches of
    get_eval_batch's rule then hold positions 0..k-1 of its order once each, k = all that fit,
    eval_batch_instances counts them, and k is the same on 1, 2, 4 or 16 devices."""
    global_batch, counts = 16, set()
    for devices in (1, 2, 4, 16):
        rows, batches = data.eval_plan(n, batches=eval_batches, global_batch=global_batch, devices=devices)
        assert rows % devices == 0 and 0 < rows <= global_batch and (eval_batches == 0 or batches <= eval_batches)
        seen = [i for b in range(batches) for r in range(devices)
                for i in np.arange(b * rows, (b + 1) * rows)[r::devices] if i < n]   # get_eval_batch's rows
        assert sorted(seen) == list(range(len(seen)))
        assert sum(data.eval_batch_instances(n, rows, b) for b in range(batches)) == len(seen)
        assert batches == 0 or data.eval_batch_instances(n, rows, batches - 1) > 0   # no batch of filler only
        if eval_batches == 0 or n <= eval_batches * global_batch:
            assert len(seen) == n
        counts.add(len(seen))
    assert len(counts) == 1


def test_cache_shared_between_file_orders(tmp_path):
    """A cached group found at another position (another permutation) still reads its own files."""
    paths, _ = write_files(tmp_path, 10)
    PackedFSLDataset(paths, 64, cache_dir=tmp_path / "cache")  # fills the cache in file order
    cached = PackedFSLDataset(paths, 64, source_permutation_seed=123, cache_dir=tmp_path / "cache")
    fresh = PackedFSLDataset(paths, 64, source_permutation_seed=123)
    assert len(cached) == len(fresh)
    for i in range(len(fresh)):
        np.testing.assert_array_equal(cached[i]["tokens"], fresh[i]["tokens"])


def test_cache_is_not_shared_between_sequence_lengths(tmp_path):
    """One cache directory, two sequence lengths (stage 3 after a shorter run): each reads its own
    packing, the one a fresh dataset packs (checked against OLMo-core above)."""
    paths, _ = write_files(tmp_path, 11)
    PackedFSLDataset(paths, 64, cache_dir=tmp_path / "cache")
    cached = PackedFSLDataset(paths, 128, cache_dir=tmp_path / "cache")
    fresh = PackedFSLDataset(paths, 128)
    assert len(cached) == len(fresh)
    for i in range(len(fresh)):
        for k in ("tokens", "doc_lens"):
            np.testing.assert_array_equal(cached[i][k], fresh[i][k])


def test_cache_is_not_shared_between_eos_ids(tmp_path):
    """One cache directory, one file, two EOS ids (a corpus of another tokenizer's ids under the
    same name): the documents end where each EOS says, as a fresh packing has them."""
    path = str(tmp_path / "part.npy")
    np.array([4, 5, 3, 6, 7, 8, 4, 9], np.uint32).tofile(path)
    kw = dict(pad_id=0, vocab_size=100)
    PackedFSLDataset([path], 8, eos_id=3, cache_dir=tmp_path / "cache", **kw)
    cached = PackedFSLDataset([path], 8, eos_id=4, cache_dir=tmp_path / "cache", **kw)
    fresh = PackedFSLDataset([path], 8, eos_id=4, **kw)
    assert [fresh[i]["doc_lens"].tolist() for i in range(len(fresh))] == [[6, 1, 1]]
    assert [cached[i]["doc_lens"].tolist() for i in range(len(cached))] == [[6, 1, 1]]


def test_instance_index_past_either_end_is_an_index_error(tmp_path):
    """ds[i] as a sequence's: -len(ds) <= i < len(ds), negative from the end; past either end an
    IndexError, never another instance."""
    path = str(tmp_path / "part.npy")
    np.array([4, 3, 5, 6, 3, 7, 8, 9, 3], np.uint32).tofile(path)
    ds = PackedFSLDataset([path], 4, eos_id=3, pad_id=0, vocab_size=100)
    n = len(ds)
    assert n == 3
    np.testing.assert_array_equal(ds[-n]["tokens"], ds[0]["tokens"])
    np.testing.assert_array_equal(ds[-1]["tokens"], ds[n - 1]["tokens"])
    for i in (n, -n - 1):
        with pytest.raises(IndexError):
            ds[i]


def test_a_cached_packing_still_checks_the_vocabulary(tmp_path):
    """The scan that packs is also the token-range check: a packing cached under a larger
    vocabulary is not reused by a smaller one, which names the file before the run starts (a
    cache hit had skipped the check until the instance was drawn)."""
    ids = np.array([4, 5000, 3, 6, 7, 3], np.uint32)   # eos 3, pad 0; id 5000 fits 8192, not 4096
    ids.tofile(tmp_path / "part.npy")
    kw = dict(eos_id=3, pad_id=0, cache_dir=tmp_path / "cache")
    assert len(PackedFSLDataset([str(tmp_path / "part.npy")], 8, vocab_size=8192, **kw)) == 1
    with pytest.raises(ValueError, match=r"part\.npy.*5000"):
        PackedFSLDataset([str(tmp_path / "part.npy")], 8, vocab_size=4096, **kw)


def test_a_file_rewritten_at_its_size_is_packed_again(tmp_path):
    """A token file rewritten with other document boundaries at the same size (a corpus rebuilt
    with documents moved between files, a reshuffled part): the cache, keyed by path and size,
    served the old packing, whose documents cut across the new ones."""
    path = str(tmp_path / "part.npy")
    kw = dict(eos_id=3, pad_id=0, vocab_size=100)
    np.array([4, 5, 6, 7, 8, 3, 9, 3], np.uint32).tofile(path)
    PackedFSLDataset([path], 8, cache_dir=tmp_path / "cache", **kw)
    np.array([4, 3, 5, 6, 3, 7, 8, 3], np.uint32).tofile(path)   # same size, three documents now
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))   # a later write
    cached = PackedFSLDataset([path], 8, cache_dir=tmp_path / "cache", **kw)
    fresh = PackedFSLDataset([path], 8, **kw)
    assert len(cached) == len(fresh)
    for i in range(len(fresh)):
        np.testing.assert_array_equal(cached[i]["doc_lens"], fresh[i]["doc_lens"])
    assert sorted(int(n) for i in range(len(fresh)) for n in fresh[i]["doc_lens"] if n) == [2, 3, 3]


def test_an_empty_part_holds_no_document(tmp_path):
    """An empty token file and its empty label mask (a converter's last, empty part) pack to the
    same instances as the other files alone (numpy cannot memmap an empty file: it crashed)."""
    toks = np.array([5, 6, EOS, 7, EOS, 8, 9, 10, EOS], np.uint32)
    toks.tofile(tmp_path / "token_ids_part_0000.npy")
    (toks % 2 == 0).tofile(tmp_path / "labels_mask_part_0000.npy")
    (tmp_path / "token_ids_part_0001.npy").write_bytes(b"")
    (tmp_path / "labels_mask_part_0001.npy").write_bytes(b"")
    paths = [str(tmp_path / f"token_ids_part_000{i}.npy") for i in (0, 1)]
    masks = [data.packed.label_mask_path(p) for p in paths]
    both = PackedFSLDataset(paths, 8, label_mask_paths=masks)
    alone = PackedFSLDataset(paths[:1], 8, label_mask_paths=masks[:1])
    assert len(both) == len(alone)
    for i in range(len(alone)):
        for k in ("tokens", "label_mask", "doc_lens"):
            np.testing.assert_array_equal(both[i][k], alone[i][k])


def test_eval_order_packed_sampled_padded_in_file_order(tmp_path):
    """Held-out batches (data.get_eval_batch): padded documents in file order, as OLMo-core's
    evaluators read them; packed instances (SFT's held-out chats, packed longest first) in the
    seed-0 order, so a capped evaluation is not the longest conversations only."""
    paths, _ = write_files(tmp_path, 6)
    packed, padded = PackedFSLDataset(paths, 64), PaddedFSLDataset(paths, 64)
    order = data.eval_order(len(packed))
    assert sorted(order.tolist()) == list(range(len(packed))) and order.tolist() != list(range(len(packed)))
    rows = data.get_eval_batch(packed, len(packed), 0)
    for r, i in enumerate(order):
        np.testing.assert_array_equal(rows["tokens"][r], packed[int(i)]["tokens"])
    rows = data.get_eval_batch(padded, len(padded), 0)
    for i in range(len(padded)):
        np.testing.assert_array_equal(rows["tokens"][i], padded[i]["tokens"])


def _fingerprint_files(d, sizes):
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for f, n in enumerate(sizes):
        ids = rng.integers(0, 1000, n).astype(np.uint32)
        ids[::5], ids[3::7], ids[-1] = EOS, EOS + 1, EOS   # eos of both eos ids
        paths.append(str(d / f"token_ids_part_{f}.npy"))
        ids.tofile(paths[-1])
    return paths


def _both_fingerprints(paths, work, seq_len=32, group=2, vocab=VOCAB, pad=PAD, eos=EOS):
    ours = PackedFSLDataset(paths, seq_len, source_group_size=group, vocab_size=vocab, pad_id=pad, eos_id=eos)
    theirs = olmo_data.NumpyPackedFSLDatasetConfig(
        tokenizer=olmo_data.TokenizerConfig(vocab_size=vocab, eos_token_id=eos, pad_token_id=pad), paths=paths,
        sequence_length=seq_len, generate_doc_lengths=True, source_group_size=group,
        dtype=olmo_data.NumpyDatasetDType.uint32, work_dir=str(work)).build()
    return ours.fingerprint, theirs.fingerprint


def test_fingerprint_changes_where_olmo_cores_does(tmp_path, monkeypatch):
    """The fingerprint that refuses a resume over other data changes with what OLMo-core's
    NumpyPackedFSLDataset fingerprint changes with (vocab size, pad and eos ids, sequence length,
    source group size, a file's size), and not with where the files lie (base names): the installed
    ai2-olmo-core's own fingerprint of the same files is the reference. Label-mask file names are
    ours alone (OLMo-core's fingerprint keeps no mask)."""
    import shutil
    monkeypatch.setenv("OLMO_DATA_PREP_WORKERS", "1")
    paths = _fingerprint_files(tmp_path / "a", [50, 70, 40])
    base = _both_fingerprints(paths, tmp_path / "w")
    for i, kw in enumerate([dict(vocab=VOCAB + 1), dict(pad=PAD + 1), dict(eos=EOS + 1),
                            dict(seq_len=64), dict(group=3)]):
        ours, theirs = _both_fingerprints(paths, tmp_path / f"w{i}", **kw)
        assert theirs != base[1] and ours != base[0], kw
    ours, theirs = _both_fingerprints(_fingerprint_files(tmp_path / "b", [50, 71, 40]), tmp_path / "wg")
    assert theirs != base[1] and ours != base[0]   # one file a token longer
    shutil.copytree(tmp_path / "a", tmp_path / "moved" / "a")
    moved = [str(tmp_path / "moved" / "a" / os.path.basename(p)) for p in paths]
    assert _both_fingerprints(moved, tmp_path / "wm") == base
    for p in paths:
        np.ones(os.path.getsize(p) // 4, np.bool_).tofile(label_mask_path(p))
        np.ones(os.path.getsize(p) // 4, np.bool_).tofile(p.replace("token_ids_", "labels_mask_other_"))
    with_masks = {PackedFSLDataset(paths, 32, label_mask_paths=masks).fingerprint
                  for masks in ([label_mask_path(p) for p in paths],
                                [p.replace("token_ids_", "labels_mask_other_") for p in paths])}
    assert len(with_masks | {PackedFSLDataset(paths, 32).fingerprint}) == 3


def test_trained_tokens_total_counts_every_chunk_of_a_mask(tmp_path, monkeypatch):
    """trained_tokens reads each label-mask file in MASK_SCAN chunks (16 MiB); with the chunk made
    tiny every chunk must still count. Reference: numpy's sum of each mask file (the total) and the
    label-mask tokens the instances themselves carry (kept)."""
    rng = np.random.default_rng(3)
    paths, total = [], 0
    for part in range(3):
        ids = np.concatenate([np.append(rng.integers(0, 1000, n - 1), EOS) for n in rng.integers(1, 30, 10)])
        mask = rng.random(len(ids)) < 0.5
        mask[0] = True
        paths.append(str(tmp_path / f"token_ids_part_{part}.npy"))
        ids.astype(np.uint32).tofile(paths[-1])
        mask.tofile(label_mask_path(paths[-1]))
        total += int(mask.sum())
    monkeypatch.setattr(data.packed, "MASK_SCAN", 7)
    ds = PackedFSLDataset(paths, 16, source_group_size=2, label_mask_paths=[label_mask_path(p) for p in paths])
    kept = sum(int(ds[i]["label_mask"].sum()) for i in range(len(ds)))
    assert ds.trained_tokens() == (kept, total) and kept < total


def test_a_pad_id_past_the_vocabulary_and_a_file_cut_mid_token_are_named(tmp_path):
    """A token id lies in 0..vocab_size-1, so pad_id == vocab_size is outside (an embedding gather
    clamps it silently); a headerless uint32 file is whole 4-byte ids."""
    p = str(tmp_path / "part.npy")
    np.array([4, 5, 3, 6, 3, 7, 8, 9, 10, 3], np.uint32).tofile(p)   # eos 3: documents of 3, 2 and 5
    ok = PackedFSLDataset([p], 8, eos_id=3, pad_id=49, vocab_size=50)
    assert any((ok[i]["tokens"] == 49).any() for i in range(len(ok)))   # padding is drawn
    bad = PackedFSLDataset([p], 8, eos_id=3, pad_id=50, vocab_size=50)
    with pytest.raises(ValueError, match="pad_id=50 >= vocab size 50"):
        for i in range(len(bad)):
            bad[i]
    with open(p, "ab") as f:
        f.write(b"\x01")
    with pytest.raises(ValueError, match=r"part\.npy.* 41 bytes, not a multiple of 4"):
        PackedFSLDataset([p], 8, eos_id=3, pad_id=0, vocab_size=50)
