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

from test_train import metrics_by_step  # noqa: E402

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
    """step -> its train/eval/optim metrics (timings left out: they differ between runs)."""
    return {step: {k: v for k, v in m.items() if k.startswith(("train/", "eval/", "optim/"))}
            for step, m in metrics_by_step(run_dir).items()}


def test_bf16_and_float8_first_step_is_log_2(pairs, tmp_path):
    """The DPO recipe computes in bf16 (dpo_*.flags): at step 1 the policy is its reference, so
    the loss is log 2 and the margin 0, with float8 linears too. On a CPU train.py handed bf16
    dots to YNNPACK (olmo3/runtime.py), whose results differ between the reference's forward-only
    program and the training step: the loss was 0.69431 and the margin -0.0023."""
    run(["--max_steps=1", "--save_interval=1", "--compute_dtype=bfloat16", "--float8",
         f"--reference_cache={tmp_path / 'ref.npz'}"], tmp_path / "run", pairs)
    m = metrics(tmp_path / "run")
    assert m[1]["train/loss"] == pytest.approx(0.6931472, abs=1e-6) and m[1]["train/rewards/margin"] == 0.0, m[1]
    # MFU's numerator: every token of both sides of each pair (4 pairs of 2 x 64 tokens), at the
    # checkpoint's model's FLOPs per token, in either convention (olmo3.Config.train_flops_per_token).
    from olmo3.checkpoint import CheckpointManager
    from olmo3.config import config_from_dict
    mgr = CheckpointManager(str(tmp_path / "run"), read_only=True)
    config = config_from_dict(mgr.read_extra(1)["model_config"])
    perf = metrics_by_step(tmp_path / "run")[1]
    for c in ("writeup", "sliding"):
        assert perf[f"perf/tflops_per_s_{c}"] * perf["perf/step_time_s"] * 1e12 == pytest.approx(
            config.train_flops_per_token(64, c) * 4 * 2 * 64, rel=1e-6), c


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

    # --dpo_beta scales every reward (olmo3/dpo.py: beta x the log-ratio). Step 1's update is Adam's first,
    # g / |g| whatever beta scales g by, so at step 2 a run with beta 10 has twice run a's margin.
    run(["--max_steps=2", "--save_interval=2", "--dpo_beta=10"], tmp_path / "beta10", pairs)
    assert metrics(tmp_path / "beta10")[2]["train/rewards/margin"] == pytest.approx(
        2 * full[2]["train/rewards/margin"], rel=1e-3)
    # DPO starts Adam fresh from --init_from (open-instruct loads weights only), even from a checkpoint that
    # holds moments (this DPO one): count 1 at its first step, the policy its own reference (loss log 2).
    run(["--max_steps=1", "--save_interval=1", f"--init_from={a / 'checkpoints' / '1'}",
         f"--reference_cache={tmp_path / 'ref_from_1.npz'}"], tmp_path / "from1", pairs)
    first = metrics(tmp_path / "from1")[1]
    assert first["optim/adam_count"] == 1.0 and first["train/loss"] == pytest.approx(0.6931472, abs=1e-6), first

    # The objective is part of the run: a resume with another loss or beta stops, naming the flag.
    for flag, saved in (("--dpo_beta=0.1", "--dpo_beta=5.0"), ("--dpo_loss=dpo", "--dpo_loss=dpo_norm")):
        p = run(["--max_steps=4", "--resume", flag], b, pairs, check=False)
        assert p.returncode == 2 and f"trained with {saved}" in p.stderr.strip().splitlines()[-1], p.stderr[-2000:]
    # So is its precision; the fix is a new DPO run from the same reference, not from this
    # checkpoint (as --init_from it would be that run's reference).
    p = run(["--max_steps=4", "--resume", "--compute_dtype=bfloat16"], b, pairs, check=False)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and "trained with --compute_dtype=float32 --nofloat8" in last, p.stderr[-2000:]
    assert "from the same --init_from" in last and "<this checkpoint>" not in last, last

    # The cache beside the pairs belongs to run a's reference; another reference is refused.
    p = run(["--max_steps=1", "--model_seed=1"], tmp_path / "c", pairs, check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert "reference_logps.npz" in last and "delete it" in last and "Traceback" not in p.stderr
    # A resumed run whose cache went missing cannot recompute it: one line, exit 2.
    os.remove(pairs / "train" / "reference_logps.npz")
    p = run(["--max_steps=3", "--resume"], b, pairs, check=False)
    assert p.returncode == 2 and "is missing" in p.stderr.strip().splitlines()[-1]


def test_dpo_heldout_names(pairs, tmp_path):
    """A held-out set in a folder named `train` is scored against its own reference log-probs and
    leaves the training pairs' alone (step 1: policy == reference, loss log 2); two held-out sets
    with one folder name would log as one: refused, one line, exit 2."""
    from data.prepare_dpo import prepare_dpo
    other = tmp_path / "other"
    other.mkdir()
    pair_jsonl(other / "pairs.jsonl", 8, seed=7)
    prepare_dpo(str(other / "pairs.jsonl"), str(other / "train"), "olmo_thinker", max_seq_length=64)
    a = tmp_path / "a"
    run(["--max_steps=1", f"--dpo_heldout={other / 'train'}", "--eval_at_start"], a, pairs)
    m = metrics(a)
    assert m[1]["train/loss"] == pytest.approx(0.6931472, abs=1e-6) and m[1]["train/rewards/margin"] == 0.0
    assert m[0]["eval/train/loss"] == pytest.approx(0.6931472, abs=1e-6)   # the held-out pairs, their own reference
    p = run(["--max_steps=1", f"--dpo_heldout={other / 'train'},{pairs / 'train'}"], tmp_path / "b", pairs,
            check=False)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and "both named 'train'" in last and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_stale_heldout_reference_cache_stops_before_any_reference_pass(pairs, tmp_path):
    """A held-out set's cache made for another reference (README: the pairs copied once per
    reference) stops the run before the reference pass over the training pairs, and its line names
    the fix that applies to it: --reference_cache moves only the training pairs' cache, so advising
    it sent a user through a whole training-set reference pass into the same error."""
    import numpy as np

    from data.prepare_dpo import prepare_dpo
    from olmo3 import reference
    other = tmp_path / "other"
    other.mkdir()
    pair_jsonl(other / "pairs.jsonl", 8, seed=7)
    prepare_dpo(str(other / "pairs.jsonl"), str(other / "heldout"), "olmo_thinker", max_seq_length=64)
    stale = reference.default_path(str(other / "heldout"))
    reference.write(stale, "0" * 64, np.zeros((8, 2)), np.ones((8, 2)))   # another reference's cache
    moved = tmp_path / "train_ref.npz"
    p = run(["--max_steps=1", f"--dpo_heldout={other / 'heldout'}", f"--reference_cache={moved}"],
            tmp_path / "a", pairs, check=False)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert stale in last and "--dpo_heldout" in last and "pass --reference_cache" not in last, last
    assert not moved.exists()   # no reference pass over the training pairs before the refusal


_PARSE = """
import json, sys
import train
F = train.F
F(["train.py", "--flagfile=" + sys.argv[1]])
print(json.dumps({k: getattr(F, k) for k in ("stage", "model", "yarn", "seq_len", "global_batch", "micro_batch", "lr",
                  "schedule", "warmup_fraction", "epochs", "weight_decay", "b1", "b2", "eps", "max_grad_norm",
                  "z_loss", "skip_steps", "dpo_loss", "dpo_beta", "seed")}))
"""


@pytest.mark.parametrize("name,lr", [("dpo_instruct", 1e-6), ("dpo_think", 8e-8)])
def test_dpo_flagfiles_hold_the_recipe(name, lr):
    """open-instruct 7b_{instruct,think}_dpo.sh (3af17aacf): dpo_norm, beta 5, LR, linear with 10% warmup,
    wd 0, 1 epoch, seq 16,384, 4 nodes x 8 GPUs x 1 pair x 4 accumulation steps = 128 pairs."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-c", _PARSE, f"{ROOT}/{name}.flags"], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    F = json.loads(p.stdout.strip().splitlines()[-1])
    assert (F["stage"], F["dpo_loss"], F["dpo_beta"], F["lr"]) == ("dpo", "dpo_norm", 5.0, lr)
    assert (F["schedule"], F["warmup_fraction"], F["epochs"], F["weight_decay"]) == ("linear", 0.1, 1, 0.0)
    assert (F["seq_len"], F["global_batch"], F["micro_batch"]) == (16384, 128, 1)
    assert (F["b1"], F["b2"], F["eps"], F["max_grad_norm"]) == (0.9, 0.999, 1e-8, 1.0)   # torch AdamW defaults
    assert (F["z_loss"], F["skip_steps"], F["model"], F["yarn"]) == (0.0, False, "olmo3_7b_long", True)
    assert F["seed"] == 42   # dpo_tune_cache.py's --seed default (the data order)
