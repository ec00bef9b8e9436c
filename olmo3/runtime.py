"""Process settings each backend rewards: `tune_cpu()` and `tune_gpu()`, called before JAX starts.

    CPU backend:  XLA_FLAGS += YNNPACK for dots only
                  malloc: one arena, no mmap, no trim          (freed temporaries stay mapped)
                  a watcher thread: malloc_trim(0) when available memory < reserve
    NVIDIA GPU:   XLA_FLAGS += the flags MaxText / JAX-Toolbox train LLMs with (GPU_XLA_FLAGS)
                  env CUDA_DEVICE_MAX_CONNECTIONS=1, XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
    every backend: a persistent compilation cache (`compilation_cache`), so that a resumed run
                  (--resume_until_done after a crash, a preempted job) does not compile again
    anything set by the user (one XLA_FLAGS entry, one environment variable) wins over ours.

CPU: each setting was found by profiling the issue-8 CPU config (benchmarks/bench_cpu.flags:
d_model 512, 8 layers, vocab 100278, batch 4 x 512, fp32, 2 cores) with jax 0.10.2:

1. YNNPACK for dots only. XLA:CPU hands dots AND reductions to YNNPACK by default. The softmax
   normalizer of the chunked cross entropy (a sum of exp over [1024, 100278] logits) took 253 ms
   per chunk there, against 22 ms for XLA's own loop fusion over the same logits. Dots only:
   step 8.76 s -> 8.08 s (AMD EPYC). (Also handing it elementwise ops: 11.04 s; no YNNPACK at all: 8.42 s.)
   On a 2-core Intel Xeon with AVX-512 and AMX (issue 14) YNNPACK's dots were still the best of
   the three libraries this XLA can hand dots to: A/B/C runs in turn, three rounds, median step
   (tokens per CPU-second) YNNPACK 9.9-25 s (85, 65, 115), XNNPACK 12.7-51 s (60, 81, 90), oneDNN
   11.4-22 s (62, 86, 101), on a machine shared with other jobs (load 1-5). A bare a @ b is faster
   through XNNPACK or oneDNN there, the step's transposed backward dots are not. On a 2-core
   AMD EPYC with AVX-512 (Zen 5), two rounds in turn, median step: YNNPACK 3.60 / 3.84 s,
   XNNPACK 3.87 / 4.02 s, oneDNN 3.89 / 4.57 s, none of them (`ynn_fusion_type=`) 4.05 /
   4.20 s. So one setting for every CPU; a user's own pick of any dot library
   (DOT_LIBRARY_FLAGS) wins whole.
   Float32 compute only (`dots=False` for bf16): with YNNPACK, bf16 dots are not computed alike
   in every program (jax 0.10.2, AMD EPYC: the same weights gave other bf16 log-probs in a
   forward-only program than inside a training step, olmo3.dpo.sequence_logps up to 0.008 nats).
   A bf16 DPO run's first loss was 0.69372, not log 2 (0.69431 with --float8: float8 casts
   amplify the difference), its reference scored apart from its policy; eval.py's held-out loss
   of a bf16 run differed from the run's own in the 5th digit. Without YNNPACK both are exact;
   float32 dots were the same in every program either way.
2. Keep freed memory in the process. XLA:CPU mallocs each step's temporaries; glibc hands any
   block over 32 MB straight back to the kernel on free (mmap/munmap), so every step faulted its
   ~3.9 GB of temporaries in again: 986k minor page faults and 1.9 s of system time per 8 s
   step. With one malloc arena that never mmaps and never trims, steady-state steps fault
   nothing: 8.1 s -> 7.0 s. On the Zen 5 EPYC above (YNNPACK dots in both; two rounds in turn):
   4.88 / 4.82 s -> 3.87 / 3.63 s.
3. ...but bound what it keeps. A heap that never shrinks also keeps its holes: temporaries of
   other shapes (evaluation, a checkpoint's host copies, 8 host devices allocating at once) land
   beside each other and the heap's high-water mark ratchets up. A train.py run with 8 host
   devices at stage-3 shapes (issue 14) was SIGKILLed at 24.4 GB RSS where glibc's defaults
   finish at 10.1 GB. So a daemon thread reads, twice a second, the resident memory the heap
   holds free (RSS minus the bytes malloc has handed out live) and returns it with
   malloc_trim(0) when memory runs short: less than `reserve` (a quarter of the memory budget)
   left available to the process. The budget is physical memory or, under a memory cgroup
   (SLURM, containers), the cgroup's limit; "available" is the smaller of the kernel's
   MemAvailable and the cgroup's headroom.
   Not a limit on what is held: memory the heap holds free is reused by the next step and by
   allocation spikes; it only hurts when something else needs it. A first version trimmed
   whenever a quarter of RAM was held free, then half of it. The bench_cpu.flags process holds
   5-12 GB free between steps (the compiler's freed memory, and temporaries whose holes the
   next step's allocations do not fit): on a 24 GB box 3 of 6 solo runs of 5-8 steps were
   trimmed once, at one limit or the other, and the next two steps took 16.4-21.4 s instead of
   12-13 s (AMD EPYC, faulting the temporaries back in). The stage-3 run above now finishes at
   13.3 GB peak RSS there. An explicit `held_limit` still trims above that much held free.
   tests/test_runtime.py checks the steady state, the fragmenting run under both triggers,
   and the cgroup accounting.

Accelerator hosts are left alone by tune_cpu (their steps do not run on these allocators).
Measure with and without: `python benchmarks/bench.py ... --notune_cpu`.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import threading
import time
from typing import Iterable

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
YNN_DOTS_ONLY = "--xla_cpu_experimental_ynn_fusion_type=dot"
# The XLA:CPU flags that pick a library for dots: one choice, the user's whole if they set any.
DOT_LIBRARY_FLAGS = ("xla_cpu_experimental_ynn_fusion_type", "xla_cpu_experimental_xnn_fusion_type",
                     "xla_cpu_experimental_onednn_fusion_type", "xla_cpu_use_onednn")
_ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
                        "jax_rocm7_plugin", "libtpu")
WATCH_INTERVAL_S = 0.5


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


class _MallInfo2(ctypes.Structure):   # glibc >= 2.33 <malloc.h> struct mallinfo2
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _glibc():
    """The C library this process loaded, if it is glibc with mallopt, mallinfo2, malloc_trim."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _MallInfo2
        libc.mallopt, libc.malloc_trim   # noqa: B018 -- AttributeError where missing
        return libc
    except (OSError, AttributeError, TypeError):   # macOS, Windows, musl, an old glibc
        return None


