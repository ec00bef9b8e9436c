"""Training metrics: metrics.jsonl, TensorBoard events, a one-line progress display, MFU.

Every logged step is one JSON object with a `step` key in `<run_dir>/metrics.jsonl` (appended
and flushed per line, so a crash loses at most the line being written). A step may have more
than one line; a reader merges them in order, a later value winning:
- on resume, lines for steps after the checkpoint are superseded by the rerun's lines;
- a run resumed from a preemption stop logs the evaluations the stop skipped at its step in a
  line of their own, after that step's training line (train.py §8).
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import resource
import sys
import time
import types
from typing import Callable, Iterator, Optional

import jax
from absl import logging

# Nominal dense bf16 peak per JAX device, TFLOP/s: (device_kind, how it matches, TFLOP/s, source).
# NVIDIA datasheets print bf16 "with sparsity"; the dense figure is half. TPU figures are per chip
# from the Cloud TPU docs; a chip is one JAX device except on Ironwood, whose two TensorCores are
# two devices (the write-up's 508-513 TFLOP/s/device at 44.5% MFU implies ~1150 per device).
# TPU kinds match exactly ("TPU v5" is v5p, "TPU v5 lite" is v5e); GPU kinds by prefix, the
# specific ones first ("NVIDIA H100 80GB HBM3" is the SXM part).
NOMINAL_PEAKS = (
    ("NVIDIA H100 PCIe", "prefix", 756.0, "NVIDIA H100 datasheet, PCIe: 1,513 with sparsity"),
    ("NVIDIA H100 NVL", "prefix", 835.0, "NVIDIA H100 datasheet, NVL: 1,671 with sparsity"),
    ("NVIDIA H100", "prefix", 989.0, "NVIDIA H100 datasheet, SXM: 1,979 with sparsity"),
    ("NVIDIA H200 NVL", "prefix", 835.0, "NVIDIA H200 datasheet, NVL: 1,671 with sparsity"),
    ("NVIDIA H200", "prefix", 989.0, "NVIDIA H200 datasheet, SXM: 1,979 with sparsity"),
    ("NVIDIA A100", "prefix", 312.0, "NVIDIA A100 datasheet: 312 dense, 624 with sparsity"),
    ("TPU v4", "exact", 275.0, "Cloud TPU v4 docs"),
    ("TPU v5 lite", "exact", 197.0, "Cloud TPU v5e docs"),
    ("TPU v5", "exact", 459.0, "Cloud TPU v5p docs"),
    ("TPU v5p", "exact", 459.0, "Cloud TPU v5p docs"),
    ("TPU v6 lite", "exact", 918.0, "Cloud TPU v6e (Trillium) docs"),
    ("TPU7x", "exact", 2307.0 / 2, "Cloud TPU7x (Ironwood) docs: 2,307 per chip, two devices per chip"),
)


def nominal_peak(device_kind: str) -> Optional[tuple[float, str]]:
    """(dense bf16 TFLOP/s per device, source) for a known accelerator, else None."""
    kind = device_kind.strip().lower()
    for name, how, tflops, source in NOMINAL_PEAKS:
        name = name.lower()
        if kind == name or (how == "prefix" and kind.startswith(name)):
            return tflops, source
    return None


def nominal_peak_tflops() -> Optional[float]:
    """The default device's nominal dense bf16 TFLOP/s per device, or None (CPUs, unknown kinds)."""
    found = nominal_peak(jax.devices()[0].device_kind)
    return found[0] if found else None


# The instruction sets that decide a CPU's matmul speed (XLA's and torch's kernels pick by them).
_CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_tile",      # x86 (Linux's names)
                 "asimd", "sve", "sve2", "bf16", "i8mm", "sme")     # arm64


