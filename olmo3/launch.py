"""Relaunch a training command after a crash, with capped exponential backoff and jitter.

`python train.py ... --resume_until_done` runs the same command with `--resume` in a child
process and reruns it when it dies (preemption, OOM kill, a lost host), because the checkpoint
manager makes every restart exact (checkpoint N = N steps done, resume at step N+1).

Why backoff and not a fixed retry budget: the MaxText reproduction's resubmission loop gave up
inside a long queue outage (DESIGN §4, bug 5). Here the delay doubles per consecutive failure up
to `max_delay_s`, with "equal jitter" (half fixed, half random) so that many jobs restarting
together do not stampede the scheduler. An attempt that made progress starts the failure count
over; `max_attempts=None` never gives up. Progress is a checkpoint newer than the newest one at
the attempt's start (train.py passes `newest_checkpoint` of its run directory): time alone is not
progress. A run that crashes every 70 minutes, each time before its next save (a bad node, a
crash at the first evaluation or downstream run, a save interval longer than the time between
failures), would otherwise be rerun forever, each rerun training the same steps again; now it
ends after `max_attempts` attempts with the newest checkpoint named. Without a progress probe,
an attempt that ran `reset_after_s` counts as progress. Exit codes that a rerun cannot fix stop
at once: 2, a user's error (flags, paths, input files), and 3, a non-finite state (olmo3/cli.py).

SIGTERM to the launcher (srun signals every process of the job step at the time limit; a
Kubernetes pod's first process alone is signalled) is passed on to the child, which saves a
checkpoint and exits (olmo3/preemption.py); the launcher then waits for it and stops with its
exit status instead of rerunning it. Dying at once would let the scheduler kill the child in
the middle of that save. SIGINT and SIGHUP (`kill -INT` of the launcher's pid, a supervisor that
signals only the process it started, a closed terminal) stop it the same way, the child told
with SIGTERM: before, the launcher exited at once and left its child training on, unseen, into
the run directory a resubmission would then share.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from typing import Callable, Iterable, Optional, Sequence

# Exit codes a rerun cannot fix (olmo3/cli.py): 2 = a user's error, 3 = non-finite state (a rerun
# would resume from the last good checkpoint into the same numbers).
NON_RETRYABLE = frozenset({2, 3})


def backoff_delay(failures: int, base_delay_s: float, max_delay_s: float,
                  rng: random.Random) -> float:
    """Delay before the rerun after `failures` consecutive failures (>= 1): a cap that doubles
    per failure, base * 2^(failures-1) up to max_delay_s, and a uniform draw in [cap/2, cap]."""
    cap = min(max_delay_s, base_delay_s * 2.0 ** min(failures - 1, 64))   # 2.0 ** 1024 overflows
    return cap / 2.0 + rng.uniform(0.0, cap / 2.0)


def strip_flag(argv: Sequence[str], name: str) -> list[str]:
    """argv without absl boolean flag `name` in any spelling (--name, --name=..., --noname)."""
    return [a for a in argv
            if a not in (f"--{name}", f"--no{name}") and not a.startswith(f"--{name}=")]


def child_argv(argv: Sequence[str]) -> list[str]:
    """The command a launcher reruns: `argv` with --resume, and never a launcher itself.
    Both flags come last, so they also win over a --flagfile's lines (a flagfile holding
    --resume_until_done made every child a launcher of its own: processes without end)."""
    return strip_flag(strip_flag(argv, "resume_until_done"), "resume") + ["--resume", "--noresume_until_done"]


def newest_checkpoint(directory: str) -> Optional[int]:
    """The largest step among the complete checkpoints in `directory` (`<step>/` folders; an
    unfinished save's temporary folder has a longer name), None if there are none. Reads only the
    listing, so a launcher that never imports JAX can ask."""
    try:
        steps = [int(n) for n in os.listdir(directory) if n.isdigit() and os.path.isdir(os.path.join(directory, n))]
    except FileNotFoundError:
        return None
    except OSError as e:   # a stale handle or I/O error on the shared filesystem: "unknown", not the end
        print(f"[launch] cannot list {directory} ({e}); counting no checkpoint", file=sys.stderr, flush=True)
        return None
    return max(steps, default=None)


def enclosing_run(path: str) -> Optional[str]:
    """The run directory when `path` is its checkpoints/ directory, one of its checkpoints or lies
    inside one (a step directory holds Orbax's _CHECKPOINT_METADATA), else None: a --run_dir
    there would write a new run into another run's checkpoints. Reads only listings, as above."""
    def is_step(d):
        return os.path.basename(d).isdigit() and os.path.isfile(os.path.join(d, "_CHECKPOINT_METADATA"))

    def holds_steps(d):
        try:
            return any(is_step(os.path.join(d, n)) for n in os.listdir(d))
        except OSError:   # not there, or not listable
            return False

    p = os.path.abspath(path)
    while True:
        if os.path.basename(p) == "checkpoints" and holds_steps(p):   # olmo3/checkpoint.py CHECKPOINTS
            return os.path.dirname(p)
        if is_step(p) and os.path.basename(os.path.dirname(p)) == "checkpoints":
            return os.path.dirname(os.path.dirname(p))
        if os.path.dirname(p) == p:
            return None
        p = os.path.dirname(p)


def run_until_done(argv: Sequence[str], max_attempts: Optional[int] = None,
                   base_delay_s: float = 30.0, max_delay_s: float = 1800.0, *,
                   no_retry: Iterable[int] = NON_RETRYABLE, reset_after_s: float = 3600.0,
                   progress: Optional[Callable[[], Optional[int]]] = None,
                   sleep: Callable[[float], None] = time.sleep,
                   rng: Optional[random.Random] = None,
                   log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
                   ) -> int:
    """Run `argv` until it exits 0; returns the last exit code.

    Stops on rc 0, on an rc in `no_retry`, or after `max_attempts` consecutive attempts that
    failed without progress (None: never). A child killed by a signal (rc 128 + N, e.g. SIGKILL from
    the OOM killer or a preemption) is retried. `progress()` is the newest checkpoint step (or
    None): an attempt after which it is larger than any seen before made progress and resets the
    count.
    Without `progress`, an attempt that ran at least `reset_after_s` resets it."""
    if max_attempts is not None and max_attempts < 1:
        raise ValueError(f"max_attempts={max_attempts} must be >= 1 (or None for no limit)")
    no_retry = frozenset(no_retry)
    rng = rng or random.Random()
    failures = 0
    attempt = 0
    newest = None   # the largest step `progress` has shown: a listing that failed once (None) is no reset
    while True:
        attempt += 1
        start = time.monotonic()
        before = progress() if progress is not None else None
        newest = before if newest is None or (before is not None and before > newest) else newest
        rc, told_to_stop = _run_forwarding_sigterm(argv)
        ran = time.monotonic() - start
        if told_to_stop:
            log(f"[launch] {told_to_stop}: attempt {attempt} stopped with exit code {rc}; not rerunning")
            return rc
        if rc == 0:
            if attempt > 1:
                log(f"[launch] attempt {attempt} succeeded")
            return 0
        if rc in no_retry:
            log(f"[launch] exit code {rc} is not retryable (usage error?); stopping")
            return rc
        if progress is None:
            progressed, since = ran >= reset_after_s, ""
        else:
            after = progress()
            progressed = after is not None and (newest is None or after > newest)
            since = (f", checkpoint {after} new" if progressed else
                     f", no checkpoint newer than {newest}" if newest is not None else ", no checkpoint yet")
            newest = after if progressed else newest
        failures = 0 if progressed else failures + 1   # attempts in a row that failed without progress
        if max_attempts is not None and failures >= max_attempts:
            log(f"[launch] giving up after {failures} consecutive failed attempts without progress "
                f"(last rc {rc}{since})")
            return rc
        delay = backoff_delay(max(failures, 1), base_delay_s, max_delay_s, rng)
        log(f"[launch] attempt {attempt} exited with {rc} after {ran:.0f}s{since}; "
            f"rerunning in {delay:.1f}s (consecutive failures without progress: {failures})")
        sleep(delay)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def signal_when_parent_dies(sig: int, parent: int) -> None:
    """Called in a child process (a worker's initializer, a preexec_fn): Linux sends it `sig` when
    `parent`, the process that started it, dies; if that has happened already, at once. Elsewhere
    a no-op."""
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, sig)   # PR_SET_PDEATHSIG
        if os.getppid() != parent:   # it died before the call
            os.kill(os.getpid(), sig)


def _told_when_the_launcher_dies(launcher: int) -> Callable[[], None]:
    """The child's start: SIGTERM (its checkpoint-and-stop) when the launcher dies, as if the
    launcher had passed one on. A launcher killed outright (SIGKILL by pid, the OOM killer) used
    to leave its child training on, unseen, into the run directory a resubmission would then share."""
    return lambda: signal_when_parent_dies(signal.SIGTERM, launcher)


def _run_forwarding_sigterm(argv: Sequence[str]) -> tuple[int, str | None]:
    """Run `argv` to its end; SIGTERM, SIGINT or SIGHUP to this process meanwhile is passed on
    to it as SIGTERM (its checkpoint-and-stop; a Ctrl-C at a terminal has sent the child its own
    SIGINT already). Returns (its exit code, the name of the signal this process was sent, or None)."""
    told, child = [], []

    def forward(signum, frame):
        told.append(signal.Signals(signum).name)
        if child and child[0].poll() is None:
            child[0].send_signal(signal.SIGTERM)

    # Handlers first: a signal between the start of the child and their installation killed the
    # launcher and left the child training on, unseen (7 in 10 tries of a signal sent at once).
    previous = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    try:
        child.append(subprocess.Popen(list(argv), preexec_fn=_told_when_the_launcher_dies(os.getpid())))
        if told:   # signalled while the child was being started: it is told now
            child[0].send_signal(signal.SIGTERM)
        rc = child[0].wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    # Killed by signal N: Popen says -N, a shell and Slurm say 128 + N (a launcher that exited
    # with -15 would have stopped with status 241).
    return (128 - rc if rc < 0 else rc), (told[0] if told else None)