def held_free_bytes(libc) -> int:
    """Resident bytes the heap holds but has not handed out: RSS - malloc's live bytes. (Also
    counts the non-malloc resident memory, shared libraries and stacks: a few hundred MB.)"""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    info = libc.mallinfo2()
    return rss - info.uordblks - info.hblkhd


# Where the kernel describes this process's memory cgroup (module constants: tests point them
# at a fake tree).
PROC_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"
_NO_LIMIT = 1 << 60   # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):   # absent, or "max" (cgroup v2's "no limit")
        return None


def cgroup_memory() -> tuple[int, int] | None:
    """(limit, usage) in bytes of this process's memory cgroup, v2 or v1, when it or a group
    above it has a limit; the kernel enforces every ancestor's limit (Slurm's cgroup v2 plugin
    limits job_N and step_N and runs the task in a leaf, .../step_N/user/task_M, whose own
    memory.max is "max"). limit: the smallest of the groups'; usage: such that limit - usage is
    the least headroom of any group. Usage leaves out the inactive page cache, which the kernel
    reclaims before it kills."""
    try:
        with open(PROC_CGROUP) as f:
            entries = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    for _, controllers, path in entries:
        if controllers == "":   # v2: one unified hierarchy
            base, names = CGROUP_ROOT, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base, names = os.path.join(CGROUP_ROOT, "memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                                 "total_inactive_file")
        else:
            continue
        # The group and each group above it up to the mount's root (where a cgroup namespace
        # shows the process's own group).
        base = os.path.normpath(base)
        d, groups = os.path.normpath(base + "/" + path), []
        if not d.startswith(base + os.sep):   # '/..': outside the namespace's root, seen at the mount's root
            d = base
        while True:
            groups.append(_group_memory(d, names))
            if d == base:
                break
            d = os.path.dirname(d)
        limited = [g for g in groups if g is not None]
        if not limited:
            return None
        limit = min(g[0] for g in limited)
        return limit, limit - min(g[0] - g[1] for g in limited)
    return None


def _group_memory(d: str, names: tuple[str, str, str]) -> tuple[int, int] | None:
    """(limit, usage less inactive page cache) of cgroup directory `d`; None without a limit."""
    limit, usage = _read_int(os.path.join(d, names[0])), _read_int(os.path.join(d, names[1]))
    if usage is None or limit is None or limit >= _NO_LIMIT:
        return None
    inactive = 0
    try:
        with open(os.path.join(d, "memory.stat")) as f:
            stat = dict(line.split() for line in f if len(line.split()) == 2)
        inactive = int(stat.get(names[2], 0))
    except (OSError, ValueError):
        pass
    return limit, max(usage - inactive, 0)


def memory_budget() -> int:
    """Bytes this process may use: physical memory, or its memory cgroup's limit if lower."""
    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cg = cgroup_memory()
    return min(phys, cg[0]) if cg else phys


def available_bytes() -> int:
    """Bytes the process can still get without the kernel reclaiming or killing: MemAvailable,
    or the cgroup's headroom if lower."""
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    avail = int(info["MemAvailable"].split()[0]) * 1024
    cg = cgroup_memory()
    return min(avail, cg[0] - cg[1]) if cg else avail


TRIM_FLOOR = 256 << 20   # above the libraries' resident pages (150-200 MB for jaxlib here)


def should_trim(held: int, available: int, held_limit: int | None, reserve: int) -> bool:
    """(3) above: return the heap's free memory when under `reserve` bytes are left available
    and the heap holds any (the libraries' own resident pages, also in `held`, are a few hundred
    MB), or when more than `held_limit` bytes of it are resident (None: no such limit)."""
    return (held_limit is not None and held > held_limit) or (available < reserve and held > TRIM_FLOOR)


class _TrimWatcher(threading.Thread):
    """(3) above: return held free memory to the kernel when memory runs short."""

    def __init__(self, libc, held_limit: int | None, reserve: int):
        super().__init__(name="olmo3-malloc-trim", daemon=True)
        self.libc, self.held_limit, self.reserve, self.trims = libc, held_limit, reserve, 0

    def run(self):
        while True:
            time.sleep(WATCH_INTERVAL_S)
            if should_trim(held_free_bytes(self.libc), available_bytes(), self.held_limit, self.reserve):
                self.libc.malloc_trim(0)   # every whole free page, not only the heap's top
                self.trims += 1


_watcher: _TrimWatcher | None = None


def trims() -> int | None:
    """How many times the watcher has returned memory so far (None when it is not running)."""
    return None if _watcher is None else _watcher.trims


def tune_cpu(held_limit: int | None = None, reserve: int | None = None, dots: bool = True) -> list[str]:
    """Apply (1)-(3) above when the backend will be the CPU; returns what was applied (empty on
    accelerator hosts); `dots=False` (a run that computes in bf16) leaves (1) out. The heap's
    resident free memory goes back to the kernel when less than `reserve` bytes are available
    (default: a quarter of `memory_budget()`) or, if `held_limit` is given, when more than that
    many bytes of it are held. Raises if JAX already started a backend: too late then."""
    global _watcher
    if not cpu_backend_expected():
        return []
    if _backends_started():
        raise RuntimeError("olmo3.runtime.tune_cpu() must run before JAX starts a backend "
                           "(before the first jax.devices() or array op)")
    user = {flag_name(t) for t in user_xla_flags()}
    # The dot library is one choice: a user who picks any of these libraries picks it whole.
    applied = [] if user & set(DOT_LIBRARY_FLAGS) or not dots else add_xla_flags([YNN_DOTS_ONLY])
    libc = _glibc() if sys.platform.startswith("linux") else None
    if libc is not None and _watcher is None:
        # -1 as size_t: never trim the heap top back to the kernel (the watcher bounds it).
        if all(libc.mallopt(p, v) == 1 for p, v in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0),
                                                     (_M_TRIM_THRESHOLD, -1))):
            reserve = memory_budget() // 4 if reserve is None else reserve
            _watcher = _TrimWatcher(libc, held_limit, reserve)
            _watcher.start()
            applied.append(f"malloc: one arena, no mmap, free memory returned when under "
                           f"{reserve / 2**30:.1f} GB is available"
                           + (f" or over {held_limit / 2**30:.1f} GB is held" if held_limit is not None else ""))
    return applied


