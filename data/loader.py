"""The training data loader: batches for consecutive global steps, prefetched in the background.

The batch of global step s is `get_batch(dataset, global_batch, seed, s, rank, num_ranks)`, a
pure function of the dataset (fixed-length `FSLDataset` or packed `PackedFSLDataset`, the same
order either way); workers only compute it ahead of time and batches are handed out strictly in step
order, so the worker count and the history of the loader cannot change what a step sees (DESIGN
§4, bug 3). The loader's state is just the next step to deliver plus what identifies the data
(seed, fingerprint, batch shape): a small JSON value saved atomically with the model state.
Restoring state N gives batch N next, exactly the batch an uninterrupted run would see at N.
"""
import collections
import concurrent.futures
import functools
import logging

import numpy as np
from jaxtyping import Int32, Integer

from data.dataset import FSLDataset
from data.filters import repetition_mask
from data.order import batch_indices, shuffled, steps_per_epoch
from data.packed import PackedFSLDataset, batch_fields
from data.padded import PaddedFSLDataset
from data.preference import PairDataset


def segment_ids(tokens: Integer[np.ndarray, "batch seq"], eos_id: int) -> Int32[np.ndarray, "batch seq"]:
    """Index of the document each token belongs to, counted from 0 within the instance.
    An eos belongs to the document it ends; the token after it starts the next one."""
    is_eos = (tokens == eos_id).astype(np.int32)
    return np.cumsum(is_eos, axis=1, dtype=np.int32) - is_eos


def get_batch(
    dataset: FSLDataset | PackedFSLDataset | PairDataset,
    global_batch: int,
    seed: int,
    step: int,
    rank: int = 0,
    num_ranks: int = 1,
    repetition_filter: bool = False,
) -> dict:
    """Rank `rank`'s share of global batch `step` (0-based, counted across epochs).

    Returns numpy arrays: `tokens` int32 [local_batch, seq_len]; `instance_mask` bool [local_batch]
    (False = masked by the repetition filter; all True when the filter is off); `segment_ids`
    int32 [local_batch, seq_len] (from eos positions for fixed-length instances, from the
    document lengths for packed ones); for packed / padded datasets `label_mask` bool
    [local_batch, seq_len] (False on padding and on masked labels); and `step` (int).
    """
    spe = steps_per_epoch(len(dataset), global_batch)
    epoch = step // spe
    idx = batch_indices(len(dataset), global_batch, seed, epoch, step % spe, rank, num_ranks)
    return _rows(dataset, [dataset[i] for i in idx], repetition_filter) | {"step": int(step)}


def _rows(dataset, instances: list, repetition_filter: bool = False) -> dict:
    if hasattr(dataset, "collate"):  # preference pairs (data/preference.py): rows chosen, rejected, ...
        out = dataset.collate(instances)
    elif isinstance(instances[0], dict):  # packed / padded: tokens, label_mask, doc_lens
        out = batch_fields(instances)
    else:
        raw = np.stack(instances)  # (local_batch, seq_len) uint32
        out = {"tokens": raw, "segment_ids": segment_ids(raw, dataset.eos_id)}
    raw = out["tokens"]
    out["tokens"] = raw.astype(np.int32)  # ids < 100278 fit; int32 is what the model embeds
    if not repetition_filter:
        out["instance_mask"] = np.ones(len(raw), dtype=bool)
    elif isinstance(dataset, PaddedFSLDataset):   # OLMo-core filters the document before padding it: its pad
        out["instance_mask"] = np.array([repetition_mask(row[None, :x["doc_lens"][0]])[0]   # run is no repetition
                                         for row, x in zip(raw, instances)])
    else:
        out["instance_mask"] = repetition_mask(raw)
    return out


