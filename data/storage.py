"""Token files wherever they live: local paths, file://, http(s)://, gs:// and s3://.

The OLMo 3 mixes are thousands of headerless uint32 token files in object storage (OLMo-core
documents https://olmo-data.org as the public root). Training reads them in place: every instance
is one byte-range read through a TensorStore kvstore, so nothing is copied to local disk first.

Three things make that safe at scale:
- Sizes once. A file's size decides how many instances it holds and enters the dataset
  fingerprint, so it is fetched once per URL (HEAD for http(s), a byte-range search otherwise),
  in parallel threads, and kept in a small JSON sidecar manifest keyed by URL. Later runs start
  without a request per file. Validation story: a recorded size is only trusted as far as every
  read agrees with it — TensorStore checks each response's Content-Range against the request and
  we check the returned length exactly, so a file that shrank on the server is a clear error
  naming the URL and the manifest entry, never wrong or missing bytes. Each open also reads the
  last token of the first remote file, which makes an unreachable root fail in about a second.
  (A file replaced by different content of the same size cannot be detected from sizes; the
  fingerprint has the same blind spot, as in OLMo-core.)
- Retries we control. TensorStore's own retries are switched off (max_retries 0) and each
  request is retried here with capped exponential backoff and jitter on transient errors only
  (connection refused/dropped, timeouts, HTTP 408, 425, 429, 500, 502-504) — DESIGN §4 bug 5:
  a fixed small budget dies in a long outage. Permanent errors (missing file, short file,
  permission, a redirect, any other status a retry would get again) are raised at once as
  FinalRemoteError naming the URL: exit status 2, also in the middle of a run, since a
  resubmission would only meet them again.
- Exact bytes. A read returns exactly `4 * count` bytes or raises; there is no partial result.

Public API: `open_token_files(paths)` -> LocalTokenFile or RemoteTokenFile readers with `.path`, `.nbytes`, `.read(start, stop)`
(the interface data/dataset.py uses), `RemoteTokenFile.read_tokens(start, count)`, `is_remote`.
"""
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import http.client
import json
import os
import queue
import random
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence

import numpy as np
import tensorstore as ts
from jaxtyping import UInt32

from olmo3 import atomic
from olmo3.cli import UserError

DTYPE = np.uint32  # OLMo-core writes dolma2 token ids as headerless uint32
ITEMSIZE = 4
REMOTE_SCHEMES = ("http", "https", "gs", "s3")


class RemoteFileError(OSError):
    """A remote token file could not be read correctly; the message names the URL."""


class UnreachableError(RemoteFileError):
    """The data root does not answer (refused, unresolvable, timed out)."""


class FinalRemoteError(RemoteFileError, UserError):
    """A remote file that no retry will read (access denied, truncated, Range ignored): the
    message names the URL and the fix; scripts end with exit status 2, never resubmitted."""
    final = True


class TruncatedFileError(FinalRemoteError):
    """The server holds fewer bytes than the recorded size: the file changed or was truncated."""


