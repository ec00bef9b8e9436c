"""Stage 3's long-context evidence on CPU: the tiny chain's flagfiles (tiny.flags -> tiny_stage2.flags
-> tiny_stage3.flags) follow the 7B recipe's structure, and the held-out loss by position bucket
(olmo3.heldout.by_position, eval.py --position_buckets) equals a numpy cross entropy computed from
full-sequence logits, bucket by bucket, and the training loss function's total when weighted."""
import json
import math
import os
import subprocess
import sys
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import data
import olmo3
from olmo3 import heldout
from olmo3.step import eval_loss
from oracles import log_softmax64

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = olmo3.Config(vocab_size=512, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8,
                   mlp_hidden=64, window=7, max_position_embeddings=512, init_std=0.2)
EOS, PAD = 1, 0

_PARSE = """
import json, sys
import train
F = train.F
out = {}
for path in sys.argv[1:]:
    F.unparse_flags()
    F(["train.py", "--flagfile=" + path])
    out[path] = {k: getattr(F, k) for k in ("stage", "model", "d_model", "n_layers", "n_heads", "n_kv_heads",
                 "head_dim", "mlp_hidden", "window", "data", "seq_len", "global_batch", "seed", "lr", "schedule",
                 "warmup_steps", "total_steps", "final_lr_ratio", "yarn", "yarn_factor", "yarn_original_max_position",
                 "packed", "doc_lengths", "source_group_size", "source_permutation_seed", "eval_padded",
                 "init_from", "init_weights_only", "run_dir", "weight_decay", "b1", "b2", "eps", "max_grad_norm",
                 "z_loss", "skip_steps")}
print(json.dumps(out))
"""


def parse(*names):
    """train.py's own flags on the flagfiles, in a fresh process (absl flags are process-global)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-c", _PARSE, *names], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    return [types.SimpleNamespace(**got[n]) for n in names]


def test_tiny_chain_flags_follow_the_recipe():
    s1, s2, s3, r1, r2, r3 = parse("tiny.flags", "tiny_stage2.flags", "tiny_stage3.flags", "stage1.flags",
                                   "stage2.flags", "stage3.flags")
    arch = ("model", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_hidden", "window", "data")
    for s in (s2, s3):  # the same model restored from the previous stage, on the same corpus
        assert [getattr(s, k) for k in arch] == [getattr(s1, k) for k in arch]
        # warm start: parameters and Adam moments from --init_from, given on the command line
        assert s.init_from is None and not s.init_weights_only
        assert s.schedule == "linear" and s.eval_padded
        assert [s.weight_decay, s.b1, s.b2, s.eps, s.max_grad_norm, s.z_loss, s.skip_steps] == \
            [s1.weight_decay, s1.b1, s1.b2, s1.eps, s1.max_grad_norm, s1.z_loss, s1.skip_steps]
    assert (s1.stage, s2.stage, s3.stage) == ("1", "2", "3")
    assert len({s1.run_dir, s2.run_dir, s3.run_dir}) == 3
    # stage 2 (stage2.flags): the same fraction of stage 1's peak lr (a jump up from where the cosine
    # ended), no warmup, half stage 1's tokens per step
    assert s2.lr / s1.lr == pytest.approx(r2.lr / r1.lr, rel=1e-3) and s2.warmup_steps == 0
    assert s2.lr > s1.lr * s1.final_lr_ratio and r2.lr > r1.lr * r1.final_lr_ratio
    assert s2.seq_len == s1.seq_len and s2.global_batch * s2.seq_len * 2 == s1.global_batch * s1.seq_len
    assert not s2.packed and not s2.yarn and s2.seed == 1337
    # stage 3 (stage3.flags): 4x the stage-1 length, YaRN over the old context, packed documents with
    # intra-document masking, stage 2's lr re-warmed, twice stage 2's tokens per step
    assert s3.seq_len == 4 * s1.seq_len
    assert s3.yarn and s3.yarn_factor == s3.seq_len / s1.seq_len and s3.yarn_original_max_position == s1.seq_len
    assert s3.packed and s3.doc_lengths
    assert (s3.source_group_size, s3.source_permutation_seed, s3.seed) == \
        (r3.source_group_size, r3.source_permutation_seed, r3.seed)
    assert s3.lr == s2.lr and 0 < s3.warmup_steps < s3.total_steps
    assert s3.global_batch * s3.seq_len == 2 * s2.global_batch * s2.seq_len
    # the 7B's own YaRN (OLMo-core L50: factor 8 over 8192) is train.py's default
    assert (r3.yarn_factor, r3.yarn_original_max_position) == (8.0, 8192)
    assert r3.seq_len == r3.yarn_factor * r3.yarn_original_max_position
    with open(os.path.join(ROOT, "tiny_stage3.flags")) as f:  # the chain a reader reruns
        text = f.read()
    for step in ("--flagfile=tiny.flags", "--flagfile=tiny_stage2.flags --init_from=",
                 "--flagfile=tiny_stage3.flags --init_from=", "--position_buckets="):
        assert step in text


def test_yarn_flags_decide_the_model_over_the_preset():
    """stage3.flags' preset (olmo3_7b_long) has YaRN; --noyarn removes it, --yarn_factor changes it,
    and stage 1 with the plain preset has none (train.model_config, the model train.py builds)."""
    code = """
