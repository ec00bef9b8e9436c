"""OLMo-core's fixed-sequence-length (FSL) dataset over headerless uint32 token files.

Mirrors OLMo-core `data/numpy_dataset.py` (`NumpyFSLDataset`): each file holds
`n = size // seq_len` instances, the leftover tokens of each file are dropped, so an instance
never crosses files (documents may span instances). Instance `i` is the i-th instance in file
order. The fingerprint identifies the data a run was trained on and is saved with every
checkpoint; resuming on a different fingerprint is refused (DESIGN §4).
"""
import hashlib
import os
from collections.abc import Sequence

import numpy as np
from jaxtyping import UInt32

from data import storage
from data.tokenizer import EOS_ID, PAD_ID, VOCAB_SIZE

ITEMSIZE = storage.ITEMSIZE


class FSLDataset:
    """Fixed-length instances over token files: `len(ds)`, `ds[i] -> uint32[seq_len]`, `ds.fingerprint`.

    `expected_tokens` (one count per file, e.g. from a prepare manifest) turns a short file into an
    error instead of silently fewer instances. `seq_len_flag`: the flag the error for files too
    short for one instance names (eval.py's is --eval_seq_len).
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike] | str | os.PathLike,
        seq_len: int,
        *,
        vocab_size: int = VOCAB_SIZE,
        eos_id: int = EOS_ID,
        pad_id: int = PAD_ID,
        expected_tokens: Sequence[int] | None = None,
        seq_len_flag: str = "--seq_len",
    ):
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        paths = [os.fspath(p) for p in paths]
        if not paths:
            raise ValueError("FSLDataset needs at least one token file")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if expected_tokens is not None and len(expected_tokens) != len(paths):
            raise ValueError(f"expected_tokens has {len(expected_tokens)} entries for {len(paths)} files")
        self.paths = paths
        self.seq_len = int(seq_len)
        self.vocab_size, self.eos_id, self.pad_id = int(vocab_size), int(eos_id), int(pad_id)
        self._files = storage.open_token_files(paths)  # local memmaps and URLs: data/storage.py
        for k, f in enumerate(self._files):
            if f.nbytes % ITEMSIZE:
                raise ValueError(
                    f"token file {f.path!r} has {f.nbytes} bytes, not a multiple of 4: it is truncated "
                    "or not a headerless uint32 token file; rebuild it with `python -m data.prepare`")
            if expected_tokens is not None and f.nbytes != ITEMSIZE * expected_tokens[k]:
                raise ValueError(
                    f"token file {f.path!r} has {f.nbytes // ITEMSIZE} tokens but its manifest says "
                    f"{expected_tokens[k]}: the file is truncated or was replaced; rebuild it with `python -m data.prepare`")
        self.file_sizes = tuple(f.nbytes for f in self._files)
        counts = np.array([n // (ITEMSIZE * self.seq_len) for n in self.file_sizes], dtype=np.int64)
        self._ends = np.cumsum(counts)  # global index of the first instance after file k
        if self._ends[-1] == 0:
            raise ValueError(f"no file holds a full instance of {self.seq_len} tokens (the largest holds "
                             f"{max(self.file_sizes) // ITEMSIZE:,}): {paths}; give a shorter {seq_len_flag} or more text "
                             "(a held-out set: --eval_padded scores its documents one per row, whatever their length)")

    def __len__(self) -> int:
        return int(self._ends[-1])

    def locate(self, i: int | np.integer) -> tuple[int, int]:
        """Instance index -> (file number, instance number within that file)."""
        n = len(self)
        i = int(i)
        if not -n <= i < n:
            raise IndexError(f"instance {i} out of range for a dataset of {n} instances")
        i %= n
        k = int(np.searchsorted(self._ends, i, side="right"))
        return k, i - (int(self._ends[k - 1]) if k else 0)

    def __getitem__(self, i: int | np.integer) -> UInt32[np.ndarray, " seq"]:
        k, j = self.locate(i)
        tokens = self._files[k].read(j * self.seq_len, (j + 1) * self.seq_len)
        if tokens.shape != (self.seq_len,):
            raise ValueError(f"token file {self.paths[k]!r} ended early reading instance {j}; it was truncated while open")
        top = int(tokens.max())
        if top >= self.vocab_size:
            raise storage.token_range_error(self._files[k], f", instance {j}", top, self.vocab_size)
        if storage.wide_integers(tokens):   # int64 ids: they trained, every other token id 0
            raise storage.wide_integers_error(self._files[k], f", instance {j}")
        return tokens

    @property
    def fingerprint(self) -> str:
        """sha256 over the dataset kind, vocab size, pad and eos ids, dtype, sequence length and each
        file's name and size (DESIGN §4; after OLMo-core `NumpyDatasetBase.fingerprint`)."""
        h = hashlib.sha256()
        h.update(b"kind=FSLDataset,")
        h.update(f"vocab_size={self.vocab_size},pad_token_id={self.pad_id},eos_token_id={self.eos_id},".encode())
        h.update(f"dtype=uint32,sequence_length={self.seq_len},".encode())
        for path, size in zip(self.paths, self.file_sizes):
            h.update(f"path={os.path.basename(path)},size={size},".encode())
        return h.hexdigest()

    def __repr__(self) -> str:
        return f"FSLDataset({len(self.paths)} files, {len(self)} instances of {self.seq_len} tokens)"
