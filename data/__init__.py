"""The data side of the OLMo 3 recipe: dolma2 tokenizer, corpus preparation, the OLMo-core
fixed-length token dataset, its packed and padded variants, the exactly-once global order, and the resumable loader.

`data.prepare` is the corpus-preparation module (also `python -m data.prepare`); its main entry
points are re-exported lazily so that `python -m data.prepare` does not import itself twice.
"""
import importlib

from data import tokenizer
from data.dataset import FSLDataset
from data.filters import repetition_mask
from data.loader import Loader, eval_batch_instances, eval_order, eval_plan, get_batch, get_eval_batch, segment_ids
from data.order import batch_indices, steps_per_epoch
from data.packed import PackedFSLDataset
from data.padded import PaddedFSLDataset
from data.preference import PairDataset
from data.tokenizer import EOS_ID, PAD_ID, VOCAB_SIZE, dolma2

_FROM_PREPARE = ("ensure_corpus", "load_manifest", "open_split", "verify")


def __getattr__(name):
    if name in ("prepare", "corpus"):
        return importlib.import_module(f"data.{name}")
    if name in _FROM_PREPARE:
        return getattr(importlib.import_module("data.prepare"), name)
    raise AttributeError(f"module 'data' has no attribute {name!r}")


__all__ = [
    "EOS_ID", "PAD_ID", "VOCAB_SIZE", "FSLDataset", "Loader", "PackedFSLDataset", "PaddedFSLDataset", "PairDataset",
    "batch_indices", "dolma2", "eval_batch_instances", "eval_order", "eval_plan", "get_batch", "get_eval_batch",
    "repetition_mask", "segment_ids", "steps_per_epoch", "tokenizer", *_FROM_PREPARE,
]
