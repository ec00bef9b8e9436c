"""train.py --stage=dpo end to end: exact resume mid-DPO (interrupted + resumed == uninterrupted,
bit for bit), and a reference cache made for another reference refused with one line, exit 2.
(No held-out pairs here: their evaluation would add a compile to every run; the README's
evidence run exercises them.)"""
import json
import os
import random
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--flagfile=" + os.path.join(ROOT, "tiny.flags"), "--stage=dpo", "--d_model=32", "--n_heads=2",
         "--n_kv_heads=2", "--head_dim=16", "--mlp_hidden=64", "--seq_len=64", "--global_batch=4", "--window=16",
         "--loss_chunk=128", "--epochs=1", "--warmup_fraction=0.1", "--lr=1e-3", "--weight_decay=0",
         "--skip_steps=false", "--z_loss=0", "--eval_interval=100", "--loader_workers=1"]


def pair_jsonl(path, n, seed):
    rng = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    with open(path, "w") as f:
        for _ in range(n):
            prompt = " ".join(rng.choice(words) for _ in range(4))
            conv = lambda a: [{"role": "user", "content": prompt}, {"role": "assistant", "content": a}]  # noqa: E731
            f.write(json.dumps({"chosen": conv(prompt.upper()),
                                "rejected": conv(" ".join(rng.choice(words) for _ in range(4)))}) + "\n")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    from data.prepare_dpo import prepare_dpo
    d = tmp_path_factory.mktemp("pairs")
    for split, n in (("train", 24),):
        pair_jsonl(d / f"{split}.jsonl", n, seed=len(split))
        prepare_dpo(str(d / f"{split}.jsonl"), str(d / split), "olmo_thinker", max_seq_length=64)
    return d


def run(args, run_dir, pairs, check=True):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update({"JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT})
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *SMALL, f"--data={pairs / 'train'}",
           f"--run_dir={run_dir}", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"train.py failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return p


def metrics(run_dir):
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            m = json.loads(line)
            out[m["step"]] = {k: v for k, v in m.items() if k.startswith(("train/", "eval/", "optim/"))}
    return out


def test_dpo_resume_is_bit_exact_and_reference_is_checked(pairs, tmp_path):
    a = tmp_path / "a"
    run(["--max_steps=3", "--save_interval=1", "--keep_checkpoints=5"], a, pairs)
    full = metrics(a)
    assert set(full) == {1, 2, 3}
    assert full[1]["train/loss"] == pytest.approx(0.6931472, abs=1e-6)   # policy == reference at step 1
    assert full[1]["train/rewards/margin"] == 0.0 and full[3]["train/rewards/margin"] > 0
    # Interrupted after step 1: a run directory holding only checkpoint 1, resumed to step 3.
    b = tmp_path / "b"
    (b / "checkpoints").mkdir(parents=True)
    shutil.copytree(a / "checkpoints" / "1", b / "checkpoints" / "1")
    run(["--max_steps=3", "--save_interval=1", "--resume"], b, pairs)
    resumed = metrics(b)
    assert set(resumed) == {2, 3}
    for step in (2, 3):
        assert resumed[step] == full[step], step        # every train/eval metric, exactly

    # The cache beside the pairs belongs to run a's reference; another reference is refused.
    p = run(["--max_steps=1", "--model_seed=1"], tmp_path / "c", pairs, check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert "reference_logps.npz" in last and "delete it" in last and "Traceback" not in p.stderr
    # A resumed run whose cache went missing cannot recompute it: one line, exit 2.
    os.remove(pairs / "train" / "reference_logps.npz")
    p = run(["--max_steps=3", "--resume"], b, pairs, check=False)
    assert p.returncode == 2 and "is missing" in p.stderr.strip().splitlines()[-1]