class MissingRemoteFileError(FinalRemoteError, FileNotFoundError):
    """The server says the file is not there (HTTP 404 / 410, a missing object): at open or in
    the middle of a run, a resubmission would only meet it again."""


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Capped exponential backoff with full jitter: try k waits U(0, min(max_delay, initial * 2^k))."""

    attempts: int = 10
    initial_delay: float = 0.5
    max_delay: float = 30.0
    timeout: float = 120.0  # seconds for one request before it counts as a transient failure

    def delay(self, attempt: int) -> float:
        return random.uniform(0.0, min(self.max_delay, self.initial_delay * 2.0**attempt))


DEFAULT_RETRY = RetryPolicy()
# The open-time reachability check: an unreachable root must fail fast, before any training step.
FAST_FAIL = RetryPolicy(attempts=3, initial_delay=0.2, max_delay=1.0, timeout=15.0)


def is_remote(path: str | os.PathLike) -> bool:
    return urllib.parse.urlsplit(os.fspath(path)).scheme in REMOTE_SCHEMES


def local_path(path: str | os.PathLike) -> str:
    """A plain path for `path` or a file URL: file:///abs/path, file://localhost/abs/path, or
    RFC 8089's short form file:/abs/path (Java's File.toURI writes it)."""
    path = os.fspath(path)
    if path.startswith("file:/"):
        u = urllib.parse.urlsplit(path)
        if u.netloc not in ("", "localhost"):   # file://d/x.npy: "d" is a host to urlsplit, not a folder
            raise ValueError(f"{path!r}: a file:// URL names an absolute path (file:///abs/path); "
                             f"write file:///{u.netloc}{u.path} or the plain path")
        return urllib.parse.unquote(u.path)
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", path):
        raise ValueError(f"{path!r}: unsupported scheme; use a local path, file://, or one of "
                         f"{', '.join(s + '://' for s in REMOTE_SCHEMES)}")
    return path


# --- transient vs permanent --------------------------------------------------------------------

# TensorStore reports errors as ValueError("<ABSL_STATUS_CODE>: ..."); these codes are what a
# flaky network or an overloaded server produces (curl errors and HTTP 5xx map to UNAVAILABLE).
_TRANSIENT_CODES = ("UNAVAILABLE", "ABORTED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "INTERNAL", "UNKNOWN")
_TRANSIENT_HTTP = (408, 425, 429, 500, 502, 503, 504)


def _is_transient(e: BaseException) -> bool:
    if isinstance(e, urllib.error.HTTPError):
        return e.code in _TRANSIENT_HTTP
    if isinstance(e, http.client.InvalidURL):   # a malformed URL stays malformed
        return False
    if isinstance(e, (urllib.error.URLError, ConnectionError, TimeoutError, socket.timeout,
                      http.client.HTTPException, concurrent.futures.TimeoutError)):
        return True
    if isinstance(e, ValueError):
        # TensorStore files most HTTP statuses it has no name for (301, 405, 422, ...) under
        # UNKNOWN, and 308 under UNAVAILABLE: the status itself decides.
        status = re.search(r"\[HTTP code (\d+)\]", str(e))
        if status:
            return int(status.group(1)) in _TRANSIENT_HTTP
        return str(e).split(":", 1)[0].strip() in _TRANSIENT_CODES
    return False


def _with_retries(what: str, url: str, fn: Callable, policy: RetryPolicy, error: type = RemoteFileError):
    """fn() with backoff on transient errors; when they persist, `error` naming `url`."""
    for attempt in range(policy.attempts):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 -- classified just below
            if not _is_transient(e):
                raise
            if attempt + 1 == policy.attempts:
                raise error(f"{what} {url} failed {policy.attempts} times, last error: {e}. "
                          "Check the URL / --data_root and the network; for a mirror pass its root.") from e
            time.sleep(policy.delay(attempt))


# --- kvstores ----------------------------------------------------------------------------------

_CONTEXT = None
_STORES: dict[tuple, ts.KvStore] = {}
_STORES_LOCK = threading.Lock()


def _context() -> ts.Context:
    global _CONTEXT
    if _CONTEXT is None:
        no_retries = {"max_retries": 0}  # retried in _with_retries, where we can see and bound it
        _CONTEXT = ts.Context({
            "http_request_retries": no_retries,
            "gcs_request_retries": no_retries,
            "s3_request_retries": no_retries,
        })
    return _CONTEXT


def _store_and_key(url: str) -> tuple[ts.KvStore, str]:
    """One shared kvstore per origin (scheme, host, query) / bucket; the key is the object path."""
    if re.search(r"[\x00-\x20\x7f]", url):
        raise ValueError(f"{url!r} holds a space or control character; percent-encode it (a space is %20)")
    u = urllib.parse.urlsplit(url)
    escaped = re.search(r"%(2[FfBb])", u.path)
    if escaped:   # TensorStore requests '/' and '+' unescaped: another folder; on S3, '+' is a space
        raise ValueError(f"{url!r} escapes {'/' if escaped.group(1) in 'Ff' else '+'} as %{escaped.group(1)} in "
                         "its path; token files are read by their decoded path, which names another object: "
                         "serve the file under a name without it")
    if u.scheme in ("http", "https"):
        origin = f"{u.scheme}://{u.netloc}" + (f"?{u.query}" if u.query else "")
        spec, key = {"driver": "http", "base_url": origin}, urllib.parse.unquote(u.path)
    elif u.scheme == "gs":
        spec, key = {"driver": "gcs", "bucket": u.netloc}, u.path.lstrip("/")
    elif u.scheme == "s3":
        spec, key = {"driver": "s3", "bucket": u.netloc}, u.path.lstrip("/")
        if os.environ.get("AWS_ENDPOINT_URL"):  # S3-compatible mirrors (R2, MinIO, ...)
            spec["endpoint"] = os.environ["AWS_ENDPOINT_URL"]
    else:
        raise ValueError(f"{url!r}: unsupported scheme {u.scheme!r}; use a local path, file://, "
                         f"or one of {', '.join(s + '://' for s in REMOTE_SCHEMES)}")
    if not key or key.endswith("/"):
        raise ValueError(f"{url!r} names a directory, not a token file")
    spec_key = tuple(sorted(spec.items()))
    with _STORES_LOCK:
        if spec_key not in _STORES:
            _STORES[spec_key] = ts.KvStore.open(spec, context=_context()).result()
        return _STORES[spec_key], key


# The characters TensorStore's http driver leaves unescaped in a key (the rest it percent-encodes),
# as requests to a local server showed: sizes are asked of the very URL the reads will request.
_UNESCAPED_BY_TENSORSTORE = "!$&'()*+,/:;=~-._"


def _as_read(url: str) -> str:
    """The http(s) URL TensorStore requests for `url` (its path decoded, then encoded its way)."""
    u = urllib.parse.urlsplit(url)
    path = urllib.parse.quote(urllib.parse.unquote(u.path), safe=_UNESCAPED_BY_TENSORSTORE)
    return urllib.parse.urlunsplit((u.scheme, u.netloc, path, u.query, ""))


def _read_once(url: str, start: int, stop: int, timeout: float) -> bytes:
    """Bytes [start, stop) of `url`, exactly, or an error naming the URL (one attempt). An empty
    range asks nothing: at the end of a file it is past the end, and a strict server answers 416."""
    if start == stop:
        return b""
    store, key = _store_and_key(url)
    fut = store.read(key, byte_range=slice(start, stop))
    try:
        res = fut.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        fut.cancel()
        raise
    except Exception as e:  # noqa: BLE001 -- TensorStore's status codes, sorted below
        total = re.search(r"total size (\d+)", str(e))
        if str(e).startswith("OUT_OF_RANGE") and total and int(total.group(1)) >= stop:
            raise FinalRemoteError(
                f"{url}: the server answered a shorter byte range than [{start}, {stop}) of a file it says "
                f"holds {total.group(1)} bytes ({e}); token files are read one instance per range, so use "
                "a root (mirror) that serves whole ranges") from e
        if str(e).startswith("OUT_OF_RANGE"):
            raise TruncatedFileError(
                f"{url} has fewer than {stop} bytes on the server ({e}); it was truncated or replaced "
                f"since its size was recorded. If the new file is intended, delete its entry from the "
                f"size manifest ({default_manifest_path()} unless you passed another) and restart.") from e
        code = str(e).split(":", 1)[0]
        if code in ("PERMISSION_DENIED", "UNAUTHENTICATED"):
            raise FinalRemoteError(f"{url}: access denied ({e}); check credentials for this bucket") from e
        if code == "FAILED_PRECONDITION" and "ignored" in str(e):
            raise FinalRemoteError(f"{url}: the server ignores HTTP Range requests ({e}); token files "
                                  "are read by byte range, so use a root (mirror) that supports them") from e
        if code == "NOT_FOUND":   # HTTP 410 Gone comes back this way
            raise MissingRemoteFileError(f"no token file at {url} ({e}). Check the mix name, --data_root "
                                         "and --tokenizer.") from e
        if _is_transient(e):
            raise
        if re.search(r"HTTP code 30[1278]\b", str(e)):
            raise FinalRemoteError(f"{url}: the server redirects it ({e}); pass the root it redirects to "
                                  "as --data_root") from e
        raise FinalRemoteError(f"{url}: {e}") from e   # 400, 501, ...: a retry would get the same
    if res.state == "missing":
        raise MissingRemoteFileError(f"no token file at {url}: the server answered 'not found'. Check the "
                                     "mix name, --data_root and --tokenizer (the URL must exist under the root).")
    value = bytes(res.value)
    if len(value) != stop - start:
        raise TruncatedFileError(f"{url}: asked for bytes [{start}, {stop}) and got {len(value)} bytes; "
                                 "the file on the server is shorter than its recorded size.")
    return value


def read_bytes(url: str, start: int, stop: int, policy: RetryPolicy = DEFAULT_RETRY,
               error: type = RemoteFileError) -> bytes:
    return _with_retries("reading", url, lambda: _read_once(url, start, stop, policy.timeout), policy, error)


# --- sizes -------------------------------------------------------------------------------------

def _head_size(url: str, timeout: float) -> int | None:
    """Content-Length from an HTTP HEAD, or None when the server gives none (then we probe)."""
    req = urllib.request.Request(_as_read(url), method="HEAD", headers={"Accept-Encoding": "identity"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            _not_redirected(url, r)
            n = (r.headers.get("Content-Length") or "").strip()
            # None (probe the ranges) unless one plain number for an unencoded body
            return int(n) if n.isdigit() and r.headers.get("Content-Encoding", "identity") == "identity" else None
    except urllib.error.HTTPError as e:
        if e.code in (405, 501):  # HEAD not allowed: fall back to range probing
            return None
        _http_error(url, e)


def _not_redirected(url: str, response) -> None:
    """urllib follows redirects, TensorStore's reads do not: a root that redirects would size every
    file and then fail every read, so it is refused when its sizes are fetched."""
    if response.geturl() != _as_read(url):
        raise FinalRemoteError(f"{url} redirects to {response.geturl()}; token files are read by byte "
                               "range without following redirects: pass the root it redirects to as --data_root")


def _http_error(url: str, e: urllib.error.HTTPError):
    """Raise what an HTTP error status means for token file `url`: transient ones as they are
    (retried), the rest naming the URL and the fix."""
    if e.code in (404, 410):
        raise MissingRemoteFileError(f"no token file at {url} (HTTP {e.code}). Check the mix name, "
                                "--data_root and --tokenizer.") from e
    if e.code in (401, 403):   # a private mirror or a missing credential: no retry helps
        raise FinalRemoteError(f"{url}: access denied (HTTP {e.code} {e.reason}); check --data_root "
                               "and the credentials the server wants") from e
    if _is_transient(e):
        raise e
    raise FinalRemoteError(f"{url}: HTTP {e.code} {e.reason}; check --data_root") from e


_CONTENT_RANGE = re.compile(r"bytes (?:(\d+)-(\d+)|\*)/(\d+)")


def _range_total(url: str, start: int, timeout: float) -> int:
    """The file size an HTTP server states in Content-Range, asking for the byte at `start` (which
    must exist, or `start` 0 of a possibly empty file: a 416 there means size 0)."""
    req = urllib.request.Request(_as_read(url), headers={"Range": f"bytes={start}-{start}",
                                                         "Accept-Encoding": "identity"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            _not_redirected(url, r)
            status, content_range = r.status, r.headers.get("Content-Range", "")
            body = r.read(2) if status == 206 else b""
    except urllib.error.HTTPError as e:
        if e.code != 416:
            _http_error(url, e)
        status, content_range, body = 416, e.headers.get("Content-Range", ""), b""
    m = _CONTENT_RANGE.fullmatch(content_range.strip())
    if status == 200:
        raise FinalRemoteError(f"{url}: the server ignores HTTP Range requests; token files are read by "
                              "byte range, so use a root (mirror) that supports them")
    if m is None or (status == 416 and start != 0):
        raise FinalRemoteError(f"{url}: HTTP {status} with Content-Range {content_range!r} for bytes "
                               f"{start}-{start}; the server does not state the file's size: use another mirror")
    if status == 206 and (not m.group(1) == m.group(2) == str(start) or len(body) != 1):
        # Another range, or a body cut short: a broken answer, retried like a dropped connection.
        raise http.client.HTTPException(f"{url}: asked for byte {start}, got Content-Range "
                                        f"{content_range!r} with {len(body)} byte(s)")
    return int(m.group(3))


def _exists(url: str, offset: int, timeout: float) -> bool:
    try:
        _read_once(url, offset, offset + 1, timeout)
        return True
    except TruncatedFileError:
        return False


def _probe_size(url: str, policy: RetryPolicy, error: type = RemoteFileError) -> int:
    """Size through byte-range reads alone (gs://, s3://, servers without HEAD): double an offset
    until it is past the end, bisect to a 64 KiB window, then read the tail: ~30 tiny requests."""
    def exists(k: int) -> bool:
        return _with_retries("probing the size of", url, lambda: _exists(url, k, policy.timeout), policy, error)
    if not exists(0):
        return 0
    lo, hi = 0, 1 << 16  # lo: a byte that exists; hi: an offset not yet known to exist
    while exists(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1 << 16:  # invariant: byte lo exists, byte hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if exists(mid) else (lo, mid)
    store, key = _store_and_key(url)

    def tail() -> int:
        return len(store.read(key, byte_range=slice(lo, None)).result(timeout=policy.timeout).value)
    return lo + _with_retries("reading the tail of", url, tail, policy, error)


def fetch_size(url: str, policy: RetryPolicy = DEFAULT_RETRY, error: type = RemoteFileError) -> int:
    """The size in bytes of the object at `url`, checked at its end.

    HTTP(S) never asks for a byte past the end (a strict server answers 416, a lenient one a
    malformed 206): the size is HEAD's Content-Length, else the total of a one-byte range's
    Content-Range, and the check reads the last byte, whose Content-Range must state the same
    total. gs:// and s3:// probe by range reads, which their APIs answer past the end too."""
    if urllib.parse.urlsplit(url).scheme in ("http", "https"):
        n = _with_retries("HEAD", url, lambda: _head_size(url, policy.timeout), policy, error)
        if not n:   # none, or 0 (a HEAD answered without a body's length): the ranges say
            n = _with_retries("asking the size of", url, lambda: _range_total(url, 0, policy.timeout), policy, error)
        if n:
            total = _with_retries("checking the end of", url, lambda: _range_total(url, n - 1, policy.timeout),
                                  policy, error)
            if total != n:
                raise FinalRemoteError(f"{url}: the server reported {n} bytes but its ranges say {total}; it "
                                       "does not report sizes reliably (a compressing proxy?). Use another mirror.")
        return n
    n = _probe_size(url, policy, error)
    if n and n % ITEMSIZE == 0:  # the last token is there, and nothing after it
        read_bytes(url, n - ITEMSIZE, n, policy, error)
        if _with_retries("checking the end of", url, lambda: _exists(url, n, policy.timeout), policy, error):
            raise FinalRemoteError(f"{url}: the server reported {n} bytes but holds more; it does not "
                                   "report sizes reliably (a compressing proxy?). Use another mirror.")
    return n


# --- the sidecar manifest ----------------------------------------------------------------------

MANIFEST_FORMAT = "olmo3-jax remote token file sizes v1"


def default_manifest_path() -> str:
    """$OLMO3_DATA_CACHE/remote_sizes.json, default ~/.cache/olmo3-jax/remote_sizes.json."""
    root = os.environ.get("OLMO3_DATA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "olmo3-jax")
    return os.path.join(root, "remote_sizes.json")


def load_manifest(path: str) -> dict[str, int]:
    """{url: size in bytes}; a missing file is an empty manifest, a corrupt one an error."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            doc = json.load(f)
        if doc.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format is {doc.get('format')!r}, expected {MANIFEST_FORMAT!r}")
        sizes = {str(u): int(e["bytes"]) for u, e in doc["files"].items()}
        negative = next((u for u, n in sizes.items() if n < 0), None)
        if negative is not None:   # an edited entry: the dataset counted it as less than nothing, skipping files
            raise ValueError(f"{negative} has {sizes[negative]} bytes")
        return sizes
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"size manifest {path} is unreadable ({e}); delete it and it will be rebuilt") from e


def save_manifest(path: str, sizes: dict[str, int]):
    """Merge `sizes` into the manifest at `path`; written to a temp name and renamed."""
    merged = load_manifest(path)
    merged.update(sizes)
    try:
        atomic.write_json(path, {"format": MANIFEST_FORMAT,
                                 "files": {u: {"bytes": n} for u, n in sorted(merged.items())}}, indent=0)
    except (FileExistsError, NotADirectoryError, FileNotFoundError, PermissionError) as e:   # not a full disk
        where = (f"OLMO3_DATA_CACHE={os.environ['OLMO3_DATA_CACHE']!r}" if os.environ.get("OLMO3_DATA_CACHE")
                 else f"the size manifest {path}")
        raise ValueError(f"{where}: cannot write {path} ({e.strerror or e}); set OLMO3_DATA_CACHE to a directory "
                         "this process can write") from e


# --- readers -----------------------------------------------------------------------------------

NPY_MAGIC = b"\x93NUMPY"   # np.save's header: token files are headerless (OLMo-core's memmap reads raw uint32)
HEADERLESS = "token files are headerless uint32: write them with np.asarray(ids, np.uint32).tofile(path)"


def file_sha256(path: str) -> str:
    """sha256 hex digest of a local file, read in 16 MiB blocks (what manifests record)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def wide_integers(tokens: np.ndarray) -> bool:
    """Whether uint32 `tokens` read from a file look like int64 / uint64 ids (np.array(ids).tofile
    writes int64): every odd position 0 (the high words), some even one not. Over 32 or more
    pairs, real text never does that (id 0 at every other position)."""
    return len(tokens) >= 64 and not tokens[1::2].any() and bool(tokens[0::2].any())


def wide_integers_error(file, where: str) -> ValueError:
    return ValueError(f"token file {file.path!r}{where}: every other uint32 is 0, as in a file of 64-bit integers; "
                      f"{HEADERLESS}")


def token_range_error(file, where: str, top: int, vocab_size: int) -> ValueError:
    """The error for token id `top` >= `vocab_size` read from `file` (`where`: e.g. ", instance 3"),
    with its likely cause: a .npy header read as tokens (np.save instead of tofile), else another
    tokenizer, a model with a smaller vocabulary, or a corrupt file."""
    head = file.read(0, min(2, file.nbytes // ITEMSIZE)).tobytes()
    if head.startswith(NPY_MAGIC):
        why = f"the file starts with a .npy header (np.save); {HEADERLESS}"
    else:
        why = ("the file was written with another tokenizer or is corrupt, or the model's vocabulary is smaller "
               "than the tokenizer's")
    return ValueError(f"token file {file.path!r}{where}: token id {top} >= vocab size {vocab_size}; {why}")


class LocalTokenFile:
    """A token file on local disk, memmapped: `nbytes`, `read(start, stop)` (token indices)."""

    def __init__(self, path: str):
        if not os.path.exists(path):
            raise FileNotFoundError(f"token file {path!r} does not exist; check the path (a data mix's files, its "
                                    "held-out sets' included, lie under --data_root) or, for a prepared corpus, "
                                    "rebuild it with `python -m data.prepare`")
        if os.path.isdir(path):
            raise IsADirectoryError(f"token file {path!r} is a directory; pass the .npy token files inside it")
        self.path = path
        self.nbytes = os.path.getsize(path)
        self._mm = None

    def read(self, start: int, stop: int) -> UInt32[np.ndarray, " n"]:
        if self._mm is None:  # opened lazily: cheap to construct, safe to share between threads
            # An empty file holds no token (numpy cannot memmap it).
            self._mm = np.memmap(self.path, dtype=DTYPE, mode="r") if self.nbytes else np.zeros(0, DTYPE)
        return np.array(self._mm[start:stop])

    def __repr__(self) -> str:
        return f"LocalTokenFile({self.path!r}, {self.nbytes} bytes)"


class RemoteTokenFile:
    """A token file behind a URL: `nbytes`, `read(start, stop)` (token indices), `read_tokens`."""

    def __init__(self, url: str, nbytes: int, policy: RetryPolicy | None = None):
        self.path = url
        self.nbytes = int(nbytes)
        self.policy = policy or DEFAULT_RETRY

    @property
    def num_tokens(self) -> int:
        return self.nbytes // ITEMSIZE

    def read(self, start: int, stop: int) -> UInt32[np.ndarray, " n"]:
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"tokens [{start}, {stop}) out of range for {self.path} ({self.num_tokens} tokens)")
        if start == stop:
            return np.zeros(0, dtype=np.uint32)
        raw = read_bytes(self.path, ITEMSIZE * start, ITEMSIZE * stop, self.policy)
        return np.frombuffer(raw, dtype=np.uint32).copy()

    def read_tokens(self, start: int, count: int) -> UInt32[np.ndarray, " n"]:
        return self.read(start, start + count)

    def __repr__(self) -> str:
        return f"RemoteTokenFile({self.path!r}, {self.nbytes} bytes)"


def _sizes_as_they_come(urls: Sequence[str], policy: RetryPolicy, threads: int):
    """(url, its size or the error fetching it) for each of `urls`, in the order they finish,
    from up to `threads` daemon threads. A caller that stops at the first hard error is held up
    neither by files still retrying (ThreadPoolExecutor's exit, and the interpreter's, waits for
    them: minutes under DEFAULT_RETRY) nor by files not yet started (none start after it stops)."""
    waiting, finished, stop = queue.SimpleQueue(), queue.SimpleQueue(), threading.Event()
    for u in urls:
        waiting.put(u)

    def work():
        while not stop.is_set():
            try:
                u = waiting.get_nowait()
            except queue.Empty:
                return
            try:
                finished.put((u, fetch_size(u, policy)))
            except BaseException as e:  # noqa: BLE001 -- handed to the caller
                finished.put((u, e))

    for _ in range(max(1, min(threads, len(urls)))):
        threading.Thread(target=work, name="olmo3-sizes", daemon=True).start()
    try:
        for _ in urls:
            yield finished.get()
    finally:
        stop.set()


def open_token_files(
    paths: Sequence[str],
    *,
    manifest: str | None = None,
    refresh: bool = False,
    threads: int = 64,
    policy: RetryPolicy | None = None,
) -> list:
    """Readers for `paths`, in order. Local paths and file:// URLs become LocalTokenFile (a
    memmap); remote URLs become RemoteTokenFile, their sizes taken from
    the sidecar `manifest` (default `default_manifest_path()`) or fetched in parallel and recorded.
    `refresh=True` re-fetches every size. Raises before any read if the root is unreachable, a
    file is missing, or a size is not a whole number of uint32 tokens."""
    policy = policy or DEFAULT_RETRY  # read at call time, so a caller (or a test) can set the default
    remote = list(dict.fromkeys(p for p in paths if is_remote(p)))
    sizes: dict[str, int] = {}
    if remote:
        for u in remote:
            _store_and_key(u)  # bad scheme / directory URLs fail here, before any request
        manifest = manifest or default_manifest_path()
        known = {} if refresh else load_manifest(manifest)
        sizes = {u: known[u] for u in remote if u in known}
        todo = [u for u in remote if u not in sizes]
        first = remote[0]
        # Fail fast: one request with a short retry budget before anything else.
        if first in sizes:
            if sizes[first] >= ITEMSIZE:
                read_bytes(first, sizes[first] - ITEMSIZE, sizes[first], FAST_FAIL, UnreachableError)
        else:
            sizes[first] = fetch_size(first, FAST_FAIL, UnreachableError)
            todo.remove(first)
        missing = []
        with contextlib.closing(_sizes_as_they_come(todo, policy, threads)) as coming:   # closed: none start after
            for u, size in coming:
                if isinstance(size, FileNotFoundError):
                    missing.append(u)
                elif isinstance(size, BaseException):
                    raise size   # the first hard error, at once
                else:
                    sizes[u] = size
        if missing:
            raise MissingRemoteFileError(
                f"{len(missing)} of {len(remote)} token files are not on the server, e.g. "
                f"{', '.join(missing[:3])}. Check --data_root, --tokenizer and the mix name.")
        whole = {u: n for u, n in sizes.items() if n % ITEMSIZE == 0}
        if (todo or refresh or first not in known) and whole:
            save_manifest(manifest, whole)   # a size no token file has is never recorded
        for u in remote:
            if sizes[u] % ITEMSIZE:
                where = (f" (as the size manifest {manifest} records it: delete that entry if the server copy "
                         "was fixed)") if u in known and not refresh else ""
                raise ValueError(f"token file {u} has {sizes[u]} bytes{where}, not a multiple of 4: it is not a "
                                 "headerless uint32 token file, or the server copy is truncated")
    out = []
    for p in paths:
        if is_remote(p):
            out.append(RemoteTokenFile(p, sizes[p], policy))
        else:
            out.append(LocalTokenFile(local_path(p)))
    return out
