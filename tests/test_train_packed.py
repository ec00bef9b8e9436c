"""train.py --packed end to end: a save-and-resume run reproduces the uninterrupted run's losses
exactly, the checkpoint's loader state names the packed dataset, and a resume over other data is
refused; 2 processes train as 1; held-out domains are evaluated on padded instances however few
documents they hold (slow: several train.py runs each); and, in the default run, one step's
loss equals its documents run alone.

The reference for a resumed run is the uninterrupted run (DESIGN §4, bug 2): equal bit for bit.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from test_train import SMALL  # noqa: E402  (the small model of the train tests)
from oracles import log_softmax64  # noqa: E402

PACKED = [*SMALL, "--packed", "--source_group_size=2", "--source_permutation_seed=123", "--doc_lengths",
          "--global_batch=4", "--eval_batches=2"]


def short_docs(d):
    """60 documents of 2..20 random words: several fit one 64-token instance, so packing matters."""
    rng = np.random.default_rng(1)
    words = [f"w{i}" for i in range(200)] + ["def", "return", "(", ")", ":"]
    for i in range(60):
        (d / f"doc{i}.txt").write_text(" ".join(rng.choice(words, rng.integers(2, 20))))
    return d


def run(args, run_dir, docs, data_dir, check=True, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # Two devices: the batch rows and the padded held-out rows are split across them.
    env.update({"JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                **(env_extra or {})})
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *PACKED, f"--data={docs}",
           f"--data_dir={data_dir}", f"--run_dir={run_dir}", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"train.py failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return p


def metrics(run_dir):
    from test_train import metrics_by_step
    return metrics_by_step(run_dir)


@pytest.mark.slow  # four train.py runs: ~3 min on 2 cores
def test_packed_resume_is_bit_exact(tmp_path):
    (tmp_path / "docs").mkdir()
    docs = str(short_docs(tmp_path / "docs"))
    run(["--max_steps=4", "--save_interval=2"], tmp_path / "a", docs, tmp_path / "data")
    run(["--max_steps=2", "--save_interval=2"], tmp_path / "b", docs, tmp_path / "data")
    run(["--max_steps=4", "--save_interval=2", "--resume"], tmp_path / "b", docs, tmp_path / "data")
    a, b = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert [a[s]["train/loss"] for s in a] == [b[s]["train/loss"] for s in a]  # exact
    assert a[4]["eval/docs/loss"] == b[4]["eval/docs/loss"]  # held-out: padded instances

    # The checkpoint's loader state is the packed dataset's (the same packing as train.py's).
    with open(tmp_path / "b" / "checkpoints" / "4" / "extra" / "metadata") as f:
        loader = json.load(f)["loader"]
    train = sorted(os.path.join(tmp_path / "data" / "train", n) for n in os.listdir(tmp_path / "data" / "train")
                   if n.endswith(".npy"))
    packed = data.PackedFSLDataset(train, 64, source_group_size=2, source_permutation_seed=123)
    assert loader["fingerprint"] == packed.fingerprint and loader["step"] == 4

    # Resuming with another packing (or fixed-length instances) is refused with one line.
    p = run(["--max_steps=6", "--save_interval=2", "--resume", "--source_group_size=1"], tmp_path / "b", docs,
            tmp_path / "data", check=False)
    assert p.returncode == 2 and "fingerprint" in p.stderr


@pytest.mark.slow  # two train.py runs: ~70 s on 2 cores
def test_small_heldout_domain_is_evaluated(tmp_path):
    """3 held-out documents on 4 devices: padded instances and fixed-length windows both evaluate
    them (filler rows masked; windows were once skipped, fewer than one per device), and eval.py
    on the padded run's checkpoint scores padded documents as the run did: the same loss."""
    rng = np.random.default_rng(2)
    (tmp_path / "docs").mkdir()
    words = [f"w{i}" for i in range(200)]
    for i in (*range(7), 8, *range(10, 16)):  # prepare holds out a quarter of the documents by hash: 3 of these
        (tmp_path / "docs" / f"doc{i}.txt").write_text(" ".join(rng.choice(words, rng.integers(15, 30))))
    four = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    for padded in (True, False):
        run_dir = tmp_path / f"run{padded}"
        run(["--max_steps=1", "--save_interval=1", "--eval_padded" if padded else "--noeval_padded"], run_dir,
            str(tmp_path / "docs"), tmp_path / "data", env_extra=four)
        m = metrics(run_dir)[1]
        if padded:
            assert np.isfinite(m["eval/docs/loss"])
            # OLMo-core's LMEvaluator number: one more position per document in the denominator
            held = data.PaddedFSLDataset(sorted(str(q) for q in (tmp_path / "data" / "heldout" / "docs").glob("*.npy")),
                                         64)
            targets = sum(int(held[i]["label_mask"].sum()) - 1 for i in range(len(held)))
            np.testing.assert_allclose(m["eval/docs/olmo_core_ce"], m["eval/docs/loss"] * targets / (targets + len(held)),
                                       rtol=1e-6)
            files = sorted(str(q) for q in (tmp_path / "data" / "heldout" / "docs").glob("*.npy"))
            out = subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), f"--model={run_dir}",
                                  "--heldout=" + ",".join(f"docs={f}" for f in files), "--eval_seq_len=64",
                                  f"--model_b={run_dir}",   # KL reads windows of the same documents
                                  f"--out={tmp_path / 'eval'}"], capture_output=True, text=True, timeout=600,
                                 env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT})
            assert out.returncode == 0, out.stderr[-3000:]
            got = json.loads((tmp_path / "eval" / "eval.json").read_text())
            np.testing.assert_allclose(got["eval/docs/loss"], m["eval/docs/loss"], rtol=1e-5)
            assert got["kl/mean"] < 1e-9 and got["eval/docs/loss_delta"] == 0.0
        else:
            assert np.isfinite(m["eval/docs/loss"])
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert manifest["splits"]["heldout/docs"]["documents"] < 4


