"""Where one training step's time goes: a jax.profiler trace of bench.py's step, summed per op.

    python benchmarks/profile_step.py --flagfile=benchmarks/bench_cpu.flags        # the CPU config
    python benchmarks/profile_step.py --flagfile=benchmarks/bench_cpu.flags --trace_dir=/tmp/t

Builds exactly the step bench.py times (same flags), runs `--warmup` steps, traces one, and
prints the thunks XLA ran (on the CPU backend each fusion, matmul or copy is one thunk):
matmuls (YNNPACK / XNNPACK / oneDNN fusions and plain `dot`s) against everything else, by
phase of the step (the HLO op names say forward, backward, cross-entropy chunk loop or
optimizer), then the `--top` most expensive ops. Thunk times are wall time on the thread that
ran them: two thunks may run at once, and an Eigen `dot` returns before its work is done (its
time shows up as the wait of whatever needs its result), so columns do not add up to the step.
Ops XLA made itself, without an op name (e.g. the reduce-windows of its tree reductions), count
as "other". Found with it (issue 14): the cross entropy's row max, then the stacked residuals.
Open the trace (`--trace_dir`, perfetto .json.gz) in ui.perfetto.dev for the timeline.
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench  # noqa: E402  (defines the step's flags)
from absl import flags  # noqa: E402

from olmo3 import cli  # noqa: E402

flags.DEFINE_string("trace_dir", None, "Keep the trace here (default: a temporary directory).")
flags.DEFINE_integer("top", 15, "How many of the most expensive ops to list.")
cli.require([("top", lambda v: v >= 1, ">= 1")])
F = flags.FLAGS

_LOOPS = re.compile(r"(while|call|conditional)(\.\d+)?$")   # their bodies' ops are listed


def phase(op_name: str) -> str:
    """Step phase from an HLO op_name ('jit(step)/transpose(jvp(vmap()))/...' = layers backward)."""
    if "transpose(jvp(vmap" in op_name:
        return "layers backward"
    if "jvp(vmap" in op_name:
        return "layers forward"
    if "jvp()" in op_name:   # the fused cross entropy: forward and gradient in one chunk loop
        return "lm_head + cross entropy"
    return "optimizer, embedding, other"


# bench.py's flags that time or compare, which one traced step does not: each would be ignored.
BENCH_ONLY = ("steps", "matmul_n", "peak_tflops", "compare_torch", "torch_threads", "independent_runs")


def check_trace_dir(trace_dir: str) -> None:
    """--trace_dir is a writable directory, and the profiler's plugins/profile in it can be made
    (a file there failed after the profile, FAILED_PRECONDITION). Before the step compiles."""
    from absl import app

    from olmo3 import atomic
    atomic.check_writable(trace_dir, "--trace_dir")
    for sub in ("plugins", os.path.join("plugins", "profile")):
        if os.path.exists(os.path.join(trace_dir, sub)) and not os.path.isdir(os.path.join(trace_dir, sub)):
            raise app.UsageError(f"--trace_dir={trace_dir}: {os.path.join(trace_dir, sub)} is not a directory, "
                                 "and the profiler writes its traces there; give another --trace_dir")


def traced(run_step, trace_dir: str | None) -> tuple[float, str]:
    """(seconds, the trace file) of one step under jax.profiler. With `trace_dir` the trace is
    written into a hidden temporary directory in it, then moved into its plugins/profile/ whole
    (a failed or interrupted profile leaves nothing there); else it stays in a temporary directory."""
    import jax
    where = tempfile.mkdtemp(prefix=".olmo3_trace_", dir=trace_dir)
    try:
        with jax.profiler.trace(where, create_perfetto_trace=True):
            t = time.perf_counter()
            run_step()
            step_s = time.perf_counter() - t
    except BaseException:
        shutil.rmtree(where, ignore_errors=True)
        raise
    runs = sorted(glob.glob(os.path.join(where, "plugins", "profile", "*")))
    if not runs or not glob.glob(os.path.join(runs[-1], "*.trace.json.gz")):
        raise RuntimeError(f"jax.profiler wrote no *.trace.json.gz under {where}; this JAX's profiler plugin "
                           "may be missing (pip install -U jax jaxlib)")
    run = runs[-1]
    if trace_dir is not None:
        os.makedirs(os.path.join(trace_dir, "plugins", "profile"), exist_ok=True)
        run = os.path.join(trace_dir, "plugins", "profile", os.path.basename(runs[-1]))
        os.rename(runs[-1], run)
        shutil.rmtree(where, ignore_errors=True)
    return step_s, sorted(glob.glob(os.path.join(run, "*.trace.json.gz")))[-1]


def main(argv):
    del argv
    cli.refuse_given(BENCH_ONLY, "is bench.py's: profile_step.py traces one step after --warmup; drop {flag}")
    if F.trace_dir:
        check_trace_dir(F.trace_dir)
    bench.tune()   # as bench.py (olmo3/runtime.py): what is traced is the step bench.py times
    import jax
    import numpy as np

    config = bench.config_from_flags()
    bench.check(config, jax.devices()[0].platform)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (F.batch, F.seq_len), dtype=np.int32)
    run_step, _ = bench.build_ours(config, tokens)
    for _ in range(F.warmup):   # bench.py's flag: >= 1, the first step compiles
        bench.check_loss(run_step())
    step_s, path = traced(run_step, F.trace_dir)
    hlo = run_step.hlo_text()
    instructions = set(re.findall(r"^\s*(?:ROOT )?%(\S+) = ", hlo, re.M))
    op_names = dict(re.findall(r'^\s*(?:ROOT )?%(\S+) = .*?op_name="([^"]*)"', hlo, re.M))
    events = [e for e in json.load(gzip.open(path))["traceEvents"]   # thunks: the step's HLO ops
              if e.get("ph") == "X" and e["name"] in instructions and not _LOOPS.match(e["name"])]

    by_phase = collections.defaultdict(lambda: [0.0, 0.0])
    by_op = collections.Counter()
    for e in events:
        ms = e["dur"] / 1e3
        is_dot = e["name"].startswith(("ynn_fusion", "xnn_fusion", "onednn", "dot"))
        by_phase[phase(op_names.get(e["name"], ""))][0 if is_dot else 1] += ms
        by_op[e["name"]] += ms
    print(f"step {step_s:.3f} s (traced); trace: {path}")
    print(f"{'phase':30s} {'matmul ms':>10s} {'other ms':>10s}")
    for name, (dots, other) in sorted(by_phase.items(), key=lambda kv: -sum(kv[1])):
        print(f"{name:30s} {dots:10.1f} {other:10.1f}")
    print(f"top {F.top} ops (ms, summed over calls):")
    for name, ms in by_op.most_common(F.top):
        print(f"  {ms:8.1f}  {name}  {op_names.get(name, '')[-70:]}")


if __name__ == "__main__":
    cli.run(main)   # a bad flag: one line, exit 2 (olmo3/cli.py)
