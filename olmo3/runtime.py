"""Process settings that XLA's CPU backend rewards. Call `tune_cpu()` before JAX starts a backend.

Both were found by profiling the issue-8 CPU config (benchmarks/bench_cpu.flags: d_model 512, 8 layers,
vocab 100278, batch 4 x 512, fp32, 2 cores) with jax 0.10.2; each is a measured fix, not folklore:

1. YNNPACK for dots only. XLA:CPU hands dots AND reductions to YNNPACK by default. The softmax
   normalizer of the chunked cross entropy (a sum of exp over [1024, 100278] logits) took 253 ms
   per chunk there, against 22 ms for XLA's own loop fusion over the same logits. Dots only:
   step 8.76 s -> 8.08 s. (Also handing it elementwise ops: 11.04 s; no YNNPACK at all: 8.42 s.)
2. Keep freed memory in the process. XLA:CPU mallocs each step's temporaries; glibc hands any
   block over 32 MB straight back to the kernel on free (mmap/munmap), so every step faulted its
   ~3.9 GB of temporaries in again: 986k minor page faults and 1.9 s of system time per 8 s
   step. With one malloc arena that never mmaps and never trims, steady-state steps fault
   nothing (a step that must grow the heap still does; seen once in six): 8.1 s -> 7.0 s. The
   cost: the process keeps its peak heap (RSS never shrinks), as a training process does anyway.

Accelerator hosts are left alone (their steps do not run on these allocators), and a user's
own XLA_FLAGS win over (1). Measure with and without: `python benchmarks/bench.py ... --notune_cpu`.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import sys

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
YNN_DOTS_ONLY = "--xla_cpu_experimental_ynn_fusion_type=dot"
_ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
                        "jax_rocm7_plugin", "libtpu")


def cpu_backend_expected() -> bool:
    """True when this process's JAX will compute on the CPU: JAX_PLATFORMS names cpu first,
    or it names nothing and no accelerator plugin (CUDA, ROCm, TPU) is installed."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not any(importlib.util.find_spec(m) for m in _ACCELERATOR_PLUGINS)


def _backends_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
        return xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):   # a JAX without the helper: assume the worst
        return True


def tune_cpu() -> list[str]:
    """Apply (1) and (2) above when the backend will be the CPU; returns what was applied
    (empty on accelerator hosts). Raises if JAX already started a backend: too late then."""
    if not cpu_backend_expected():
        return []
    if _backends_started():
        raise RuntimeError("olmo3.runtime.tune_cpu() must run before JAX starts a backend "
                           "(before the first jax.devices() or array op)")
    applied = []
    xla_flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_experimental_ynn_fusion_type" not in xla_flags:
        os.environ["XLA_FLAGS"] = f"{xla_flags} {YNN_DOTS_ONLY}".strip()
        applied.append(YNN_DOTS_ONLY)
    try:
        mallopt = ctypes.CDLL(None).mallopt   # the C library this process already loaded
    except (OSError, AttributeError, TypeError):   # no glibc (macOS, Windows): nothing to tune
        mallopt = None
    if mallopt is not None:
        # -1 as size_t: never trim the heap top back to the kernel.
        ok = all(mallopt(p, v) == 1 for p, v in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0),
                                                 (_M_TRIM_THRESHOLD, -1)))
        if ok:
            applied.append("malloc: one arena, no mmap, no trim")
    return applied
