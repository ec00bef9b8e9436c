"""A step that never finishes ends the process (exit status 1, rerun), not the allocation.

    watchdog = Watchdog(timeout_s=1800)
    watchdog.arm(start)            # the first step is timed too; compiling never is
    for step in ...:
        train_step(...)            # blocks in float(loss) while the devices work
        watchdog.beat(step)
        with watchdog.phase("held-out evaluation"):   # its own pace: see below
            evaluate()

Why: a collective that never completes (a GPU fallen off the bus, a link that drops a peer, a
deadlock in the collective library) or a read that never returns blocks every process of a run
while each one is still alive. JAX's heartbeat sees nothing wrong and the job keeps its machines
until the scheduler's time limit, hours of a whole cluster. PyTorch's NCCL watchdog makes the
same trade: a collective past its timeout (10 minutes by default) ends the process.

Compiling is not a hang, however long it takes (a 7B's first step, a recompile): JAX announces
the start and the end of each trace, lowering and backend compile (jax.monitoring: a scalar at
the start, a duration at the end, `COMPILE_EVENTS`); while one runs the clock stands still, and
it starts again from zero when the last one ends. So the first step is timed from the end of its
compilation, and a first collective that never completes (a peer that never joined, a
misconfigured network between hosts: a common way for a multi-host job to hang) ends the run as
any later one does, and so does a first batch's read that never returns, before anything
compiled. A host that compiles longer holds its peers' first step, so the timeout must cover the
spread of compile times between hosts; the worst case is a fresh host with a cold compilation
cache among warm ones. Whether this JAX announces starts is learnt when the watchdog starts, by
compiling a one-line function: jax 0.10.2 announces them; older jax (0.6.0) records only the
ends, and compiling and hanging look alike there, so its first step goes untimed (the clock
starts at its beat).

When no step has finished for `timeout_s` seconds outside a phase, a daemon thread prints every
Python thread's stack (faulthandler: where the main thread waits), then one line (the last step
and how long it took), and ends the process with status 1 (os._exit: the main thread is stuck and
cannot unwind). `--resume_until_done` and the cluster's restart policy then resume from the
newest checkpoint; every process of a hung run has its own watchdog and they all stop within a
second or two of each other.

A phase (an evaluation, a save) is work of its own size: the first one of each name is not timed
(it compiles, and nothing says how long it should take), and each later one may take
max(timeout_s, PHASE_FACTOR x the longest of its name so far) before the same ending. A save
stuck behind a storage mount that stopped answering, or an evaluation's collective that never
completes, then ends the process too, however long the phase is normally. Work measured outside
the loop bounds its phase through `observed`: train.py's final wait for an async save's commit
("checkpoint commit") by the commits the checkpoint manager reported before.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from typing import Iterator, Optional

import jax
import jax.monitoring
import numpy as np

EXIT_STATUS = 1   # retried by --resume_until_done (olmo3/cli.py)
# The jax.monitoring events of one compilation (jax/_src/dispatch.py: JAXPR_TRACE_EVENT,
# JAXPR_TO_MLIR_MODULE_EVENT, BACKEND_COMPILE_EVENT), each announced at its start and its end.
COMPILE_EVENTS = frozenset(("/jax/core/compile/jaxpr_trace_duration",
                            "/jax/core/compile/jaxpr_to_mlir_module_duration",
                            "/jax/core/compile/backend_compile_duration"))
PHASE_FACTOR = 3.0   # a phase may take this many times its longest earlier run (and at least timeout_s)


class Watchdog:
    """Ends the process when no `beat` came for `timeout_s` seconds (None or <= 0: never)."""

    def __init__(self, timeout_s: Optional[float], prog: str = "train.py") -> None:
        self.timeout_s = timeout_s if timeout_s and timeout_s > 0 else None
        self.prog = prog
        self._lock = threading.Lock()
        self._last: Optional[float] = None      # monotonic time of the last beat; None: not armed
        self._step = self._took = None
        self._phase: Optional[tuple[str, float]] = None   # (name, monotonic start) of the phase running
        self._longest: dict[str, float] = {}              # each phase's longest run so far, seconds
        self._compiling = 0          # compile events started and not yet ended (they nest)
        self._announces: Optional[bool] = None   # does this JAX announce compile starts? (see above)
        self._first = False          # armed, and no step finished since
        self._compiled = False       # a compilation ended since `arm`
        self._stop = threading.Event()
        if self.timeout_s is not None:
            jax.monitoring.register_scalar_listener(self._compile_started)
            jax.monitoring.register_event_duration_secs_listener(self._compile_ended)
            # Compile something new once: its events say whether starts are announced, before the
            # first step (a first read that hangs compiles nothing that would tell).
            jax.jit(lambda x: x + 1)(np.int32(0)).block_until_ready()
            threading.Thread(target=self._watch, name="olmo3-watchdog", daemon=True).start()

    def arm(self, step: int) -> None:
        """The loop is about to run the step after `step`: the clock starts now (compiling aside).
        Without `arm`, the first `beat` starts it."""
        with self._lock:
            self._last, self._step, self._took, self._first = time.monotonic(), step, None, True
            self._compiled = False

    def beat(self, step: int) -> None:
        """Step `step` finished: the clock starts again."""
        now = time.monotonic()
        with self._lock:
            self._took = None if self._last is None else now - self._last
            self._last, self._step, self._first = now, step, False

    def _compile_started(self, event: str, value: float, **kwargs) -> None:
        if event in COMPILE_EVENTS:
            with self._lock:
                self._compiling += 1
                self._announces = True

    def _compile_ended(self, event: str, duration_s: float, **kwargs) -> None:
        if event in COMPILE_EVENTS:
            with self._lock:
                if self._compiling == 0:     # no start announced (or one before we listened)
                    self._announces = self._announces or False
                    return
                self._compiling -= 1
                if self._compiling == 0 and self._last is not None:
                    self._last = time.monotonic()   # the clock starts again from the compile's end
                    self._compiled = True

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A phase with no steps (an evaluation, a save), bounded by its own earlier durations (see
        the module docstring); the step clock restarts after it. Phases do not nest."""
        with self._lock:
            assert self._phase is None, f"phase {name!r} inside phase {self._phase[0]!r}"
            self._phase = (name, time.monotonic())
        try:
            yield
        finally:
            now = time.monotonic()
            with self._lock:
                self._longest[name] = max(self._longest.get(name, 0.0), now - self._phase[1])
                self._phase = None
                if self._last is not None:
                    self._last = now

    def observed(self, name: str, seconds: float) -> None:
        """A run of phase `name` measured elsewhere (an async save's commit, which the phase that
        waits for it at the end does not see in the loop): it bounds the later ones."""
        with self._lock:
            self._longest[name] = max(self._longest.get(name, 0.0), seconds)

    def close(self) -> None:
        self._stop.set()
        if self.timeout_s is not None:   # jax 0.6's public API cannot unregister: they stay, unused
            for name, callback in (("unregister_scalar_listener", self._compile_started),
                                   ("unregister_event_duration_listener", self._compile_ended)):
                unregister = getattr(jax.monitoring, name, None)
                if unregister is not None:
                    unregister(callback)

    def _watch(self) -> None:
        period = min(self.timeout_s / 4, 10.0)
        while not self._stop.wait(period):
            with self._lock:
                if self._last is None or self._compiling:
                    continue
                now, step, took = time.monotonic(), self._step, self._took
                if self._phase is None:
                    if self._first and not self._announces:   # compiling and hanging would look alike
                        continue
                    waited, limit = now - self._last, self.timeout_s
                    last = f" (it took {took:.1f} s)" if took is not None else ""
                    if not self._first:
                        what = f"no training step finished for {waited:.0f} s after step {step}{last}"
                    elif self._compiled:   # or a step slower than the timeout: its fix is said too
                        what = (f"step {step + 1}, the first of this run, has not finished {waited:.0f} s after "
                                f"its compilation (a step of this model on these devices may take longer: then "
                                f"raise --hang_timeout_s)")
                    else:
                        what = (f"step {step + 1}, the first of this run, has waited {waited:.0f} s and not yet "
                                f"compiled (its first batch's read?)")
                else:
                    name, started = self._phase
                    if name not in self._longest:   # the first of its name: compiles, no measure yet
                        continue
                    waited, limit = now - started, max(self.timeout_s, PHASE_FACTOR * self._longest[name])
                    what = (f"the {name} after step {step} has run for {waited:.0f} s, past {limit:.0f} s "
                            f"({PHASE_FACTOR:g} x its longest before, {self._longest[name]:.1f} s, or the timeout)")
            if waited > limit:
                self._end(what)

    def _end(self, what: str) -> None:
        print(f"{self.prog}: {what}; where every thread waits:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        print(f"{self.prog}: error: {what}, --hang_timeout_s={self.timeout_s:g}: a hung collective, device or read; "
              f"exiting with status {EXIT_STATUS} so that the run restarts from its newest checkpoint",
              file=sys.stderr, flush=True)
        os._exit(EXIT_STATUS)
