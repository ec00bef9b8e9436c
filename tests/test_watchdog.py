"""olmo3/watchdog.py: a step that never finishes ends the process with status 1 (rerun), naming
the last step and showing where the main thread waits; compiling and a phase's first run are not
timed, the first step after `arm` is."""
import os
import re
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(body: str) -> subprocess.CompletedProcess:
    code = "import time\nfrom olmo3.watchdog import Watchdog\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_stuck_step_ends_the_process_with_status_1_and_the_stacks():
    p = run("""
        w = Watchdog(1.0, prog="train.py")
        w.beat(6)
        time.sleep(0.3)          # step 7 takes 0.3 s
        w.beat(7)
        def waiting_for_the_step():
            time.sleep(60)    # what a hung collective looks like from Python: a call that never returns
        waiting_for_the_step()
    """)
    assert p.returncode == 1, p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines[-1].startswith("train.py: error: no training step finished for ") and "after step 7 (it took" in lines[-1]
    assert "--hang_timeout_s=1" in lines[-1] and "restarts from its newest checkpoint" in lines[-1]
    took = re.search(r"after step 7 \(it took ([\d.]+) s\)", lines[-1])   # a loaded machine oversleeps
    assert took and 0.3 <= float(took.group(1)) < 1.0, lines[-1]
    assert "in waiting_for_the_step" in p.stderr          # faulthandler: where the main thread waits


