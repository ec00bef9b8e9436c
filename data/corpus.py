"""Document sources: the embedded standard-library corpus and user corpus directories.

A source is a deterministic stream of `Document`s (name, text, domain, key). The train / held-out
split is decided per document from a hash of its key alone: for a user corpus, the path relative
to the corpus directory (and line number), never where the directory is or what it is called. So
the same document lands on the same side on every machine, from every copy of the corpus and in
every mixture, and a held-out document is never trained on.

Built-in corpus "stdlib" (present wherever Python is):
  code  every .py file of the standard library (site-packages excluded), named by its path
        relative to the stdlib root, so the split does not depend on the install location;
  docs  the prose of `pydoc_data.topics` (the Python reference documentation), one document per
        topic.
"""
import dataclasses
import gzip
import hashlib
import json
import math
import os
import re
import sys
import sysconfig
import zlib
from collections.abc import Iterator

from absl import logging

# Fraction of documents held out from training (a hash threshold, not a count).
HELDOUT_FRACTION = 0.1
# pydoc_data.topics is only 79 long documents (~106k tokens): hold out a quarter so the docs
# domain keeps a usable held-out set (17 documents, ~21k tokens).
DOMAIN_HELDOUT_FRACTION = {"docs": 0.25}
# Sources that name no directory.
BUILTIN = ("stdlib", "stdlib-code", "stdlib-docs")


@dataclasses.dataclass(frozen=True)
class Document:
    name: str  # stable identifier: names the document in errors (and decides the split without a key)
    text: str
    domain: str  # held-out documents are kept per domain (multi-domain perplexity)
    key: str = ""  # decides the split (the name when empty): the same wherever the corpus lies


def is_heldout(name: str, fraction: float = HELDOUT_FRACTION) -> bool:
    """Document-level split: the first 8 bytes of sha256(name) as a uniform number in [0, 1)."""
    h = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big")
    return h / 2.0**64 < fraction


def split_of(doc: Document, fraction: float | None = None) -> str:
    """"train" or "heldout/<domain>". `fraction=None` uses the per-domain defaults above."""
    if fraction is None:
        fraction = DOMAIN_HELDOUT_FRACTION.get(doc.domain, HELDOUT_FRACTION)
    return f"heldout/{doc.domain}" if is_heldout(doc.key or doc.name, fraction) else "train"


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_documents() -> Iterator[Document]:
    """The standard library's .py sources (domain "code"), then pydoc topics (domain "docs")."""
    root = stdlib_root()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for fn in sorted(filenames):
            if fn.endswith(".py"):
                path = os.path.join(dirpath, fn)
                rel = os.path.relpath(path, root).replace(os.sep, "/")
                with open(path, "rb") as f:
                    # A few test files are deliberately not UTF-8; replacement keeps it deterministic.
                    text = f.read().decode("utf-8", errors="replace")
                yield Document(f"stdlib/{rel}", text, "code")
    from pydoc_data import topics

    for key in sorted(topics.topics):
        yield Document(f"pydoc_data.topics/{key}", topics.topics[key], "docs")


def stdlib_description() -> dict:
    """What makes the embedded corpus of this interpreter what it is (recorded in the manifest)."""
    return {"python": sys.version.split()[0], "implementation": sys.implementation.name}


def directory_documents(root: str, domain: str | None = None) -> Iterator[Document]:
    """A user corpus: every .txt file (one document) and every line of .jsonl / .jsonl.gz files
    (one document per line, from its "text" field), walked in sorted order. Symlinked folders are
    followed (a corpus assembled from links to shards), each real folder once. Bytes that are not
    UTF-8 become U+FFFD, with one warning naming the .txt files that had any."""
    if not os.path.isdir(root):
        raise _not_a_directory(root)
    domain = domain or os.path.basename(os.path.normpath(root)) or "user"
    found = False
    seen = {os.path.realpath(root)}
    not_utf8, left_out = [], []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = [d for d in sorted(dirnames) if not d.startswith(".") and _first_visit(dirpath, d, seen)]
        for fn in sorted(filenames):
            if not fn.endswith((".txt", ".jsonl", ".jsonl.gz")):
                if not fn.startswith(".") and _looks_like_text(fn):
                    left_out.append(os.path.relpath(os.path.join(dirpath, fn), root).replace(os.sep, "/"))
                continue
            found = True
            path = os.path.join(dirpath, fn)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            _require_regular_file(path)
            if fn.endswith(".txt"):
                with open(path, "rb") as f:
                    raw = f.read()
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    text = raw.decode("utf-8", errors="replace")
                    not_utf8.append(rel)
                yield Document(f"{domain}/{rel}", text, domain, rel)
            else:
                yield from _jsonl_documents(path, rel, domain)
    if not found:
        raise ValueError(f"corpus directory {root!r} holds no .txt, .jsonl or .jsonl.gz files")
    if left_out:   # Dolma's shards are *.json.gz: a corpus of them was read as its few .txt files, unsaid
        logging.warning("corpus %s: %d file(s) left out, only .txt, .jsonl and .jsonl.gz are read (e.g. %s); "
                        "decompress them, or rename gzipped JSON lines to .jsonl.gz", root, len(left_out),
                        ", ".join(left_out[:3]))
    if not_utf8:
        logging.warning("corpus %s: %d .txt file(s) hold bytes that are not UTF-8, read as U+FFFD (e.g. %s); "
                        "is it another encoding, or a binary file?", root, len(not_utf8), ", ".join(not_utf8[:3]))


