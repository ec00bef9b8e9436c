"""FSLDataset: OLMo-core instance layout, fingerprint, and clear errors on bad token files."""
import os

import numpy as np
import pytest

import data


def _write(path, tokens):
    np.asarray(tokens, dtype=np.uint32).tofile(path)
    return str(path)


def test_instances_match_plain_file_reading(tmp_path):
    rng = np.random.default_rng(0)
    seq = 16
    sizes = [5 * seq + 7, 3 * seq, seq - 1, 2 * seq + 15]  # leftovers, and a file with no instance
    arrays = [rng.integers(0, data.VOCAB_SIZE, size=n) for n in sizes]
    paths = [_write(tmp_path / f"part-{k}.npy", a) for k, a in enumerate(arrays)]
    ds = data.FSLDataset(paths, seq)
    # Reference: per file n = size // seq instances, leftovers dropped, never crossing files.
    ref = [np.fromfile(p, dtype=np.uint32)[j * seq:(j + 1) * seq]
           for p in paths for j in range(os.path.getsize(p) // 4 // seq)]
    assert len(ds) == len(ref) == 5 + 3 + 0 + 2
    for i, want in enumerate(ref):
        got = ds[i]
        assert got.dtype == np.uint32 and got.shape == (seq,)
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(ds[np.int64(-1)], ref[-1])
    with pytest.raises(IndexError):
        ds[len(ref)]


def test_fingerprint(tmp_path):
    seq = 8
    a = _write(tmp_path / "a.npy", np.arange(40))
    b = _write(tmp_path / "b.npy", np.arange(24))
    fp = data.FSLDataset([a, b], seq).fingerprint
    assert len(fp) == 64 and int(fp, 16) >= 0
    assert data.FSLDataset([a, b], seq).fingerprint == fp  # deterministic
    assert data.FSLDataset([a, b], 4).fingerprint != fp  # sequence length
    assert data.FSLDataset([b, a], seq).fingerprint != fp  # file order
    for ids in ({"vocab_size": data.VOCAB_SIZE + 1}, {"pad_id": data.PAD_ID + 1}, {"eos_id": data.EOS_ID + 1}):
        assert data.FSLDataset([a, b], seq, **ids).fingerprint != fp, ids   # another tokenizer's data
    with pytest.raises(ValueError, match="expected_tokens has 3 entries for 2 files"):   # a manifest of other files
        data.FSLDataset([a, b], seq, expected_tokens=[40, 24, 8])
    # Content size change that keeps the instance count the same still changes the fingerprint.
    n_before = len(data.FSLDataset([a, b], seq))
    _write(b, np.arange(25))
    ds = data.FSLDataset([a, b], seq)
    assert len(ds) == n_before and ds.fingerprint != fp
    # Same names and sizes elsewhere: same fingerprint (OLMo-core hashes base names, so data can move).
    os.makedirs(tmp_path / "moved")
    a2 = _write(tmp_path / "moved" / "a.npy", np.arange(40))
    b2 = _write(tmp_path / "moved" / "b.npy", np.arange(25))
    assert data.FSLDataset([a2, b2], seq).fingerprint == ds.fingerprint


def test_bad_files(tmp_path):
    seq = 8
    good = _write(tmp_path / "good.npy", np.arange(64))
    missing = str(tmp_path / "missing.npy")
    with pytest.raises(FileNotFoundError, match="missing.npy"):
        data.FSLDataset([good, missing], seq)
    with pytest.raises(IsADirectoryError, match="pass the .npy token files inside it"):
        data.FSLDataset([good, str(tmp_path)], seq)   # at open, not at the first read of it
    empty = tmp_path / "empty.npy"
    empty.write_bytes(b"")
    # An empty file holds no instance, as in OLMo-core (a published mix may list one).
    both = data.FSLDataset([str(empty), good], seq)
    assert len(both) == 8 and both[0].tolist() == list(range(8))
    odd = tmp_path / "odd.npy"
    odd.write_bytes(np.arange(10, dtype=np.uint32).tobytes()[:-3])
    with pytest.raises(ValueError, match="odd.npy.*not a multiple of 4"):
        data.FSLDataset([str(odd)], seq)
    with pytest.raises(ValueError, match="truncated"):
        data.FSLDataset([good], seq, expected_tokens=[65])
    big = _write(tmp_path / "big.npy", np.r_[np.arange(8), [data.VOCAB_SIZE], np.arange(7)])
    ds = data.FSLDataset([big], seq)
    ds[0]
    with pytest.raises(ValueError, match=f"big.npy.*{data.VOCAB_SIZE} >= vocab size"):
        ds[1]
    with pytest.raises(ValueError, match="full instance"):
        data.FSLDataset([good], 1000)
