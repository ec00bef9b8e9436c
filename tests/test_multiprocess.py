"""Two real processes (jax.distributed on 127.0.0.1, gloo CPU collectives, 2 devices each) train
a tiny OLMo 3 for a few steps and agree with the single-process, single-device step. They join
through explicit flags, or, as on a cluster, through nothing but the variables `srun` or Open MPI's
`mpirun` set (tests/fake_srun.py), which JAX's own detection reads (olmo3/cluster.py).

Tolerances as in tests/test_sharding.py (float32 reduction order): losses rtol 2e-6; the
parameter update per weight in L2 norm 1e-3 relative (Adam's sign-like first step amplifies
rounding in near-zero gradient entries). The checkpoint both processes wrote into ONE Orbax
directory must restore here, in a third process, to exactly the params they trained (bitwise).
"""
import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import equinox as eqx
import pytest
import jax
import jax.numpy as jnp
import numpy as np

import fake_srun
import olmo3
from olmo3.optim import SkipStepAdamW

CFG = olmo3.Config.tiny(vocab_size=512, d_model=64, n_heads=4, n_kv_heads=4, head_dim=16,
                        mlp_hidden=128, n_layers=4, window=8, remat="none")
MESH = "fsdp:2,data:2"      # 4 global devices: fsdp within a process, data across the two
MICROBATCHES = 2
STEPS = 3
B, T = 8, 32


def optimizer():
    return SkipStepAdamW(lambda s: 1e-3, decay_mask=olmo3.model.decay_mask)


def fresh():
    model = olmo3.OLMo3(CFG, jax.random.key(0))
    return model, optimizer().init(model)


def batches():
    rng = np.random.default_rng(7)
    out = []
    for _ in range(STEPS):
        mask = np.ones(B, bool)
        mask[rng.integers(B)] = False
        out.append({"tokens": rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32),
                    "instance_mask": mask})
    return out


