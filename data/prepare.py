"""Documents -> OLMo-core token files + a JSON manifest.

    python -m data.prepare --source=stdlib --out_dir=runs/corpus
    python -m data.prepare --source=/data/my_corpus --out_dir=runs/my_corpus
    python -m data.prepare --source="stdlib-code:0.3,/data/web:0.7" --out_dir=runs/mix

Output format (OLMo-core `NumpyFSLDataset` input): headerless uint32 token files (the `.npy` name
is OLMo-core's convention; they are raw memmaps, not NumPy files), every document as AI2's `dolma
tokens` writes it (its text stripped, blank documents skipped, one eos (100257) after it), at
most `max_tokens_per_file` tokens per file (a single longer document gets a file of its own), one
directory per split: `train/`, `heldout/<domain>/`. `manifest.json` records the tokenizer, the
inputs' digest, and per split and file the document and token counts and sha256.

Determinism: documents are read in a fixed order, encoded in parallel processes but written in
input order, and the manifest holds no timestamps, so identical inputs give byte-identical
files. Every file is written under a temporary name and renamed when complete; the manifest is
written last and is the commit point (a directory without a valid manifest is rebuilt).

A mixture "a:w1,b:w2" tokenizes each source on its own (under `sources/<i>/`), then builds
`train/` from whole documents of each source's train split so that source i supplies a fraction
w_i / sum(w) of the train tokens; by default the total is the largest that repeats no source,
`--mixture_tokens` sets it (a source that must supply more than it has is repeated from its
start, as OLMo-core upsamples). Held-out splits stay per domain and are never mixed into train.
"""
import concurrent.futures
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator

import numpy as np
from absl import logging

from data import corpus as corpus_lib
from data import storage
from data.dataset import FSLDataset
from data.tokenizer import CL100K_SHA256, EOS_ID, PAD_ID, VOCAB_SIZE, dolma2, encode_to_numpy
from olmo3 import atomic

MANIFEST = "manifest.json"
FORMAT = "olmo-core-fsl-uint32/v1"
# How documents are split (data/corpus.py), recorded in the manifest; builds from before it hashed
# "<corpus folder name>/<path>" for directory corpora (the built-in one is split as it always was).
SPLIT = "sha256 of the path inside the corpus"
DEFAULT_MAX_TOKENS_PER_FILE = 2**28  # 1 GiB of uint32 per file
_CHUNK_CHARS = 1 << 20  # documents are sent to workers in chunks of about this many characters
# What the ids are, recorded in the manifest: a build made under other rules is rebuilt.
TOKENIZER = {"name": "dolma2", "cl100k_sha256": CL100K_SHA256, "vocab_size": VOCAB_SIZE, "eos_id": EOS_ID,
             "pad_id": PAD_ID, "documents": "dolma 1.2.1 tokenize_file: stripped, blank ones skipped, eos after each",
             "added_tokens": "dolma2 tokenizer.json, the non-special ones matched in text"}


# ---------------------------------------------------------------------------------------------
# Encoding, in parallel processes, results in input order


