"""olmo3/watchdog.py: a step that never finishes ends the process with status 1 (rerun), naming
the last step and showing where the main thread waits; phases and the first step are not timed."""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(body: str) -> subprocess.CompletedProcess:
    code = "import time\nfrom olmo3.watchdog import Watchdog\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_stuck_step_ends_the_process_with_status_1_and_the_stacks():
    p = run("""
        w = Watchdog(0.5, prog="train.py")
        w.beat(6)
        w.beat(7)
        def waiting_for_the_step():
            time.sleep(60)    # what a hung collective looks like from Python: a call that never returns
        waiting_for_the_step()
    """)
    assert p.returncode == 1, p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines[-1].startswith("train.py: error: no training step finished for ") and "after step 7 (it took" in lines[-1]
    assert "--hang_timeout_s=0.5" in lines[-1] and "restarts from its newest checkpoint" in lines[-1]
    assert "in waiting_for_the_step" in p.stderr          # faulthandler: where the main thread waits


def test_not_armed_before_the_first_step_nor_inside_a_phases_first_run():
    p = run("""
        w = Watchdog(0.3)
        time.sleep(1.5)          # the first step compiles: not timed
        w.beat(1)
        with w.phase("held-out evaluation"):
            time.sleep(1.5)      # the first evaluation (it compiles): not timed
        time.sleep(0.1)
        w.beat(2)
        w.close()
        Watchdog(0).beat(3)      # 0: no watchdog at all
        print("done")
    """)
    assert p.returncode == 0 and p.stdout.strip() == "done", p.stderr


def test_a_phase_that_ran_before_is_bounded_by_its_own_duration():
    """A later evaluation or save may take 3 x its longest earlier run, or the timeout if longer;
    here the second save outlives both and the line names it. A different phase is not bounded
    by the save's duration."""
    p = run("""
        w = Watchdog(1.0)
        w.beat(1)
        with w.phase("checkpoint save"):
            time.sleep(0.5)      # first save: 0.5 s
        with w.phase("held-out evaluation"):
            time.sleep(2.5)      # first of ITS name: not timed
        w.beat(2)
        with w.phase("checkpoint save"):
            time.sleep(0.6)      # well within max(1.0, 3 x 0.5) = 1.5 s
        w.beat(3)
        print("bounded", flush=True)
        with w.phase("checkpoint save"):
            time.sleep(60)       # a save stuck on a mount that stopped answering
    """)
    assert p.returncode == 1 and p.stdout.strip() == "bounded", (p.stdout, p.stderr)
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("train.py: error: the checkpoint save after step 3 has run for "), last
    assert "3 x its longest before, 0.6 s" in last, last
