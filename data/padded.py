"""Padded instances: one held-out document per instance, padded to `seq_len`.

    ds[i] = document i (file order; documents as in data/packing.py, truncated to seq_len)
            + [pad] * (seq_len - len), label_mask False on the padding,
            doc_lens = [len(document), padding runs]

OLMo-core's `NumpyPaddedFSLDataset` (`data/numpy_dataset.py`), which its validation sets use:
every held-out document is scored from its first token, none is split across instances, and
padding is never counted in the loss. train.py evaluates held-out domains on it, so a domain
with fewer documents than devices is still evaluated (its last batch is filled with rows whose
label mask is all False). tests/test_data_packed.py checks ours equal OLMo-core's. A file with
tokens but no eos is refused, as OLMo-core refuses it, instead of silently scoring the others.

Why a subclass of the packed dataset: the files, label masks, reading, padding and fingerprint
are the same; only the grouping differs (each document is its own instance, in file order).
"""
import numpy as np

from data import packing, storage
from data.packed import PackedFSLDataset
from data.tokenizer import EOS_ID, PAD_ID, VOCAB_SIZE


class PaddedFSLDataset(PackedFSLDataset):
    """`len(ds)` = number of documents; `ds[i] -> {"tokens", "label_mask", "doc_lens"}`."""

    kind = "PaddedFSLDataset"

    def __init__(self, paths, seq_len: int, *, label_mask_paths=None, vocab_size: int = VOCAB_SIZE,
                 eos_id: int = EOS_ID, pad_id: int = PAD_ID, cache_dir=None):
        super().__init__(paths, seq_len, source_group_size=1, label_mask_paths=label_mask_paths,
                         vocab_size=vocab_size, eos_id=eos_id, pad_id=pad_id, cache_dir=cache_dir)

    def _group(self, files: range, cache_dir) -> dict:
        (k,) = files
        spans = packing.document_spans(self._files[k], self.eos_id, self.seq_len, self.vocab_size)
        if self.file_sizes[k] and not len(spans):   # OLMo-core stops too; an empty file holds no token
            raise ValueError(f"held-out token file {self.paths[k]!r} has {self.file_sizes[k] // storage.ITEMSIZE} "
                             f"tokens but no eos (id {self.eos_id}), so no document to score; is it a file of "
                             "this tokenizer, written with an eos after each document?")
        return {"files": np.array([k]), "file_starts": np.array([0, self.file_sizes[k] // storage.ITEMSIZE]),
                "spans": spans, "offsets": np.arange(len(spans) + 1), "docs": np.arange(len(spans))}

    def _fingerprint_fields(self) -> str:
        return ""
