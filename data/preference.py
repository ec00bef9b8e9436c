"""Preference pairs for DPO: rendered conversations on disk, one (chosen, rejected) pair per instance.

    <dir>/token_ids.npy     headerless uint32: pair 0 chosen, pair 0 rejected, pair 1 chosen, ...
    <dir>/labels_mask.npy   headerless bool, one per token: True on the last message (the response)
    <dir>/pairs.json        lengths of the 2n sequences, sha256 of both files, how they were made
    ds[i] = {tokens:     uint32 [2, seq_len]  chosen, rejected; truncated to seq_len, padded,
             label_mask: bool   [2, seq_len]  False on prompt tokens and padding,
             ref_logps:  float32 [2]          the frozen reference's summed log-probs (once attached)}

Written by `python -m data.prepare_dpo` from open-instruct's preference JSONL (`chosen` and
`rejected` message lists, `preference_tulu_tokenize_and_truncate_v1`). The pair index is the
instance index of `data.order`, so `data.Loader` gives the exactly-once global order, its
checkpointed state and its fingerprint check to pairs unchanged (`collate` stacks a batch: row
2i chosen, row 2i + 1 rejected, so a pair never splits across devices).

Why padded rows and not packing: chosen and rejected each need their own per-sequence sums, and
with one sequence per row (open-instruct pads them too, `concatenated_forward`) nothing can leak
between sequences; packing several short sequences into one row would save compute on short data
at the price of segment ids and per-segment sums in every loss. The fingerprint covers the files' contents (their
sha256, recorded when written) and seq_len, so the reference cache keyed on it
(olmo3/reference.py) notices a rebuilt data set even when its sizes are unchanged. Opening a data
set checks both files against those sha256 (one read, about a second per GB), so bytes changed in
place cannot pass for the recorded ones.
"""
import glob
import hashlib
import json
import os

import numpy as np
from jaxtyping import Bool, UInt32

from data import storage
from data.tokenizer import EOS_ID, PAD_ID, VOCAB_SIZE
from olmo3 import atomic

TOKENS, MASKS, MANIFEST = "token_ids.npy", "labels_mask.npy", "pairs.json"
FORMAT = "olmo3-jax preference pairs v1"


