"""olmo3/preemption.py's single-process SIGTERM handler under a flood of signals."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FLOOD = r"""
import faulthandler, os, signal, sys, time
from olmo3.preemption import Notice
notice = Notice()
pid = os.getpid()
if os.fork() == 0:   # the sender: SIGTERMs back to back, as srun's child gets two within microseconds
    for _ in range(int(sys.argv[1])):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            break
    os._exit(0)
faulthandler.dump_traceback_later(60, exit=True)   # a deadlock: every thread's stack, exit 1
step, t0 = 0, time.time()
while time.time() - t0 < float(sys.argv[2]):        # the main thread busy in Python, as between steps
    step += 1
    notice.reached(step)
os.wait()
faulthandler.cancel_dump_traceback_later()
notice.close()
print("reached", notice.reached(step + 1), "after", step, "steps")
"""


def test_sigterm_flood_never_deadlocks_the_handler():
    """Signals nested in the handler: a handler that takes a lock (threading.Event.set) deadlocked
    on the lock its own interrupted call held (2 of 4 such runs hung before the fix)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", FLOOD, "200000", "4"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "reached True" in p.stdout, (p.stdout + p.stderr)[-3000:]