def _looks_like_text(name: str) -> bool:
    """A file name of documents in a form the corpus reader does not take: JSON or text under
    another name or compression (a.json.gz, a.jsonl.zst, a.txt.gz, a.json), or compressed."""
    name = name.lower()
    return ".json" in name or ".txt" in name or name.endswith((".gz", ".zst", ".bz2", ".xz", ".parquet"))


def _jsonl_documents(path: str, rel: str, domain: str) -> Iterator[Document]:
    """One document per non-blank line of a .jsonl / .jsonl.gz file, from its "text" field."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError, RecursionError) as e:
                    raise ValueError(f"{path}:{lineno}: expected a JSON object with a string 'text' field "
                                     f"({type(e).__name__}: {e})") from e
                if not isinstance(text, str):
                    raise ValueError(f"{path}:{lineno}: 'text' must be a string, got {type(text).__name__}")
                yield Document(f"{domain}/{rel}:{lineno}", _without_lone_surrogates(text), domain, f"{rel}:{lineno}")
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:   # not gzip; cut short; damaged inside
        raise ValueError(f"{path}: not a whole gzip file ({e}); replace it with an intact copy or remove it "
                         "from the corpus") from e


def _require_regular_file(path: str) -> None:
    """A broken link or a pipe named like a corpus file is an error naming it (a pipe would block
    the read forever)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"corpus file {path} is a symbolic link to {os.readlink(path)!r}, which does not "
                                "exist; fix the link or remove it")
    if not os.path.isfile(path):
        raise ValueError(f"corpus file {path} is not a regular file (a pipe, socket or device); remove it from the "
                         "corpus")


def _not_a_directory(path: str) -> FileNotFoundError:
    return FileNotFoundError(f"corpus directory {path!r} {'is a file' if os.path.exists(path) else 'does not exist'}; "
                             "pass a directory of .txt/.jsonl/.jsonl.gz files or 'stdlib'")


def _first_visit(dirpath: str, name: str, seen: set[str]) -> bool:
    """True the first time a folder's real path is met: a link back up the tree is not a loop."""
    real = os.path.realpath(os.path.join(dirpath, name))
    if real in seen:
        return False
    seen.add(real)
    return True


def _without_lone_surrogates(text: str) -> str:
    """JSON may escape half of a UTF-16 pair ("\\ud800"), which no UTF-8 encoder takes: each lone
    one becomes U+FFFD, as undecodable bytes of a .txt file do. (json.loads joins whole pairs.)"""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)


_SURROGATE = re.compile("[\ud800-\udfff]")


def documents(source: str) -> Iterator[Document]:
    """Documents of a named source: "stdlib", "stdlib-code", "stdlib-docs", or a directory path."""
    if source == "stdlib":
        return stdlib_documents()
    if source in BUILTIN[1:]:
        domain = source.split("-")[1]
        return (d for d in stdlib_documents() if d.domain == domain)
    return directory_documents(source)


def parse_mixture(spec: str) -> list[tuple[str, float]]:
    """"stdlib-code:0.7,/data/web:0.3" -> [(source, weight)]; a lone source has weight 1. Directory
    paths come back normalised ("/data/web/" is "/data/web"); a missing one is an error."""
    out = _mixture_parts(spec)
    for source, _ in out:
        if source not in BUILTIN and not os.path.isdir(source):
            raise _not_a_directory(source)
    return out


def same_mixture(a: str, b: str) -> bool:
    """Whether two specs name the same sources and weights, spelled alike or not."""
    try:
        return _mixture_parts(a) == _mixture_parts(b)
    except ValueError:
        return False


def _mixture_parts(spec: str) -> list[tuple[str, float]]:
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        source, sep, w = part.rpartition(":")
        if not sep or not _is_float(w):
            source, w = part, "1"
        weight = float(w)
        if not 0 < weight < math.inf:
            raise ValueError(f"mixture {spec!r}: weight of {source!r} must be finite and > 0, got {w}")
        out.append((source if source in BUILTIN else os.path.normpath(source), weight))
    if not out:
        raise ValueError(f"mixture {spec!r} names no source")
    return out


def _is_float(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False