# ---------------------------------------------------------------------------------------------
# GPU: the XLA flags MaxText and NVIDIA's JAX-Toolbox train LLMs with. Sources:
#   [MT] MaxText MaxText/configs/a3/llama_2_7b/1vm.sh (Llama-2-7B, 8 x H100, FSDP 8, scanned layers)
#   [JT] NVIDIA JAX-Toolbox rosetta/docs/GPU_performance.md ("Tips for high-performance LLMs")
# Each name was checked against jaxlib 0.10.2 and 0.8.1 (an unknown XLA flag aborts the process;
# the test parses them all on the CPU backend); add_xla_flags leaves out any that a later jaxlib
# drops. Left out on purpose: --xla_gpu_graph_level and
# --xla_gpu_enable_triton_softmax_fusion ([MT], gone from this XLA), and
# --xla_disable_hlo_passes=rematerialization ([MT]: turns XLA's fallback when memory is short
# into an out-of-memory error; our --remat flag is the memory knob).
# ---------------------------------------------------------------------------------------------
GPU_XLA_FLAGS = (
    # Overlap the FSDP all-gathers / reduce-scatters with the layers' matmuls. [MT] [JT]
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    # Collectives on their own highest-priority stream, so compute does not starve them. [MT] [JT]
    "--xla_gpu_enable_highest_priority_async_stream=true",
    # cuBLAS, not Triton, for the dense matmuls (cuBLAS is faster on them at LLM shapes). [MT] [JT]
    "--xla_gpu_enable_triton_gemm=false",
    # Combine a scanned layer's collectives into one, thresholds at least one layer's weights:
    # the 7B's layer is 202M parameters, 0.81 GB in fp32, so the gather takes 1 GiB ([JT] lists
    # up to 8 GiB; [MT] 128 MiB for Llama-2-7B's bf16 layer); all-reduce 1 GiB; the reduce-scatter
    # 128 MiB, twice [MT]'s 64 MiB as our gradients are fp32 ([JT] lists up to 8 GiB).
    "--xla_gpu_all_gather_combine_threshold_bytes=1073741824",
    "--xla_gpu_all_reduce_combine_threshold_bytes=1073741824",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    # Combine across tensors of different shapes (q/k/v/o, the MLP), not only along one dim. [MT] [JT]
    "--xla_gpu_enable_all_gather_combine_by_dim=false",
    "--xla_gpu_enable_reduce_scatter_combine_by_dim=false",
    # Gather layer i+1's weights while layer i computes, and reduce-scatter layer i's gradients
    # while layer i-1 runs backward: the FSDP pipelining of the scan over layers. [MT] [JT]
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    # Unroll the layer scan by two so the pipelined collectives have a next iteration to overlap
    # with ("scan loop unrolling and loop double buffering" [JT]). [MT] [JT]
    "--xla_gpu_enable_while_loop_double_buffering=true",
)
# Environment the CUDA runtime reads at start-up. CUDA_DEVICE_MAX_CONNECTIONS=1: one hardware
# queue, so kernels launch in the order the latency-hiding scheduler chose. [MT] [JT]
# XLA_PYTHON_CLIENT_MEM_FRACTION: JAX preallocates 75% of the GPU by default; [MT] gives it 0.85,
# [JT] "typically 0.9": the rest is left to cuDNN / cuBLAS workspaces and NCCL.
GPU_ENV = (("CUDA_DEVICE_MAX_CONNECTIONS", "1"), ("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9"))
_CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def flag_name(flag: str) -> str:
    """'--xla_foo=1' -> 'xla_foo' (XLA_FLAGS tokens are --name=value or --name)."""
    return flag.lstrip("-").split("=", 1)[0]


