"""olmo3/preemption.py's single-process SIGTERM handler under a flood of signals."""
import os
import signal
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


EARLY = r"""
import os, signal, sys, time
import jax
start, rank, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
from olmo3.preemption import Notice
if rank == 0:
    os.kill(os.getpid(), signal.SIGTERM)   # during the restore or the first compile, before any step
    time.sleep(2)                          # the notice reaches the other process first
notice = Notice(start)
stop = next((s for s in range(start + 1, start + 40) if notice.reached(s) or time.sleep(0.1)), None)
print("stopped at", stop, notice.signal_name, notice.exit_status, flush=True)
"""


def test_a_notice_before_a_resumed_run_s_first_step_stops_every_process_after_it():
    """Two processes resumed at step 1000, one signalled before the first step: both stop after
    step 1001. JAX's sync manager counts from 0 and answered the early notice at its step 1, which a
    run asking about steps 1001, 1002, ... never met: it trained on until SIGKILL. Both report the
    notice as SIGTERM, status 143, though only JAX's handler saw the signal, on one of them."""
    import fake_srun
    port = str(fake_srun.free_derived_port())
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    procs = [subprocess.Popen([sys.executable, "-c", EARLY, "1000", str(rank), port], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "stopped at 1001 SIGTERM 143" in out, (out + err)[-3000:]


def test_a_preemption_service_turned_off_never_stops_the_run(monkeypatch):
    """Several processes with jax_enable_preemption_service off: JAX's sync point raises the
    RuntimeError its docstring names. The run goes on (one warning, the service not asked again)
    rather than stopping at once as if preempted."""
    import jax
    from jax.experimental import multihost_utils
    from olmo3.preemption import Notice
    asked = []

    def off(step):
        asked.append(step)
        raise RuntimeError("Preemption sync manager has not been initialized.")
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", off)
    notice = Notice(1000)   # several processes: JAX's handler, none of ours
    assert [notice.reached(s) for s in (1001, 1002, 1003)] == [False] * 3 and asked == [1]
    notice.close()


CLOSE = r"""
import os, signal, time
from olmo3.preemption import Notice
notice = Notice(1000)
os.kill(os.getpid(), signal.SIGTERM)   # held as a notice: the step that finishes next is saved
time.sleep(0.2)
print("notice", notice.reached(1001), flush=True)
notice.close()                         # SIGTERM is the process's own again: it ends it
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(10)
print("survived", flush=True)
"""


def test_close_gives_sigterm_back():
    """One process: a SIGTERM before `close` is a notice, reached at the next step asked about; after
    `close` (train.py's loop is over) SIGTERM ends the process as it would without a Notice."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", CLOSE], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGTERM and p.stdout.split() == ["notice", "True"], (p.returncode, p.stdout, p.stderr)


CTRL_C = r"""
import os, signal, time
from olmo3.preemption import Notice
signal.signal(signal.SIGINT, signal.SIG_IGN)   # a shell's background job: ignored, and left so
Notice(1000).close()
ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
signal.signal(signal.SIGINT, signal.default_int_handler)   # a process at a terminal (it may inherit SIG_IGN here)
notice = Notice(1000)
os.kill(os.getpid(), signal.SIGINT)    # Ctrl-C: a notice, as SIGTERM (it was a KeyboardInterrupt: nothing saved)
time.sleep(0.2)
os.kill(os.getpid(), signal.SIGTERM)   # the launcher's forwarded SIGTERM after it: the same notice
time.sleep(0.2)
print("notice", notice.reached(1001), notice.signal_name, notice.exit_status, flush=True)
try:
    os.kill(os.getpid(), signal.SIGINT)   # Ctrl-C again: the user does not wait for the save
    time.sleep(10)
except KeyboardInterrupt:
    print("interrupted", flush=True)
notice.close()
print("restored", signal.getsignal(signal.SIGINT) is signal.default_int_handler, "ignored", ignored, flush=True)
"""


def test_ctrl_c_is_a_notice_and_twice_stops_at_once():
    """One process: SIGINT sets the notice as SIGTERM does (reported as SIGINT, exit status 130),
    a second SIGINT raises KeyboardInterrupt, and `close` gives SIGINT its handler back. A SIGINT
    the process ignores (a shell's `cmd &`) stays ignored."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", CTRL_C], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["notice", "True", "SIGINT", "130", "interrupted", "restored", "True", "ignored",
                                "True"], p.stdout


STOPPED = r"""
import os, signal, sys, time
from absl import flags
from olmo3 import cli
from olmo3.checkpoint import new_directory

def main(argv):
    with new_directory(os.environ["OUT"] + "/out", "test output") as tmp:
        open(os.path.join(tmp, "part"), "w").write("half")
        if os.fork() == 0:   # a forked worker inherits the handler and dies of the signal, as before
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
            os._exit(0)
        _, status = os.wait()
        print("worker", os.waitstatus_to_exitcode(status), flush=True)
        os.kill(os.getpid(), signal.SIGTERM)   # a time limit while the output is half-written
        time.sleep(10)

cli.run(main)
"""


def test_sigterm_outside_the_training_loop_cleans_up_and_says_so(tmp_path):
    """Any script run by cli.run (data.prepare_sft, convert.py, eval.py, train.py before its loop):
    SIGTERM ended it at once, without a word, its temporary directory left behind. Now the
    cleanups run, one line says it, exit 143; a forked worker still dies of the signal."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, OUT=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", STOPPED], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 143, p.stderr[-3000:]
    assert p.stdout.split() == ["worker", "-15"], p.stdout
    assert p.stderr.strip().splitlines() == ["-c: stopped by SIGTERM"], p.stderr
    assert os.listdir(tmp_path) == []   # no .tmp-out-* left