def _encode_chunk(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Worker: a list of documents -> (all tokens with an eos after each document, per-document lengths).

    As AI2's `dolma tokens` (dolma 1.2.1 tokenizer.py `tokenize_file`) encodes a document: its text
    stripped of leading and trailing whitespace, then an eos. A literal "<|endoftext|>" inside is
    text (its runs pass --tokenizer.encode_special_tokens), so only prepare places eos tokens."""
    ids = [encode_to_numpy(t.strip()) for t in texts]
    lengths = np.array([len(x) + 1 for x in ids], dtype=np.int64)
    ends = np.cumsum(lengths)
    out = np.empty(int(ends[-1]) if len(ends) else 0, dtype=np.uint32)
    for x, end in zip(ids, ends):
        out[end - 1 - len(x) : end - 1] = x
    out[ends - 1] = EOS_ID
    return out, lengths


def _chunks(docs: Iterable[corpus_lib.Document]) -> Iterator[list[corpus_lib.Document]]:
    chunk, chars = [], 0
    for d in docs:
        chunk.append(d)
        chars += len(d.text)
        if chars >= _CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _exit_with_parent(parent: int) -> None:
    """Worker start: SIGKILL when the process that started it dies. Without it, a SIGKILLed
    prepare (a job's time limit, the OOM killer) left its workers blocked on the task queue
    forever, each holding the tokenizer."""
    from olmo3.launch import signal_when_parent_dies
    signal_when_parent_dies(signal.SIGKILL, parent)


def encode_documents(docs: Iterable[corpus_lib.Document], workers: int) -> Iterator[tuple[list[corpus_lib.Document], np.ndarray, np.ndarray]]:
    """Yield (documents, tokens, lengths) per chunk, in input order, encoding in `workers` processes.
    A document of whitespace only is left out, as `dolma tokens` skips it."""
    docs = (d for d in docs if d.text.strip())
    if workers <= 1:
        for chunk in _chunks(docs):
            yield (chunk, *_encode_chunk([d.text for d in chunk]))
        return
    # fork is nearly free and the children inherit the loaded tokenizer, but forking a process that
    # runs threads (JAX starts several) can deadlock the child: then pay for spawn instead.
    if threading.active_count() == 1 and "jax" not in sys.modules:
        dolma2()
        ctx = multiprocessing.get_context("fork")
    else:
        ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_exit_with_parent,
                                                initargs=(os.getpid(),)) as pool:
        pending = []
        for chunk in _chunks(docs):
            pending.append((chunk, pool.submit(_encode_chunk, [d.text for d in chunk])))
            if len(pending) >= 2 * workers:
                chunk0, fut = pending.pop(0)
                yield (chunk0, *fut.result())
        for chunk0, fut in pending:
            yield (chunk0, *fut.result())


# ---------------------------------------------------------------------------------------------
# Writing token files


class _Progress:
    """Progress with tokens/s on stderr: one line redrawn in place on a terminal; in a log file
    (not a terminal, where carriage returns pile up into one endless line) a line every 30 s."""

    def __init__(self, label: str, enabled: bool):
        self.label, self.enabled = label, enabled
        self.tty = sys.stderr.isatty()
        self.every = 0.5 if self.tty else 30.0
        self.t0 = self.last = time.perf_counter()
        self.tokens = self.docs = 0

    def update(self, tokens: int, docs: int):
        self.tokens += tokens
        self.docs += docs
        now = time.perf_counter()
        if self.enabled and now - self.last > self.every:
            self.last = now
            self._print(final=False)

    def _print(self, final: bool):
        dt = max(time.perf_counter() - self.t0, 1e-9)
        text = (f"{self.label}: {self.docs:,} docs, {self.tokens / 1e6:.2f}M tokens, "
                f"{self.tokens / dt / 1e6:.2f}M tokens/s")
        sys.stderr.write(f"\r{text}   " + ("\n" if final else "") if self.tty else text + "\n")
        sys.stderr.flush()

    def done(self):
        if self.enabled:
            self._print(final=True)


class _SplitWriter:
    """Appends whole documents to `<out>/<split>/<split>-NNNNN.npy`, starting a new file before one
    would exceed `max_tokens` tokens."""

    def __init__(self, out_dir: str, split: str, max_tokens: int, created: list[str]):
        self.out_dir, self.split, self.max_tokens = out_dir, split, max_tokens
        self.files: list[dict] = []
        self._created = created  # every file it writes, deleted if the build fails
        self._f = None

    def _open(self):
        k = len(self.files)
        rel = f"{self.split}/{self.split.replace('/', '-')}-{k:05d}.npy"
        path = os.path.join(self.out_dir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = atomic.temporary_name(path)
        self._created.append(tmp)
        self._f = open(tmp, "wb")
        self._cur = {"path": rel, "tokens": 0, "documents": 0, "sha256": hashlib.sha256(), "_tmp": tmp}

    def _close_file(self):
        if self._f is None:
            return
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._f = None
        cur = self._cur
        os.replace(cur.pop("_tmp"), os.path.join(self.out_dir, cur["path"]))
        self._created.append(os.path.join(self.out_dir, cur["path"]))
        cur["sha256"] = cur["sha256"].hexdigest()
        self.files.append(cur)

    def add(self, tokens: np.ndarray, lengths: np.ndarray):
        """Append documents: `tokens` is their concatenation, `lengths[i]` the length of document i."""
        ends = np.cumsum(lengths)
        i, n = 0, len(lengths)
        while i < n:
            if self._f is None:
                self._open()
            base = int(ends[i - 1]) if i else 0
            room = self.max_tokens - self._cur["tokens"]
            k = int(np.searchsorted(ends[i:] - base, room, side="right"))  # documents that fit
            if k == 0:
                if self._cur["tokens"]:
                    self._close_file()
                    continue
                k = 1  # a document longer than the bound gets a file of its own
            block = tokens[base : int(ends[i + k - 1])]
            data = block.tobytes()
            self._f.write(data)
            self._cur["sha256"].update(data)
            self._cur["tokens"] += len(block)
            self._cur["documents"] += k
            i += k
            if self._cur["tokens"] >= self.max_tokens:
                self._close_file()

    def close(self) -> dict:
        self._close_file()
        return {
            "documents": sum(f["documents"] for f in self.files),
            "tokens": sum(f["tokens"] for f in self.files),
            "files": self.files,
        }


def _remove_written(created: list[str], out_dir: str):
    """Delete the files a failed build wrote into `out_dir` (temporaries and finished parts) and
    the split directories under it left empty."""
    for p in created:
        if os.path.exists(p):
            os.remove(p)
    top = os.path.abspath(out_dir)
    for d in sorted({os.path.abspath(os.path.dirname(p)) for p in created}, key=len, reverse=True):
        while d.startswith(top + os.sep):
            try:
                os.rmdir(d)
            except OSError:   # not empty: files of an earlier build
                break
            d = os.path.dirname(d)


# ---------------------------------------------------------------------------------------------
# Sources -> splits


def _effective_heldout(fraction: float | None) -> dict:
    if fraction is not None:
        return {"default": fraction}
    return {"default": corpus_lib.HELDOUT_FRACTION, **corpus_lib.DOMAIN_HELDOUT_FRACTION}


def inputs_digest(source: str) -> str:
    """sha256 over every document's name and text, in order: what the token files are built from."""
    h = hashlib.sha256()
    for d in corpus_lib.documents(source):
        h.update(d.name.encode("utf-8") + b"\0" + d.text.encode("utf-8", errors="replace") + b"\0")
    return h.hexdigest()


def _tokenize_source(source: str, out_dir: str, prefix: str, workers: int, max_tokens: int,
                     heldout_fraction: float | None, progress: bool, created: list[str]) -> tuple[dict, str]:
    writers: dict[str, _SplitWriter] = {}
    digest = hashlib.sha256()
    bar = _Progress(f"prepare {source}", progress)

    def hashed(docs):
        for d in docs:
            digest.update(d.name.encode("utf-8") + b"\0" + d.text.encode("utf-8", errors="replace") + b"\0")
            yield d

    for chunk, tokens, lengths in encode_documents(hashed(corpus_lib.documents(source)), workers):
        # Route each document to its split; consecutive documents of one split are written together.
        splits = [corpus_lib.split_of(d, heldout_fraction) for d in chunk]
        ends = np.concatenate([[0], np.cumsum(lengths)])
        i = 0
        while i < len(chunk):
            j = i
            while j < len(chunk) and splits[j] == splits[i]:
                j += 1
            name = prefix + splits[i]
            if name not in writers:
                writers[name] = _SplitWriter(out_dir, name, max_tokens, created)
            writers[name].add(tokens[ends[i] : ends[j]], lengths[i:j])
            i = j
        bar.update(len(tokens), len(chunk))
    bar.done()
    return {name: w.close() for name, w in sorted(writers.items())}, digest.hexdigest()


def _require_train(source: str, splits: dict, train: str) -> None:
    if train not in splits:   # every document blank or held out: nothing to train on
        raise ValueError(f"corpus {source!r} gives no training document: "
                         f"{'every document is blank' if not splits else 'every document is held out'}; "
                         "add documents, lower --heldout_fraction, or drop the source")


def _doc_blocks(out_dir: str, split: dict) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Whole documents of a written split, one (tokens, lengths) block per file."""
    for f in split["files"]:
        tokens = np.fromfile(os.path.join(out_dir, f["path"]), dtype=np.uint32)
        ends = np.flatnonzero(tokens == EOS_ID) + 1
        yield tokens, np.diff(ends, prepend=0)


def _mix(out_dir: str, parts: list[tuple[dict, float]], total: int | None, max_tokens: int,
         created: list[str]) -> tuple[dict, list[dict]]:
    """Train split from whole documents of each source's train split, token shares ~ weights."""
    weights = np.array([w for _, w in parts], dtype=np.float64)
    frac = weights / weights.sum()
    available = [p["tokens"] for p, _ in parts]
    asked = total is not None
    if total is None:
        total = int(min(a / f for a, f in zip(available, frac)))
    # Before, a large mixture_tokens wrote until the disk was full. An earlier build's files are
    # gone by now (_remove_leftovers), their space free.
    free = shutil.disk_usage(out_dir).free
    if total * 4 > free:
        what = (f"mixture_tokens={total:,}" if asked
                else f"the mixture's {total:,} train tokens (the default: the most that repeats no source)")
        raise ValueError(f"{what} needs {total * 4 / 2**30:.1f} GiB of uint32 tokens in {out_dir}, which has "
                         f"{free / 2**30:.1f} GiB free; ask for fewer tokens (--mixture_tokens) or free space")
    writer = _SplitWriter(out_dir, "train", max_tokens, created)
    report = []
    for (split, w), f, avail in zip(parts, frac, available):
        target = int(round(f * total))
        taken = 0
        while taken < target:  # cycle through the source (upsampling) until it has supplied its share
            for tokens, lengths in _doc_blocks(out_dir, split):
                ends = np.cumsum(lengths)
                k = min(int(np.searchsorted(ends, target - taken, side="left")) + 1, len(lengths))
                writer.add(tokens[: int(ends[k - 1])], lengths[:k])
                taken += int(ends[k - 1])
                if taken >= target:
                    break
        report.append({"weight": w, "train_tokens_available": avail, "train_tokens_taken": taken})
    return writer.close(), report


def prepare(
    source: str,
    out_dir: str,
    *,
    workers: int | None = None,
    max_tokens_per_file: int = DEFAULT_MAX_TOKENS_PER_FILE,
    heldout_fraction: float | None = None,
    mixture_tokens: int | None = None,
    progress: bool = True,
) -> dict:
    """Tokenize `source` ("stdlib", a directory, or a mixture "a:w,b:w") into `out_dir`; returns the manifest."""
    if max_tokens_per_file < 1:
        raise ValueError(f"max_tokens_per_file must be >= 1, got {max_tokens_per_file}")
    if heldout_fraction is not None and not 0 <= heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    workers = (os.cpu_count() or 1) if workers is None else workers
    sources = corpus_lib.parse_mixture(source)
    if mixture_tokens is not None and len(sources) == 1:   # it was ignored: the whole source was written
        raise ValueError(f"mixture_tokens={mixture_tokens:,} (--mixture_tokens) sizes a mixture of sources "
                         f"('a:w,b:w'); {source!r} is one source: drop it, or name the sources to mix")
    if os.path.isfile(out_dir):
        raise ValueError(f"out_dir {out_dir!r} is a file; give a directory for the token files")
    if os.path.islink(out_dir) and not os.path.exists(out_dir):   # makedirs said only "File exists"
        raise ValueError(f"out_dir {out_dir!r} is a symlink to {os.readlink(out_dir)!r}, which does not exist; "
                         "create that directory, or give another out_dir")
    atomic.check_writable(out_dir, "out_dir")   # /proc/x was a bare errno, after the tokenizer loaded
    _require_ours(out_dir)
    made = not os.path.exists(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    manifest_path = os.path.join(out_dir, MANIFEST)
    if os.path.exists(manifest_path):
        before = _manifest_source(out_dir)
        if before is not None and not corpus_lib.same_mixture(before, source):   # it went without a word
            logging.warning("%s held the prepared corpus of %r; replacing it with %r", out_dir, before, source)
        os.remove(manifest_path)  # the old commit point goes first: a crash below leaves no stale manifest
    _remove_leftovers(out_dir)
    created: list[str] = []
    try:
        if len(sources) == 1:
            splits, digest = _tokenize_source(sources[0][0], out_dir, "", workers, max_tokens_per_file,
                                              heldout_fraction, progress, created)
            inputs = [{"source": sources[0][0], "sha256": digest}]
            mixture = None
            _require_train(sources[0][0], splits, "train")
        else:
            splits, inputs, parts = {}, [], []
            for i, (src, w) in enumerate(sources):
                sub, digest = _tokenize_source(src, out_dir, f"sources/{i}/", workers, max_tokens_per_file,
                                               heldout_fraction, progress, created)
                inputs.append({"source": src, "sha256": digest})
                _require_train(src, sub, f"sources/{i}/train")
                parts.append((sub[f"sources/{i}/train"], w))
                for name, split in sub.items():  # held-out splits per domain, across sources
                    if name != f"sources/{i}/train":
                        dom = name.split("/", 2)[2]
                        merged = splits.setdefault(dom, {"documents": 0, "tokens": 0, "files": []})
                        for key in ("documents", "tokens"):
                            merged[key] += split[key]
                        merged["files"] += split["files"]
            splits["train"], mixture = _mix(out_dir, parts, mixture_tokens, max_tokens_per_file, created)
            for entry, (src, _) in zip(mixture, sources):
                entry["source"] = src
    except BaseException:   # nothing of a failed build stays behind: no commit point, so no corpus
        if made:
            shutil.rmtree(out_dir, ignore_errors=True)
        else:
            _remove_written(created, out_dir)
        raise
    manifest = {
        "format": FORMAT,
        "tokenizer": TOKENIZER,
        "source": source,
        "inputs": inputs,
        "heldout_fraction": _effective_heldout(heldout_fraction),
        "split": SPLIT,
        "max_tokens_per_file": max_tokens_per_file,
        "mixture": mixture,
        "mixture_tokens": mixture_tokens,
        "splits": dict(sorted(splits.items())),
    }
    if any(s in corpus_lib.BUILTIN for s, _ in sources):
        manifest["stdlib"] = corpus_lib.stdlib_description()
    atomic.write_json(manifest_path, manifest, indent=1, sort_keys=True)
    return manifest


def _require_ours(out_dir: str) -> None:
    """A rebuild replaces the manifest and token files of `out_dir`: it must be new, empty, or a
    prepared corpus (its manifest, train/, heldout/, sources/, packing/ and hidden temporaries),
    never a folder of someone's other files."""
    if not os.path.isdir(out_dir):
        return
    other = sorted(e for e in os.listdir(out_dir)
                   if not e.startswith(".") and e not in (MANIFEST, *_SPLIT_DIRS, PACKING))
    foreign = f"holds {other[:3]}" if other else None
    try:
        with open(os.path.join(out_dir, MANIFEST)) as f:
            manifest = json.load(f)
        if not (isinstance(manifest, dict) and manifest.get("format") == FORMAT):
            foreign = foreign or f"holds a {MANIFEST} that is not a prepared corpus's"
    except (OSError, ValueError):   # none, or torn: a build of ours that stopped half-way is rebuilt
        pass
    if foreign:
        raise ValueError(f"out_dir {out_dir!r} {foreign}; a prepared corpus is written into a new or empty "
                         "directory (or over an earlier prepared corpus), so give another directory")


def _manifest_source(out_dir: str) -> str | None:
    """The source a prepared corpus in `out_dir` was built from; None without a readable manifest."""
    try:
        with open(os.path.join(out_dir, MANIFEST)) as f:
            return json.load(f).get("source")
    except (OSError, ValueError, AttributeError):
        return None


_SPLIT_DIRS = ("train", "heldout", "sources")   # what `prepare` writes beside the manifest
PACKING = "packing"   # train.py --packed's default cache of the packings of these token files


def _remove_leftovers(out_dir: str) -> None:
    """Before a build, whose manifest is gone: every file an earlier build wrote beside it (its
    token files, which the new manifest need not all list: a smaller source left the old build's
    later files there, for a glob of train/*.npy to mix in, and its disk never freed), the hidden
    temporaries of a build that was killed (a SIGKILL runs no cleanup), and the packings cached
    from the token files it replaces. One build writes a directory at a time."""
    for name in (PACKING, *_SPLIT_DIRS):
        shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Reading back


def load_manifest(out_dir: str) -> dict:
    """The manifest of a prepared directory, or a clear error naming the file."""
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist; build it with `python -m data.prepare --out_dir={out_dir}`")
    try:
        with open(path) as f:
            manifest = json.load(f)
        if manifest["format"] != FORMAT:
            raise ValueError(f"format {manifest['format']!r}, expected {FORMAT!r}")
        for split in manifest["splits"].values():
            for entry in split["files"]:
                _ = entry["path"], int(entry["tokens"]), entry["sha256"]
        # what verify and ensure_corpus compare (a KeyError there was a traceback, exit 1: retried)
        for key, kind in (("tokenizer", dict), ("inputs", list), ("heldout_fraction", dict)):
            if not isinstance(manifest[key], kind):
                raise TypeError(f"{key!r} is a {type(manifest[key]).__name__}, not a JSON "
                                f"{'object' if kind is dict else 'array'}")
        _ = manifest["max_tokens_per_file"], manifest["mixture_tokens"], manifest["heldout_fraction"]["default"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{path}: unreadable manifest ({type(e).__name__}: {e}); delete it and rebuild "
                         f"with `python -m data.prepare --out_dir={out_dir}`") from e
    return manifest


def verify(out_dir: str, check_sha256: bool = True) -> dict:
    """Check every file against the manifest (existence, size, sha256); returns the manifest."""
    manifest = load_manifest(out_dir)
    if manifest["tokenizer"].get("cl100k_sha256") != CL100K_SHA256:
        raise ValueError(f"{os.path.join(out_dir, MANIFEST)}: built with another tokenizer; rebuild it")
    for split in manifest["splits"].values():
        for entry in split["files"]:
            path = os.path.join(out_dir, entry["path"])
            if not os.path.exists(path):
                raise FileNotFoundError(f"token file {path} listed in the manifest is missing; rebuild with `python -m data.prepare`")
            size = os.path.getsize(path)
            if size != 4 * entry["tokens"]:
                raise ValueError(f"token file {path} has {size} bytes, the manifest says {4 * entry['tokens']}: "
                                 "it is truncated or was replaced; rebuild with `python -m data.prepare`")
            if check_sha256 and storage.file_sha256(path) != entry["sha256"]:
                raise ValueError(f"token file {path}: sha256 differs from the manifest; it is corrupt, rebuild it")
    return manifest


def split_paths(out_dir: str, manifest: dict) -> dict[str, list[str]]:
    return {name: [os.path.join(out_dir, f["path"]) for f in split["files"]]
            for name, split in manifest["splits"].items()}


def open_split(out_dir: str, split: str, seq_len: int) -> FSLDataset:
    """An FSLDataset over one split, with file sizes checked against the manifest."""
    manifest = load_manifest(out_dir)
    if split not in manifest["splits"]:
        raise KeyError(f"{out_dir}: no split {split!r}; it has {sorted(manifest['splits'])}")
    files = manifest["splits"][split]["files"]
    return FSLDataset([os.path.join(out_dir, f["path"]) for f in files], seq_len,
                      expected_tokens=[f["tokens"] for f in files])


def default_dir_name(corpus: str) -> str:
    """The folder a run prepares `corpus` in when no --data_dir is given: a built-in source by its
    name; directories by their names and a hash of their absolute paths and weights, so that
    /a/web and /b/web never build over each other, and /data/web/ is /data/web."""
    if corpus in corpus_lib.BUILTIN:
        return corpus
    parts = corpus_lib.parse_mixture(corpus)
    spelled = ",".join(f"{s if s in corpus_lib.BUILTIN else os.path.abspath(s)}:{w!r}" for s, w in parts)
    names = "+".join(os.path.basename(s) or "root" for s, _ in parts)[:48]
    return f"{names}-{hashlib.sha256(spelled.encode()).hexdigest()[:10]}"


def contents_digest(out_dir: str, split: str) -> str:
    """sha256 over the split's token files' sha256s, in order, from the manifest: what a
    resumed run checks besides the names and sizes in the dataset's fingerprint (a document edited
    to another text of the same token count changes only this)."""
    files = load_manifest(out_dir)["splits"][split]["files"]
    return hashlib.sha256("\n".join(f["sha256"] for f in files).encode()).hexdigest()


def check_out_dir(path: str, flag: str) -> None:
    """Stop with one line naming `flag` unless `path` holds a build (only read then: it may be on
    a read-only mount) or token files can be written there."""
    if os.path.exists(os.path.join(path, MANIFEST)):
        atomic.existing_directory(path, flag)
    else:
        atomic.check_writable(path, flag)


def ensure_corpus(out_dir: str, corpus: str = "stdlib", **prepare_kwargs) -> dict[str, list[str]]:
    """Token files of `corpus` under `out_dir`, built only if missing or stale: {split: [paths]}.

    The existing build is reused when its manifest is readable, was built from identical inputs
    (digest of every document) with the same tokenizer and the settings given, and every file
    matches its recorded size and sha256; otherwise it is rebuilt, with its own settings where none
    are given. A build of another source is refused (ValueError), never replaced. With several
    processes, call it from one (process 0) and let the others wait: concurrent rebuilds are
    identical but redundant.
    """
    sources = corpus_lib.parse_mixture(corpus)  # a missing source is the user's error: nothing written
    first, reason = not os.path.exists(os.path.join(out_dir, MANIFEST)), None
    held = _manifest_source(out_dir)
    if held is not None and not corpus_lib.same_mixture(held, corpus):
        # Named for another corpus's build (a --data forgotten, a --data_dir mistyped): rebuilding it
        # would destroy that build and train on, or score, what the user did not mean.
        raise ValueError(f"{out_dir} holds the prepared corpus of {held!r}, not of {corpus!r}; nothing was "
                         f"changed: name {held!r} as the corpus (train.py --data, eval.py --heldout) or give "
                         "another directory (--data_dir, --eval_data_dir)")
    manifest = None
    try:
        manifest = None if first else verify(out_dir)
        # Settings the caller gives must match; those it leaves out are the build's own (train.py
        # and eval.py give none, so a `python -m data.prepare --heldout_fraction=...` build is used as made).
        asked = {"heldout_fraction": _effective_heldout(prepare_kwargs.get("heldout_fraction")),
                 "max_tokens_per_file": prepare_kwargs.get("max_tokens_per_file"),
                 "mixture_tokens": prepare_kwargs.get("mixture_tokens")}
        if manifest is not None and (
                manifest["tokenizer"] != TOKENIZER
                or manifest["inputs"] != [{"source": s, "sha256": inputs_digest(s)} for s, _ in sources]
                or any(manifest[k] != v for k, v in asked.items() if k in prepare_kwargs)):
            reason = "its inputs, settings or tokenization rules changed"
    except (OSError, ValueError) as e:  # a truncated or replaced token file, a torn manifest
        reason = " ".join(str(e).split())
    if first or reason is not None:
        if reason is not None:  # kept as it always was: rebuilt, but never silently
            logging.warning("rebuilding the prepared corpus in %s: %s", out_dir, reason)
        if manifest is not None:   # rebuilt for its inputs: with the settings it was made with
            made = {"heldout_fraction": None if manifest["heldout_fraction"] == _effective_heldout(None)
                    else manifest["heldout_fraction"]["default"],
                    "max_tokens_per_file": manifest["max_tokens_per_file"], "mixture_tokens": manifest["mixture_tokens"]}
            prepare_kwargs = {**made, **prepare_kwargs}
        manifest = prepare(corpus, out_dir, **prepare_kwargs)
    elif manifest.get("split") != SPLIT and any(s not in corpus_lib.BUILTIN for s, _ in sources):
        # Reused, not rebuilt: a run resuming on it keeps its data. But a fresh build holds out others.
        logging.warning("%s was prepared before directory corpora were split by the path inside the corpus "
                        "(it hashed '<folder name>/<path>'): a build of the same files made now holds out other "
                        "documents, some of which this one trains on. Compare held-out numbers only within one "
                        "build; delete the folder to rebuild it with the current split", out_dir)
    return split_paths(out_dir, manifest)


# ---------------------------------------------------------------------------------------------
# CLI


def main(argv):
    from absl import flags

    del argv
    f = flags.FLAGS
    t0 = time.perf_counter()
    if f.verify:   # the build is checked as it was made: these would shape a new one
        from olmo3 import cli
        cli.refuse_given(("source", "workers", "max_tokens_per_file", "heldout_fraction", "mixture_tokens"),
                         "does not apply with --verify, which checks the existing build in --out_dir against its "
                         "manifest: drop {flag}")
        manifest = verify(f.out_dir)
    else:
        manifest = prepare(f.source, f.out_dir, workers=f.workers, max_tokens_per_file=f.max_tokens_per_file,
                           heldout_fraction=f.heldout_fraction, mixture_tokens=f.mixture_tokens)
    dt = time.perf_counter() - t0
    for name, split in manifest["splits"].items():
        print(f"{name:>24}: {split['documents']:>9,} docs {split['tokens']:>14,} tokens {len(split['files'])} files")
    total = sum(s["tokens"] for s in manifest["splits"].values())
    print(f"{'verified' if f.verify else 'wrote'} {os.path.join(f.out_dir, MANIFEST)} in {dt:.1f} s "
          f"({total / dt / 1e6:.2f}M tokens/s)")


def _define_flags():
    from absl import flags

    flags.DEFINE_string("source", "stdlib", "'stdlib', 'stdlib-code', 'stdlib-docs', a directory of "
                        ".txt/.jsonl/.jsonl.gz, or a mixture 'src:weight,src:weight'")
    flags.DEFINE_string("out_dir", None, "where the token files and manifest.json go", required=True)
    flags.DEFINE_integer("workers", os.cpu_count() or 1, "encoding processes")
    flags.DEFINE_integer("max_tokens_per_file", DEFAULT_MAX_TOKENS_PER_FILE, "token file size bound")
    flags.DEFINE_float("heldout_fraction", None, "fraction of documents held out, by name hash "
                       "(default: 0.1, and 0.25 for the small stdlib docs domain)")
    flags.DEFINE_integer("mixture_tokens", None, "train tokens of a mixture (default: the most without repeating a source)")
    flags.DEFINE_bool("verify", False, "only check an existing build against its manifest")
    from olmo3 import cli
    cli.require([
        # 100,000 was as many processes, each with its tokenizer: the OOM killer, with no word.
        ("workers", lambda v: 1 <= v <= 4 * (os.cpu_count() or 1),
         f">= 1 and at most 4 per CPU core of this machine ({4 * (os.cpu_count() or 1)})"),
        ("max_tokens_per_file", lambda v: v >= 1, ">= 1"),
        ("heldout_fraction", lambda v: v is None or (cli.finite(v) and 0 <= v < 1), "in [0, 1)"),
        ("mixture_tokens", lambda v: v is None or v >= 1, ">= 1")])


if __name__ == "__main__":
    from olmo3 import cli

    _define_flags()
    cli.run(main)
