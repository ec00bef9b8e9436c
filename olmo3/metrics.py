"""Training metrics: metrics.jsonl, TensorBoard events, a one-line progress display, MFU.

Every logged step is one JSON object with a `step` key in `<run_dir>/metrics.jsonl` (appended
and flushed per line, so a crash loses at most the line being written; on resume, lines for
steps after the checkpoint are superseded by the rerun's lines, last one wins).
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Optional

import jax

# Nominal dense bf16 peaks per device, TFLOP/s (vendor datasheets; TPU numbers per chip).
NOMINAL_PEAK_TFLOPS = {
    "H100": 989.0,   # SXM, dense bf16
    "H200": 989.0,   # same tensor cores as H100 SXM
    "TPU v5p": 459.0,
    "TPU7x": 2307.0,  # Ironwood, dense bf16 (the write-up used ~508-513 achieved at 44.5% MFU)
}


def nominal_peak_tflops() -> Optional[float]:
    kind = jax.devices()[0].device_kind
    for name, tflops in NOMINAL_PEAK_TFLOPS.items():
        if name.lower() in kind.lower():
            return tflops
    return None


def measure_matmul_peak(n: int = 2048, dtype=None, repeats: int = 5) -> float:
    """FLOP/s of an n x n matmul on the default device, best of `repeats` (a same-run peak)."""
    import jax.numpy as jnp
    dtype = dtype or jnp.float32
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best


def peak_flops(flag_tflops: Optional[float]) -> float:
    """Per-device peak FLOP/s for MFU: the flag, else the device's nominal peak, else a matmul
    peak measured now (CPUs and unknown devices)."""
    if flag_tflops:
        return flag_tflops * 1e12
    nominal = nominal_peak_tflops()
    return nominal * 1e12 if nominal else measure_matmul_peak()


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


def read_jsonl(path: str) -> list[dict]:
    """The JSON objects of a JSON Lines file (metrics.jsonl, task files); blank lines skipped. A
    malformed line is an error naming the file and line."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not JSON ({e})") from e
    return out


class MetricsWriter:
    """metrics.jsonl + TensorBoard event files + a progress line on stderr (process 0 only)."""

    def __init__(self, run_dir: str, enabled: bool = True):
        self.enabled = enabled
        self._tb = None
        self._t0 = time.time()
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self._file = open(os.path.join(run_dir, "metrics.jsonl"), "a", buffering=1)
        try:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(os.path.join(run_dir, "tb"))
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
            for k, v in metrics.items():
                self._tb.add_scalar(k, v, step)
        line = (f"step {step:>7d} | loss {metrics.get('train/loss', float('nan')):.4f} | "
                f"{metrics.get('perf/tokens_per_s', 0):,.0f} tok/s | "
                f"MFU {100 * metrics.get('perf/mfu_writeup', float('nan')):.1f}%")
        if metrics.get("optim/step_skipped"):
            line += " | SKIPPED"
        evals = {k.split("/")[1]: v for k, v in metrics.items() if k.startswith("eval/")}
        if evals:
            line += " | held-out " + " ".join(f"{d} {v:.3f}" for d, v in evals.items())
        if eta_s is not None:
            line += f" | ETA {_hms(eta_s)}"
        print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _hms(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    d, rem = divmod(seconds, 86400)
    h, rem = divmod(rem, 3600)
    m, s = divmod(rem, 60)
    return (f"{d}d " if d else "") + f"{h:02d}:{m:02d}:{s:02d}"