@pytest.mark.slow  # three train.py processes: ~100 s on 2 cores
def test_packed_two_processes_match_one(tmp_path):
    """train.py --packed as 2 processes x 2 devices (process 0 packs into the shared cache, the
    other reads it) against 1 process x 4 devices: the same losses (rtol 2e-6: float32 reduction
    order) and the same held-out loss."""
    import socket
    import subprocess as sp
    (tmp_path / "docs").mkdir()
    docs = short_docs(tmp_path / "docs")

    def launch(run_dir, devices, extra):
        env = {k: v for k, v in os.environ.items()
               if k not in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")}
        env.update({"JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT,
                    "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"})
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), *PACKED, f"--data={docs}",
               f"--data_dir={tmp_path / 'data'}", f"--run_dir={run_dir}", "--max_steps=3", "--save_interval=3",
               "--mesh=fsdp:4", "--eval_padded", *extra]
        return sp.Popen(cmd, env=env, stdout=sp.PIPE, stderr=sp.STDOUT, text=True)

    def wait(procs):
        for p in procs:
            out = p.communicate(timeout=600)[0]
            assert p.returncode == 0, f"train.py failed:\n{out[-4000:]}"

    wait([launch(tmp_path / "one", 4, [])])
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    wait([launch(tmp_path / "two", 2, [f"--coordinator=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}"])
          for i in range(2)])
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert sorted(one) == sorted(two) == [1, 2, 3]
    np.testing.assert_allclose([two[s]["train/loss"] for s in one], [one[s]["train/loss"] for s in one], rtol=2e-6)
    np.testing.assert_allclose(two[3]["eval/docs/loss"], one[3]["eval/docs/loss"], rtol=2e-6)


def test_packed_step_attends_within_documents(tmp_path):
    """--packed --doc_lengths (stage 3's data path): step 1's training loss, the initial model's, equals
    a float64 cross entropy of every packed document run through the model alone, over the targets
    the batch trains on (a document's last token predicts the next one's first; padding never). So
    train.py hands the document boundaries to the step's attention: without them the loss differs."""
    import jax

    import olmo3
    (tmp_path / "docs").mkdir()
    docs = str(short_docs(tmp_path / "docs"))
    run(["--max_steps=1", "--save_interval=1", "--eval_batches=1"], tmp_path / "a", docs, tmp_path / "data")
    got = metrics(tmp_path / "a")[1]["train/loss"]
    files = sorted(str(q) for q in (tmp_path / "data" / "train").glob("*.npy"))
    ds = data.PackedFSLDataset(files, 64, source_group_size=2, source_permutation_seed=123)
    batch = data.get_batch(ds, 4, 34521, 0)   # PACKED: --global_batch=4; tiny.flags: --seed=34521
    cfg = olmo3.Config.preset("tiny", d_model=32, n_layers=4, n_heads=2, n_kv_heads=2, head_dim=16, mlp_hidden=64,
                              window=16)
    model = olmo3.OLMo3(cfg, jax.random.key(0))   # --model_seed=0
    ce, n, documents = 0.0, 0, 0
    for tokens, mask, segs in zip(batch["tokens"], batch["label_mask"], batch["segment_ids"]):
        T = len(tokens)
        for s in np.unique(segs):
            where = np.flatnonzero(segs == s)
            targets = [t for t in where if t + 1 < T and mask[t + 1]]
            if not targets:   # padding
                continue
            assert (np.diff(where) == 1).all()
            logp = log_softmax64(model(jax.numpy.asarray(tokens[where])))
            ce -= sum(logp[t - where[0], tokens[t + 1]] for t in targets)
            n += len(targets)
            documents += 1
    assert documents > len(batch["tokens"])   # rows holding several documents
    assert got == pytest.approx(ce / n, rel=1e-5)
