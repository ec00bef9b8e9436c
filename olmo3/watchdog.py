"""A step that never finishes ends the process (exit status 1, rerun), not the allocation.

    watchdog = Watchdog(timeout_s=1800)
    for step in ...:
        train_step(...)            # blocks in float(loss) while the devices work
        watchdog.beat(step)        # armed from the first beat: the first step's compile is free
        with watchdog.paused():    # evaluations and saves have their own pace
            evaluate(); save()

Why: a collective that never completes (a GPU fallen off the bus, a link that drops a peer, a
deadlock in the collective library) or a read that never returns blocks every process of a run
while each one is still alive. JAX's heartbeat sees nothing wrong and the job keeps its machines
until the scheduler's time limit, hours of a whole cluster. PyTorch's NCCL watchdog makes the
same trade: a collective past its timeout (10 minutes by default) ends the process.

When no step has finished for `timeout_s` seconds outside a paused phase, a daemon thread prints
every Python thread's stack (faulthandler: where the main thread waits), then one line (the last
step and how long it took), and ends the process with status 1 (os._exit: the main thread is stuck
and cannot unwind). `--resume_until_done` and the cluster's restart policy then resume from the
newest checkpoint; every process of a hung run has its own watchdog and they all stop within a
second or two of each other. A hang inside an evaluation or a save is not caught.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from typing import Iterator, Optional

EXIT_STATUS = 1   # retried by --resume_until_done (olmo3/cli.py)


class Watchdog:
    """Ends the process when no `beat` came for `timeout_s` seconds (None or <= 0: never)."""

    def __init__(self, timeout_s: Optional[float], prog: str = "train.py") -> None:
        self.timeout_s = timeout_s if timeout_s and timeout_s > 0 else None
        self.prog = prog
        self._lock = threading.Lock()
        self._last: Optional[float] = None      # monotonic time of the last beat; None: not armed
        self._step = self._took = None
        self._paused = 0
        self._stop = threading.Event()
        if self.timeout_s is not None:
            threading.Thread(target=self._watch, name="olmo3-watchdog", daemon=True).start()

    def beat(self, step: int) -> None:
        """Step `step` finished: the clock starts again."""
        now = time.monotonic()
        with self._lock:
            self._took = None if self._last is None else now - self._last
            self._last, self._step = now, step

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A phase with no steps (an evaluation, a save): not timed; the clock restarts after it."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                if self._last is not None:
                    self._last = time.monotonic()

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        period = min(self.timeout_s / 4, 10.0)
        while not self._stop.wait(period):
            with self._lock:
                if self._last is None or self._paused:
                    continue
                waited = time.monotonic() - self._last
                step, took = self._step, self._took
            if waited > self.timeout_s:
                print(f"{self.prog}: no training step finished for {waited:.0f} s; where every thread waits:",
                      file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                last = f" (it took {took:.1f} s)" if took is not None else ""
                print(f"{self.prog}: error: no training step finished for {waited:.0f} s after step {step}{last}, "
                      f"--hang_timeout_s={self.timeout_s:g}: a hung collective, device or read; exiting with status "
                      f"{EXIT_STATUS} so that the run restarts from its newest checkpoint", file=sys.stderr, flush=True)
                os._exit(EXIT_STATUS)