def test_not_armed_before_the_first_step_nor_inside_a_phases_first_run():
    p = run("""
        w = Watchdog(1.0)
        time.sleep(1.5)          # the first step compiles: not timed
        w.beat(1)
        with w.phase("held-out evaluation"):
            time.sleep(1.5)      # the first evaluation (it compiles): not timed
        time.sleep(0.1)
        w.beat(2)
        w.close()
        Watchdog(0).beat(3)      # 0: no watchdog at all
        Watchdog(-1).beat(4)     # nor a negative --hang_timeout_s
        time.sleep(1.5)          # closed, or none: a slow exit is not a hang
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
    # the 0.6 s save's duration as measured: a loaded machine oversleeps, printed as 0.7 s or more
    longest = re.search(r"3 x its longest before, ([\d.]+) s", last)
    assert longest and 0.6 <= float(longest.group(1)) < 1.0, last


def test_the_final_commit_is_bounded_by_earlier_commits_not_by_the_in_loop_save():
    """train.py's last wait for an async save's commit: the in-loop "checkpoint save" phase only
    copies to host (here 0.1 s), the commit takes longer (2 s, reported by the checkpoint manager
    and `observed`). The final wait may take 3 x 2 s; a commit stuck past that still ends it."""
    p = run("""
        w = Watchdog(1.0)
        w.beat(1)
        with w.phase("checkpoint save"):
            time.sleep(0.1)
        w.observed("checkpoint commit", 2.0)
        w.beat(2)
        with w.phase("checkpoint commit"):
            time.sleep(3.0)      # past max(1.0, 3 x 0.1) = 1 s, well within max(1.0, 3 x 2.0) = 6 s
        print("committed", flush=True)
        with w.phase("checkpoint commit"):
            time.sleep(60)
    """)
    assert p.returncode == 1 and p.stdout.strip() == "committed", (p.stdout, p.stderr)
    assert "the checkpoint commit after step 2 has run for" in p.stderr.strip().splitlines()[-1]


def test_the_first_step_is_timed_from_the_end_of_its_compilation():
    """After `arm`, the clock stands still while JAX compiles (its announced start and end: a real
    jit compile here, then a 2 s "compile" recorded as JAX records one, 4x the timeout) and starts
    again from the compile's end; a first step that then never finishes ends the process, named."""
    p = run("""
        import jax, jax.numpy as jnp
        from olmo3.watchdog import COMPILE_EVENTS
        w = Watchdog(0.5)
        w.arm(5)
        jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((64, 64))).block_until_ready()
        assert w._announces is True and w._compiling == 0, (w._announces, w._compiling)
        event = "/jax/core/compile/backend_compile_duration"
        assert event in COMPILE_EVENTS
        jax.monitoring.record_scalar(event, time.time())            # a compile starts...
        time.sleep(2.0)
        jax.monitoring.record_event_duration_secs(event, 2.0)       # ...and ends 2 s later
        time.sleep(0.2)
        print("compiled", flush=True)
        def the_first_collective():
            time.sleep(60)     # a peer that never joined
        the_first_collective()
    """)
    assert p.returncode == 1 and p.stdout.strip() == "compiled", (p.stdout, p.stderr)
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("train.py: error: step 6, the first of this run, has not finished "), last
    assert "s after its compilation (a step of this model on these devices may take longer: then raise " \
           "--hang_timeout_s), --hang_timeout_s=0.5" in last, last
    assert "in the_first_collective" in p.stderr


def test_a_first_read_that_never_returns_ends_the_process_before_anything_compiled():
    """Armed, nothing compiled yet, and the first batch's read hangs (a storage mount that stopped
    answering): the clock runs from `arm`, because the watchdog learnt when it started that this
    JAX announces its compiles, and the line says the step never got to compile."""
    p = run("""
        w = Watchdog(0.5)
        assert w._announces is True, w._announces
        w.arm(3)
        def the_first_read():
            time.sleep(60)
        the_first_read()
    """)
    assert p.returncode == 1, (p.stdout, p.stderr)
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("train.py: error: step 4, the first of this run, has waited "), last
    assert "not yet compiled (its first batch's read?)" in last and "in the_first_read" in p.stderr


def test_the_first_step_is_not_timed_when_compile_starts_are_not_announced():
    """A JAX that records compile ends but announces no starts (jax 0.6; here jax's own dispatch
    with its start announcement removed): compiling and a hang cannot be told apart, so the first
    step runs untimed and the clock starts at its beat."""
    p = run("""
        import jax
        import jax._src.dispatch
        jax._src.dispatch.record_scalar = lambda *args, **kwargs: None   # no compile starts announced
        w = Watchdog(1.0)
        assert w._announces is False, w._announces   # learnt from the watchdog's own compile
        w.arm(0)
        jax.monitoring.record_event_duration_secs("/jax/core/compile/backend_compile_duration", 1.0)
        time.sleep(1.5)          # compiling, as far as anyone can tell
        w.beat(1)
        time.sleep(0.1)
        w.beat(2)
        print("done", flush=True)
        time.sleep(60)           # step 3 never finishes: timed as before
    """)
    assert p.returncode == 1 and p.stdout.strip() == "done", (p.stdout, p.stderr)
    assert "no training step finished for " in p.stderr and "after step 2 (it took" in p.stderr


def test_a_phase_is_bounded_by_its_longest_run_not_its_last():
    """The bound is 3 x the LONGEST earlier run of the phase's name (the docstring's rule), however
    short the runs since: a 1 s save, then a 0.1 s one, then a 0.8 s one is within 3 x 1 s. A bound
    from the last run alone (3 x 0.1 s, below the 0.3 s timeout) ended a healthy run. The same for
    commits reported through `observed`: a short report does not lower a longer one's bound. And
    never below the timeout: a 1 s evaluation after a 0.05 s one is within a 2 s timeout."""
    p = run("""
        w = Watchdog(0.3)
        w.beat(1)
        for seconds in (1.0, 0.1, 0.8):   # the first is not timed; the third is within max(0.3, 3 x 1.0)
            with w.phase("checkpoint save"):
                time.sleep(seconds)
            w.beat(2)
        w.observed("checkpoint commit", 1.0)
        w.observed("checkpoint commit", 0.1)
        with w.phase("checkpoint commit"):
            time.sleep(0.8)               # within max(0.3, 3 x 1.0), past max(0.3, 3 x 0.1)
        w.close()
        w = Watchdog(2.0)
        w.beat(1)
        with w.phase("held-out evaluation"):
            time.sleep(0.05)              # the first: not timed
        with w.phase("held-out evaluation"):
            time.sleep(1.0)               # past 3 x 0.05 s: a phase may always take the timeout
        w.beat(2)
        print("bounded", flush=True)
    """)
    assert p.returncode == 0 and p.stdout.strip() == "bounded", (p.stdout, p.stderr)


def test_an_unmatched_compile_end_does_not_unlearn_that_starts_are_announced():
    """A compile that started before the watchdog listened ends without a start: that says nothing
    about this JAX, which has announced a start already, so the first step stays timed."""
    p = run("""
        import jax
        event = "/jax/core/compile/backend_compile_duration"
        w = Watchdog(0.5)
        jax.monitoring.record_scalar(event, time.time())           # a compile announced...
        jax.monitoring.record_event_duration_secs(event, 0.1)      # ...and ended
        jax.monitoring.record_event_duration_secs(event, 1.0)      # an end whose start came before the watchdog
        w.arm(0)
        time.sleep(20)           # the first step never finishes
    """)
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "step 1, the first of this run, has waited" in p.stderr.strip().splitlines()[-1], p.stderr