def _xla_library() -> str | None:
    """The installed jaxlib's shared library that holds XLA's flag table (None: not found)."""
    spec = importlib.util.find_spec("jaxlib")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for name in ("libjax_common.so", "xla_extension.so"):   # jaxlib >= 0.8, older
            if os.path.isfile(os.path.join(folder, name)):
                return os.path.join(folder, name)
    return None


def unknown_xla_flags(names: Iterable[str]) -> set[str]:
    """Those of `names` that the installed jaxlib does not define. XLA aborts the process on an
    unknown name in XLA_FLAGS ('Unknown flag in XLA_FLAGS'), and experimental flags come and go
    between releases, so a default is added only when its name is in the library's flag table
    (a NUL-terminated string there, not the tail of a longer name: 'cpu_use_onednn', the end of
    'xla_cpu_use_onednn', is no flag; ~20 ms per name). Nothing is unknown when the library is not
    found (a layout this does not know)."""
    import mmap
    path = _xla_library()
    if path is None:
        return set()

    def defined(table: mmap.mmap, name: bytes) -> bool:
        at = table.find(name)
        while at > 0 and (table[at - 1:at].isalnum() or table[at - 1:at] == b"_"):   # a longer name's tail
            at = table.find(name, at + 1)
        return at >= 0

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as table:
        return {n for n in names if not defined(table, n.encode() + b"\0")}


