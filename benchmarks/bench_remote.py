"""Reading token files over HTTP vs from local disk, through the training loader, in tokens/s.

    python benchmarks/bench_remote.py                                  # 127.0.0.1 server, no added latency
    python benchmarks/bench_remote.py --latency_ms=20 --workers=8,32   # a stand-in for a real object store

Serves a temporary corpus with the range server of tests/test_storage.py and times
`data.Loader` (the prefetching loader train.py uses) over the same files read three ways: local
paths (memmap), http:// URLs (TensorStore byte-range reads), and http:// with `--latency_ms`
added to every request. Also times opening `--open_files` remote files cold (sizes fetched in
parallel and recorded in the sidecar manifest) and warm (sizes from the manifest).
Each loader worker reads one batch's instances one after another, so the reads in flight are
about `workers`: with round-trip time L and instances of S tokens, expect ~workers * S / L tokens/s.
"""
import os
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

import data
from olmo3 import cli

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_storage import RangeServer  # noqa: E402

flags.DEFINE_integer("seq_len", 8192, "instance length (stage 1 uses 8192)")
flags.DEFINE_integer("global_batch", 16, "instances per step")
flags.DEFINE_integer("files", 8, "token files in the corpus")
flags.DEFINE_integer("tokens_per_file", 1 << 21, "tokens per file")
flags.DEFINE_integer("steps", 40, "loader steps timed per configuration")
flags.DEFINE_list("workers", ["0", "2", "8", "32"], "loader worker counts (prefetch = 2 x workers)")
flags.DEFINE_float("latency_ms", 20.0, "added per-request delay for the 'remote-like' rows")
flags.DEFINE_integer("open_files", 1000, "files for the open-time (size manifest) measurement")
cli.require([*[(name, lambda v: v >= 1, ">= 1") for name in ("global_batch", "files", "tokens_per_file", "steps",
                                                             "open_files")],
             ("seq_len", lambda v: v >= 2, ">= 2"),
             ("workers", lambda v: len(v) >= 1 and all(w.isdigit() for w in v), "one or more worker counts >= 0"),
             ("latency_ms", lambda v: cli.finite(v) and v >= 0, "finite and >= 0")])
FLAGS = flags.FLAGS


def time_loader(ds, workers: int) -> float:
    loader = data.Loader(ds, FLAGS.global_batch, seed=34521, workers=workers, prefetch=max(1, 2 * workers))
    next(loader)  # warm-up: threads, connections
    t0 = time.perf_counter()
    tokens = sum(next(loader)["tokens"].size for _ in range(FLAGS.steps))
    dt = time.perf_counter() - t0
    loader.close()
    return tokens / dt


def main(argv):
    del argv
    if FLAGS.tokens_per_file < FLAGS.seq_len:   # it named a temporary file, not the flags
        raise app.UsageError(f"--tokens_per_file={FLAGS.tokens_per_file} holds no instance of --seq_len="
                             f"{FLAGS.seq_len} tokens; give at least {FLAGS.seq_len}")
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; seq_len={FLAGS.seq_len} "
          f"global_batch={FLAGS.global_batch}, {FLAGS.steps} steps per row")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["OLMO3_DATA_CACHE"] = os.path.join(tmp, "cache")  # a fresh size manifest
        rng = np.random.default_rng(0)
        rel = []
        for k in range(FLAGS.files):
            rel.append(f"corpus/part-{k:03d}.npy")
            os.makedirs(os.path.join(tmp, "corpus"), exist_ok=True)
            rng.integers(0, data.VOCAB_SIZE, FLAGS.tokens_per_file, dtype=np.uint32).tofile(os.path.join(tmp, rel[-1]))
        with RangeServer(tmp, lifetime=3600) as srv:
            local = data.FSLDataset([os.path.join(tmp, r) for r in rel], FLAGS.seq_len)
            remote = data.FSLDataset([f"{srv.url}/{r}" for r in rel], FLAGS.seq_len)
            assert local.fingerprint == remote.fingerprint
            print(f"{len(local)} instances; local and http fingerprints equal")
            for w in map(int, FLAGS.workers):
                row = {"disk": time_loader(local, w)}
                row["http"] = time_loader(remote, w)
                srv.delay = FLAGS.latency_ms / 1e3
                row[f"http+{FLAGS.latency_ms:g}ms"] = time_loader(remote, w)
                srv.delay = 0.0
                print(f"workers={w:3d}: " + "  ".join(f"{k} {v / 1e6:7.2f}M tokens/s" for k, v in row.items()))

            # Open time over many files: cold (HEAD + 2 range reads per file, 64 threads), then warm.
            os.makedirs(os.path.join(tmp, "many"), exist_ok=True)
            small = np.arange(4 * FLAGS.seq_len, dtype=np.uint32)
            urls = []
            for k in range(FLAGS.open_files):
                small.tofile(os.path.join(tmp, "many", f"{k:05d}.npy"))
                urls.append(f"{srv.url}/many/{k:05d}.npy")
            srv.delay = FLAGS.latency_ms / 1e3
            for label in ("cold", "warm"):
                t0 = time.perf_counter()
                data.FSLDataset(urls, FLAGS.seq_len)
                print(f"open {len(urls)} remote files, {label} (latency {FLAGS.latency_ms:g} ms/request): "
                      f"{time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    cli.run(main)   # a bad flag: one line, exit 2 (olmo3/cli.py)