def scored_batch():
    """Rows of other lengths and contents, so that a result moved to another row shows: the DPO
    log-probs' fields and downstream scoring's (olmo3/scoring.py continuation_scores)."""
    rng = np.random.default_rng(11)
    lengths = rng.permutation(np.arange(3, 3 + 3 * B, 3))[:B]
    return {"tokens": rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32),
            "label_mask": np.arange(T)[None, :] < lengths[:, None] % T,
            "targets": rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32),
            "weights": (np.arange(T)[None, :] < lengths[:, None] % T).astype(np.float32),
            "pos": (lengths % T).astype(np.int32), "choices": rng.integers(0, CFG.vocab_size, (B, 4)).astype(np.int32)}


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train_py_env(devices: int) -> dict:
    """This environment for a train.py process on `devices` CPU devices, with no inherited JAX
    cluster variables."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")}
    env.update({"JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT,
                "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"})
    return env


def _start_two_train_py(per_process, popen) -> list:
    """train.py as 2 processes x 2 CPU devices (fsdp:4) with SMALL's recipe, `per_process(i)`
    adding each one's own flags; `popen(i)` gives each one's output files."""
    from test_train import SMALL

    port, env = fake_srun.free_derived_port(), _train_py_env(2)
    return [subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *SMALL, "--mesh=fsdp:4",
                              f"--coordinator=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}",
                              *per_process(i)], env=env, text=True, **popen(i)) for i in range(2)]


@pytest.mark.parametrize("launcher", ["flags", "slurm", pytest.param("mpirun", marks=pytest.mark.slow)])
def test_two_processes_match_single_process(tmp_path, launcher):
    worker = os.path.join(os.path.dirname(__file__), "multiprocess_worker.py")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu"}
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(var, None)
    if launcher == "flags":
        port, envs = str(fake_srun.free_derived_port()), [env, env]
    elif launcher == "slurm":   # one task per node, two nodes: what launch/slurm.sbatch runs
        job_id = fake_srun.job_id_for_free_port()
        port, envs = "auto", [{**env, **fake_srun.srun_env(job_id, i, 2, 2)} for i in range(2)]
    else:
        free = fake_srun.free_derived_port()
        port, envs = "auto", [{**env, **fake_srun.mpirun_env(i, 2, free)} for i in range(2)]
    procs = [subprocess.Popen([sys.executable, worker, port, str(i), str(tmp_path)], env=envs[i],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"

    # Reference: one process, one device, the plain step (no shard_map), whole batches.
    from olmo3.step import make_train_step
    step = make_train_step(optimizer(), chunk=64)
    model, opt = fresh()
    ref_losses = []
    for b in batches():
        model, opt, m = step(model, opt, {k: jnp.asarray(v) for k, v in b.items()})
        ref_losses.append(float(m["train/loss"]))

    got = np.load(tmp_path / "result.npz")
    np.testing.assert_allclose(got["losses"], ref_losses, rtol=2e-6)
    leaves = jax.tree_util.tree_flatten_with_path(model)[0]
    for (path, want), base in zip(leaves, jax.tree.leaves(fresh()[0])):   # step donated the first
        update, ref_update = got[jax.tree_util.keystr(path)] - base, want - base
        assert np.linalg.norm(update - ref_update) < 1e-3 * np.linalg.norm(ref_update), path

    # One checkpoint directory written by both processes; restore it here on one device.
    from olmo3.checkpoint import CheckpointManager
    ckpt = CheckpointManager(str(tmp_path / "run"), read_only=True)
    assert ckpt.all_steps() == [STEPS]
    abstract = eqx.filter_eval_shape(fresh)
    restored, extra = ckpt.restore(STEPS, {"model": abstract[0], "opt": abstract[1]})
    np.testing.assert_allclose(extra["losses"], got["losses"], rtol=0)
    for path, x in jax.tree_util.tree_flatten_with_path(restored["model"])[0]:
        np.testing.assert_array_equal(np.asarray(x), got[jax.tree_util.keystr(path)])
    assert int(restored["opt"].step) == STEPS


def test_whole_batch_results_keep_the_batch_order_across_processes(tmp_path):
    """DPO reference log-probs and downstream scores are computed for a batch every process holds
    whole. On a mesh that puts process 1's devices first, interleaved with process 0's (a TPU
    slice's physical device order may do that), row i's result must still be row i's: each
    process used to send rows [p * n, (p + 1) * n), which land wherever its devices sit."""
    from olmo3 import dpo
    from olmo3.scoring import continuation_scores_jit
    worker = os.path.join(os.path.dirname(__file__), "multiprocess_worker.py")
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")}
    port = str(fake_srun.free_derived_port())
    procs = [subprocess.Popen([sys.executable, worker, port, str(i), str(tmp_path), "scores"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    with contextlib.ExitStack() as stack:
        for p in procs:
            stack.callback(p.kill)
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
    got = np.load(tmp_path / "scores.npz")
    model, batch = fresh()[0], scored_batch()
    sums, counts = dpo.sequence_logps(model, jnp.asarray(batch["tokens"]), jnp.asarray(batch["label_mask"]), chunk=64)
    ll, choice = continuation_scores_jit(model, {k: jnp.asarray(v) for k, v in batch.items()})
    np.testing.assert_array_equal(got["counts"], counts)
    np.testing.assert_allclose(got["sums"], sums, rtol=2e-5)
    np.testing.assert_allclose(got["ll"], ll, rtol=2e-5)
    np.testing.assert_allclose(got["choice"], choice, rtol=2e-5, atol=1e-5)


@pytest.mark.slow
def test_train_py_two_processes_match_one(tmp_path):
    """train.py itself, launched as 2 processes x 2 CPU devices (--coordinator/--num_processes/
    --process_id), against train.py as 1 process x 4 devices on the same recipe: same mesh
    shape (fsdp:4), same losses (rtol 2e-6, float32 reduction order), one checkpoint dir."""
    import json

    from test_train import SMALL, word_corpus   # the tiny recipe and corpus of the train.py tests

    corpus = tmp_path / "docs"
    corpus.mkdir()
    word_corpus(corpus)

    def launch(run_dir, devices, extra):
        env = _train_py_env(devices)
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), *SMALL, f"--data={corpus}",
               f"--data_dir={tmp_path / 'data'}", f"--run_dir={run_dir}", "--max_steps=3",
               "--save_interval=3", "--mesh=fsdp:4", *extra]
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    def wait(procs):
        outs = [p.communicate(timeout=600)[0] for p in procs]
        for p, out in zip(procs, outs):
            assert p.returncode == 0, f"train.py failed:\n{out[-4000:]}"

    def losses(run_dir):
        with open(run_dir / "metrics.jsonl") as f:
            return [json.loads(line)["train/loss"] for line in f if "train/loss" in line]

    wait([launch(tmp_path / "one", 4, [])])
    port = fake_srun.free_derived_port()
    wait([launch(tmp_path / "two", 2, [f"--coordinator=127.0.0.1:{port}", "--num_processes=2",
                                        f"--process_id={i}"]) for i in range(2)])
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(one) == 3
    np.testing.assert_allclose(two, one, rtol=2e-6)
    assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == ["3"]


# Gloo's (C++) "[Gloo] Rank 2 is connected to 3 peer ranks. Expected number of connected peer ranks
# is : 3", written piece by piece from one thread per collective context: two threads' pieces
# interleave within a line and across lines (CI, 2026-12-06), so the pieces are removed, not lines.
_GLOO_PIECES = re.compile(r"\[Gloo\] Rank | is connected to | ?peer ranks\. ?|Expected number of connected "
                          r"peer ranks is : ")


def _our_lines(out: str) -> list:
    """A process's output without Gloo's lines."""
    return [line for line in _GLOO_PIECES.sub("", out).splitlines() if line.strip(" 0123456789")]


def _repeats(out: str, of: str) -> list:
    """The lines of process 1's output `out` that begin as a line of process 0's output `of` does
    (its first 16 characters: "step       2 | l", numbers after), other than cluster lines and
    absl's WARNING/ERROR/FATAL lines: what a process other than 0 must not print (olmo3/logs.py
    quiet_other_processes). A line of process 1's own (a C++ log record's second line, a warning
    about a compilation cache entry process 0 is still writing) is no repeat."""
    theirs = {line[:16] for line in _our_lines(of)}
    return [line for line in _our_lines(out)
            if line[:16] in theirs and not re.match(r"cluster: |[WEF]\d{4} ", line)]


def _error_line(out: str) -> str:
    """A process's last "train.py: error:" line (or its last line, to show, when it has none): C++
    threads may still print as the process exits."""
    lines = _our_lines(out)
    return next((line for line in reversed(lines) if line.startswith("train.py: error:")), lines[-1] if lines else "")


@contextlib.contextmanager
def _two_train_py(tmp_path, *extra, until=r"^step +2 \|", log="p"):
    """train.py as 2 processes x 2 CPU devices (fsdp:4) with SMALL's recipe, output in
    tmp_path/{log}{0,1}.log; yields the two processes once process 0 has logged a line matching
    `until` (by default step 2), kills whatever is left when the block ends."""
    from test_train import word_corpus

    corpus = tmp_path / "docs"
    corpus.mkdir(exist_ok=True)
    word_corpus(corpus)
    logs = [open(tmp_path / f"{log}{i}.log", "w+") for i in range(2)]
    procs = _start_two_train_py(lambda i: [f"--data={corpus}", f"--data_dir={tmp_path / 'data'}",
                                           f"--run_dir={tmp_path / 'run'}", "--save_interval=1000", *extra],
                                lambda i: {"stdout": logs[i], "stderr": subprocess.STDOUT})
    try:
        deadline = time.time() + 300
        while not re.search(until, (tmp_path / f"{log}0.log").read_text(), re.M):
            assert time.time() < deadline and procs[0].poll() is None, (tmp_path / f"{log}0.log").read_text()[-3000:]
            time.sleep(0.05)
        yield procs
    finally:
        for p in procs:
            p.kill()


@pytest.mark.slow
def test_sigterm_to_one_process_checkpoints_both_at_one_step(tmp_path):
    """A preemption notice that reaches one process of two (a GPU node or TPU VM signalled alone):
    JAX's preemption sync manager tells both to stop at the same step (olmo3/preemption.py); both
    write their shards of that one checkpoint and exit 143. Resumed, both do the held-out
    evaluation the stop skipped (a collective each: one process alone would hang) before training on."""
    with _two_train_py(tmp_path, "--max_steps=12", "--eval_interval=1") as procs:
        procs[1].send_signal(signal.SIGTERM)     # process 1 only; process 0 hears it through JAX
        codes = [p.wait(timeout=300) for p in procs]
    out = [(tmp_path / f"p{i}.log").read_text() for i in range(2)]
    assert codes == [143, 143], out[0][-3000:] + out[1][-3000:]
    saved = sorted(int(n) for n in os.listdir(tmp_path / "run" / "checkpoints") if n.isdigit())
    assert len(saved) == 1 and 2 <= saved[0] < 12, saved
    assert f"Stopped by SIGTERM after step {saved[0]}" in out[0]
    print(f"SIGTERM to process 1 after step 2 was logged; both stopped after step {saved[0]}")
    from olmo3.checkpoint import CheckpointManager
    ckpt = CheckpointManager(str(tmp_path / "run"), read_only=True)
    assert ckpt.read_extra(saved[0])["loader"]["step"] == saved[0]
    assert ckpt.read_extra(saved[0])["owed_evaluations"] == ["held-out"]
    with _two_train_py(tmp_path, f"--max_steps={saved[0] + 1}", "--resume", until="^OLMo 3 stage", log="r") as procs:
        codes = [p.wait(timeout=300) for p in procs]
    out = [(tmp_path / f"r{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], out[0][-3000:] + out[1][-3000:]
    assert f"The held-out evaluation of step {saved[0]}, which the preemption stop skipped" in out[0]
    assert f"Resumed {tmp_path / 'run'} at step {saved[0]}" in out[0] and re.search(r"^step +\d+ \|", out[0], re.M)
    assert not _repeats(out[1], out[0]), out[1][-3000:]   # its "Resumed" line repeated process 0's
    from olmo3.comparison import read_metrics
    assert any(k.startswith("eval/") for k in read_metrics(str(tmp_path / "run"))[saved[0]])


@pytest.mark.slow
@pytest.mark.parametrize("when", ["after step 2", "before the first step"])
def test_a_stopped_peer_ends_the_run_through_the_watchdog(tmp_path, when):
    """Process 1 frozen (SIGSTOP) after step 2, or before the first step (as process 0 logs its
    header): process 0 waits in a collective that never completes. The watchdog ends it with status
    1 (rerun) after --hang_timeout_s, with the line that says so (olmo3/watchdog.py); the first
    step is timed from the end of its compilation. A frozen process is also what JAX's heartbeat
    sees, after 100 s; the hang only the watchdog sees, every process alive and stuck (a device, a
    deadlocked collective, a read), cannot be made on CPU: this is the same wait, seen from
    process 0."""
    first = when == "before the first step"
    until = r"^OLMo 3 stage" if first else r"^step +2 \|"
    with _two_train_py(tmp_path, "--max_steps=20", "--hang_timeout_s=8", until=until) as procs:
        procs[1].send_signal(signal.SIGSTOP)
        stopped_at = time.time()
        code = procs[0].wait(timeout=90)
        waited = time.time() - stopped_at
    out = (tmp_path / "p0.log").read_text()
    assert code == 1, out[-3000:]
    last = _error_line(out)
    if first:
        assert not re.search(r"^step +1 \|", out, re.M)
        assert re.match(r"train\.py: error: step 1, the first of this run, has not finished \d+ s after its "
                        r"compilation", last), last
    else:
        assert re.match(r"train\.py: error: no training step finished for \d+ s after step \d+ \(it took", last), last
    assert "--hang_timeout_s=8" in last
    print(f"process 0 ended {waited:.0f} s after its peer stopped {when}: {last}")


def _two_train_py_until_done(tmp_path, per_process, timeout=240):
    """_start_two_train_py's processes run to their end: their exit codes and outputs."""
    procs = _start_two_train_py(per_process, lambda i: {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT})
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], outs