def user_xla_flags() -> list[str]:
    """The user's XLA flags as XLA reads XLA_FLAGS: its value's flags, or, when the value does not
    start with '-', the flags of the file it names (XLA's parse_flags_from_env.cc; `_xla_text`).
    A file that cannot be read: [] (XLA itself then names it)."""
    return xla_flag_tokens(_xla_text() or "")


def _xla_text() -> str | None:
    """The text XLA reads its flags from: XLA_FLAGS itself, or the file it names (None: unreadable)."""
    value = os.environ.get("XLA_FLAGS", "").strip()
    if not value or value.startswith("-"):
        return value
    try:
        with open(value) as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


_XLA_SPACE = " \t\r\n"


def xla_flag_tokens(text: str) -> list[str]:
    """The flags of `text` as XLA's parse_flags_from_env.cc splits them: from each '-' after
    whitespace, a name of letters, digits, '-' and '_', then a value up to the next whitespace,
    or, written ='...' or ="..." (a backslash escaping in double quotes), up to the closing
    quote, spaces and all. XLA stops at a word that does not start with '-'."""
    out, i, n = [], 0, len(text)
    while True:
        while i < n and text[i] in _XLA_SPACE:
            i += 1
        if i == n or text[i] != "-":
            return out
        j = i
        while j < n and text[j].isascii() and (text[j].isalnum() or text[j] in "-_"):
            j += 1
        if j + 1 < n and text[j] == "=" and text[j + 1] in "'\"":
            quote, j = text[j + 1], j + 2
            while j < n and text[j] != quote:
                j += 2 if quote == '"' and text[j] == "\\" and j + 1 < n else 1
            j = min(j + 1, n)
        else:
            while j < n and text[j] not in _XLA_SPACE:
                j += 1
        out.append(text[i:j])
        i = j


def xla_flags_problem() -> str | None:
    """What in the user's XLA_FLAGS would end the process when JAX starts XLA, with XLA's own
    words and exit 1 (retried by a resubmission loop): a file of flags that cannot be read, or a
    flag the installed jaxlib does not define. None when XLA will read it."""
    value = text = os.environ.get("XLA_FLAGS", "").strip()
    if value and not value.startswith("-"):
        try:
            with open(value) as f:
                text = f.read()
        except OSError as e:
            return (f"XLA_FLAGS={value!r} is read as a file of flags, which cannot be opened ({e.strerror}); give "
                    "the flags themselves (XLA_FLAGS='--xla_...') or a readable file")
        except UnicodeDecodeError as e:   # the bare codec error named no XLA_FLAGS
            return (f"XLA_FLAGS={value!r} is read as a file of flags, which is not UTF-8 text ({e.reason} at byte "
                    f"{e.start}); give the flags themselves (XLA_FLAGS='--xla_...') or a text file of them")
    unknown = unknown_xla_flags({flag_name(t) for t in xla_flag_tokens(text)})
    if unknown:
        from importlib import metadata
        names = " ".join(f"--{n}" for n in sorted(unknown))
        return (f"XLA_FLAGS: {names} is not a flag of the installed jaxlib {metadata.version('jaxlib')}; remove "
                "it from XLA_FLAGS, or install the jaxlib that has it")
    return None


