"""run_until_done with real child processes and a scripted failure sequence."""
import random
import sys
import textwrap

import pytest

from olmo3.launch import backoff_delay, child_argv, enclosing_run, newest_checkpoint, run_until_done, strip_flag

# Each run appends a line to the counter file, then exits with codes[run index] (or the last).
# A code ending in "+" saves first: a checkpoint folder named by the run's number in argv[3]; one
# ending in "~" leaves only an unfinished save's temporary folder there.
SCRIPT = textwrap.dedent("""
    import os, signal, sys
    path, codes, checkpoints = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
    with open(path, "a") as f:
        f.write("x\\n")
    n = sum(1 for _ in open(path))
    code = codes[min(n, len(codes)) - 1]
    if code[-1] in "+~":
        os.makedirs(os.path.join(checkpoints, str(n) + ("" if code[-1] == "+" else ".orbax-checkpoint-tmp-1")))
        code = code[:-1]
    if int(code) == -9:
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(code))
""")


def _run(tmp_path, codes, log=lambda s: None, **kw):
    counter = tmp_path / "runs.txt"
    delays = []
    kw.setdefault("base_delay_s", 0.01)
    kw.setdefault("max_delay_s", 0.04)
    rc = run_until_done([sys.executable, "-c", SCRIPT, str(counter), codes, str(tmp_path / "checkpoints")],
                        sleep=delays.append, rng=random.Random(0), log=log, **kw)
    runs = len(counter.read_text().splitlines())
    return rc, runs, delays


def test_fails_twice_then_succeeds(tmp_path):
    rc, runs, delays = _run(tmp_path, "1,-9,0", max_attempts=5)
    assert (rc, runs) == (0, 3)             # a crash and a SIGKILL are both retried
    assert len(delays) == 2
    assert 0.005 <= delays[0] <= 0.01 and 0.01 <= delays[1] <= 0.02


def test_signal_death_is_128_plus_the_signal(tmp_path):
    """A child killed by SIGKILL ends the launcher with 137, as a shell or Slurm report it (Popen's
    -9 made the launcher's own exit status 247)."""
    assert _run(tmp_path, "-9", max_attempts=1)[:2] == (137, 1)


def test_usage_error_is_not_retried(tmp_path):
    assert _run(tmp_path, "2", max_attempts=5)[:2] == (2, 1)


def test_non_finite_state_is_not_retried(tmp_path):
    """Exit 3 (olmo3/cli.py): a rerun would resume from the last good checkpoint into the same NaN."""
    assert _run(tmp_path, "1,3", max_attempts=5)[:2] == (3, 2)


def test_gives_up_after_max_attempts(tmp_path):
    rc, runs, delays = _run(tmp_path, "4", max_attempts=3)
    assert (rc, runs, len(delays)) == (4, 3, 2)


def test_long_runs_reset_the_failure_count_without_a_progress_probe(tmp_path):
    # Every attempt counts as healthy (reset_after_s=0): three failures never exhaust 2 attempts.
    rc, runs, _ = _run(tmp_path, "1,1,1,0", max_attempts=2, reset_after_s=0.0)
    assert (rc, runs) == (0, 4)