def test_train_py_as_two_processes_trains_and_saves(tmp_path):
    """The smallest whole train.py run as 2 processes x 2 CPU devices, in the default suite: 2
    steps and a checkpoint. (A check that every run passes once stopped every multi-process run
    before its first step, and only slow tests ran train.py as several processes.)"""
    from test_train import word_corpus

    corpus = tmp_path / "docs"
    corpus.mkdir()
    word_corpus(corpus)
    codes, outs = _two_train_py_until_done(tmp_path, lambda i: [
        f"--data={corpus}", f"--data_dir={tmp_path / 'data'}", f"--run_dir={tmp_path / 'run'}", "--max_steps=2",
        "--save_interval=2"])
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["2"]
    assert re.search(r"^step +2 \|", outs[0], re.M) and not _repeats(outs[1], outs[0]), outs[1][-3000:]


def test_run_dir_not_shared_by_every_process_is_refused(tmp_path):
    """Two processes whose --run_dir is not one directory (as two hosts with a local disk each, or
    a bucket mounted on one): both stop before the first step with exit status 2 and one line
    naming --run_dir and the process that saw nothing. (Before, their first checkpoint never
    completed and the watchdog ended every rerun as a hang.)"""
    from test_train import word_corpus

    corpus = tmp_path / "docs"
    corpus.mkdir()
    word_corpus(corpus)
    codes, outs = _two_train_py_until_done(tmp_path, lambda i: [
        f"--data={corpus}", f"--data_dir={tmp_path / f'data{i}'}", f"--run_dir={tmp_path / f'host{i}' / 'run'}"])
    for code, out in zip(codes, outs):
        last = _error_line(out)
        assert code == 2 and "--run_dir=" in last and "process(es) [1] of 2 do not see" in last, out[-3000:]
    assert not os.listdir(tmp_path / "host0" / "run")     # the marker is gone, nothing else was written


