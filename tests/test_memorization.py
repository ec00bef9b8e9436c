"""The calibrated memorization verdict (eval.py --compare, olmo3/comparison.py) through real
train.py runs, as a new user would try it: two clean runs that differ only in --seed must flag no
step; a run that sees a few documents over and over (DESIGN §4 bug 1 taken to the extreme) must be
flagged at every checkpoint. The reference is what the runs did, not a threshold tuned to them:
the noise band is derived by eval.py from the runs' own training-loss spread and held-out spread."""
import csv
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--flagfile=" + os.path.join(ROOT, "tiny.flags"), "--d_model=64", "--n_heads=2", "--n_kv_heads=2",
         "--head_dim=32", "--mlp_hidden=128", "--seq_len=64", "--global_batch=8", "--window=16",
         "--eval_interval=1000", "--eval_batches=1", "--loss_chunk=256", "--total_steps=100",
         "--warmup_steps=10", "--save_interval=50", "--keep_checkpoints=5"]


def env():
    e = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    e.update({"JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT})
    return e


def write_docs(d, n, seed):
    """Documents from one word-level Markov chain (learnable structure, so held-out loss moves)."""
    rng = np.random.default_rng(1234)
    words = [f"w{i}" for i in range(200)]
    succ = rng.integers(0, len(words), size=(len(words), 3))
    rng = np.random.default_rng(seed)
    d.mkdir()
    for k in range(n):
        w, out = int(rng.integers(len(words))), []
        for _ in range(300):
            out.append(words[w])
            w = int(succ[w, rng.integers(3)])
        (d / f"doc{k}.txt").write_text(" ".join(out))
    return str(d)


def train(run_dir, docs, data_dir, *args):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *FLAGS, f"--data={docs}",
                        f"--data_dir={data_dir}", f"--run_dir={run_dir}", *args],
                       capture_output=True, text=True, env=env(), timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]


def compare(a, b, docs, data_dir, out):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), f"--compare={a},{b}", f"--heldout={docs}",
                        f"--eval_data_dir={data_dir}", "--eval_seq_len=64", "--eval_batch_size=4",
                        "--max_eval_batches=8", f"--out={out}"],
                       capture_output=True, text=True, env=env(), timeout=900)
    with open(os.path.join(out, "report.csv")) as f:
        rows = list(csv.DictReader(f))
    return p, rows


@pytest.mark.slow
def test_clean_seed_pair_never_flagged_memorizer_flagged_at_every_step(tmp_path):
    clean = write_docs(tmp_path / "docs", 150, seed=0)
    few = write_docs(tmp_path / "few", 2, seed=99)  # ~1,200 tokens: 20 epochs in 100 steps
    data_dir = tmp_path / "data"
    train(tmp_path / "a", clean, data_dir, "--seed=1")
    train(tmp_path / "b", clean, data_dir, "--seed=2")
    train(tmp_path / "m", few, tmp_path / "data_few", "--seed=1")

    p, rows = compare(tmp_path / "a", tmp_path / "b", clean, data_dir, tmp_path / "ab")
    for r in rows:
        print("seed pair", {k: r[k] for k in ("step", "train_delta", "heldout_delta", "train_band", "gap_band", "flag")})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert [r["step"] for r in rows] == ["50", "100"] and not any(r["flag"] for r in rows)
    assert all(float(r["train_band"]) > 0 and float(r["gap_band"]) > 0 for r in rows)

    p, rows = compare(tmp_path / "a", tmp_path / "m", clean, data_dir, tmp_path / "am")
    for r in rows:
        print("memorizer", {k: r[k] for k in ("step", "train_delta", "heldout_delta", "train_band", "gap_band", "flag")})
    assert p.returncode == 2 and "memorization signature" in p.stdout
    assert [r["step"] for r in rows] == ["50", "100"] and all("memorization signature" in r["flag"] for r in rows)