import json, sys
import train
out = []
for args in json.loads(sys.argv[1]):
    train.F.unparse_flags()
    train.F(["train.py", *args])
    yarn = train.model_config().yarn
    out.append(None if yarn is None else [yarn.factor, yarn.original_max_position])
print(json.dumps(out))
"""
    cases = [["--flagfile=stage3.flags"], ["--flagfile=stage3.flags", "--noyarn"],
             ["--flagfile=stage3.flags", "--yarn_factor=4"], ["--flagfile=stage1.flags"]]
    p = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == [[8.0, 8192], None, [4.0, 8192], None]


def test_bucket_bounds():
    assert heldout.bucket_bounds(["0.25", "0.5", "1"], 1024) == (0, 256, 512, 1024)
    assert heldout.bucket_bounds([1], 64) == (0, 64)
    for bad in ([0.5, 0.25, 1], [0.25, 0.5], [0.0, 1], [0.3, 1]):  # not increasing, not ending at 1, 0.3 * 64
        with pytest.raises(ValueError, match="position buckets"):
            heldout.bucket_bounds(bad, 64)
    # whole edges that floating point writes as 55.00000000000001 or 196.00000000000003
    assert heldout.bucket_bounds(["0.55", "1"], 100) == (0, 55, 100)
    assert heldout.bucket_bounds(["0.07", "0.14", "0.28", "1"], 700) == (0, 49, 98, 196, 700)
    # ... and as 28.999999999999996 (0.29 x 100): rounded, not cut to 28
    assert 0.29 * 100 < 29 and heldout.bucket_bounds(["0.29", "1"], 100) == (0, 29, 100)
    with pytest.raises(ValueError, match="increasing fractions"):
        heldout.bucket_bounds(["0.5", "nan", "1"], 64)


def test_ratio_se_equals_standard_error_of_the_mean_for_equal_rows():
    x = np.random.default_rng(0).normal(2.0, 0.5, size=40)
    n = np.full(40, 7.0)  # equal denominators: the ratio is the mean of x / 7
    assert heldout.ratio_se(x, n) == pytest.approx(np.std(x / 7, ddof=1) / math.sqrt(40), rel=1e-12)
    assert math.isnan(heldout.ratio_se(x[:1], n[:1]))


@pytest.mark.parametrize("args, message", [
    (["--position_buckets=0.3,1", "--eval_seq_len=64"], "position buckets"),
    (["--yarn", "--yarn_factor=4"], "--yarn needs --yarn_factor and --yarn_original_max_position"),
])
def test_eval_bad_long_context_flags(tmp_path, args, message):
    """One line naming the flag, exit status 2, before any checkpoint is read."""
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), f"--model={tmp_path / 'none'}", *args],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert message in p.stderr.strip().splitlines()[-1]


def test_eval_attention_flag_scores_as_xla(tmp_path):
    """eval.py --attention=splash (what the xla kernel's refusal above 16,384 tokens of full
    attention asks for: stage 3 evaluates at 65,536) loads the model with that kernel, and its
    held-out loss equals the default xla one on a YaRN model (the Splash kernel interpreted)."""
    from olmo3 import hf
    model = olmo3.OLMo3(CFG.replace(yarn=olmo3.YaRN(factor=4.0, original_max_position=8)), jax.random.key(5))
    hf.to_hf(model, str(tmp_path / "hf"))
    path, _ = _documents(tmp_path, [40, 5, 32, 17, 9, 70, 25], seed=5)
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    losses = {}
    for kernel in ("xla", "splash"):
        out = tmp_path / kernel
        p = subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), f"--model={tmp_path / 'hf'}",
                            f"--heldout=docs={path}", "--eval_seq_len=32",
                            "--eval_batch_size=2", "--max_eval_batches=1", f"--attention={kernel}", f"--out={out}"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        with open(out / "eval.json") as f:
            losses[kernel] = json.load(f)["eval/all/loss"]
    assert losses["splash"] == pytest.approx(losses["xla"], rel=1e-5)


def _documents(tmp_path, lengths, seed):
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(2, 512, size=n - 1), EOS) for n in lengths]
    path = str(tmp_path / f"h{seed}.npy")
    np.concatenate(docs).astype(np.uint32).tofile(path)
    return path, docs


def test_by_position_equals_numpy_oracle_and_training_loss(tmp_path):
    """Padded documents (shorter and longer than the sequence) scored from their first token:
    each bucket's CE sum equals -log softmax of a full forward over the document alone, the
    buckets add up to eval_loss (the training loss function) on the same batches, and the
    filler rows of the last batch count nothing."""
    model = olmo3.OLMo3(CFG.replace(yarn=olmo3.YaRN(factor=4.0, original_max_position=8)), jax.random.key(3))
    seq = 32
    path, docs = _documents(tmp_path, [40, 5, 32, 17, 9, 70, 25], seed=0)
    ds = data.PaddedFSLDataset([path], seq, vocab_size=512, eos_id=EOS, pad_id=PAD)
    bounds = heldout.bucket_bounds([0.25, 0.5, 1], seq)
    lengths = np.arange(512) % 3  # any per-token byte counts
    got = heldout.by_position(model, ds, bounds, batch_size=4, byte_lengths=lengths)
    assert got["rows"] == len(docs) and got["ce"].shape == (len(docs), 3)

    fwd = eqx.filter_jit(lambda m, t: m(t))
    ce = np.zeros((len(docs), 3))
    n = np.zeros((len(docs), 3))
    nb = np.zeros((len(docs), 3))
    for i, doc in enumerate(docs):
        doc = doc[:seq]  # a padded instance is the document truncated to seq_len
        padded = np.zeros(seq, np.int32)  # one jit shape; tokens after the document cannot change causal logits
        padded[:len(doc)] = doc
        lp = log_softmax64(fwd(model, jnp.asarray(padded)))
        for t in range(len(doc) - 1):  # position t predicts doc[t + 1]
            k = np.searchsorted(bounds, t, side="right") - 1
            ce[i, k] -= lp[t, doc[t + 1]]
            n[i, k] += 1
            nb[i, k] += lengths[doc[t + 1]]
    np.testing.assert_allclose(got["ce"], ce, rtol=2e-5, atol=1e-4)
    np.testing.assert_array_equal(got["tokens"], n)
    np.testing.assert_array_equal(got["bytes"], nb)
    np.testing.assert_allclose(got["loss"], ce.sum(0) / n.sum(0), rtol=2e-5)
    np.testing.assert_allclose(got["bpb"], ce.sum(0) / (math.log(2) * nb.sum(0)), rtol=2e-5)

    total_ce = total_n = 0.0  # the training loss function over the same padded batches
    for b in range(2):
        rows = data.get_eval_batch(ds, 4, b)
        batch = {k: jnp.asarray(v) for k, v in rows.items() if k != "step"}
        s, c = eval_loss(model, batch, chunk=64, use_segments=True)
        total_ce, total_n = total_ce + float(s), total_n + float(c)
    assert got["tokens"].sum() == total_n
    np.testing.assert_allclose((got["loss"] * got["tokens"].sum(0)).sum() / total_n, total_ce / total_n, rtol=1e-5)


def test_by_position_on_fixed_length_instances_adds_up_to_heldout(tmp_path):
    model = olmo3.OLMo3(CFG, jax.random.key(4))
    rows = np.random.default_rng(4).integers(2, 512, size=(16, 24))
    path = str(tmp_path / "f.npy")
    rows.astype(np.uint32).tofile(path)
    ds = data.FSLDataset(path, 24, vocab_size=512)
    ref = heldout.heldout(model, ds, batch_size=8, max_batches=2)
    got = heldout.by_position(model, ds, heldout.bucket_bounds([0.5, 1], 24), batch_size=8, max_batches=2,
                              use_segments=False)
    assert got["tokens"].sum() == ref["tokens"] == 16 * 23
    np.testing.assert_allclose(got["ce"].sum(), ref["ce_sum"], rtol=1e-5)
    with pytest.raises(ValueError, match="must end at the sequence length"):
        heldout.by_position(model, ds, (0, 8, 16), batch_size=8)


def test_eval_position_report_and_paired_deltas(tmp_path):
    """eval.py's report: per-domain and pooled buckets from the per-document sums, and B - A
    deltas whose paired standard error is that of the per-document differences."""
    from test_eval import eval_script as ev   # one eval.py per process: absl flags are global
    path_a, _ = _documents(tmp_path, [40, 12, 33, 20], seed=1)
    path_b, _ = _documents(tmp_path, [8, 50, 31], seed=2)
    sets = {d: data.PaddedFSLDataset([p], 32, vocab_size=512, eos_id=EOS, pad_id=PAD)
            for d, p in (("x", path_a), ("y", path_b))}
    ma, mb = olmo3.OLMo3(CFG, jax.random.key(5)), olmo3.OLMo3(CFG, jax.random.key(6))
    rows_a, rows_b = {}, {}
    ra = ev.position_report(ma, sets, [0.5, 1], batch_size=2, max_batches=8, rows=rows_a)
    ev.position_report(mb, sets, [0.5, 1], batch_size=2, max_batches=8, rows=rows_b)
    assert ra["pos/x/documents"] == 4 and ra["pos/y/documents"] == 3 and ra["pos/all/documents"] == 7
    ce = np.concatenate([rows_a["x"]["ce"], rows_a["y"]["ce"]])
    n = np.concatenate([rows_a["x"]["tokens"], rows_a["y"]["tokens"]])
    assert ra["pos/all/16-32/loss"] == pytest.approx(ce[:, 1].sum() / n[:, 1].sum())
    assert ra["pos/x/0-16/loss"] == pytest.approx(rows_a["x"]["loss"][0])
    nb = np.concatenate([rows_a["x"]["bytes"], rows_a["y"]["bytes"]])   # by_position's: the numpy oracle's above
    assert ra["pos/all/16-32/bpb"] == pytest.approx(ce[:, 1].sum() / (math.log(2) * nb[:, 1].sum()))
    assert ra["pos/x/0-16/bpb"] == pytest.approx(rows_a["x"]["bpb"][0])
    for k, bucket in enumerate(("0-16", "16-32")):   # se over the documents that reach the bucket (7, then 5)
        reach = n[:, k] > 0
        c, t = ce[reach, k], n[reach, k]
        z = (c - c.sum() / t.sum() * t) / t.mean()   # the ratio's linearisation: mean of z is 0
        assert ra[f"pos/all/{bucket}/se"] == pytest.approx(np.std(z, ddof=1) / math.sqrt(reach.sum()), rel=1e-9)
    assert (n[:, 1] > 0).sum() == 5
    d = ev.position_deltas(rows_a, rows_b)
    ce_b = np.concatenate([rows_b["x"]["ce"], rows_b["y"]["ce"]])
    diff = (ce_b[:, 0] - ce[:, 0])
    assert d["pos/all/0-16/loss_delta"] == pytest.approx(diff.sum() / n[:, 0].sum())
    assert d["pos/all/0-16/loss_delta_se"] == pytest.approx(heldout.ratio_se(diff, n[:, 0]))
    # each bucket says how many documents reach it: the 12- and 8-token ones end inside 0-16
    assert [ra[f"pos/{k}/16-32/documents"] for k in "xy"] == [3, 2] and ra["pos/all/0-16/documents"] == 7


def test_a_bucket_no_document_reaches_is_nan_not_zero(tmp_path):
    from test_eval import eval_script as ev
    path, _ = _documents(tmp_path, [5, 6, 7], seed=3)
    sets = {"s": data.PaddedFSLDataset([path], 32, vocab_size=512, eos_id=EOS, pad_id=PAD)}
    ma, mb = olmo3.OLMo3(CFG, jax.random.key(5)), olmo3.OLMo3(CFG, jax.random.key(6))
    rows_a, rows_b = {}, {}
    r = ev.position_report(ma, sets, [0.25, 0.5, 1], batch_size=2, max_batches=8, rows=rows_a)
    ev.position_report(mb, sets, [0.25, 0.5, 1], batch_size=2, max_batches=8, rows=rows_b)
    d = ev.position_deltas(rows_a, rows_b)
    assert r["pos/s/0-8/loss"] > 0 and r["pos/s/0-8/documents"] == 3
    for key in ("pos/s/8-16", "pos/s/16-32", "pos/all/16-32"):
        assert np.isnan(r[f"{key}/loss"]) and np.isnan(r[f"{key}/bpb"]) and np.isnan(d[f"{key}/loss_delta"])
        assert r[f"{key}/documents"] == 0
    assert np.isnan(rows_a["s"]["loss"][1:]).all() and np.isfinite(rows_a["s"]["loss"][0])


@pytest.mark.slow  # four train.py / eval.py processes: a few minutes on 2 cores
def test_tiny_chain_end_to_end(tmp_path):
    """The README's chain, shrunk (a smaller model, 1/8 of the sequence lengths, a few steps):
    stage 1 -> warm stage-2 anneal -> stage 3 at 4x the length with YaRN and packed documents ->
    eval.py's position buckets before (stage 2) and after (stage 3)."""
    from test_train import word_corpus
    (tmp_path / "docs").mkdir()
    docs = word_corpus(tmp_path / "docs")
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    shrink = ["--d_model=32", "--n_heads=2", "--n_kv_heads=2", "--head_dim=16", "--mlp_hidden=64", "--window=8",
              f"--data={docs}", f"--data_dir={tmp_path / 'data'}", "--eval_batches=1", "--loss_chunk=128"]

    def run(script, *args):
        p = subprocess.run([sys.executable, os.path.join(ROOT, script), *args], capture_output=True, text=True,
                           env=env, cwd=ROOT, timeout=900)
        assert p.returncode == 0, p.stderr[-4000:]
        return p

    s1, s2, s3 = (str(tmp_path / n) for n in ("s1", "s2", "s3"))
    run("train.py", "--flagfile=tiny.flags", *shrink, "--seq_len=32", "--total_steps=6", "--warmup_steps=2",
        "--save_interval=6", f"--run_dir={s1}")
    run("train.py", "--flagfile=tiny_stage2.flags", *shrink, "--total_steps=3", "--save_interval=3",
        "--seq_len=32", f"--init_from={s1}/checkpoints/6", f"--run_dir={s2}")
    p = run("train.py", "--flagfile=tiny_stage3.flags", *shrink, "--seq_len=128", "--yarn_original_max_position=32",
            "--total_steps=3", "--warmup_steps=1", "--save_interval=3", f"--init_from={s2}/checkpoints/3",
            f"--run_dir={s3}")
    assert "Warm start (params + Adam moments)" in p.stderr and "Packed PackedFSLDataset" in p.stderr
    from olmo3.checkpoint import CheckpointManager
    yarn = CheckpointManager(s3, read_only=True).read_extra(3)["model_config"]["yarn"]  # YaRN 4 over 32
    assert (yarn["factor"], yarn["original_max_position"]) == (4.0, 32)
    out = tmp_path / "eval"
    run("eval.py", f"--model={s2}", f"--model_b={s3}", f"--heldout={docs}", f"--eval_data_dir={tmp_path / 'data'}",
        "--eval_seq_len=128", "--position_buckets=0.25,0.5,1", "--eval_batch_size=2", "--max_eval_batches=2",
        f"--out={out}")
    with open(out / "eval.json") as f:
        r = json.load(f)
    for lo, hi in ((0, 32), (32, 64), (64, 128)):
        for k in ("loss", "se", "bpb", "loss_delta", "loss_delta_se"):
            assert math.isfinite(r[f"pos/all/{lo}-{hi}/{k}"]), (lo, hi, k)
