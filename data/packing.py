"""Documents of token files, and their Optimized Best-Fit Decreasing packing into instances.

    docs   = [(s, e) for each eos at position p: e = p + 1; s = previous e]   # per file, eos kept
    docs   = [(s, min(e, s + seq_len))]                                       # long docs truncated
    order  = argsort(-(e - s))                                                # longest first
    for doc in order:                                                         # best fit
        c = smallest free space >= len(doc) among open instances, else open a new one (space seq_len)
        put doc in the first-opened instance with free space c; its space becomes c - len(doc)

This is OLMo-core's packing (`data/utils.py`: `iter_document_indices`,
`iter_document_indices_with_max_sequence_length`, `InstancePacker`; arXiv 2404.10830, App. B),
rewritten from its semantics so that our instances equal its `NumpyPackedFSLDataset`'s one for
one (tests/test_data_packed.py checks that against the installed package):

- A document ends at (and includes) an eos; tokens after a file's last eos belong to no document
  and are dropped. An empty document is the eos alone (length 1).
- "Truncate" long-document strategy (OLMo-core's default): a document longer than `seq_len`
  keeps its first `seq_len` tokens; the rest is dropped.
- Ties between documents of equal length keep the order of numpy's default `argsort` of the
  negated int64 lengths, which is what OLMo-core calls; the packing itself never depends on the
  tie order, only which of two equal-length documents lands in which slot.
- Among open instances with the same free space the one that got that space first is used (a
  FIFO per free space). OLMo-core finds the smallest fitting space with a segment tree over
  capacities; a sorted list of the free spaces in use gives the same answer in fewer lines.
"""
import bisect
import collections

import numpy as np
from jaxtyping import Int32, Int64, Integer

from data import storage

# Tokens per read when scanning a file for eos (4 bytes each: 256 MB per read).
SCAN_TOKENS = 1 << 26


def document_spans(file, eos_id: int, seq_len: int | None = None, vocab_size: int | None = None
                   ) -> Int64[np.ndarray, "docs 2"]:
    """[start, end) token offsets of the documents of one token file (`data.storage` reader),
    each truncated to `seq_len` tokens when given. Tokens after the last eos are no document.
    `vocab_size`: a token id at or above it stops the scan (ValueError naming the file), before
    a run starts rather than when its instance is drawn."""
    n = file.nbytes // 4
    ends = []
    for a in range(0, n, SCAN_TOKENS):
        chunk = file.read(a, min(n, a + SCAN_TOKENS))
        if vocab_size is not None and len(chunk):
            if int(chunk.max()) >= vocab_size:
                at = int(np.argmax(chunk >= vocab_size))
                raise storage.token_range_error(file, f", token {a + at}", int(chunk[at]), vocab_size)
            if a == 0 and storage.wide_integers(chunk[:4096]):
                raise storage.wide_integers_error(file, "")
        ends.append(np.flatnonzero(chunk == eos_id).astype(np.int64) + a + 1)
    ends = np.concatenate(ends) if ends else np.zeros(0, np.int64)
    starts = np.concatenate([[0], ends])[:-1].astype(np.int64)
    if seq_len is not None:
        ends = np.minimum(ends, starts + seq_len)
    return np.stack([starts, ends], axis=1)


def pack(lengths: Integer[np.ndarray, " docs"], seq_len: int) -> tuple[Int64[np.ndarray, " docs"], list[list[int]]]:
    """OBFD: (order, instances). `order[k]` is the document placed k-th (longest first);
    `instances[i]` lists positions in `order`, in the order they were put into instance i.
    Every length must be in 1..seq_len."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (lengths.min() < 1 or lengths.max() > seq_len):
        raise ValueError(f"document lengths must be in 1..{seq_len}, got {lengths.min()}..{lengths.max()}")
    order = np.argsort(-lengths)  # numpy's default kind, as OLMo-core: same tie order
    instances: list[list[int]] = []
    by_space = collections.defaultdict(collections.deque)  # free space -> instances, oldest first
    spaces: list[int] = []  # sorted free spaces (< seq_len) that some open instance has
    for k, length in enumerate(lengths[order].tolist()):
        j = bisect.bisect_left(spaces, length)
        if j == len(spaces):  # nothing fits: a new instance
            space, i = seq_len, len(instances)
            instances.append([])
        else:
            space = spaces[j]
            i = by_space[space].popleft()
            if not by_space[space]:
                spaces.pop(j)
        instances[i].append(k)
        left = space - length
        if left > 0:
            if not by_space[left]:
                bisect.insort(spaces, left)
            by_space[left].append(i)
    return order, instances


def document_lengths(tokens: Integer[np.ndarray, " seq"], eos_id: int) -> Int32[np.ndarray, " docs"]:
    """Lengths of the eos-terminated runs of `tokens`; a tail without eos is one more run (OLMo-core
    `get_document_lengths` without bos). Their sum is len(tokens)."""
    cuts = np.flatnonzero(np.asarray(tokens) == eos_id) + 1
    if len(tokens) and (not len(cuts) or cuts[-1] != len(tokens)):
        cuts = np.append(cuts, len(tokens))
    return np.diff(np.concatenate([[0], cuts])).astype(np.int32)


def segments_from_lengths(doc_lens: Integer[np.ndarray, " docs"]) -> Int32[np.ndarray, " seq"]:
    """Document index of every token (0, 0, 1, 1, 1, 2, ...) from the document lengths."""
    return np.repeat(np.arange(len(doc_lens), dtype=np.int32), np.asarray(doc_lens, dtype=np.int64))