def test_noise_bands_against_direct_formulas():
    """train_loss_se: residual std about a least-squares line (numpy lstsq), ddof 2, over sqrt(n);
    paired_se: statistics.stdev of the per-batch differences over sqrt(n); the verdict's edges.
    Steps whose lines logged no training loss (evaluation only: read_metrics keeps them as {}) are
    not points of the line."""
    import math
    import statistics

    from olmo3 import comparison
    rng = np.random.default_rng(0)
    metrics = {s: {"train/loss": 5.0 - 0.01 * s + 0.05 * rng.normal()} for s in range(1, 41)}
    metrics[24] = metrics[33] = {}
    x = np.array([s for s in range(21, 41) if s not in (24, 33)], np.float64)
    y = np.array([metrics[s]["train/loss"] for s in x.astype(int)])
    coef, *_ = np.linalg.lstsq(np.stack([x, np.ones_like(x)], 1), y, rcond=None)
    r = y - (coef[0] * x + coef[1])
    assert comparison.train_loss_se(metrics, 40, 20) == pytest.approx(math.sqrt((r @ r) / 16) / math.sqrt(18))
    a, b = rng.normal(3, 0.1, 8), rng.normal(3, 0.1, 8)
    assert comparison.paired_se(a, b) == pytest.approx(statistics.stdev(b - a) / math.sqrt(8))
    assert math.isnan(comparison.train_loss_se(metrics, 2, 20)) and math.isnan(comparison.paired_se([1.0], [2.0]))
    # gap band 3 * hypot(0.03, 0.04) = 0.15; train band 0.09
    kw = dict(train_se=0.03, heldout_se=0.04)
    assert comparison.verdict(-0.10, 0.06, **kw)             # gap -0.16: flagged
    assert not comparison.verdict(-0.10, 0.04, **kw)         # gap -0.14: inside the band
    assert not comparison.verdict(0.10, 0.30, **kw)          # training loss worse beyond its band
    assert not comparison.verdict(-0.50, -0.45, **kw)        # both improved alike: a better run, not memorization
    assert not comparison.verdict(-0.10, 0.06, tol=0.2, **kw)  # --tol is a floor


def test_window_mean_train_band_edge_and_steps_both_runs_saved(monkeypatch):
    """train_loss_at: the plain mean over the logged steps in (step - window, step]; the verdict
    still flags a training loss a little worse (inside its band) whose gap is beyond the gap's
    band; iter_steps: the steps both runs saved, a note naming those only one saved, and explicit
    steps one run lacks refused."""
    from olmo3 import comparison
    metrics = {s: {"train/loss": float(s * s)} for s in range(1, 31) if s != 25}
    metrics[25] = {}   # a line with no training loss (read_metrics(keys=("train/loss",)) of an evaluation's)
    metrics[26]["other"] = 1.0
    assert comparison.train_loss_at(metrics, 30, 10) == pytest.approx(np.mean([s * s for s in range(21, 31) if s != 25]))
    assert comparison.train_loss_at(metrics, 20, 1) == 400.0
    with pytest.raises(ValueError, match=r"no train/loss logged in steps \(24, 25\]"):
        comparison.train_loss_at(metrics, 25, 1)
    kw = dict(train_se=0.03, heldout_se=0.04)   # train band 0.09, gap band 0.15
    assert comparison.verdict(0.05, 0.25, **kw)        # worse by 0.05 < 0.09, gap -0.20: flagged
    assert not comparison.verdict(0.10, 0.30, **kw)    # worse beyond the train band: not memorization

    class Manager:
        steps = {"a": [10, 20, 30, 40], "b": [20, 40, 50]}

        def __init__(self, run, read_only):
            self.run = run

        def all_steps(self):
            return self.steps[self.run]

        def close(self):
            pass
    monkeypatch.setattr(comparison.checkpoint, "CheckpointManager", Manager)
    assert comparison.iter_steps("a", "b") == ([20, 40], ["Steps saved by only one run (not compared): [10, 30, 50]"])
    assert comparison.iter_steps("a", "b", [40, 20, 20]) == ([20, 40], [])
    with pytest.raises(FileNotFoundError, match=r"run b has no checkpoint for step\(s\) \[30\]"):
        comparison.iter_steps("a", "b", [20, 30])
    Manager.steps["b"] = [40]
    assert comparison.iter_steps("a", "b") == ([40], ["Steps saved by only one run (not compared): [10, 20, 30]"])
