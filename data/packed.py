"""Packed fixed-length instances: whole documents packed into `seq_len` tokens, then padded.

    files  = shuffle(files, random.Random(source_permutation_seed)) if a seed is given
    groups = files[0:g], files[g:2g], ...                     # source_group_size = g
    for each group: docs = its files' documents (data/packing.py), truncated to seq_len
                    instances += OBFD(docs)                   # data/packing.py
    ds[i] = {tokens:     concat(docs of instance i) + [pad] * padding,
             label_mask: True on document tokens (or the labels_mask_*.npy values), False on padding,
             doc_lens:   the documents' lengths, then the padding as one more "document"}

OLMo-core's `NumpyPackedFSLDataset` (`data/numpy_dataset.py`) with its config's
`source_permutation_seed` (`NumpyDatasetConfig._resolve_paths_metadata`): the stage-3 recipe
(`OLMo-3-1025-7B-long-context.py`) trains on it with `generate_doc_lengths=True`, so attention
stays inside a document instead of inside an eos-delimited window of a fixed-length slice.
tests/test_data_packed.py checks ours equal OLMo-core's instance for instance.

Why it is built this way: the packing is a pure function of the file list, their sizes and
contents, so every host computes the same instances and `data.order` can shuffle their indices
exactly as for `FSLDataset`; nothing but the fingerprint goes into a checkpoint. Packing scans
every token once (eos search) and keeps three small index arrays per group in memory;
`cache_dir` keeps them on disk, keyed by the files (path, size, and a local file's mtime), so a
restart does not rescan. Equal-length documents are ordered by numpy's default argsort, as in
OLMo-core, and that order depends on the CPU: numpy's sorts dispatch on the instruction set
(100,000 lengths in 1..49 argsort to different permutations with AVX-512 and with AVX2 only,
numpy 2.4). train.py lets process 0 pack first and the others read its cache, so hosts with
different CPUs still agree when the cache directory is shared; where they cannot agree it stops
(`packing_digest`, compared across processes and with the checkpoint's loader state) instead of
letting one index mean two instances.

Document boundaries come from the eos tokens, local or remote files alike. OLMo-core takes a
remote file's boundaries from its `.csv.gz` metadata instead; the two agree whenever every
document ends in eos (AI2's published token files do), and only then.

Label masks: OLMo-core's SFT data (open-instruct `convert_sft_data_for_olmocore.py`) stores one
bool per token beside the ids (`labels_mask_*.npy`); `label_mask_paths` gives one per token file.
"""
import functools
import hashlib
import os
import random
from collections.abc import Sequence

import numpy as np

from data import packing, storage
from data.tokenizer import EOS_ID, PAD_ID, VOCAB_SIZE
from olmo3 import atomic


def permute_sources(paths: Sequence[str], seed: int | None) -> list[int]:
    """The file order OLMo-core's `source_permutation_seed` gives: Python's `random.Random(seed)`
    shuffle of 0..n-1 (identity for seed None)."""
    order = list(range(len(paths)))
    if seed is not None:
        random.Random(seed).shuffle(order)
    return order


MASK_SCAN = 1 << 24   # label-mask entries per read while looking for a 1 (16 MiB)


def label_mask_path(token_path: str) -> str:
    """`.../labels_mask_X.npy` beside `.../token_ids_X.npy` (open-instruct's names for OLMo-core SFT data)."""
    head, name = os.path.split(os.fspath(token_path))
    if not name.startswith("token_ids_"):
        raise ValueError(f"token file {token_path!r} is not named token_ids_*.npy, so its labels_mask_*.npy "
                         "file cannot be found; name the pair token_ids_X.npy and labels_mask_X.npy")
    return os.path.join(head, "labels_mask_" + name[len("token_ids_"):])


def open_label_masks(paths: Sequence[str], files) -> list[np.ndarray]:
    """Memmaps of one-byte bool label masks, one per token file, checked to be the same length."""
    masks = []
    for p, f in zip(paths, files):
        p = os.fspath(p)
        if storage.is_remote(p):
            raise ValueError(f"label-mask file {p!r} is remote; copy the labels_mask_*.npy files to local disk")
        if not os.path.isfile(p):
            raise FileNotFoundError(f"label-mask file {p!r} does not exist; pass one labels_mask_*.npy per token file")
        if os.path.getsize(p) != f.nbytes // storage.ITEMSIZE:
            raise ValueError(f"label-mask file {p!r} has {os.path.getsize(p)} entries but {f.path!r} has "
                             f"{f.nbytes // storage.ITEMSIZE} tokens; they must be written together")
        # An empty file holds no token (numpy cannot memmap it).
        mask = np.memmap(p, dtype=np.bool_, mode="r") if os.path.getsize(p) else np.zeros(0, np.bool_)
        # A file that trains no token ran as a loss of 0.0 at every step. Data files drop such chats
        # (data.prepare_sft, open-instruct's sft_tulu_filter_v1), so one is a bug of the file. Stops at
        # the first chunk holding a 1: one read in a good file.
        if len(mask) and not any(mask[a:a + MASK_SCAN].any() for a in range(0, len(mask), MASK_SCAN)):
            raise ValueError(f"label-mask file {p!r} marks no token for the loss (every entry is 0), so training "
                             "on it learns nothing; write 1 on the tokens to train (the assistant's turns), as "
                             "python -m data.prepare_sft does")
        masks.append(mask)
    return masks


