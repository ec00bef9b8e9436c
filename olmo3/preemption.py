"""Preemption notices: a checkpoint at a step every process agrees on, then exit status 143.

Schedulers warn before they take the machines away, with SIGTERM and then, after a grace period,
SIGKILL: SLURM at the time limit (`#SBATCH --signal=TERM@600` sends the warning 10 minutes
early; its KillWait default is 30 s), GKE and Cloud TPU on preemption or maintenance
(the pod's `terminationGracePeriodSeconds`), Kubernetes on `kubectl delete`. Left alone, SIGTERM
ends the process at once and the steps since the last checkpoint are trained again: up to
--save_interval of them, 1000 steps at stage 1.

train.py asks `Notice.reached(step)` after every step and, on True, saves checkpoint `step`,
waits for it to be written and exits with status 143.
- One process: a Python SIGTERM handler only sets a flag; the step that finishes next is saved.
  Ctrl-C (SIGINT) does the same and exits with 130, as a shell reports a process it ended (it
  was a KeyboardInterrupt: a traceback, and the steps since the last save lost). A second Ctrl-C
  stops at once (cli.run: one line, 130, nothing saved). Under `--resume_until_done` the launcher turns a terminal's
  Ctrl-C into SIGTERM too (olmo3/launch.py): one notice, one save.
- Several processes (jax.distributed): JAX's preemption sync manager, which
  jax.distributed.initialize starts with its own SIGTERM handler, spreads a notice that reached
  any one process to all of them (a preempted TPU VM or GPU node is signalled alone) and answers
  True on every process at the same step: the largest step any of them had reported, plus one
  (`multihost_utils.reached_preemption_sync_point`). A Python handler here would replace JAX's,
  so none is installed. The manager counts from 0 when it starts, and a notice before the first
  question is answered at its step 1: it is asked about the steps of this attempt, 1, 2, ...
  (step - start), so that a resumed run's notice during its restore or first compile stops it
  after its first step, as it does a fresh run (asked about its global steps, a run resumed at
  1000 never met step 1 and trained on until SIGKILL).

143 is 128 + SIGTERM, what a shell reports for a process that SIGTERM ended. It is not 0, so a
Kubernetes Job does not count the pod as completed, and it is retryable: `--resume_until_done`
(olmo3/launch.py) reruns the command from the new checkpoint unless the launcher was told to
stop as well, as under srun, which signals every process of the job step.
"""
from __future__ import annotations

import signal

from absl import logging

EXIT_STATUS = 128 + signal.SIGTERM   # 143


class Notice:
    """Whether this process (or, across processes, any process) was told to stop; install once
    the processes have joined (olmo3.cluster.start), before the first step."""

    def __init__(self, start: int = 0) -> None:
        """`start`: the step this attempt starts after (the restored checkpoint's)."""
        import jax
        self._start = start
        self._received: int | None = None   # the first stop signal: a plain value, the handler takes no lock (below)
        self._interrupts = 0
        self._previous = {}
        self._mode = "jax" if jax.process_count() > 1 else "signal"
        if self._mode == "signal":   # not a SIGINT the process ignores: a shell's background job (`cmd &`)
            self._previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)
                              if signal.getsignal(s) is not signal.SIG_IGN}

    def _on_signal(self, signum, frame) -> None:
        # Only that, and no lock: the handler may interrupt the main thread anywhere, also inside
        # itself. Under srun a second SIGTERM follows the first by microseconds (Slurm signals the
        # launcher and the child, the launcher forwards its own), and a nested Event.set() waited
        # forever on the lock the outer one held (helper repro: 1 hang in ~30 to ~1,100 pairs).
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts > 1:   # Ctrl-C again: the user will not wait for the save
                raise KeyboardInterrupt
        if self._received is None:
            self._received = signum

    @property
    def signal_name(self) -> str:
        """The signal that stopped the run: SIGTERM (also every multi-process notice) or SIGINT."""
        return signal.Signals(self._received or signal.SIGTERM).name

    @property
    def exit_status(self) -> int:
        """143 after SIGTERM (retried by --resume_until_done unless it was told too), 130 after Ctrl-C."""
        return 128 + (self._received or signal.SIGTERM)

    def reached(self, step: int) -> bool:
        """True at the step to checkpoint before stopping (the same step on every process). Call
        it after every step, on every process, from the same first step on."""
        if self._mode == "signal":
            if self._received is not None:
                logging.warning("%s received: saving checkpoint %d, then exiting%s", self.signal_name, step,
                                " (Ctrl-C again stops at once, without it)" if self._interrupts else "")
            return self._received is not None
        if self._mode == "off":
            return False
        from jax.experimental import multihost_utils
        try:
            return multihost_utils.reached_preemption_sync_point(step - self._start)
        except RuntimeError as e:   # jax_enable_preemption_service turned off by the user
            logging.warning("preemption notices are off (%s): SIGTERM ends the run without a checkpoint",
                            " ".join(str(e).split()))
            self._mode = "off"
            return False

    def close(self) -> None:
        """Give SIGTERM and SIGINT back their previous handlers."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