@pytest.mark.parametrize("edit", ["other_sizes", "same_sizes"])
def test_processes_that_see_different_data_are_refused(tmp_path, edit):
    """Each process builds the data order from the files and sizes it sees (a stale cache of remote
    sizes on one host, another --data): one that sees other data would read rows of another
    permutation, with no error. Both stop before the first step, exit status 2, one line naming
    the data set that differs. A corpus edited on one host to the same token counts (two words
    swapped) prepares into files of the same names and sizes: their contents digests differ."""
    from test_train import word_corpus

    for i in range(2):   # one folder name: the held-out domain is named after it
        os.makedirs(tmp_path / f"host{i}" / "docs")
        word_corpus(tmp_path / f"host{i}" / "docs")
    doc = tmp_path / "host1" / "docs" / "doc0.txt"
    if edit == "other_sizes":
        doc.write_text("one document changed on one host")
        says = "the data sets (file names and sizes) differ between processes: "
    else:
        words = doc.read_text().split(" ")
        k = next(k for k in range(1, len(words) - 1) if words[k] != words[k + 1])
        words[k], words[k + 1] = words[k + 1], words[k]
        doc.write_text(" ".join(words))
        says = "the prepared token files' contents (same names and sizes) differ between processes: "
    codes, outs = _two_train_py_until_done(tmp_path, lambda i: [
        f"--data={tmp_path / f'host{i}' / 'docs'}", f"--data_dir={tmp_path / f'data{i}'}", f"--run_dir={tmp_path / 'run'}"])
    for code, out in zip(codes, outs):
        last = _error_line(out)
        assert code == 2 and says in last and "process(es) [1] of 2 differ from process 0's" in last, out[-3000:]
    assert not os.path.exists(tmp_path / "run" / "checkpoints") or not os.listdir(tmp_path / "run" / "checkpoints")
