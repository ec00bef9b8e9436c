"""Throughput of the data side: corpus preparation and the loader, in tokens/s.

    python benchmarks/bench_data.py                       # embedded stdlib corpus, fresh build in a temp dir
    python benchmarks/bench_data.py --seq_len=8192 --global_batch=16

Targets (issue 3): prepare >= 1M tokens/s on 2 cores; the loader >= 20x what the tiny CPU
training step consumes (~1-3k tokens/s), i.e. >= 60k tokens/s.
"""
import os
import resource
import tempfile
import time

from absl import flags

import data
from data import prepare as prep
from olmo3 import cli

flags.DEFINE_string("out_dir", None, "where to build the corpus (default: a fresh temporary directory)")
flags.DEFINE_multi_integer("prepare_workers", [1, os.cpu_count() or 1], "encoding process counts to time")
flags.DEFINE_integer("seq_len", 512, "instance length for the loader benchmark")
flags.DEFINE_integer("global_batch", 32, "instances per global step")
flags.DEFINE_integer("steps", 200, "loader steps to time per configuration")
flags.DEFINE_multi_integer("loader_workers", [0, 2, 8], "loader worker counts to time")
cli.require([("prepare_workers", lambda v: all(n >= 1 for n in v), "process counts >= 1"),
             ("seq_len", lambda v: v >= 2, ">= 2"), ("global_batch", lambda v: v >= 1, ">= 1"),
             ("steps", lambda v: v >= 1, ">= 1"), ("loader_workers", lambda v: all(n >= 0 for n in v), "counts >= 0")])
FLAGS = flags.FLAGS


def _cpu_seconds() -> float:
    """User + system CPU of this process and its finished children (the encoding processes)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def bench_prepare(out_dir: str, workers: int) -> dict:
    t0, c0 = time.perf_counter(), _cpu_seconds()
    manifest = prep.prepare("stdlib", out_dir, workers=workers, progress=False)
    dt, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
    tokens = sum(s["tokens"] for s in manifest["splits"].values())
    docs = sum(s["documents"] for s in manifest["splits"].values())
    print(f"prepare stdlib, {workers} process(es): {docs:,} docs, {tokens:,} tokens in {dt:.2f} s "
          f"= {tokens / dt / 1e6:.2f}M tokens/s wall (incl. process start-up and writes); "
          f"{tokens / cpu / 1e6:.2f}M tokens per CPU-second")
    return manifest


def bench_loader(ds, workers: int, repetition_filter: bool, num_ranks: int = 1):
    loader = data.Loader(ds, FLAGS.global_batch, seed=34521, num_ranks=num_ranks, workers=workers,
                         prefetch=max(2 * workers, 1), repetition_filter=repetition_filter)
    next(loader)  # warm-up: thread start, permutation
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(FLAGS.steps):
        tokens += next(loader)["tokens"].size
    dt = time.perf_counter() - t0
    loader.close()
    print(f"loader seq_len={ds.seq_len} global_batch={FLAGS.global_batch} workers={workers} "
          f"filter={'on ' if repetition_filter else 'off'}: {tokens / dt / 1e6:.2f}M tokens/s "
          f"({FLAGS.steps / dt:.0f} steps/s)")


def main(argv):
    del argv
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} (other work on the machine slows every figure)")
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = FLAGS.out_dir or os.path.join(tmp, "stdlib")
        for w in FLAGS.prepare_workers:
            bench_prepare(out_dir, w)
        ds = data.open_split(out_dir, "train", FLAGS.seq_len)
        print(f"train split: {len(ds):,} instances of {ds.seq_len} tokens")
        for filt in (False, True):
            for w in FLAGS.loader_workers:
                bench_loader(ds, w, filt)


if __name__ == "__main__":
    cli.run(main)   # a bad flag: one line, exit 2 (olmo3/cli.py)