class PairDataset:
    """`len(ds)` pairs, `ds[i] -> {"tokens", "label_mask"[, "ref_logps"]}`, `ds.fingerprint`, `ds.collate`."""

    kind = "PairDataset"

    def __init__(self, directory: str | os.PathLike, seq_len: int, *, vocab_size: int = VOCAB_SIZE,
                 eos_id: int = EOS_ID, pad_id: int = PAD_ID, flag: str | None = None):
        """`flag`: the option that named `directory` (train.py's --data, --dpo_heldout), for errors."""
        self.directory = os.fspath(directory)
        manifest_path = os.path.join(self.directory, MANIFEST)
        if not os.path.isfile(manifest_path):
            said = f"{flag}={self.directory!r}" if flag else repr(self.directory)
            if glob.glob(os.path.join(self.directory, "token_ids_part_*.npy")):   # it read as "write pairs here"
                raise FileNotFoundError(f"{said} holds SFT data (token_ids_part_*.npy), not preference pairs "
                                        f"({MANIFEST}); give it to --stage=sft, or a directory written by "
                                        "`python -m data.prepare_dpo`")
            raise FileNotFoundError(f"{manifest_path} does not exist: {said} holds no prepared "
                                    "preference pairs; write them with `python -m data.prepare_dpo "
                                    "--input=<pairs.jsonl> --out_dir=<a new directory>`")
        rebuild = f"rebuild {self.directory} with `python -m data.prepare_dpo`"
        try:
            with open(manifest_path, encoding="utf-8") as f:
                self.manifest = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{manifest_path} is damaged (not JSON: {e}); {rebuild}") from None
        if not isinstance(self.manifest, dict) or self.manifest.get("format") != FORMAT:
            raise ValueError(f"{manifest_path} is not a '{FORMAT}' manifest; {rebuild}")
        if not isinstance(self.manifest.get("lengths"), list):
            raise ValueError(f"{manifest_path} has no list of pair lengths ('lengths'); {rebuild}")
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        self.seq_len, self.vocab_size = int(seq_len), int(vocab_size)
        self.eos_id, self.pad_id = int(eos_id), int(pad_id)
        lengths = np.asarray(self.manifest["lengths"], np.int64)
        self._starts = np.concatenate([[0], np.cumsum(lengths)])
        total = int(self._starts[-1])
        for name, itemsize in ((TOKENS, 4), (MASKS, 1)):
            path = os.path.join(self.directory, name)
            if not os.path.isfile(path) or os.path.getsize(path) != total * itemsize:
                raise ValueError(f"{path} should hold {total} entries ({total * itemsize} bytes) as {MANIFEST} "
                                 "says; it is missing, truncated or from another build. Rebuild with "
                                 "`python -m data.prepare_dpo`")
        in_dir = lambda name: os.path.join(self.directory, name)  # noqa: E731
        for name, key in ((TOKENS, "token_ids_sha256"), (MASKS, "labels_mask_sha256")):
            # Same size, other bytes (an edit in place, bit rot): the fingerprint, and so the
            # reference cache keyed on it, reads the recorded sha256, and trained on stale log-probs.
            if storage.file_sha256(in_dir(name)) != self.manifest.get(key):
                raise ValueError(f"{in_dir(name)}: its sha256 differs from the one {MANIFEST} recorded; it was "
                                 f"changed or damaged since it was written. Rebuild with `python -m data.prepare_dpo`")
        self._tokens = np.memmap(in_dir(TOKENS), np.uint32, "r") if total else np.zeros(0, np.uint32)
        self._masks = np.memmap(in_dir(MASKS), np.bool_, "r") if total else np.zeros(0, bool)
        if len(lengths) % 2 or not len(lengths):
            raise ValueError(f"{manifest_path} lists {len(lengths)} sequences; expected 2 per pair, at least one pair")
        for k in np.flatnonzero(lengths > self.seq_len):   # truncation must leave a trainable token
            if not self._masks[self._starts[k]:self._starts[k] + self.seq_len].any():
                raise ValueError(
                    f"pair {k // 2} of {self.directory!r}: its {'chosen' if k % 2 == 0 else 'rejected'} response "
                    f"starts after token {self.seq_len}, so nothing of it is trained at --seq_len={self.seq_len}; "
                    f"prepare the pairs with --max_seq_length={self.seq_len} (which drops such pairs)")
        self.reference = None   # float32 [pairs, 2]: the reference model's summed log-probs

    def __len__(self) -> int:
        return (len(self._starts) - 1) // 2

    def sequence(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and label mask of sequence k (2i chosen, 2i + 1 rejected), truncated to seq_len."""
        s, e = int(self._starts[k]), min(int(self._starts[k + 1]), int(self._starts[k]) + self.seq_len)
        return np.asarray(self._tokens[s:e]), np.asarray(self._masks[s:e])

    def __getitem__(self, i: int | np.integer) -> dict:
        n = len(self)
        if not -n <= int(i) < n:
            raise IndexError(f"pair {i} out of range for {n} pairs")
        i = int(i) % n
        tokens = np.full((2, self.seq_len), self.pad_id, np.uint32)
        mask = np.zeros((2, self.seq_len), bool)
        for j in range(2):
            ids, m = self.sequence(2 * i + j)
            tokens[j, :len(ids)], mask[j, :len(m)] = ids, m
        if tokens.size and int(tokens.max()) >= self.vocab_size:
            raise ValueError(f"{self.directory!r}, pair {i}: token id {int(tokens.max())} >= vocab size "
                             f"{self.vocab_size}; the pairs were written with another tokenizer")
        out = {"tokens": tokens, "label_mask": mask}
        if self.reference is not None:
            out["ref_logps"] = self.reference[i].astype(np.float32)
        return out

    def attach_reference(self, sums: np.ndarray) -> None:
        """The reference model's summed log-probs, float [pairs, 2] (olmo3/reference.py)."""
        sums = np.asarray(sums, np.float32)
        if sums.shape != (len(self), 2):
            raise ValueError(f"reference log-probs of shape {sums.shape} for {len(self)} pairs")
        self.reference = sums

    def collate(self, instances: list[dict]) -> dict:
        """Stack pairs into rows: tokens uint32 [2P, T], label_mask [2P, T], ref_logps [2P]."""
        if self.reference is None:
            raise RuntimeError("PairDataset has no reference log-probs attached (olmo3/reference.py)")
        return {k: np.concatenate([x[k] for x in instances]) for k in ("tokens", "label_mask", "ref_logps")}

    @property
    def fingerprint(self) -> str:
        """sha256 over the kind, vocab, pad/eos ids, seq_len, the pair count and both files' sha256."""
        h = hashlib.sha256()
        h.update(f"kind={self.kind},vocab_size={self.vocab_size},pad_token_id={self.pad_id},"
                 f"eos_token_id={self.eos_id},dtype=uint32,sequence_length={self.seq_len},pairs={len(self)},".encode())
        h.update(f"tokens={self.manifest['token_ids_sha256']},masks={self.manifest['labels_mask_sha256']},".encode())
        return h.hexdigest()

    def __repr__(self) -> str:
        return f"{self.kind}({self.directory!r}: {len(self)} pairs padded to {self.seq_len} tokens)"


def _side(ids, mask, max_seq_length: int, where: str) -> tuple[UInt32[np.ndarray, " n"], Bool[np.ndarray, " n"]]:
    """One rendered sequence as stored, truncated: ids whole numbers in uint32's range, a mask of
    0 / 1 (or bools) as long as the ids; ValueError naming `where` otherwise. Labels in its place
    (open-instruct's -100 for an untrained token) read as True, every prompt token trained."""
    ids, mask = np.asarray(ids), np.asarray(mask)
    if ids.ndim != 1 or mask.ndim != 1 or len(ids) != len(mask):
        raise ValueError(f"{where}: token ids {ids.shape} and label mask {mask.shape} must be 1-D of one length")
    if len(ids) and (ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() > np.iinfo(np.uint32).max):
        raise ValueError(f"{where}: token ids must be whole numbers from 0 to 2**32 - 1 (got {ids.dtype}, "
                         f"{ids.min()} to {ids.max()})")
    if len(mask) and mask.dtype != bool and not np.isin(mask, (0, 1)).all():
        raise ValueError(f"{where}: the label mask holds {sorted(set(np.unique(mask).tolist()) - {0, 1})[:3]}; it "
                         "must be 0 / 1 (1: trained), not labels (-100 for an untrained token)")
    return ids[:max_seq_length].astype(np.uint32), mask[:max_seq_length].astype(bool)


def write_pairs(out_dir: str | os.PathLike, pairs, *, max_seq_length: int, info: dict | None = None,
                display: str | None = None) -> dict:
    """Write rendered pairs [((chosen_ids, chosen_mask), (rejected_ids, rejected_mask)), ...] into
    `out_dir` (the layout above). Each sequence is truncated to `max_seq_length`; a pair where either
    side keeps no trainable token is dropped (open-instruct `preference_tulu_filter_v1`). Files are
    written under temporary names and renamed, the manifest last: a crash leaves no half data set
    that reads as whole. `display`: the directory named in messages. Returns the manifest."""
    if isinstance(max_seq_length, bool) or not isinstance(max_seq_length, (int, np.integer)) or max_seq_length < 1:
        raise ValueError(f"max_seq_length={max_seq_length!r} must be a whole number >= 1")   # -1 cut a token off each side
    out_dir = os.fspath(out_dir)
    path = {name: os.path.join(out_dir, name) for name in (TOKENS, MASKS, MANIFEST)}
    lengths, dropped = [], 0
    sha = {TOKENS: hashlib.sha256(), MASKS: hashlib.sha256()}
    # Token and mask files are renamed into place when this block ends (nothing on an error),
    # after the old manifest is gone; the new manifest is written after them.
    with atomic.replacing(path[TOKENS]) as tmp_tokens, atomic.replacing(path[MASKS]) as tmp_masks:
        with open(tmp_tokens, "wb") as ft, open(tmp_masks, "wb") as fm:
            for n, (chosen, rejected) in enumerate(pairs, 1):
                sides = [_side(ids, m, max_seq_length, f"pair {n}, {name}")
                         for name, (ids, m) in (("chosen", chosen), ("rejected", rejected))]
                if not all(m.any() for _, m in sides):
                    dropped += 1
                    continue
                for ids, m in sides:
                    for name, f, buf in ((TOKENS, ft, ids.tobytes()), (MASKS, fm, m.tobytes())):
                        f.write(buf)
                        sha[name].update(buf)
                    lengths.append(len(ids))
        if not lengths:
            raise ValueError(f"no pair with a trainable token on both sides within --max_seq_length="
                             f"{max_seq_length} tokens (of {dropped}); nothing written to {display or out_dir}")
        if os.path.exists(path[MANIFEST]):   # no old manifest over new files, even mid-crash
            os.remove(path[MANIFEST])
    manifest = {"format": FORMAT, "pairs": len(lengths) // 2, "dropped": dropped, "max_seq_length": max_seq_length,
                "token_ids_sha256": sha[TOKENS].hexdigest(), "labels_mask_sha256": sha[MASKS].hexdigest(),
                **(info or {}), "lengths": lengths}
    atomic.write_json(path[MANIFEST], manifest)
    return manifest