def cpu_model(cpuinfo: Optional[str] = None) -> str:
    """The CPU, named well enough to tell families apart (DESIGN §7: name the CPU beside every
    CPU figure): /proc/cpuinfo's model name, which virtual machines often shorten to a brand
    ('AMD EPYC', 'Intel(R) Xeon(R) Processor'), then its vendor's family and model numbers
    (x86) or implementer and part (arm64), and the matmul-relevant instruction sets present,
    e.g. 'AMD EPYC (family 25 model 17; avx2 avx512f avx512_bf16)'. `cpuinfo`: the file's
    text (tests); elsewhere than Linux, the platform's processor name."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            import platform
            return platform.processor() or platform.machine() or "unknown CPU"
    first: dict[str, str] = {}
    for line in cpuinfo.splitlines():   # the first processor's fields (all processors agree)
        key, sep, value = line.partition(":")
        if sep and key.strip() and key.strip() not in first:
            first[key.strip()] = value.strip()
    ids = (f"family {first['cpu family']} model {first['model']}" if "cpu family" in first and "model" in first
           else f"implementer {first['CPU implementer']} part {first.get('CPU part', '?')}"
           if "CPU implementer" in first else "")
    flags = set((first.get("flags") or first.get("Features") or "").split())
    features = " ".join(f for f in _CPU_FEATURES if f in flags)
    import platform
    name = first.get("model name") or first.get("Model") or platform.machine() or "unknown CPU"
    detail = "; ".join(p for p in (ids, features) if p)
    return f"{name} ({detail})" if detail else name


def device_description() -> str:
    """'<count> x <kind>' of the global devices, with the CPU model on a CPU backend."""
    d = jax.devices()[0]
    kind = f"cpu ({cpu_model()})" if d.platform == "cpu" else d.device_kind
    return f"{jax.device_count()} x {kind}"


def measure_matmul_peak(n: int = 2048, dtype=None, repeats: int = 5) -> float:
    """FLOP/s of an n x n matmul on the default device, best of `repeats` (a same-run peak)."""
    import jax.numpy as jnp
    f, a = _matmul(n, jnp.dtype(dtype or jnp.float32))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best


@functools.lru_cache(maxsize=2)
def _matmul(n: int, dtype) -> tuple:
    """The compiled, warmed-up matmul and its operand, kept: a run re-measures its peak often."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    return f, a


def peak_units(n_devices: int) -> int:
    """How many peaks a run's FLOP/s is shared among: its devices on an accelerator; on a CPU
    its processes (hosts), whose host devices (--xla_force_host_platform_device_count) share
    the cores that the measured one-device matmul already uses."""
    return jax.process_count() if jax.devices()[0].platform == "cpu" else n_devices


class PeakFlops:
    """The per-device peak FLOP/s that MFU divides by, and where it came from.

    --peak_tflops wins, then a known accelerator's nominal peak (NOMINAL_PEAKS). Otherwise
    (CPUs, unknown devices) the peak is the best n x n matmul rate measured in this run. Load on
    a shared machine can only make a measurement low, never high, so the best of several is
    the estimate, and it is re-measured: briefly after each of the first `early_steps` steps,
    then every `refresh_s` seconds, and at once whenever a step ran faster than the peak
    (MFU above 100% means the peak is wrong, not that the step beat the hardware). If the
    re-measurement still falls short, the step's own rate becomes the peak: the device has just
    shown it can do that much. `update` returns the seconds it spent, to bill to no step.
    """

    def __init__(self, flag_tflops: Optional[float] = None, *, device_kind: Optional[str] = None,
                 dtype=None, measure: Optional[Callable[[int], float]] = None,
                 clock: Callable[[], float] = time.perf_counter, early_steps: int = 5,
                 refresh_s: float = 600.0):
        self.clock, self.early_steps, self.refresh_s = clock, early_steps, refresh_s
        self.kind = kind = device_kind if device_kind is not None else jax.devices()[0].device_kind
        nominal = nominal_peak(kind)
        self.measured = not flag_tflops and nominal is None
        self.measurements = self._updates = 0
        if flag_tflops:
            self.value, self.source = flag_tflops * 1e12, "--peak_tflops"
        elif nominal:
            self.value, self.source = nominal[0] * 1e12, f"{kind}, dense bf16 ({nominal[1]})"
        else:
            import jax.numpy as jnp
            dtype = jnp.dtype(dtype or jnp.float32)
            n = 2048 if kind.lower() == "cpu" else 8192   # big enough to reach the peak
            self.source = (f"measured: best {n}x{n} {dtype.name} matmul on this device, "
                           f"re-measured during the run")
            self._measure = measure or (lambda repeats: measure_matmul_peak(n, dtype, repeats))
            self.value = 0.0
            self._remeasure(repeats=5)
        self._last = self.clock()

    def describe(self) -> str:
        unit = "TFLOP/s per host" if self.kind.lower() == "cpu" else "TFLOP/s/device"   # see peak_units
        return f"peak {_tflops(self.value)} {unit} ({self.source})"

    def _remeasure(self, repeats: int) -> float:
        self.measurements += 1
        self.value = max(self.value, self._measure(repeats))
        return self.value

    def update(self, step: int, achieved: float) -> float:
        """After step `step` ran at `achieved` FLOP/s per device: re-measure if due, or if
        `achieved` beats the peak. Returns the seconds spent (billed to no step)."""
        t0 = self.clock()
        self._updates += 1
        if achieved > self.value:
            if self.measured:
                old = self.value
                self._remeasure(repeats=5)
                logging.info("MFU would exceed 100%%: step %d ran at %s TFLOP/s, above the measured "
                             "peak of %s; re-measured: %s", step, _tflops(achieved), _tflops(old),
                             _tflops(self.value))
            if achieved > self.value:
                # A measured peak: the matmul is not this device's best kernel (normal, say so).
                # A nominal or --peak_tflops one: the figure or the FLOP count is wrong (warn).
                (logging.info if self.measured else logging.warning)(
                    "step %d ran at %s TFLOP/s, above the peak of %s (%s); the peak is now "
                    "that rate", step, _tflops(achieved), _tflops(self.value), self.source)
                self.value = achieved
                if not self.measured:
                    self.source += "; raised to a rate this run reached"
        elif self.measured and (self._updates <= self.early_steps or t0 - self._last >= self.refresh_s):
            self._remeasure(repeats=2)
        else:
            return 0.0
        self._last = self.clock()
        return self._last - t0