def add_xla_flags(defaults: tuple[str, ...] | list[str]) -> list[str]:
    """Append to XLA_FLAGS each default whose flag the user has not set and the installed jaxlib
    knows; returns those added (and a note naming any left out). Flag by flag: a user's own
    value for any one flag wins, the other defaults still apply. An XLA_FLAGS that names a file
    of flags becomes ours plus that file's text (appended to a file name, XLA would read the
    whole value as one file name and stop the process); an unreadable one is left to XLA. Ours
    go first: XLA stops reading at a word that is no flag (a '# comment') and an unclosed quote
    runs to the end, so behind the user's text they could be read as nothing, or as its value."""
    current = _xla_text()
    if current is None:
        return []
    user = {flag_name(t) for t in xla_flag_tokens(current)}
    added = [f for f in defaults if flag_name(f) not in user]
    unknown = unknown_xla_flags({flag_name(f) for f in added})
    skipped = [f for f in added if flag_name(f) in unknown]
    added = [f for f in added if flag_name(f) not in unknown]
    if added:
        os.environ["XLA_FLAGS"] = " ".join(added + [current.strip()]).strip()
    return added + ([f"left out (unknown to this jaxlib): {' '.join(skipped)}"] if skipped else [])


def gpu_backend_expected() -> bool:
    """True when this process's JAX will compute on an NVIDIA GPU: JAX_PLATFORMS names cuda (or
    gpu) first, or it names nothing and a CUDA plugin is installed (and no TPU runtime)."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() in ("cuda", "gpu")
    return (any(importlib.util.find_spec(m) for m in _CUDA_PLUGINS)
            and importlib.util.find_spec("libtpu") is None)


def tune_gpu() -> list[str]:
    """Apply GPU_XLA_FLAGS and GPU_ENV when JAX will compute on an NVIDIA GPU; a user's own
    XLA_FLAGS entry or environment variable wins, one by one. Returns what was applied (empty
    elsewhere). Raises if JAX already started a backend: the flags would be ignored then."""
    if not gpu_backend_expected():
        return []
    if _backends_started():
        raise RuntimeError("olmo3.runtime.tune_gpu() must run before JAX starts a backend "
                           "(before the first jax.devices() or array op)")
    applied = add_xla_flags(GPU_XLA_FLAGS)
    for name, value in GPU_ENV:
        if name not in os.environ:
            os.environ[name] = value
            applied.append(f"{name}={value}")
    return applied


# ---------------------------------------------------------------------------------------------
# Every backend: JAX's persistent compilation cache. A resumed run traces the same programs
# as the run it continues (the step does not bake in its start step; tests/test_train.py checks
# that the resumed run finds its step in the cache), so it loads the executables instead of
# compiling them: the 7B step's compile is minutes on a TPU slice or a GPU node, paid again
# at every restart of a crash-resubmission loop. MaxText keeps one too (`jax_cache_dir`). JAX
# keys an entry by the program, the XLA flags, the devices and the jaxlib version, caches only
# programs that took over a second to compile, and only process 0 writes.
# ---------------------------------------------------------------------------------------------
def compilation_cache(directory: str | None) -> list[str]:
    """Cache compiled programs in `directory` (None: off). JAX_COMPILATION_CACHE_DIR in the
    environment wins (JAX reads it itself). Returns what was applied, for the run's header."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return [f"compilation cache {os.environ['JAX_COMPILATION_CACHE_DIR']} (JAX_COMPILATION_CACHE_DIR)"]
    if not directory:
        return []
    directory = os.path.expanduser(directory)   # '~/cc' (a flag's value, unexpanded): it made ./~/cc
    if "://" not in directory:   # a speed-up, never a reason to stop a run: JAX would raise mid-compile
        # JAX makes the directory at the first compile; a run stopped by bad input before that
        # leaves none behind. Here: the nearest existing ancestor must be a writable directory.
        d = os.path.abspath(directory)
        while not os.path.exists(d):
            d = os.path.dirname(d)
        if not os.path.isdir(d) or not os.access(d, os.W_OK | os.X_OK):
            return [f"no compilation cache ({d} is not a writable directory)"]
    import jax
    jax.config.update("jax_compilation_cache_dir", directory)
    return [f"compilation cache {directory}"]