def test_a_new_checkpoint_is_progress_and_time_is_not(tmp_path):
    """With train.py's probe (the newest checkpoint), an attempt that saved resets the count; one
    that ran long but saved nothing (reset_after_s=0: every attempt is 'long') does not, nor does
    a save that never finished. A run crashing before each next save ends instead of looping."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    rc, runs, delays = _run(first, "1+,1+,1+,0", max_attempts=2,
                            progress=lambda: newest_checkpoint(f"{first}/checkpoints"))
    assert (rc, runs) == (0, 4)             # each failure saved first: never two in a row
    assert len(delays) == 3 and all(0.005 <= d <= 0.01 for d in delays), delays   # each the first failure's delay
    lines = []
    rc, runs, _ = _run(second, "1,1+,1~,1,1", max_attempts=3, reset_after_s=0.0, log=lines.append,
                       progress=lambda: newest_checkpoint(f"{second}/checkpoints"))
    assert (rc, runs) == (1, 5)             # a failure that saved checkpoint 2 starts a new count, three more end it
    assert "checkpoint 2 new" in lines[1] and "no checkpoint newer than 2" in lines[2]
    assert lines[-1].startswith("[launch] giving up after 3 consecutive failed attempts without progress")
    # --max_restarts=1: one failure without a new checkpoint ends it, one with a new checkpoint does
    # not (the saving attempt counted as the first of a new run of failures, so nothing was rerun).
    third = tmp_path / "third"
    third.mkdir()
    assert _run(third, "1+,1,0", max_attempts=1, progress=lambda: newest_checkpoint(f"{third}/checkpoints"))[:2] == (1, 2)


def test_a_listing_that_failed_once_is_no_progress(tmp_path):
    """The probe said None once (a stale handle on the shared run directory) before an attempt
    that then failed without saving: the step it listed afterwards, seen before, was counted as
    new, and a run crashing before each next save was rerun past --max_restarts."""
    steps, lines = iter([4, 4, None, 4, 4, 6]), []
    rc, runs, _ = _run(tmp_path, "1,1,1", max_attempts=2, log=lines.append, progress=lambda: next(steps))
    assert (rc, runs) == (1, 2), lines
    assert "no checkpoint newer than 4" in lines[1] and lines[-1].startswith("[launch] giving up after 2 ")


def test_a_stale_older_listing_does_not_lower_the_mark(tmp_path):
    """A network filesystem once lists an older step (4 after 6 was seen): the 6 listed again
    afterwards is not new, and a run crashing before each next save still ends."""
    steps = iter([6, 6, 6, 4, 4, *[6] * 10])
    assert _run(tmp_path, "1", max_attempts=3, progress=lambda: next(steps))[:2] == (1, 3)


def test_a_child_that_a_signal_ended_alone_is_rerun(tmp_path):
    """The child alone got SIGTERM / SIGINT (its handler saved and exited 143 / 130; the launcher
    was not signalled: a node's OOM killer, an admin): a crash like any other, rerun."""
    assert _run(tmp_path, "143,130,0", max_attempts=5)[:2] == (0, 3)


def test_newest_checkpoint_lists_finished_saves_only(tmp_path):
    assert newest_checkpoint(str(tmp_path / "none")) is None
    for name in ("3", "12", "40.orbax-checkpoint-tmp-7", ".deleted"):
        (tmp_path / name).mkdir()
    (tmp_path / "99").write_text("")      # a file, not a step folder
    assert newest_checkpoint(str(tmp_path)) == 12


def test_enclosing_run_finds_a_run_dir_inside_checkpoints_only(tmp_path):
    """train.py refuses a --run_dir that is a run's checkpoints/ directory, one of its checkpoints
    (Orbax's _CHECKPOINT_METADATA marks a step) or a folder inside one: a new run was written there.
    A folder a user named "checkpoints", holding runs, is not one."""
    run = tmp_path / "run"
    (run / "checkpoints" / "4" / "state").mkdir(parents=True)
    (run / "checkpoints" / "4" / "_CHECKPOINT_METADATA").write_text("{}")
    for inside in ("checkpoints", "checkpoints/4", "checkpoints/4/state", "checkpoints/4/state/new", "checkpoints/5"):
        assert enclosing_run(str(run / inside)) == str(run), inside
    for outside in (run, tmp_path / "new", run / "logs"):
        assert enclosing_run(str(outside)) is None, outside
    mine = tmp_path / "checkpoints"   # the user's folder of runs, runs named by number among them
    (mine / "7" / "checkpoints").mkdir(parents=True)
    assert enclosing_run(str(mine / "7")) is None and enclosing_run(str(mine / "8")) is None


def test_newest_checkpoint_survives_a_stale_handle(tmp_path, monkeypatch, capsys):
    """An I/O error listing the shared run directory (ESTALE on NFS) counts as no checkpoint, so
    the attempt counts as no progress and the loop goes on; it used to end the launcher (exit 1,
    and srun --kill-on-bad-exit then ends the job)."""
    import errno
    import os

    def stale(path):
        raise OSError(errno.ESTALE, "Stale file handle", path)
    monkeypatch.setattr(os, "listdir", stale)
    assert newest_checkpoint(str(tmp_path)) is None
    assert "Stale file handle" in capsys.readouterr().err


def test_backoff_is_exponential_jittered_and_capped():
    rng = random.Random(1)
    for failures in range(1, 12):
        cap = min(100.0, 1.0 * 2 ** (failures - 1))
        d = [backoff_delay(failures, 1.0, 100.0, rng) for _ in range(50)]
        assert all(cap / 2 <= x <= cap for x in d)
        assert len(set(d)) > 1                                  # jittered
    assert backoff_delay(30, 1.0, 100.0, rng) <= 100.0          # capped, no overflow
    assert backoff_delay(5000, 30.0, 1800.0, rng) <= 1800.0     # never gives up: failure 1025 overflowed
    with pytest.raises(ValueError):
        run_until_done(["true"], max_attempts=0)


def test_child_is_never_a_launcher(tmp_path):
    """--resume_until_done in a flagfile: the child, given the flagfile back, parses as a resuming
    trainer, not a launcher (each child started launchers of its own: 24 -> 173 processes in 16 s)."""
    import json
    import os
    import subprocess
    flagfile = tmp_path / "run.flags"
    flagfile.write_text("--resume_until_done\n--noresume\n--max_steps=2\n")
    child = child_argv(["train.py", f"--flagfile={flagfile}"])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parse = ("import json, sys, train; train.F(sys.argv[1:]); "
             "print(json.dumps([train.F.resume_until_done, train.F.resume, train.F.max_steps]))")
    p = subprocess.run([sys.executable, "-c", parse, *child], capture_output=True, text=True, cwd=root,
                       env={**os.environ, "PYTHONPATH": root}, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == [False, True, 2]


# train.py --resume_until_done with the loop itself stubbed: what it hands run_until_done.
WIRING = """
import json, sys
import train
from olmo3 import launch
seen = {}
def loop(argv, **kw):
    seen.update(argv=argv, max_attempts=kw["max_attempts"], progress=kw["progress"]())
    return 7
launch.run_until_done = loop
sys.argv = ["train.py", *sys.argv[1:]]
train.F(sys.argv)
try:
    train.main(["train.py"])
except SystemExit as e:
    seen["exit"] = e.code
print(json.dumps(seen))
"""


def test_train_py_hands_the_loop_its_limit_and_its_progress_probe(tmp_path):
    """train.py's launcher: --max_restarts is the loop's limit of attempts without progress, and
    progress is the newest finished checkpoint under <--run_dir>/checkpoints (here 12: the
    folders this test made, an unfinished save's aside). Without the probe any attempt that ran an
    hour counted as progress, and a run crashing before each next save was rerun forever."""
    import json
    import os
    import subprocess
    checkpoints = tmp_path / "run" / "checkpoints"
    for name in ("3", "12", "40.orbax-checkpoint-tmp-7"):
        (checkpoints / name).mkdir(parents=True)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", WIRING, f"--run_dir={tmp_path / 'run'}", "--resume_until_done",
                        "--max_restarts=4", "--max_steps=9"], capture_output=True, text=True, cwd=root,
                       env={**os.environ, "PYTHONPATH": root}, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    seen = json.loads(p.stdout.strip().splitlines()[-1])
    assert (seen["max_attempts"], seen["progress"], seen["exit"]) == (4, 12, 7), seen
    assert seen["argv"] == [sys.executable, "train.py", f"--run_dir={tmp_path / 'run'}", "--max_restarts=4",
                            "--max_steps=9", "--resume", "--noresume_until_done"], seen["argv"]


def test_strip_flag():
    argv = ["--stage=1", "--resume_until_done", "--noresume_until_done", "--resume_until_done=true",
            "--resume", "--resume_until_done_x"]
    assert strip_flag(argv, "resume_until_done") == ["--stage=1", "--resume", "--resume_until_done_x"]


# Traps SIGTERM as train.py does (olmo3/preemption.py): "saves", then exits 143.
TRAPPING = textwrap.dedent("""
    import os, signal, sys, time
    path = sys.argv[1]
    def stop(signum, frame):
        with open(path, "a") as f:
            f.write("saved\\n")
        sys.exit(143)
    signal.signal(signal.SIGTERM, stop)
    with open(path, "a") as f:
        f.write("started\\n")
    time.sleep(60)
    sys.exit(1)
""")


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_sigterm_is_passed_to_the_child_and_ends_the_loop(tmp_path, name):
    """srun's SIGTERM at the time limit reaches the launcher: it must not die before the child
    has saved, nor rerun the child afterwards. SIGINT or SIGHUP to the launcher alone stop the
    child the same way (the launcher exited at once on SIGINT and left the child training)."""
    import os
    import signal
    import subprocess
    import time
    log = tmp_path / "child.txt"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    launcher = (f"import sys; from olmo3.launch import run_until_done; "
                f"sys.exit(run_until_done([sys.executable, '-c', {TRAPPING!r}, {str(log)!r}], base_delay_s=0.01))")
    p = subprocess.Popen([sys.executable, "-c", launcher], cwd=root, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (log.exists() and "started" in log.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    p.send_signal(getattr(signal, name))   # the launcher only; it passes SIGTERM on
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143, err
    assert log.read_text().split() == ["started", "saved"]    # one attempt, which saved
    assert f"{name}: attempt 1 stopped with exit code 143; not rerunning" in err


def test_a_signal_while_the_child_starts_reaches_it(tmp_path, monkeypatch):
    """SIGTERM to the launcher while it is starting the child (in Popen): the child is told once
    it exists and the launcher stops with its status. The handlers used to be installed after
    Popen returned, so such a signal killed the launcher and left the child training on."""
    import os
    import signal
    import subprocess
    from olmo3 import launch
    real = subprocess.Popen

    def popen_signalled_meanwhile(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)   # lands before Popen returns
        return real(*args, **kwargs)
    monkeypatch.setattr(launch.subprocess, "Popen", popen_signalled_meanwhile)
    lines = []
    rc = run_until_done([sys.executable, "-c", "import time; time.sleep(60)"], base_delay_s=0.01, log=lines.append)
    assert rc == 143 and lines == ["[launch] SIGTERM: attempt 1 stopped with exit code 143; not rerunning"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_launcher_killed_outright_tells_its_child_to_stop(tmp_path):
    """SIGKILL to the launcher alone (by pid, or the OOM killer): the child gets SIGTERM, saves and
    exits, instead of training on, unseen, into a run directory a resubmission shares."""
    import os
    import signal
    import subprocess
    import time
    log = tmp_path / "child.txt"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    launcher = (f"import sys; from olmo3.launch import run_until_done; "
                f"sys.exit(run_until_done([sys.executable, '-c', {TRAPPING!r}, {str(log)!r}], base_delay_s=0.01))")
    p = subprocess.Popen([sys.executable, "-c", launcher], cwd=root, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not (log.exists() and "started" in log.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    while "saved" not in log.read_text() and time.time() < deadline:
        time.sleep(0.05)
    assert log.read_text().split() == ["started", "saved"]