def _tflops(flops: float) -> str:
    return f"{flops / 1e12:.4g}"


def memory_bytes() -> dict:
    """Peak device memory in use if the backend reports it, and the host's peak RSS."""
    out = {"mem/host_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        out["mem/device_peak_gb"] = stats["peak_bytes_in_use"] / 2**30
    return out


def perf(step_time_s: float, tokens_per_step: int, flops_per_step: dict, peak_flops_total: float,
         step: int) -> dict:
    """Throughput metrics for one step; MFU in both FLOP conventions (config.py)."""
    out = {"perf/step_time_s": step_time_s, "perf/tokens_per_s": tokens_per_step / step_time_s,
           "perf/total_tokens": float(tokens_per_step) * step}
    for convention, f in flops_per_step.items():
        out[f"perf/mfu_{convention}"] = f / step_time_s / peak_flops_total
        out[f"perf/tflops_per_s_{convention}"] = f / step_time_s / 1e12
    out.update(memory_bytes())
    return out


def iter_jsonl(path: str, torn_tail_ok: bool = False) -> Iterator[dict]:
    """The JSON objects of a JSON Lines file (metrics.jsonl, task files), one at a time; blank
    lines skipped. A malformed line is an error naming the file and line; with `torn_tail_ok` (a
    log a process appends to), a malformed last line without its newline is what a killed writer
    leaves, and is skipped with a warning."""
    with open(path) as f:   # streamed: a stage-1 metrics.jsonl is ~1 GB
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                if torn_tail_ok and not line.endswith("\n"):   # only the last line can lack it
                    logging.warning("%s:%d: a torn last line (%d bytes, a writer killed mid-line), skipped",
                                    path, i, len(line))
                    return
                raise ValueError(f"{path}:{i}: not JSON ({e})") from e
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{i}: a JSON {type(rec).__name__}, not an object")
            yield rec


def read_jsonl(path: str, torn_tail_ok: bool = False) -> list[dict]:
    """iter_jsonl's objects, as a list (a small file: tasks, chats)."""
    return list(iter_jsonl(path, torn_tail_ok))


def drop_torn_tail(path: str) -> int:
    """Cut a file that a killed appender left without its final newline back to its last whole
    line; the bytes dropped. The next append then starts on a line of its own (it was glued onto
    the fragment, and the file was unreadable from there on)."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return 0
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        keep = size
        while keep > 0:   # back to the last newline, 64 KiB at a time (a stage-1 log is ~1 GB)
            start = max(0, keep - (1 << 16))
            f.seek(start)
            chunk = f.read(keep - start)
            if keep == size and chunk.endswith(b"\n"):
                return 0
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                keep = start + cut + 1
                break
            keep = start
        f.truncate(keep)
    return size - keep


class StepClock:
    """Step times for the progress line: raw per step for metrics.jsonl, and over a moving
    window for the tokens/s, MFU and ETA a reader watches, so one slow step moves them little.

    A step's time runs from the end of the previous step's bookkeeping to the end of this step
    (data wait included); time spent inside `excluded(kind)` (evaluation, checkpoint saves) and
    in peak measurements is billed to no step. The first step of a process compiles, so it
    leaves the window once a second step exists. The ETA adds the remaining evaluations and
    saves at the duration of the last one of each kind.
    """

    def __init__(self, tokens_per_step: int, flops_per_step: dict, n_devices: int,
                 peak: Optional[PeakFlops], window: int = 20,
                 clock: Callable[[], float] = time.perf_counter):
        self.tokens_per_step, self.flops, self.n_devices = tokens_per_step, flops_per_step, n_devices
        self.peak, self.window, self.clock = peak, window, clock
        self.times: list[float] = []      # the window, oldest first
        self.last: dict[str, float] = {}  # kind -> seconds of the last excluded span
        self._mark = clock()
        self._excluded = 0.0
        self._steps = 0

    @contextlib.contextmanager
    def excluded(self, kind: str):
        t0 = self.clock()
        try:
            yield
        finally:
            dt = self.clock() - t0
            self.last[kind] = dt
            self._excluded += dt

    def step_done(self, step: int) -> dict:
        """Close step `step`: its raw metrics and the windowed ones (perf/*_smoothed)."""
        now = self.clock()
        dt = max(now - self._mark - self._excluded, 1e-9)
        self._mark, self._excluded = now, 0.0
        self._steps += 1
        if self.peak is None:   # processes other than 0 log nothing: time only
            out = {"perf/step_time_s": dt, "perf/tokens_per_s": self.tokens_per_step / dt}
        else:
            achieved = max(self.flops.values()) / dt / self.n_devices
            self._excluded += self.peak.update(step, achieved)   # may raise the peak: before MFU
            out = perf(dt, self.tokens_per_step, self.flops, self.peak.value * self.n_devices, step)
            out["perf/peak_tflops_per_device"] = self.peak.value / 1e12
        if self._steps == 2 and self.times:
            self.times.clear()   # drop the compiling first step
        self.times = (self.times + [dt])[-self.window:]
        mean = sum(self.times) / len(self.times)
        out["perf/tokens_per_s_smoothed"] = self.tokens_per_step / mean
        for convention, f in self.flops.items() if self.peak else ():
            out[f"perf/mfu_{convention}_smoothed"] = f / mean / (self.peak.value * self.n_devices)
        return out

    def eta_s(self, step: int, max_steps: int, eval_interval: int, save_interval: int,
              downstream_interval: Optional[int] = None) -> float:
        """Seconds left after step `step`'s line: steps at the windowed step time, plus the
        evaluations (every eval_interval, every save_interval and at the end), the downstream
        evaluations (every downstream_interval) and saves still to come, each at its last duration
        (a resumed run starts from those its checkpoint recorded: train.py seeds `last`). The line
        is written after the step's evaluations and before its save, so that save is still to
        come. NaN (no ETA shown) until a step after the compiling one has been timed: a 60 s
        compile made the first line of a 9,000-step resume promise six days."""
        if not self.times or self._steps < 2:
            return math.nan
        evals = _events_left(step, max_steps, eval_interval, save_interval)
        saves = _events_left(step - 1, max_steps, save_interval)
        downstream = _multiples(step, max_steps, downstream_interval) if downstream_interval else 0
        return (sum(self.times) / len(self.times) * (max_steps - step) + evals * self.last.get("eval", 0.0)
                + saves * self.last.get("save", 0.0) + downstream * self.last.get("downstream", 0.0))


def _events_left(step: int, max_steps: int, *intervals: int) -> int:
    """Steps in (step, max_steps] that are a multiple of one of `intervals` (one or two), or
    the last step (train.py evaluates and saves there too)."""
    n = sum(_multiples(step, max_steps, i) for i in intervals)
    if len(intervals) == 2:
        n -= _multiples(step, max_steps, math.lcm(*intervals))
    return n + int(max_steps > step and all(max_steps % i for i in intervals))


def _multiples(lo: int, hi: int, every: int) -> int:
    """How many multiples of `every` lie in (lo, hi]."""
    return max(hi // every - lo // every, 0)


class MetricsWriter:
    """metrics.jsonl + TensorBoard event files + a progress line on stderr (process 0 only)."""

    def __init__(self, run_dir: str, enabled: bool = True, purge_step: Optional[int] = None):
        """`purge_step`: the first step this process logs (a resume's start + 1): TensorBoard
        hides the points at and after it that an earlier attempt logged."""
        self.enabled = enabled
        self._tb = None
        self._t0 = time.time()
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, "metrics.jsonl")
        dropped = drop_torn_tail(path)
        if dropped:   # the resumed run logs those steps again
            logging.warning("%s: dropped a torn last line (%d bytes) before appending", path, dropped)
        self._file = open(path, "a", buffering=1)
        try:
            self._tb = TensorBoardEvents(os.path.join(run_dir, "tb"), purge_step)
        except ImportError:  # TensorBoard is optional; metrics.jsonl is the record
            self._tb = None

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, file=sys.stderr, flush=True)

    def write(self, step: int, metrics: dict, eta_s: Optional[float] = None) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        if self._tb is not None:
            self._tb.write(step, metrics)
        parts = [f"step {step:>7d}"]
        if "train/loss" in metrics:   # absent from an evaluation-only record (--eval_at_start's step 0)
            tokens_per_s = metrics.get("perf/tokens_per_s_smoothed", metrics.get("perf/tokens_per_s", 0))
            mfu = metrics.get("perf/mfu_writeup_smoothed", metrics.get("perf/mfu_writeup", math.nan))
            parts += [f"loss {metrics['train/loss']:.4f}", f"{tokens_per_s:,.0f} tok/s", f"MFU {100 * mfu:.1f}%"]
        if metrics.get("optim/step_skipped"):
            parts.append("SKIPPED")
        if "train/rewards/accuracy" in metrics:   # DPO (olmo3/dpo.py)
            parts.append(f"acc {metrics['train/rewards/accuracy']:.3f} margin {metrics['train/rewards/margin']:.4f}")
        evals = {k.split("/")[1]: v for k, v in metrics.items() if k.startswith("eval/") and k.endswith("/loss")}
        if evals:
            parts.append("held-out " + " ".join(f"{d} {v:.3f}" for d, v in evals.items()))
        if eta_s is not None and math.isfinite(eta_s):
            parts.append(f"ETA {_hms(eta_s)}")
        print(" | ".join(parts), file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()


class TensorBoardEvents:
    """A TensorBoard event file, written in the caller's thread and flushed at every step, so that
    it holds what metrics.jsonl holds when a run dies. tensorboardX's SummaryWriter queues events
    for a thread that flushes every 120 s, and its flush() does not wait for that queue: a crash
    after a checkpoint lost up to two minutes of points before the checkpoint's step, which the
    resumed run never logs again. The file format is tensorboardX's (its EventsWriter and Event
    proto); a step is one Event holding all its scalars."""

    def __init__(self, logdir: str, purge_step: Optional[int] = None):
        """`purge_step`: TensorBoard hides the points at and after it from earlier files (a
        SessionLog START at that step, as tensorboardX's `purge_step` writes it)."""
        tbx = _import_tensorboardx()
        self._event, self._summary = tbx.event_pb2.Event, tbx.summary_pb2.Summary
        os.makedirs(logdir, exist_ok=True)
        self._writer = tbx.event_file_writer.EventsWriter(os.path.join(logdir, "events"))
        if purge_step is not None:
            start = tbx.event_pb2.SessionLog(status=tbx.event_pb2.SessionLog.START)
            self._writer.write_event(self._event(step=purge_step, wall_time=time.time(), session_log=start))
        self._writer.flush()

    def write(self, step: int, metrics: dict) -> None:
        values = [self._summary.Value(tag=k, simple_value=float(v)) for k, v in metrics.items()]
        self._writer.write_event(self._event(step=step, wall_time=time.time(), summary=self._summary(value=values)))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _import_tensorboardx():
    """tensorboardX's event writer and protos, imported without torch. tensorboardX imports torch
    whenever it is installed (the test extras, OLMo-core, most GPU images), only so that it can
    accept torch tensors; we log Python floats. Without that import, a 4-step test-config train.py run
    took 31.0 s instead of 35.4 s and peaked at 1.18 GB RSS instead of 1.35 GB (three runs each,
    AMD EPYC), and a GPU process keeps torch's CUDA libraries out from beside JAX's (a torch
    cuDNN loaded before JAX's backend starts stops that backend: jax-ml/jax#18032, #19004).
    tensorboardX falls back to numpy when `import torch` raises ImportError, which a None entry
    in sys.modules makes it do; the entry goes at once, so the process can import torch later.
    The same for boto3 and google.cloud.storage, which its event writer imports for s3:// and
    gs:// log directories (ours is always a local path, train.py refuses URLs): the import takes
    0.17 s instead of 0.64-0.73 s (`python -X importtime`, three runs each, AMD EPYC)."""
    blocked = [m for m in ("torch", "boto3", "google.cloud.storage") if m not in sys.modules]
    for m in blocked:
        sys.modules[m] = None
    try:
        import tensorboardX
        import tensorboardX.event_file_writer
        import tensorboardX.proto.event_pb2
        import tensorboardX.proto.summary_pb2
    finally:
        for m in blocked:
            sys.modules.pop(m, None)
    return types.SimpleNamespace(event_file_writer=tensorboardX.event_file_writer,
                                 event_pb2=tensorboardX.proto.event_pb2,
                                 summary_pb2=tensorboardX.proto.summary_pb2)


def _hms(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    d, rem = divmod(seconds, 86400)
    h, rem = divmod(rem, 3600)
    m, s = divmod(rem, 60)
    return (f"{d}d " if d else "") + f"{h:02d}:{m:02d}:{s:02d}"