class PackedFSLDataset:
    """`len(ds)`, `ds[i] -> {"tokens", "label_mask", "doc_lens"}`, `ds.fingerprint`, `ds.seq_len`."""

    kind = "PackedFSLDataset"

    def __init__(
        self,
        paths: Sequence[str | os.PathLike] | str | os.PathLike,
        seq_len: int,
        *,
        source_group_size: int = 1,
        source_permutation_seed: int | None = None,
        label_mask_paths: Sequence[str | os.PathLike] | None = None,
        vocab_size: int = VOCAB_SIZE,
        eos_id: int = EOS_ID,
        pad_id: int = PAD_ID,
        cache_dir: str | os.PathLike | None = None,
    ):
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        paths = [os.fspath(p) for p in paths]
        if not paths:
            raise ValueError(f"{self.kind} needs at least one token file")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if source_group_size < 1:
            raise ValueError(f"source_group_size must be >= 1, got {source_group_size}")
        if label_mask_paths is not None and len(label_mask_paths) != len(paths):
            raise ValueError(f"{len(label_mask_paths)} label-mask files for {len(paths)} token files; "
                             "pass one per file")
        order = permute_sources(paths, source_permutation_seed)
        self.paths = [paths[k] for k in order]
        self.label_mask_paths = None if label_mask_paths is None else [os.fspath(label_mask_paths[k]) for k in order]
        self.seq_len, self.source_group_size = int(seq_len), int(source_group_size)
        self.source_permutation_seed = source_permutation_seed
        self.vocab_size, self.eos_id, self.pad_id = int(vocab_size), int(eos_id), int(pad_id)
        self._files = storage.open_token_files(self.paths)
        for f in self._files:
            if f.nbytes % storage.ITEMSIZE:
                raise ValueError(f"token file {f.path!r} has {f.nbytes} bytes, not a multiple of 4: it is truncated "
                                 "or not a headerless uint32 token file")
        self.file_sizes = tuple(f.nbytes for f in self._files)
        self._masks = None if self.label_mask_paths is None else open_label_masks(self.label_mask_paths, self._files)
        self._groups = [self._group(range(a, min(a + self.source_group_size, len(paths))), cache_dir)
                        for a in range(0, len(paths), self.source_group_size)]
        self._ends = np.cumsum([len(g["offsets"]) - 1 for g in self._groups])
        if self._ends[-1] == 0:
            raise ValueError(f"no document (a run of tokens ending in eos id {self.eos_id}) in {self.paths[:3]}...; "
                             "are these token files of this tokenizer?")

    def _group(self, files: range, cache_dir) -> dict:
        """Pack the documents of `files` (one source group): sorted spans, instance offsets, docs."""
        # vocab_size: the scan is also the token-range check, which a cache hit must not skip
        key = hashlib.sha256(f"{self.kind},{self.seq_len},{self.eos_id},{self.vocab_size},truncate,".encode())
        for k in files:   # a local file rewritten at its size (a rebuild, a reshuffle) has a new mtime
            mtime = "" if storage.is_remote(self.paths[k]) else os.stat(self.paths[k]).st_mtime_ns
            key.update(f"{self.paths[k]},{self.file_sizes[k]},{mtime},".encode())
        cached = cache_dir and os.path.join(os.fspath(cache_dir), f"packed-{key.hexdigest()[:32]}.npz")
        if cached and os.path.isfile(cached):  # the key names the group's files, not their positions
            with np.load(cached) as z:
                return {k: z[k] for k in z.files} | {"files": np.array(list(files), np.int64)}
        starts = np.cumsum([0] + [self.file_sizes[k] // storage.ITEMSIZE for k in files])
        spans = np.concatenate([packing.document_spans(self._files[k], self.eos_id, self.seq_len, self.vocab_size)
                                + starts[j] for j, k in enumerate(files)])
        order, instances = packing.pack(spans[:, 1] - spans[:, 0], self.seq_len)
        group = {"files": np.array(list(files), np.int64), "file_starts": starts,
                 "spans": spans[order],  # (docs, 2) group-token offsets, in packing order
                 "offsets": np.cumsum([0] + [len(d) for d in instances]).astype(np.int64),
                 "docs": np.array([k for d in instances for k in d], np.int64)}
        if cached:   # another host may write the same file: each renames a whole one over it
            with atomic.replacing(cached, suffix=".npz") as tmp:
                np.savez(tmp, **group)
        return group

    def __len__(self) -> int:
        return int(self._ends[-1])

    def documents(self, i: int | np.integer) -> list[tuple[int, int, int]]:
        """(file number, start, end) of each document of instance `i`, in instance order."""
        n = len(self)
        if not -n <= int(i) < n:
            raise IndexError(f"instance {i} out of range for a dataset of {n} instances")
        i = int(i) % n
        g = int(np.searchsorted(self._ends, i, side="right"))
        j = i - (int(self._ends[g - 1]) if g else 0)
        group = self._groups[g]
        out = []
        for d in group["docs"][group["offsets"][j]:group["offsets"][j + 1]]:
            s, e = (int(x) for x in group["spans"][d])
            f = int(np.searchsorted(group["file_starts"], s, side="right")) - 1
            base = int(group["file_starts"][f])
            out.append((int(group["files"][f]), s - base, e - base))
        return out

    def __getitem__(self, i: int | np.integer) -> dict:
        return self._assemble(self.documents(i))

    def _assemble(self, docs: list[tuple[int, int, int]]) -> dict:
        """tokens uint32[seq], label_mask bool[seq], doc_lens int32[k] of documents, then padding."""
        tokens = [self._files[k].read(s, e) for k, s, e in docs]
        masks = [np.ones(e - s, np.bool_) if self._masks is None else np.array(self._masks[k][s:e])
                 for k, s, e in docs]
        n = sum(len(t) for t in tokens)
        pad = self.seq_len - n
        ids = np.concatenate(tokens + [np.full(pad, self.pad_id, np.uint32)])
        top = int(ids.max())
        if top >= self.vocab_size:   # the file that holds it (none: the padding itself)
            held = next((d for d, t in zip(docs, tokens) if len(t) and int(t.max()) == top), None)
            if held is None:
                raise ValueError(f"pad_id={self.pad_id} >= vocab size {self.vocab_size}: padding is no token of "
                                 "this vocabulary")
            raise storage.token_range_error(self._files[held[0]], f", document at token {held[1]}", top,
                                            self.vocab_size)
        # Padding is segmented as OLMo-core scans it (one run, or one per token if pad == eos).
        doc_lens = [len(t) for t in tokens] + (packing.document_lengths(ids[n:], self.eos_id).tolist() if pad else [])
        return {"tokens": ids, "label_mask": np.concatenate(masks + [np.zeros(pad, np.bool_)]),
                "doc_lens": np.array(doc_lens, np.int32)}

    def trained_tokens(self) -> tuple[int, int]:
        """(in the instances, in the files) of the label-mask tokens (label-masked sets only): the
        second minus the first is what truncation to seq_len (and any tokens after a file's last
        eos) leave out of training. One pass over the masks, one slice per document."""
        kept = 0
        for g in self._groups:
            file_of = np.searchsorted(g["file_starts"], g["spans"][:, 0], side="right") - 1
            local = g["spans"] - g["file_starts"][file_of][:, None]
            for k, (s, e) in zip(g["files"][file_of].tolist(), local.tolist()):
                kept += int(np.count_nonzero(self._masks[k][s:e]))
        total = sum(int(np.count_nonzero(m[a:a + MASK_SCAN])) for m in self._masks
                    for a in range(0, len(m), MASK_SCAN))
        return kept, total

    def _fingerprint_fields(self) -> str:
        return f"source_group_size={self.source_group_size},source_permutation_seed={self.source_permutation_seed},"

    @property
    def fingerprint(self) -> str:
        """sha256 over the kind, vocab, pad/eos ids, dtype, seq_len, packing options, and each
        file's name and size in packing order, label-mask files included (DESIGN §4)."""
        h = hashlib.sha256()
        h.update(f"kind={self.kind},long_doc_strategy=truncate,".encode())
        h.update(f"vocab_size={self.vocab_size},pad_token_id={self.pad_id},eos_token_id={self.eos_id},".encode())
        h.update(f"dtype=uint32,sequence_length={self.seq_len},{self._fingerprint_fields()}".encode())
        for path, size in zip(self.paths, self.file_sizes):
            h.update(f"path={os.path.basename(path)},size={size},".encode())
        for path in self.label_mask_paths or []:
            h.update(f"label_mask={os.path.basename(path)},".encode())
        return h.hexdigest()

    @functools.cached_property
    def packing_digest(self) -> str:
        """sha256 over the packing itself (each group's document spans, instance offsets and
        document order): what `fingerprint` cannot see, the tie order of equal-length documents,
        which depends on the CPU that packed them (module docstring)."""
        h = hashlib.sha256()
        for g in self._groups:
            for k in ("files", "spans", "offsets", "docs"):
                a = np.ascontiguousarray(g[k], np.int64)
                h.update(f"{k}{a.shape}".encode())
                h.update(a.tobytes())
        return h.hexdigest()

    def __repr__(self) -> str:
        return f"{self.kind}({len(self.paths)} files, {len(self)} instances of {self.seq_len} tokens)"


def batch_fields(instances: list[dict]) -> dict[str, np.ndarray]:
    """Stack instances: tokens uint32 [B, T], label_mask bool [B, T], segment_ids int32 [B, T]."""
    return {"tokens": np.stack([x["tokens"] for x in instances]),
            "label_mask": np.stack([x["label_mask"] for x in instances]),
            "segment_ids": np.stack([packing.segments_from_lengths(x["doc_lens"]) for x in instances])}

