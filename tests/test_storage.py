"""Remote token files (data/storage.py) against a range-capable HTTP server on 127.0.0.1.

The oracle is always the same bytes read from local disk with plain numpy. No internet: the
server below serves a temporary directory, handles HEAD and `Range: bytes=a-b`, can inject
faults (503s, dropped connections, bodies cut short), and shuts itself down after a deadline.
"""
import gzip
import http.server
import json
import os
import re
import socket
import threading
import time
import types

import numpy as np
import pytest

import data
from data import storage

FAST = storage.RetryPolicy(attempts=40, initial_delay=0.001, max_delay=0.01, timeout=10.0)


class RangeHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a real object store
    disable_nagle_algorithm = True  # headers and body go out as separate writes: no 40 ms ACK stalls

    def log_message(self, *args):
        pass

    def _fault(self) -> bool:
        """Answer with the server's next scheduled fault, if any. True when a fault was sent."""
        kind = self.server.next_fault(self.command)
        if kind is None:
            return False
        if kind in ("503", "403"):
            self.send_response(int(kind))
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif kind == "drop":  # connection closed before any response
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
        elif kind == "short":  # headers promise 64 bytes, 5 arrive, then the connection drops
            self.send_response(206)
            self.send_header("Content-Range", "bytes 0-63/1000000")
            self.send_header("Content-Length", "64")
            self.end_headers()
            self.wfile.write(b"short")
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
        return True

    def do_HEAD(self):
        self.do_GET(head=True)

    def do_GET(self, head=False):
        self.server.count(self.command)
        if self.server.delay:  # a stand-in for network round-trip time (benchmarks/bench_remote.py)
            time.sleep(self.server.delay)
        if self._fault():
            return
        for prefix, (status, location) in self.server.answers.items():   # a fixed answer for some paths
            if self.path.startswith(prefix):
                self.send_response(status)
                if location:
                    self.send_header("Location", location + self.path[len(prefix):])
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
        if head and self.server.no_head:
            self.send_response(405)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        path = os.path.join(self.server.root, self.path.lstrip("/"))
        if not os.path.isfile(path):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        with open(path, "rb") as f:
            body = f.read()
        n, status, rng = len(body), 200, None if self.server.no_range else self.headers.get("Range")
        headers = {"Accept-Ranges": "bytes", "ETag": f'"{n:x}-{os.stat(path).st_mtime_ns:x}"'}  # S3 needs one
        if rng and not head:
            a, b = re.fullmatch(r"bytes=(\d*)-(\d*)", rng).groups()
            if a == "":  # suffix range: the last b bytes
                a, b = max(0, n - int(b)), n - 1
            else:
                a, b = int(a), min(int(b), n - 1) if b else n - 1
            if a >= n:  # a strict server; the request is recorded: a client should never send it
                self.server.past_end.append(rng)
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{n}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            b = min(b, a + self.server.max_range - 1)   # a server that caps what one range returns
            status, body = 206, body[a:b + 1]
            headers["Content-Range"] = f"bytes {a}-{b}/{n}"
        if head and self.server.gzip_head:   # a HEAD answered as if the body were gzip-compressed
            body = gzip.compress(body)
            headers["Content-Encoding"] = "gzip"
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)