def eval_plan(num_instances: int, *, batches: int, global_batch: int, devices: int) -> tuple[int, int]:
    """(rows per batch, batches) of a held-out domain's evaluation: rows a multiple of `devices`,
    at most `global_batch`, at most `batches` batches (0: as many global batches as the domain
    fills). Every instance when they fit (0: always), else the first `batches` x `global_batch`
    of get_eval_batch's order; a last partial batch is filled with rows that count nothing. The
    instances evaluated never depend on `devices`, so a domain's loss is the same number on any
    number of devices (up to the order of float sums)."""
    if num_instances < 1:
        return 0, 0
    most = batches or -(-num_instances // global_batch)
    per_batch = -(-num_instances // most)                              # ceil: every instance fits
    rows = min(global_batch, -(-per_batch // devices) * devices)       # whole rows on every device
    return rows, min(most, -(-num_instances // rows))


def eval_batch_instances(num_instances: int, rows: int, batch: int) -> int:
    """How many of held-out batch `batch`'s `rows` rows are the dataset's instances, not filler
    (see get_eval_batch)."""
    return max(0, min(rows, num_instances - batch * rows))


def get_eval_batch(dataset: FSLDataset | PackedFSLDataset, rows: int, batch: int, rank: int = 0,
                   num_ranks: int = 1) -> dict:
    """Rank `rank`'s share of held-out batch `batch`: instances [batch * rows, (batch + 1) * rows)
    of the evaluation order, rank r taking rows r, r + R, ... The order: a padded set's documents
    in file order (OLMo-core's evaluators); packed instances (SFT's held-out chats, longest
    first) and fixed-length windows in the seed-0 order of the data loader's first epoch, so a
    capped evaluation samples the whole domain. Rows past the end are filler
    whose label mask is all False (a window's is all True), so a domain of any size fills whole
    device batches and its loss counts exactly its own tokens."""
    if num_ranks < 1 or rows % num_ranks:
        raise ValueError(f"num_ranks={num_ranks} must divide rows={rows}")
    n = len(dataset)
    idx = np.arange(batch * rows, (batch + 1) * rows)[rank::num_ranks]
    order = np.arange(n) if isinstance(dataset, PaddedFSLDataset) else eval_order(n)
    packed = isinstance(dataset, PackedFSLDataset)
    # Masked, so any token of the vocabulary: dolma2's pad is none of a smaller one (eval.py's
    # held-out files of a model of another tokenizer), and its bytes were looked up out of range.
    filler = np.full(dataset.seq_len, dataset.pad_id if dataset.pad_id < dataset.vocab_size else 0, np.uint32)
    if packed:
        filler = {"tokens": filler, "label_mask": np.zeros(dataset.seq_len, bool),
                  "doc_lens": np.array([dataset.seq_len], np.int32)}
    out = _rows(dataset, [dataset[int(order[i])] if i < n else filler for i in idx])
    if not packed:   # a filler window's labels are masked (a masked instance would still count its
        # tokens, as OLMo-core's repetition filter does); every real window's are all kept
        out["label_mask"] = np.repeat((idx < n)[:, None], dataset.seq_len, axis=1)
    return out


@functools.lru_cache(maxsize=32)
def eval_order(num_instances: int) -> np.ndarray:
    """The held-out order of fixed-length windows and packed instances: batch_indices'
    permutation for seed 0, epoch 0, cached apart from its cache (which holds the training set's)."""
    return shuffled(num_instances, 0, 0)


class Loader:
    """Iterates batches for steps start_step, start_step + 1, ... forever (epochs roll over)."""

    def __init__(
        self,
        dataset: FSLDataset | PackedFSLDataset | PairDataset,
        global_batch: int,
        seed: int,
        rank: int = 0,
        num_ranks: int = 1,
        workers: int = 2,
        prefetch: int = 4,
        repetition_filter: bool = False,
        start_step: int = 0,
        contents: str | None = None,
    ):
        if num_ranks < 1 or global_batch % num_ranks:
            raise ValueError(f"num_ranks={num_ranks} must divide global_batch={global_batch}")
        if not 0 <= rank < num_ranks:
            raise ValueError(f"rank={rank} out of range for num_ranks={num_ranks}")
        if workers < 0 or prefetch < 1:
            raise ValueError(f"need workers >= 0 and prefetch >= 1, got workers={workers}, prefetch={prefetch}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self.dataset = dataset
        self.global_batch = int(global_batch)
        self.seed = int(seed)
        self.rank, self.num_ranks = int(rank), int(num_ranks)
        self.workers, self.prefetch = int(workers), int(prefetch)
        self.repetition_filter = bool(repetition_filter)
        self.steps_per_epoch = steps_per_epoch(len(dataset), self.global_batch)
        self._next_step = int(start_step)  # the step of the next batch __next__ returns
        self.contents = contents  # digest of the token files' contents, where known (data.prepare.contents_digest)
        self._pool = None
        self._pending = collections.deque()  # (step, future) for steps _next_step, _next_step + 1, ...

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.num_ranks

    @property
    def step(self) -> int:
        """The global step of the next batch to be delivered."""
        return self._next_step

    @property
    def epoch(self) -> int:
        return self._next_step // self.steps_per_epoch

    def batch(self, step: int) -> dict:
        """This rank's batch of global step `step` (no prefetch, no state change)."""
        return get_batch(self.dataset, self.global_batch, self.seed, step, self.rank, self.num_ranks,
                         self.repetition_filter)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        step = self._next_step
        if self.workers == 0:
            out = self.batch(step)
        else:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="data-loader")
            # Keep steps step .. step + prefetch - 1 in flight; results are taken strictly in order.
            nxt = self._pending[-1][0] + 1 if self._pending else step
            while len(self._pending) < self.prefetch:
                self._pending.append((nxt, self._pool.submit(self.batch, nxt)))
                nxt += 1
            pending_step, fut = self._pending.popleft()
            assert pending_step == step, (pending_step, step)
            out = fut.result()
        self._next_step = step + 1
        return out

    def state(self) -> dict:
        """JSON-able loader state; `step` is the next batch to deliver."""
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "step": self._next_step,
            "fingerprint": self.dataset.fingerprint,
            "global_batch": self.global_batch,
            "seq_len": self.dataset.seq_len,
        } | ({"packing": self.dataset.packing_digest} if hasattr(self.dataset, "packing_digest") else {}) | (
            {"contents": self.contents} if self.contents is not None else {})

    @classmethod
    def from_state(
        cls,
        dataset: FSLDataset | PackedFSLDataset | PairDataset,
        state: dict,
        rank: int = 0,
        num_ranks: int = 1,
        workers: int = 2,
        prefetch: int = 4,
        repetition_filter: bool = False,
        allow_fingerprint_mismatch: bool = False,
        contents: str | None = None,
    ) -> "Loader":
        """Resume at `state["step"]`. A different dataset fingerprint or batch shape is an error:
        silently training on other data after a restart is a real failure mode (DESIGN §4). So are
        other `contents` than the state's, where both are known."""
        missing = {"seed", "step", "fingerprint", "global_batch", "seq_len"} - set(state)
        if missing:
            raise ValueError(f"loader state lacks {sorted(missing)}; it is not a data.Loader.state() value")
        if state["seq_len"] != dataset.seq_len:
            raise ValueError(f"loader state has seq_len={state['seq_len']} but the dataset has seq_len={dataset.seq_len}")
        if state["fingerprint"] != dataset.fingerprint:
            packed = hasattr(dataset, "packing_digest")
            if packed != ("packing" in state):   # the same files read as other instances
                cause = ("this run packs documents (--packed) and the checkpoint's did not" if packed else
                         "the checkpoint's run packed documents (--packed) and this one does not")
                fix = f"{'drop' if packed else 'add'} --packed"
            else:
                cause, fix = "the token files changed since the checkpoint was written", "point the run at the original files"
            msg = (f"dataset fingerprint {dataset.fingerprint[:16]}... differs from the checkpoint's "
                   f"{str(state['fingerprint'])[:16]}...: {cause}, so the data order would differ. {fix.capitalize()}, "
                   "or pass allow_fingerprint_mismatch=True (train.py --allow_data_change) to continue on the new "
                   "data deliberately.")
        elif None not in (contents, state.get("contents")) and contents != state["contents"]:
            msg = (f"the token files' contents differ from the checkpoint's (digest {contents[:16]}... against "
                   f"{str(state['contents'])[:16]}...) though their names and sizes are the same: the corpus was "
                   "edited and prepared again since the checkpoint was written. Restore the original corpus, or "
                   "pass allow_fingerprint_mismatch=True (train.py --allow_data_change) to continue on the new "
                   "data deliberately.")
        elif "packing" in state and state["packing"] != getattr(dataset, "packing_digest", state["packing"]):
            msg = (f"the packed instances differ from the checkpoint's (packing digest {dataset.packing_digest[:16]}... "
                   f"against {str(state['packing'])[:16]}...) though the token files are the same: numpy's argsort "
                   "orders equal-length documents by the CPU's instruction set, and these were packed afresh on "
                   "another CPU type. Point --packing_cache at the indices the run was packed with, or resume on "
                   "the CPU type that packed them; allow_fingerprint_mismatch=True (train.py --allow_data_change) "
                   "continues on the new packing deliberately.")
        else:
            msg = None
        if msg and not allow_fingerprint_mismatch:
            raise ValueError(msg)
        if msg:
            logging.warning(msg)
        return cls(dataset, state["global_batch"], state["seed"], rank=rank, num_ranks=num_ranks, workers=workers,
                   prefetch=prefetch, repetition_filter=repetition_filter, start_step=state["step"],
                   contents=contents)

    def close(self):
        for _, fut in self._pending:
            fut.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