class RangeServer(http.server.ThreadingHTTPServer):
    """Serves `root` on an ephemeral 127.0.0.1 port; stops itself after `lifetime` seconds.
    `faults`: a list of fault kinds applied in turn to every request while `flaky` is set, with
    one good answer after each fault (so every read needs at least one retry)."""

    daemon_threads = True

    def __init__(self, root, lifetime=120.0):
        super().__init__(("127.0.0.1", 0), RangeHandler)
        self.root, self.no_head, self.no_range, self.faults, self.delay = str(root), False, False, [], 0.0
        self.answers, self.max_range = {}, 1 << 62   # {path prefix: (status, redirect target)}
        self.gzip_head = False
        self.requests, self.faulted, self.past_end = {}, 0, []
        self._lock, self._n = threading.Lock(), 0
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._timer = threading.Timer(lifetime, self.shutdown)
        self._timer.daemon = True

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"

    def count(self, method):
        with self._lock:
            self.requests[method] = self.requests.get(method, 0) + 1

    def next_fault(self, method):
        with self._lock:
            if not self.faults:
                return None
            self._n += 1
            if self._n % 2 == 0:  # every other request is answered normally
                return None
            kind = self.faults[(self._n // 2) % len(self.faults)]
            if method == "HEAD" and kind == "short":
                kind = "503"
            self.faulted += 1
            return kind

    def __enter__(self):
        self._thread.start()
        self._timer.start()
        return self

    def __exit__(self, *exc):
        self._timer.cancel()
        self.shutdown()
        self.server_close()


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Sizes manifest in the test's temp dir; fast retries so fault tests take milliseconds."""
    monkeypatch.setenv("OLMO3_DATA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(storage, "DEFAULT_RETRY", FAST)


def _corpus(root, sizes, seed=0):
    """Token files under root/mix/ with random ids; returns their relative paths."""
    rng = np.random.default_rng(seed)
    os.makedirs(root / "mix" / "sub", exist_ok=True)
    rel = []
    for k, n in enumerate(sizes):
        r = f"mix/sub/part-{k:02d}.npy" if k % 2 else f"mix/part-{k:02d}.npy"
        rng.integers(0, data.VOCAB_SIZE, size=n, dtype=np.uint32).tofile(root / r)
        rel.append(r)
    return rel


SEQ = 64
SIZES = [5 * SEQ + 7, 3 * SEQ, SEQ - 1, 4 * SEQ + 63, 2 * SEQ]


def _plain_instances(paths, seq):
    """Oracle: numpy reads of each file, n = size // seq instances, leftovers dropped."""
    out = []
    for p in paths:
        t = np.fromfile(p, dtype=np.uint32)
        out += [t[j * seq:(j + 1) * seq] for j in range(len(t) // seq)]
    return out


def test_remote_equals_local_byte_for_byte(tmp_path):
    rel = _corpus(tmp_path, SIZES)
    local = [str(tmp_path / r) for r in rel]
    want = _plain_instances(local, SEQ)
    with RangeServer(tmp_path) as srv:
        urls = [f"{srv.url}/{r}" for r in rel]
        remote = data.FSLDataset(urls, SEQ)
        assert len(remote) == len(want) == 5 + 3 + 0 + 4 + 2
        for i, w in enumerate(want):
            got = remote[i]
            assert got.dtype == np.uint32 and got.tobytes() == w.tobytes()
            assert got.flags.writeable   # an array of its own, like a local read (not a view of the reply)
        files = [f"file://{p}" for p in local]
        assert data.FSLDataset(urls, SEQ).fingerprint == data.FSLDataset(local, SEQ).fingerprint \
            == data.FSLDataset(files, SEQ).fingerprint
        # Sizes were recorded once: a second open sends no HEAD and one GET (the reachability check).
        sizes = storage.load_manifest(storage.default_manifest_path())
        assert sizes == {u: os.path.getsize(p) for u, p in zip(urls, local)}
        before = dict(srv.requests)
        stamp = os.stat(storage.default_manifest_path()).st_ino
        data.FSLDataset(urls, SEQ)
        assert os.stat(storage.default_manifest_path()).st_ino == stamp   # nothing new: not rewritten
        assert srv.requests.get("HEAD", 0) == before.get("HEAD", 0)
        assert srv.requests["GET"] == before["GET"] + 1


def test_read_tokens_at_any_offset(tmp_path):
    rel = _corpus(tmp_path, [10_007])
    ref = np.fromfile(tmp_path / rel[0], dtype=np.uint32)
    with RangeServer(tmp_path) as srv:
        (f,) = storage.open_token_files([f"{srv.url}/{rel[0]}"])
        assert f.nbytes == 4 * 10_007 and f.num_tokens == 10_007
        rng = np.random.default_rng(1)
        for start in [0, 10_006, *rng.integers(0, 10_007, 20)]:
            count = int(min(rng.integers(0, 3000), 10_007 - start))
            np.testing.assert_array_equal(f.read_tokens(int(start), count), ref[start:start + count])
        with pytest.raises(IndexError):
            f.read_tokens(10_000, 8)


@pytest.mark.parametrize("faults", [["503"], ["drop"], ["short"], ["503", "drop", "short"]])
def test_transient_faults_are_retried_and_reads_exact(tmp_path, faults):
    rel = _corpus(tmp_path, SIZES, seed=2)
    want = _plain_instances([tmp_path / r for r in rel], SEQ)
    with RangeServer(tmp_path) as srv:
        srv.faults = faults
        ds = data.FSLDataset([f"{srv.url}/{r}" for r in rel], SEQ)
        for i in np.random.default_rng(3).permutation(len(ds)):
            np.testing.assert_array_equal(ds[int(i)], want[i])
        assert srv.faulted >= len(ds)  # every read met at least one fault and was retried


def test_faults_beyond_the_retry_budget_raise_naming_the_url(tmp_path):
    rel = _corpus(tmp_path, [4 * SEQ])
    with RangeServer(tmp_path) as srv:
        url = f"{srv.url}/{rel[0]}"
        (f,) = storage.open_token_files([url])
        f.policy = storage.RetryPolicy(attempts=3, initial_delay=0.001, max_delay=0.001)
        srv.faults, srv._n = ["503"], 0
        srv.next_fault = lambda method: "503"  # never recovers
        with pytest.raises(storage.RemoteFileError, match=re.escape(url)):
            f.read_tokens(0, SEQ)


def test_backoff_doubles_to_its_cap_and_every_attempt_is_made(tmp_path, monkeypatch):
    """DESIGN §4 bug 5: try k waits U(0, min(max_delay, initial * 2^k)) (written out below), and a
    budget of N attempts sends N requests with a wait between each two before it gives up."""
    bounds = []
    monkeypatch.setattr(storage.random, "uniform", lambda a, b: bounds.append((a, b)) or b)   # the jitter's bounds
    p = storage.RetryPolicy(attempts=7, initial_delay=0.25, max_delay=3.0)
    [p.delay(k) for k in range(7)]
    assert bounds == [(0.0, b) for b in (0.25, 0.5, 1.0, 2.0, 3.0, 3.0, 3.0)]
    monkeypatch.undo()
    rel = _corpus(tmp_path, [4 * SEQ])
    waits = []
    monkeypatch.setattr(storage.time, "sleep", waits.append)
    with RangeServer(tmp_path) as srv:
        (f,) = storage.open_token_files([f"{srv.url}/{rel[0]}"])
        f.policy = storage.RetryPolicy(attempts=5, initial_delay=0.001, max_delay=0.002)
        before = srv.requests["GET"]
        srv.next_fault = lambda method: "503"  # never recovers
        with pytest.raises(storage.RemoteFileError, match="failed 5 times"):
            f.read_tokens(0, SEQ)
        assert srv.requests["GET"] - before == 5
    assert len(waits) == 4 and all(0 <= w <= 0.002 for w in waits)


def test_file_truncated_on_server(tmp_path):
    rel = _corpus(tmp_path, [6 * SEQ, 6 * SEQ], seed=4)
    with RangeServer(tmp_path) as srv:
        urls = [f"{srv.url}/{r}" for r in rel]
        ds = data.FSLDataset(urls, SEQ)
        with open(tmp_path / rel[1], "r+b") as fh:  # the server copy loses its tail
            fh.truncate(4 * 3 * SEQ + 8)
        ds[6 + 2]  # still whole
        with pytest.raises(storage.TruncatedFileError, match=re.escape(urls[1])):
            ds[6 + 3]
        with pytest.raises(storage.TruncatedFileError, match=re.escape(urls[1])):
            ds[6 + 5]
        # A new run with the recorded size fails at open when the first file is the short one.
        with pytest.raises(storage.TruncatedFileError, match=re.escape(urls[1])):
            data.FSLDataset(urls[1:], SEQ)
        # refresh=True takes the new size (3 instances now, 8 tokens left over).
        f = storage.open_token_files(urls[1:], refresh=True)[0]
        assert f.nbytes == 4 * (3 * SEQ + 2)


def test_errors_no_retry_cures_end_with_status_2(tmp_path, monkeypatch):
    """A truncated file and a root that refuses access (HTTP 403: a private mirror, a missing
    credential) end a script with one line naming the URL and exit 2, also mid-run, where other
    OSErrors are retried (exit 1): a resubmission would only meet them again."""
    from olmo3 import cli
    rel = _corpus(tmp_path, [6 * SEQ, 6 * SEQ], seed=5)
    with RangeServer(tmp_path) as srv:
        url, other = f"{srv.url}/{rel[0]}", f"{srv.url}/{rel[1]}"
        ds = data.FSLDataset([url], SEQ)
        with open(tmp_path / rel[0], "r+b") as fh:
            fh.truncate(4 * SEQ)
        with pytest.raises(storage.TruncatedFileError) as truncated:
            ds[3]
        srv.next_fault = lambda method: "403"
        with pytest.raises(storage.FinalRemoteError, match=re.escape(other) + ".*HTTP 403.*--data_root") as denied:
            data.FSLDataset([other], SEQ)   # its size never recorded: asked of the server
    for running in (False, True):
        monkeypatch.setattr(cli, "_running", running)
        assert cli.exit_status(truncated.value) == cli.exit_status(denied.value) == 2
        assert cli.exit_status(storage.RemoteFileError(f"reading {url} failed 10 times")) == 1


@pytest.mark.parametrize("status", [404, 410, 400, 501, 301, 308, 405, 422])
def test_a_file_the_server_refuses_mid_run_ends_with_status_2_naming_it(tmp_path, monkeypatch, status):
    """A token file deleted from the server (404 / 410) or refused for good (400, 501) after the
    run started: one line naming the URL, exit status 2 (before, a 404 was retried as exit 1 and
    each rerun trained back to the same step; 410, 400 and 501 named no file). TensorStore files
    301, 405, 422 and most statuses it has no name for under UNKNOWN, 308 under UNAVAILABLE: they
    were retried, then ended the run with exit 1, and every resubmission met them again."""
    from olmo3 import cli
    rel = _corpus(tmp_path, [6 * SEQ, 6 * SEQ], seed=6)
    with RangeServer(tmp_path) as srv:
        urls = [f"{srv.url}/{r}" for r in rel]
        ds = data.FSLDataset(urls, SEQ)
        ds[7]
        if status == 404:
            os.remove(tmp_path / rel[1])
        else:
            srv.answers["/" + rel[1]] = (status, None)
        with pytest.raises(storage.FinalRemoteError, match=re.escape(urls[1])) as e:
            ds[8]
    assert isinstance(e.value, FileNotFoundError) == (status in (404, 410))
    monkeypatch.setattr(cli, "_running", True)
    assert cli.exit_status(e.value) == 2


def test_sizes_no_retry_cures_end_with_status_2_and_one_hard_error_is_said_at_once(tmp_path, monkeypatch):
    """While sizing: a HEAD refused for good (400), and a server whose ranges disagree with its
    HEAD, end with exit 2 (they were exit 1: resubmitted); a HEAD saying 0 bytes is checked against
    the ranges (a file was sized empty and its instances vanished); a size that is not whole
    tokens is never recorded. The first hard error is raised while other files still retry: it
    used to wait for every retry budget (minutes)."""
    from olmo3 import cli
    rel = _corpus(tmp_path, [3 * SEQ, 3 * SEQ, 3 * SEQ, 3 * SEQ], seed=9)
    with RangeServer(tmp_path) as srv:
        urls = [f"{srv.url}/{r}" for r in rel]
        srv.answers["/" + rel[1]] = (400, None)
        with pytest.raises(storage.FinalRemoteError, match=re.escape(urls[1]) + ".*HTTP 400") as e:
            storage.open_token_files(urls[:2])
        assert cli.exit_status(e.value) == 2
        del srv.answers["/" + rel[1]]

        real_head = storage._head_size
        monkeypatch.setattr(storage, "_head_size", lambda url, timeout: 0)   # "Content-Length: 0"
        assert storage.fetch_size(urls[2]) == 4 * 3 * SEQ
        monkeypatch.setattr(storage, "_head_size", lambda url, timeout: 4 * 3 * SEQ - 8)
        with pytest.raises(storage.FinalRemoteError, match="reported 760 bytes but its ranges say 768") as e:
            storage.fetch_size(urls[2])
        assert cli.exit_status(e.value) == 2
        monkeypatch.setattr(storage, "_head_size", real_head)

        with open(tmp_path / rel[3], "ab") as fh:
            fh.write(b"\0")
        with pytest.raises(ValueError, match="not a multiple of 4"):
            storage.open_token_files(urls)
        with open(tmp_path / rel[3], "r+b") as fh:
            fh.truncate(4 * 3 * SEQ)
        assert urls[3] not in storage.load_manifest(storage.default_manifest_path())
        assert [f.nbytes for f in storage.open_token_files(urls)] == [4 * 3 * SEQ] * 4   # the fix is seen

    rel = _corpus(tmp_path, [SEQ] * 6, seed=10)
    with RangeServer(tmp_path) as srv:
        urls = [f"{srv.url}/{r}" for r in rel]
        for r in rel[1:]:
            srv.answers["/" + r] = (503, None)   # every file but the first retries ...
        srv.answers["/" + rel[3]] = (403, None)  # ... and one is refused for good
        monkeypatch.setattr(storage, "DEFAULT_RETRY", storage.RetryPolicy(attempts=60, initial_delay=0.4,
                                                                          max_delay=0.4, timeout=5.0))
        t0 = time.perf_counter()
        with pytest.raises(storage.FinalRemoteError, match=re.escape(urls[3]) + ".*access denied"):
            storage.open_token_files(urls, manifest=str(tmp_path / "m.json"))
        assert time.perf_counter() - t0 < 5   # the others retry for ~12 s each


def test_urls_that_name_another_object_than_is_read_are_refused(tmp_path):
    """TensorStore requests the decoded path: %2F is read as a folder, %2B as '+' (a space on
    S3), so the size came from one object and the tokens from another. A raw space is refused
    before any request (it was retried as an unreachable root, exit 1). Other escapes are sized
    at the URL TensorStore requests, so both come from one object."""
    os.makedirs(tmp_path / "d")
    np.arange(4, dtype=np.uint32).tofile(tmp_path / "a!b.npy")
    with RangeServer(tmp_path) as srv:
        for bad in ("d%2Fe.npy", "a%2Bb.npy", "a b.npy"):
            with pytest.raises(ValueError, match=re.escape(f"{srv.url}/{bad}")):
                storage.open_token_files([f"{srv.url}/{bad}"])
        assert srv.requests == {}
        f, = storage.open_token_files([f"{srv.url}/a%21b.npy"])
        np.testing.assert_array_equal(f.read(0, 4), np.arange(4))


def test_a_redirecting_root_is_refused_at_open(tmp_path):
    """urllib follows redirects, TensorStore's range reads do not: a root that redirects is refused
    when its sizes are fetched, naming where it points, instead of every read failing later."""
    rel = _corpus(tmp_path, [2 * SEQ], seed=7)
    with RangeServer(tmp_path) as srv:
        srv.answers["/moved/"] = (302, f"{srv.url}/")
        url = f"{srv.url}/moved/{rel[0]}"
        with pytest.raises(storage.FinalRemoteError, match=re.escape(f"{url} redirects to {srv.url}/{rel[0]}")
                           + ".*--data_root"):
            data.FSLDataset([url], SEQ)


def test_a_server_that_shortens_ranges_is_not_called_truncated(tmp_path):
    rel = _corpus(tmp_path, [4 * SEQ], seed=8)
    with RangeServer(tmp_path) as srv:
        url = f"{srv.url}/{rel[0]}"
        ds = data.FSLDataset([url], SEQ)
        srv.max_range = 100
        for i in (1, 3):   # 3: the file's last range, which ends at its size
            with pytest.raises(storage.FinalRemoteError, match="shorter byte range") as e:
                ds[i]
            assert not isinstance(e.value, storage.TruncatedFileError)


def test_file_urls(tmp_path):
    assert storage.local_path(f"file://{tmp_path}/x.npy") == f"{tmp_path}/x.npy"
    assert storage.local_path(f"file://localhost{tmp_path}/x.npy") == f"{tmp_path}/x.npy"
    assert storage.local_path(f"file:{tmp_path}/x.npy") == f"{tmp_path}/x.npy"   # RFC 8089's short form
    assert storage.local_path("data/x.npy") == "data/x.npy"
    odd = tmp_path / "a b%c#d.npy"   # pathlib's URI of it is percent-encoded: file:///.../a%20b%25c%23d.npy
    assert storage.local_path(odd.as_uri()) == str(odd)
    with pytest.raises(ValueError, match="file:///d/x.npy"):   # "d" would be a host, and dropped
        storage.local_path("file://d/x.npy")


def test_the_length_of_an_encoded_head_is_not_taken_for_the_size(tmp_path):
    """A HEAD whose Content-Length is that of a gzip-encoded body (a server that compresses
    whatever it is asked) says nothing of the file's size: the sizes recorded are the files' own,
    found by probing ranges."""
    rel = _corpus(tmp_path, SIZES)
    local = [str(tmp_path / r) for r in rel]
    with RangeServer(tmp_path) as srv:
        srv.gzip_head = True
        urls = [f"{srv.url}/{r}" for r in rel]
        remote = data.FSLDataset(urls, SEQ)
        assert storage.load_manifest(storage.default_manifest_path()) == \
            {u: os.path.getsize(p) for u, p in zip(urls, local)}
        assert [remote[i].tobytes() for i in range(len(remote))] == [w.tobytes() for w in _plain_instances(local, SEQ)]


def test_a_short_answer_is_a_truncated_file_not_fewer_tokens(monkeypatch):
    """A store that answers a range with fewer bytes than asked and no error (a driver or proxy
    that shortens replies) is a TruncatedFileError naming the URL, never fewer tokens than
    read(start, stop) names. The store is a stand-in for TensorStore's kvstore serving bytes from
    memory; the oracle is numpy's slice of them."""
    tokens = np.arange(100, dtype=np.uint32)
    blob, url = tokens.tobytes(), "http://127.0.0.1:9/mix/part-00.npy"

    class Store:
        def read(self, key, byte_range):
            res = types.SimpleNamespace(state="value", value=blob[byte_range.start:byte_range.stop][:40])
            return types.SimpleNamespace(result=lambda timeout=None: res, cancel=lambda: None)
    monkeypatch.setattr(storage, "_store_and_key", lambda u: (Store(), "mix/part-00.npy"))
    f = storage.RemoteTokenFile(url, tokens.nbytes, FAST)
    np.testing.assert_array_equal(f.read(0, 10), tokens[:10])   # 40 bytes: answered in full
    with pytest.raises(storage.TruncatedFileError, match=url):
        f.read(0, 16)


def test_wide_integers_needs_32_pairs():
    """The int64-file check (np.array(ids).tofile writes int64) flags 32 ids read as uint32, and no
    shorter run whose odd positions happen to be 0 (real ids, e.g. [5, 0, 9, 0]), nor all zeros."""
    as_u32 = np.frombuffer(np.arange(1, 33, dtype=np.int64).tobytes(), np.uint32)
    assert storage.wide_integers(as_u32)
    assert not storage.wide_integers(as_u32[:62])
    assert not storage.wide_integers(np.array([5, 0, 9, 0], np.uint32))
    assert not storage.wide_integers(np.zeros(64, np.uint32))


def test_unreachable_root_fails_fast(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens here now
    url = f"http://127.0.0.1:{port}/mix/part-00.npy"
    t0 = time.perf_counter()
    with pytest.raises(storage.UnreachableError, match=re.escape(url)):
        data.FSLDataset([url, url.replace("00", "01")], SEQ)
    assert time.perf_counter() - t0 < 5.0


def test_unreachable_root_fails_fast_with_recorded_sizes(tmp_path, monkeypatch):
    """Sizes in the manifest send no size request, but the open still reads one token of the
    first file with the short budget: a root gone down fails in seconds, not after the run's
    long retry budget (here ~24 s), as UnreachableError."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    urls = [f"http://127.0.0.1:{port}/mix/part-0{k}.npy" for k in range(2)]
    storage.save_manifest(storage.default_manifest_path(), {u: 4 * SEQ for u in urls})
    monkeypatch.setattr(storage, "DEFAULT_RETRY", storage.RetryPolicy(attempts=60, initial_delay=0.4, max_delay=0.4))
    t0 = time.perf_counter()
    with pytest.raises(storage.UnreachableError, match=re.escape(urls[0])):
        data.FSLDataset(urls, SEQ)
    assert time.perf_counter() - t0 < 12.0   # FAST_FAIL: ~1 s of waits; the run's budget here: ~24 s


def test_root_without_files_and_bad_sizes(tmp_path):
    rel = _corpus(tmp_path, [3 * SEQ, 3 * SEQ])
    with open(tmp_path / "mix" / "odd.npy", "wb") as fh:
        fh.write(b"\0" * (4 * SEQ + 2))
    with RangeServer(tmp_path) as srv:
        with pytest.raises(FileNotFoundError, match="wrong-root"):
            data.FSLDataset([f"{srv.url}/wrong-root/{r}" for r in rel], SEQ)
        with pytest.raises(FileNotFoundError, match=r"1 of 2 token files.*missing\.npy"):
            data.FSLDataset([f"{srv.url}/{rel[0]}", f"{srv.url}/mix/missing.npy"], SEQ)
        odd = f"{srv.url}/mix/odd.npy"
        with pytest.raises(ValueError, match=re.escape(odd) + ".*not a multiple of 4"):
            data.FSLDataset([f"{srv.url}/{rel[0]}", odd], SEQ)
        with pytest.raises(ValueError, match="directory"):
            data.FSLDataset([f"{srv.url}/mix/"], SEQ)
        with pytest.raises(ValueError, match="unsupported scheme"):
            storage.open_token_files(["ftp://example.invalid/a.npy"])
        srv.no_range = True  # a server that answers every read with the whole file
        with pytest.raises(storage.RemoteFileError, match="ignores HTTP Range"):
            data.FSLDataset([f"{srv.url}/{rel[1]}"], SEQ)


@pytest.mark.parametrize("nbytes", [4, 4 * 1000, 4 * 16384, 4 * 16384 + 4, 4 * 70_001])
def test_size_by_range_probing(tmp_path, nbytes):
    """Without HEAD: HTTP takes the size from a one-byte range's Content-Range; the gs:// and s3://
    path finds it by byte-range reads alone (_probe_size)."""
    os.makedirs(tmp_path / "p")
    with open(tmp_path / "p" / "f.npy", "wb") as fh:
        fh.write(os.urandom(nbytes))
    with RangeServer(tmp_path) as srv:
        srv.no_head = True
        assert storage.fetch_size(f"{srv.url}/p/f.npy") == nbytes
        assert "HEAD" in srv.requests and srv.past_end == []  # it asked, got 405, asked a range
        assert storage._probe_size(f"{srv.url}/p/f.npy", FAST) == nbytes


@pytest.mark.parametrize("no_head", [False, True], ids=["head", "no_head"])
def test_http_never_asks_past_the_end(tmp_path, no_head):
    """Against a strict server (416 with `bytes */size` past the end) no request starts at or after
    a file's size: not while sizing, checking the end, opening, or reading every instance. An
    empty file is sized 0 from the 416 to its byte 0 (HEAD's Content-Length 0 is not taken alone:
    a HEAD answered without the body's length says 0 too) and holds no instance."""
    rel = _corpus(tmp_path, SIZES, seed=6)
    want = _plain_instances([tmp_path / r for r in rel], SEQ)
    (tmp_path / "mix" / "empty.npy").write_bytes(b"")
    with RangeServer(tmp_path) as srv:
        srv.no_head = no_head
        urls = [f"{srv.url}/{r}" for r in rel]
        ds = data.FSLDataset(urls, SEQ)
        for i, w in enumerate(want):
            np.testing.assert_array_equal(ds[i], w)
        for f in storage.open_token_files(urls):
            assert f.read(f.num_tokens, f.num_tokens).size == 0 and f.read(0, 0).size == 0
        assert storage.fetch_size(f"{srv.url}/mix/empty.npy") == 0
        with pytest.raises(ValueError, match=r"no file holds a full instance of \d+ tokens \(the largest holds 0\).*shorter --seq_len"):
            data.FSLDataset([f"{srv.url}/mix/empty.npy"], SEQ)
        assert len(data.FSLDataset([f"{srv.url}/mix/empty.npy", *urls], SEQ)) == len(want)
        # Only for the empty file is byte 0 asked for: its 416 means "empty".
        assert srv.past_end == ["bytes=0-0"] * 2, srv.past_end


def test_manifest_errors(tmp_path):
    path = tmp_path / "sizes.json"
    storage.save_manifest(str(path), {"http://a/x.npy": 8})
    storage.save_manifest(str(path), {"http://a/y.npy": 12})  # merges
    assert storage.load_manifest(str(path)) == {"http://a/x.npy": 8, "http://a/y.npy": 12}
    fmt = json.dumps(storage.MANIFEST_FORMAT)   # a size edited below 0 made the dataset skip a file
    for text in ("{not json", '{"format": "some other cache", "files": {"http://a/x.npy": {"bytes": 8}}}',
                 '{"format": ' + fmt + ', "files": {"http://a/x.npy": {"bytes": -4}}}'):
        path.write_text(text)
        with pytest.raises(ValueError, match=re.escape(str(path)) + ".*delete it"):
            storage.load_manifest(str(path))


def test_s3_urls_through_an_s3_compatible_endpoint(tmp_path, monkeypatch):
    """s3:// goes through TensorStore's s3 driver (path-style requests to the endpoint); sizes come
    from range probing, as there is no HEAD there. Our server stands in for an S3-compatible store."""
    rel = _corpus(tmp_path / "bucket", SIZES[:3], seed=5)
    want = _plain_instances([tmp_path / "bucket" / r for r in rel], SEQ)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no credential look-ups off this machine
    with RangeServer(tmp_path) as srv:
        monkeypatch.setenv("AWS_ENDPOINT_URL", srv.url)
        ds = data.FSLDataset([f"s3://bucket/{r}" for r in rel], SEQ)
        assert len(ds) == len(want)
        for i, w in enumerate(want):
            np.testing.assert_array_equal(ds[i], w)
        assert ds.fingerprint == data.FSLDataset([tmp_path / "bucket" / r for r in rel], SEQ).fingerprint


def test_an_unwritable_size_cache_names_its_variable(tmp_path, monkeypatch):
    """A file (or /proc) as OLMO3_DATA_CACHE ended with '[Errno 17] File exists: ...', naming nothing."""
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("OLMO3_DATA_CACHE", str(tmp_path / "afile"))
    with pytest.raises(ValueError, match=f"^OLMO3_DATA_CACHE='{tmp_path / 'afile'}': cannot write .*; set "
                                         "OLMO3_DATA_CACHE to a directory this process can write"):
        storage.save_manifest(storage.default_manifest_path(), {"http://h/a.npy": 8})
