"""eval.py and its machinery (olmo3/heldout.py, scoring.py, comparison.py, load.py) against independent references: a numpy cross entropy and the
training step for held-out loss, full forwards for the KV cache, hand-built prompts for few-shot
scoring, lm-eval-harness's own evaluator for the adapter, and two tiny runs (one on a heavily
repeated stream) for the step-aligned comparison."""
import importlib.util
import json
import math
import os
import re
from types import SimpleNamespace

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import app

import data
import olmo3
from olmo3 import heldout, hf, load, optim, schedules, scoring
from olmo3.config import config_to_dict
from olmo3.checkpoint import CheckpointManager
from olmo3.step import make_train_step
from oracles import log_softmax64
from test_context import random_score_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
spec = importlib.util.spec_from_file_location("eval_script", os.path.join(ROOT, "eval.py"))
eval_script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(eval_script)

CFG = olmo3.Config(vocab_size=512, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8,
                   mlp_hidden=64, window=7, max_position_embeddings=512, init_std=0.2)


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, end of text 256 (fits the tiny vocabulary)."""
    eot_token = 256

    def encode(self, s):
        return list(s.encode())

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode(errors="replace")


_FWD = eqx.filter_jit(lambda m, t: m(t))


def forward(model, seq, pad=64):
    """Full-sequence logits, right-padded to one jit shape (padding after the last token cannot
    change causal logits)."""
    n = len(seq)
    padded = np.zeros(max(pad, n), np.int32)
    padded[:n] = seq
    return np.asarray(_FWD(model, jnp.asarray(padded)))[:n]


def token_file(path, rows):
    np.asarray(rows, np.uint32).tofile(path)
    return str(path)


# ---- held-out loss ------------------------------------------------------------------------------
def test_heldout_equals_training_loss_and_numpy_oracle(tmp_path):
    model = olmo3.OLMo3(CFG, jax.random.key(0))
    rows = np.random.default_rng(0).integers(0, 500, size=(24, 33))
    rows[:, 10] = data.EOS_ID % 512  # any id; bpb must count real bytes of each target token
    ds = data.FSLDataset(token_file(tmp_path / "h.npy", rows), 33, vocab_size=512)
    lengths = heldout.token_byte_lengths(512)
    got = heldout.heldout(model, ds, batch_size=8, max_batches=2, byte_lengths=lengths)
    assert got["batches"] == 2 and got["tokens"] == 2 * 8 * 32

    ce, n, nbytes = 0.0, 0, 0
    enc = data.dolma2()
    for b in range(2):  # the same fixed batches (seed 0) train.py's in-run evaluation reads
        tokens = data.get_batch(ds, 8, 0, b)["tokens"]
        lp = log_softmax64(np.stack([forward(model, r) for r in tokens]))
        ce -= np.take_along_axis(lp[:, :-1], tokens[:, 1:, None], -1).sum()
        n += tokens[:, 1:].size
        nbytes += sum(len(enc.decode_single_token_bytes(int(t))) for t in tokens[:, 1:].ravel())
        if b == 0:  # the training step's own train/loss on batch 0, before its update
            step = make_train_step(optim.SkipStepAdamW(schedules.constant_schedule(1e-3)), chunk=64)
            batch = {k: jnp.asarray(v) for k, v in data.get_batch(ds, 8, 0, 0).items() if k != "step"}
            m0 = olmo3.OLMo3(CFG, jax.random.key(0))
            _, _, metrics = step(m0, optim.SkipStepAdamW(schedules.constant_schedule(1e-3)).init(m0), batch)
            one = heldout.heldout(model, ds, batch_size=8, max_batches=1)
            np.testing.assert_allclose(one["loss"], float(metrics["train/loss"]), rtol=1e-6)
    np.testing.assert_allclose(got["loss"], ce / n, rtol=1e-5)
    assert got["bytes"] == nbytes
    np.testing.assert_allclose(got["bpb"], ce / (math.log(2) * nbytes), rtol=1e-5)

    report = eval_script.heldout_report(model, {"a": ds, "b": ds}, batch_size=8, max_batches=2)
    np.testing.assert_allclose(report["eval/a/loss"], ce / n, rtol=1e-5)
    np.testing.assert_allclose(report["eval/all/loss"], ce / n, rtol=1e-5)
    # domains of different sizes pool token-weighted (not a mean of their losses), bpb in bits
    small = data.FSLDataset(token_file(tmp_path / "s.npy", rows[:8] // 2), 33, vocab_size=512)
    one = heldout.heldout(model, small, batch_size=8, byte_lengths=lengths)
    report = eval_script.heldout_report(model, {"a": ds, "b": small}, batch_size=8, max_batches=2)
    np.testing.assert_allclose(report["eval/b/bpb"], one["bpb"], rtol=1e-6)
    np.testing.assert_allclose(report["eval/all/loss"], (ce + one["ce_sum"]) / (n + one["tokens"]), rtol=1e-5)
    np.testing.assert_allclose(report["eval/all/bpb"], (ce + one["ce_sum"]) / (math.log(2) * (nbytes + one["bytes"])),
                               rtol=1e-5)


def test_heldout_of_a_smaller_vocabulary_with_a_part_filled_batch(tmp_path):
    """A last batch filled with dolma2's pad (100277) crashed bpb's byte lookup (IndexError) for a
    model of a smaller vocabulary (eval.py's held-out token files of another tokenizer) whenever
    a domain's windows do not fill whole batches. The five windows score as the numpy oracle."""
    model = olmo3.OLMo3(CFG, jax.random.key(0))
    rows = np.random.default_rng(1).integers(0, 500, size=(5, 17))
    ds = data.FSLDataset(token_file(tmp_path / "h.npy", rows), 17, vocab_size=512)
    lengths = heldout.token_byte_lengths(512)
    got = heldout.heldout(model, ds, batch_size=4, byte_lengths=lengths)
    lp = log_softmax64(np.stack([forward(model, r) for r in rows]))
    ce = -np.take_along_axis(lp[:, :-1], rows[:, 1:, None], -1).sum()
    assert got["batches"] == 2 and got["tokens"] == 5 * 16 and got["bytes"] == lengths[rows[:, 1:]].sum()
    np.testing.assert_allclose(got["loss"], ce / (5 * 16), rtol=1e-5)
    np.testing.assert_allclose(got["bpb"], ce / (math.log(2) * lengths[rows[:, 1:]].sum()), rtol=1e-5)


def test_heldout_batches_stop_at_the_data_and_each_batch_loss_is_its_mean(tmp_path):
    """--max_eval_batches above a domain's batches scores the domain's batches only (a filler
    batch's 0 would narrow --compare's paired noise band), and batch_losses, that band's input,
    are each batch's mean target loss against a float64 oracle; no byte lengths: bpb NaN, not 0."""
    model = olmo3.OLMo3(CFG, jax.random.key(0))
    rows = np.random.default_rng(1).integers(0, 500, size=(5, 17))
    ds = data.FSLDataset(token_file(tmp_path / "h.npy", rows), 17, vocab_size=512)
    got = heldout.heldout(model, ds, batch_size=4, max_batches=10)
    assert got["batches"] == 2 and len(got["batch_losses"]) == 2
    order = np.concatenate([data.get_eval_batch(ds, 4, b)["tokens"][:n] for b, n in ((0, 4), (1, 1))])
    lp = log_softmax64(np.stack([forward(model, r) for r in order]))
    per_row = -np.take_along_axis(lp[:, :-1], order[:, 1:, None], -1).sum((1, 2))
    np.testing.assert_allclose(got["batch_losses"], [per_row[:4].sum() / 64, per_row[4] / 16], rtol=1e-5)
    assert math.isnan(got["bpb"])


def test_token_bytes_add_up_to_the_texts_bytes():
    """bpb's denominator: the tokens of a text count its UTF-8 bytes, PII masks (added tokens matched
    in text) included; eos, pad and the rows past the tokenizer (OLMo-core pads to 100352) count none."""
    lengths = heldout.token_byte_lengths(100352)
    text = "Héllo wörld, 日本語 |||EMAIL_ADDRESS||| and <|endoftext|> as text\n"
    ids = data.tokenizer.encode(text)
    assert data.tokenizer.ADDED_TOKENS["|||EMAIL_ADDRESS|||"] in ids
    assert lengths[ids + [data.EOS_ID, data.PAD_ID, data.tokenizer.ADDED_TOKENS["<|im_end|>"], 100300]].sum() \
        == len(text.encode())


def test_cli_float8_scores_as_a_float8_run_does(tmp_path, caplog):
    """A stage-3 run trains, and scores its held-out loss, with float8 projections in bf16: eval.py
    --compute_dtype=bfloat16 --float8 gives its number (here the training step's own loss on the
    batch, as above); without --float8 the number is another. eval.py had no --float8, so a
    float8 run's in-loop losses could not be reproduced."""
    rows = np.random.default_rng(3).integers(0, 500, size=(8, 33))
    ds = data.FSLDataset(token_file(tmp_path / "h.npy", rows), 33, vocab_size=512)
    run = str(tmp_path / "run")
    mgr = CheckpointManager(run, keep=None, async_save=False)
    mgr.save(1, {"model": olmo3.OLMo3(CFG, jax.random.key(0))}, {"model_config": config_to_dict(CFG), "stage": 1,
                                                                 "precision": {"compute_dtype": "bfloat16", "float8": True}})
    mgr.close()
    m0 = olmo3.OLMo3(CFG.replace(compute_dtype="bfloat16", float8=True), jax.random.key(0))
    opt = optim.SkipStepAdamW(schedules.constant_schedule(1e-3))
    batch = {k: jnp.asarray(v) for k, v in data.get_batch(ds, 8, 0, 0).items() if k != "step"}
    want = float(make_train_step(opt, chunk=64)(m0, opt.init(m0), batch)[2]["train/loss"])
    F = eval_script.F
    got = {}
    warned = {}
    for name, extra in (("float8", ["--float8"]), ("plain", [])):
        F.unparse_flags()
        F(["eval.py", f"--model={run}", f"--heldout=a={ds.paths[0]}", "--eval_seq_len=33", "--eval_batch_size=8",
           "--max_eval_batches=1", "--compute_dtype=bfloat16", *extra, f"--out={tmp_path / name}"])
        caplog.clear()
        eval_script.main(["eval.py"])
        got[name] = json.load(open(tmp_path / name / "eval.json"))["eval/a/loss"]
        warned[name] = [r.getMessage() for r in caplog.records if "in-loop ones" in r.getMessage()]
    F.unparse_flags()
    assert got["float8"] == pytest.approx(want, rel=1e-6)
    assert abs(got["plain"] - want) > 1e-3, (got, want)
    # The run's precision is in its checkpoint: scored in another, eval.py says so (one line) and how to match it.
    assert warned["float8"] == [] and len(warned["plain"]) == 1, warned
    assert "add --compute_dtype=bfloat16 --float8" in warned["plain"][0], warned


def test_heldout_with_doc_lengths_equals_such_a_runs_training_loss(tmp_path):
    """A run with --doc_lengths (stage 3, SFT) attends within eos-delimited documents; eval.py scores
    its held-out windows the same way (load.doc_lengths reads it from the checkpoint's extra, the
    stages that default to it when an older checkpoint did not save it), and that loss differs
    from the unmasked one."""
    model = olmo3.OLMo3(CFG, jax.random.key(0))
    rows = np.random.default_rng(2).integers(0, 500, size=(8, 33))
    rows[:, [7, 20]] = data.EOS_ID % 512   # three documents per row
    ds = data.FSLDataset(token_file(tmp_path / "h.npy", rows), 33, vocab_size=512, eos_id=data.EOS_ID % 512)
    opt = optim.SkipStepAdamW(schedules.constant_schedule(1e-3))
    batch = {k: jnp.asarray(v) for k, v in data.get_batch(ds, 8, 0, 0).items() if k != "step"}
    m0 = olmo3.OLMo3(CFG, jax.random.key(0))   # the step donates its model
    _, _, metrics = make_train_step(opt, chunk=64, use_segments=True)(m0, opt.init(m0), batch)
    masked = eval_script.heldout_report(model, {"a": ds}, batch_size=8, max_batches=1, use_segments=True)
    plain = eval_script.heldout_report(model, {"a": ds}, batch_size=8, max_batches=1)
    np.testing.assert_allclose(masked["eval/a/loss"], float(metrics["train/loss"]), rtol=1e-6)
    assert abs(masked["eval/a/loss"] - plain["eval/a/loss"]) > 1e-4
    assert [load.doc_lengths(e) for e in ({"stage": "3"}, {"stage": 1}, {"stage": "sft"}, {"stage": "3", "doc_lengths": False},
                                          {"stage": "1", "doc_lengths": True}, {})] == [True, False, True, False, True, None]


def test_heldout_on_padded_documents_scores_the_documents_only(tmp_path):
    """One whole document per row, padded (OLMo-core's NumpyPaddedFSLDataset): CE and bytes count
    each document's own next-token targets, never the padding (numpy oracle: each document alone),
    every document scored (8 in batches of 3: the last batch's filler rows count nothing)."""
    model = olmo3.OLMo3(CFG, jax.random.key(0))
    rng = np.random.default_rng(1)
    eos, pad = 510, 511   # within the tiny vocabulary
    docs = [list(rng.integers(0, 500, size=int(n))) + [eos] for n in rng.integers(3, 30, size=8)]
    ds = data.PaddedFSLDataset([token_file(tmp_path / "p.npy", np.concatenate(docs))], 32, vocab_size=512,
                               eos_id=eos, pad_id=pad)
    assert len(ds) == 8
    lengths = heldout.token_byte_lengths(512)
    got = heldout.heldout(model, ds, batch_size=3, byte_lengths=lengths)   # a last batch of 2 documents + filler
    assert got["batches"] == 3
    ce, n, nbytes = 0.0, 0, 0
    for row in np.concatenate([data.get_batch(ds, 4, 0, b)["tokens"] for b in range(2)]):
        doc = np.asarray(next(d for d in docs if list(row[:len(d)]) == d))   # the row's document
        assert (row[len(doc):] == pad).all()
        lp = log_softmax64(forward(model, doc, pad=32))
        ce -= np.take_along_axis(lp[:-1], doc[1:, None], -1).sum()
        n += len(doc) - 1
        nbytes += int(lengths[doc[1:]].sum())
    assert got["tokens"] == n
    np.testing.assert_allclose(got["loss"], ce / n, rtol=1e-5)
    assert got["bytes"] == nbytes


def test_logit_agreement_against_direct_formulas():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(5, 40)), rng.normal(size=(5, 40))
    r = heldout.logit_agreement(a, b)
    pa, pb = np.exp(log_softmax64(a)), np.exp(log_softmax64(b))
    kl = [sum(pa[i, j] * math.log(pa[i, j] / pb[i, j]) for j in range(40)) for i in range(5)]
    np.testing.assert_allclose([r["kl_mean"], r["kl_max"]], [np.mean(kl), np.max(kl)], rtol=1e-9)
    top = lambda x: set(np.argsort(-x)[:10])  # noqa: E731
    assert r["top10"] == pytest.approx(np.mean([len(top(a[i]) & top(b[i])) / 10 for i in range(5)]))
    assert r["top1"] == np.mean(a.argmax(-1) == b.argmax(-1))
    same = heldout.logit_agreement(a, a + 3.0)  # a constant shift is the same distribution
    assert same["kl_max"] < 1e-12 and same["top1"] == 1.0 and same["top10"] == 1.0


def test_logit_agreement_memory_does_not_grow_with_tokens():
    """The float64 log-probabilities are built a block of positions at a time: 4x the positions
    must not take 4x the memory (a whole 65,536-token row of the 7B took ~320 GB of host memory)."""
    import tracemalloc
    rng = np.random.default_rng(0)
    peaks = {}
    for tokens in (1024, 4096):
        a = rng.normal(size=(tokens, 1024)).astype(np.float32)
        b = a + 0.1 * rng.normal(size=a.shape).astype(np.float32)
        tracemalloc.start()
        heldout.logit_agreement(a, b)   # AGREEMENT_CHUNK: 512 positions a block
        peaks[tokens] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peaks[4096] < 1.3 * peaks[1024], peaks
    a, b = rng.normal(size=(7, 3, 40)), rng.normal(size=(7, 3, 40))   # blocks give the one-block numbers
    whole, blocks = heldout.logit_agreement(a, b, chunk=1000), heldout.logit_agreement(a, b, chunk=4)
    assert whole.keys() == blocks.keys() and whole["tokens"] == blocks["tokens"] == 21
    np.testing.assert_allclose([blocks[k] for k in whole], [whole[k] for k in whole], rtol=1e-12)


def test_model_agreement_never_builds_a_rows_whole_logits(monkeypatch):
    """The logits of a row are computed `chunk` positions at a time (a 65,536-token row of the 7B:
    26 GB per model otherwise) and give the numbers of the whole row's logits."""
    cfg = CFG.replace(max_position_embeddings=2048)
    ma, mb = olmo3.OLMo3(cfg, jax.random.key(0)), olmo3.OLMo3(cfg, jax.random.key(1))
    rows = np.random.default_rng(0).integers(0, 512, size=(2, 1100)).astype(np.int32)
    want = heldout.logit_agreement(np.stack([forward(ma, r) for r in rows]), np.stack([forward(mb, r) for r in rows]))
    got = heldout.model_agreement(ma, mb, rows)   # AGREEMENT_CHUNK: 512 positions a block
    assert got["tokens"] == 2200
    np.testing.assert_allclose([got[k] for k in ("kl_mean", "kl_max", "top1", "top10")],
                               [want[k] for k in ("kl_mean", "kl_max", "top1", "top10")], rtol=1e-5)
    seen, head = [], heldout._head_fn()
    monkeypatch.setattr(heldout, "_head_fn", lambda: lambda m, h: seen.append(h.shape[0]) or head(m, h))
    assert heldout.model_agreement(ma, mb, rows) == got
    assert seen == [512, 512, 512, 512, 76, 76] * 2   # rows of 1,100: blocks of 512, 512, 76, for A and B


# ---- scoring and generation ---------------------------------------------------------------------
def test_kv_cache_matches_full_forward_and_greedy_oracle():
    model = olmo3.OLMo3(CFG.replace(yarn=olmo3.YaRN(factor=4.0, original_max_position=16)), jax.random.key(1))
    tokens = np.random.default_rng(1).integers(0, 512, size=40).astype(np.int32)
    full = forward(model, tokens)
    c = model.config
    kc = jnp.zeros((c.n_layers, 64, c.n_kv_heads, c.head_dim))
    vc = jnp.zeros_like(kc)
    l1, kc, vc = scoring._extend_jit(model, kc, vc, jnp.asarray(tokens[:25]), jnp.int32(0))   # prefill
    parts = [np.asarray(l1)]
    for t in range(25, 40):                                                            # decode
        lt, kc, vc = scoring._extend_jit(model, kc, vc, jnp.asarray(tokens[t:t + 1]), jnp.int32(t))
        parts.append(np.asarray(lt))
    np.testing.assert_allclose(np.concatenate(parts), full, atol=1e-4, rtol=1e-4)

    seq = list(tokens[:9])
    for _ in range(12):  # oracle: a full forward per generated token, no cache
        seq.append(int(np.argmax(forward(model, seq)[-1])))
    assert scoring.Scorer(model).generate(tokens[:9], 12) == seq[9:]
    # `stop` (chat's end-of-turn ids) ends the answer at the first token it accepts, that token kept
    stop_at = seq[9 + 4]
    want = seq[9:9 + seq[9:].index(stop_at) + 1]
    assert scoring.Scorer(model).generate(tokens[:9], 12, stop=lambda ids: ids[-1] == stop_at) == want
    assert len(want) < 12


def test_long_prompts_prefill_in_chunks(monkeypatch):
    """A prompt is prefilled PREFILL_CHUNK tokens at a time: one call on a whole 32k-token prompt held
    [heads, 32k, 32k] fp32 attention scores (137 GB for the 7B). Chunks that cut the sliding window
    and a prompt that ends mid-chunk (the cache then outgrows prompt + answer) decode as the
    full-forward greedy oracle does."""
    monkeypatch.setattr(scoring, "PREFILL_CHUNK", 48)
    calls = []
    real = scoring._extend_jit
    monkeypatch.setattr(scoring, "_extend_jit", lambda m, kc, vc, t, s: calls.append((t.shape[0], kc.shape[1]))
                        or real(m, kc, vc, t, s))
    model = olmo3.OLMo3(CFG.replace(yarn=olmo3.YaRN(factor=4.0, original_max_position=16)), jax.random.key(5))
    tokens = [int(x) for x in np.random.default_rng(5).integers(0, 512, size=100)]
    seq = list(tokens)
    for _ in range(5):
        seq.append(int(np.argmax(forward(model, seq, pad=128)[-1])))
    assert scoring.Scorer(model).generate(tokens, 5) == seq[100:]
    assert calls[:3] == [(48, 144)] * 3 and {t for t, _ in calls[3:]} == {1}   # 3 whole chunks outgrow 105 -> 128


def hf_and_ours(**config):
    """A random transformers Olmo3ForCausalLM (4 layers, width 32; `config` sets the rest) and our
    model with its weights (olmo3.hf.from_hf)."""
    import torch
    import transformers
    cfg = transformers.Olmo3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
                                   bos_token_id=None, tie_word_embeddings=False, **config)
    torch.manual_seed(0)
    ref = transformers.Olmo3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    return ref, hf.from_hf({k: v.detach() for k, v in ref.state_dict().items()}, hf.config_from_hf(cfg.to_dict()))


def test_generate_equals_transformers_generate():
    """Greedy decoding against transformers' own `generate` (its KV cache, its sliding-window
    cache layers) on a random Olmo3ForCausalLM: a window of 3 far shorter than prompt + answer,
    YaRN on the full layers, prompts shorter and longer than the window, and stopping at an id."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32,
            "beta_slow": 1, "attention_factor": 1.2}
    ref, model = hf_and_ours(vocab_size=97, sliding_window=3, pad_token_id=None, eos_token_id=None, rope_scaling=yarn)
    assert model.config.window == 3 and model.config.yarn is not None

    def hf_generate(prompt, n, eos=None):
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                           pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        return out[0, len(prompt):].tolist()

    rng = np.random.default_rng(0)
    for n_prompt in (2, 30):
        prompt = rng.integers(0, 97, size=n_prompt).tolist()
        ours = scoring.Scorer(model, max_length=128).generate(prompt, 24)
        assert ours == hf_generate(prompt, 24)
        stop = ours[9]
        assert scoring.Scorer(model, max_length=128).generate(prompt, 24, eos_id=stop) == hf_generate(prompt, 24, stop)


def test_loglikelihood_and_rolling_against_oracle():
    model = olmo3.OLMo3(CFG, jax.random.key(2))
    t = [int(x) for x in np.random.default_rng(2).integers(0, 256, size=21)]
    lp_full = log_softmax64(forward(model, t))
    ll, greedy = scoring.Scorer(model).loglikelihood(t[:15], t[15:])
    np.testing.assert_allclose(ll, sum(lp_full[j - 1, t[j]] for j in range(15, 21)), rtol=1e-5)
    assert greedy == all(lp_full[j - 1].argmax() == t[j] for j in range(15, 21))
    # is_greedy is every continuation token the argmax (lm-eval's), not the last one: [argmax,
    # not, argmax] is not greedy, [argmax] x 3 is
    cont = []
    for pick in ("argmax", "other", "argmax"):
        row = log_softmax64(forward(model, t[:15] + cont))[-1][:CFG.vocab_size]
        cont.append(int(row.argmax()) if pick == "argmax" else int(np.argsort(row)[-2]))
    assert scoring.Scorer(model).loglikelihood(t[:15], cont)[1] is False
    assert scoring.Scorer(model).loglikelihood(t[:15], cont[:1])[1] is True
    cont[1] = int(log_softmax64(forward(model, t[:15] + cont[:1]))[-1].argmax())
    cont[2] = int(log_softmax64(forward(model, t[:15] + cont[:2]))[-1].argmax())
    assert scoring.Scorer(model).loglikelihood(t[:15], cont)[1] is True
    # rolling with max_length 8: each token predicted from at most the 8 tokens before it, the
    # windows sharing context (oracle: one forward per token over its own context)
    scorer = scoring.Scorer(model, max_length=8)
    seq = [256] + t
    want = 0.0
    for j in range(1, len(seq)):
        a = (j - 1) // 8 * 8 + 1          # first target of j's window
        b = min(a + 8, len(seq))
        ctx = seq[max(0, b - 1 - 8):j]
        want += log_softmax64(forward(model, ctx))[-1, seq[j]]
    np.testing.assert_allclose(scorer.loglikelihood_rolling(t, 256), want, rtol=1e-5)
    np.testing.assert_allclose(scoring.Scorer(model).loglikelihood_rolling(t, 256),
                               sum(log_softmax64(forward(model, seq[:-1]))[j - 1, seq[j]]
                                   for j in range(1, len(seq))), rtol=1e-5)


def test_split_encode_is_lm_evals_encode_pair():
    """Scorer.split_encode against lm-eval's own TemplateLM._encode_pair (causal) with the dolma2
    tokenizer: a context's trailing spaces move to the continuation (so " 4" is one token, scored),
    the pair is encoded whole and split; an empty context is the prefix token alone."""
    model_api = pytest.importorskip("lm_eval.api.model")
    tok = data.dolma2()
    lm = SimpleNamespace(backend="causal", tok_encode=lambda s, **kw: data.tokenizer.encode(s))
    scorer = scoring.Scorer(olmo3.OLMo3(CFG, jax.random.key(0)), tok)
    for context, continuation in (("Question: 2+2? Answer: ", "4"), ("a b  ", "c d"), ("x", " y"), ("日本 ", "語"),
                                  ("Answer:", " yes")):
        assert scorer.split_encode(context, continuation) == model_api.TemplateLM._encode_pair(lm, context, continuation)
    assert scorer.split_encode("", "Hello") == ([tok.eot_token], data.tokenizer.encode("Hello"))


def test_loglikelihood_refuses_a_continuation_without_a_token_before_it():
    """Every continuation token is scored from a preceding one, or the call is an error: an empty
    context (no prefix token) or a continuation longer than max_length left its first tokens
    unpredicted, and the sum of the rest came back as the continuation's log-likelihood (lm-eval's
    HFLM asserts len(continuation) <= max_length)."""
    scorer = scoring.Scorer(olmo3.OLMo3(CFG, jax.random.key(2)), max_length=8)
    with pytest.raises(ValueError, match="an empty context needs a prefix token"):
        scorer.loglikelihood([], [1, 2, 3])
    with pytest.raises(ValueError, match="a continuation of 9 tokens does not fit max_length=8"):
        scorer.loglikelihood([5], list(range(1, 10)))
    ll, _ = scorer.loglikelihood([5], list(range(1, 9)))   # 8 tokens: each has the one before it
    lp = log_softmax64(forward(scorer.model, [5] + list(range(1, 8))))
    np.testing.assert_allclose(ll, sum(lp[j, j + 1] for j in range(8)), rtol=1e-5)
    # max_length + 1 tokens in all lose nothing (the first is only a context); one more is cut
    assert scorer.truncated == 0
    scorer.loglikelihood([5, 6, 7], [1, 2, 3, 4, 5, 6])
    assert scorer.truncated == 0
    scorer.loglikelihood([4, 5, 6, 7], [1, 2, 3, 4, 5, 6])
    assert scorer.truncated == 1


def test_scorer_scores_long_windows_in_head_chunks(monkeypatch):
    """Past SCORE_CHUNK positions the LM head runs 512 positions at a time, with the numbers of a
    full forward; at the 7B's 65,536-token context no [seq, vocab] logits exist (26 GB before)."""
    model = olmo3.OLMo3(CFG.replace(max_position_embeddings=2048), jax.random.key(5))
    t = [int(x) for x in np.random.default_rng(5).integers(0, 256, size=1100)]
    lp_full = log_softmax64(forward(model, [256] + t[:-1]))
    calls, score = [], scoring.token_scores_jit
    monkeypatch.setattr(scoring, "token_scores_jit",
                        lambda m, tok, tg, chunk, rows: calls.append((tok.shape[0], chunk)) or score(m, tok, tg, chunk, rows))
    scorer = scoring.Scorer(model, max_length=2048)
    ll, greedy = scorer.loglikelihood(t[:600], t[600:])
    lp = log_softmax64(forward(model, t[:-1]))           # no prefix token: t[j] predicted at j - 1
    np.testing.assert_allclose(ll, lp[np.arange(599, 1099), t[600:]].sum(), rtol=1e-5)
    assert greedy == all(lp[j - 1].argmax() == t[j] for j in range(600, 1100))
    np.testing.assert_allclose(scorer.loglikelihood_rolling(t, 256), lp_full[np.arange(1100), t].sum(), rtol=1e-5)
    assert calls == [(1536, 512), (1536, 512)]
    assert scoring.score_shape(100) == (128, 128) and scoring.score_shape(65_536) == (65_536, 512)

    big = olmo3.Config.olmo3_7b().replace(n_layers=4, attention="splash")
    abstract = eqx.filter_eval_shape(olmo3.OLMo3, big, jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((65_536,), jnp.int32)
    params, static = eqx.partition(abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    fn = jax.jit(lambda p, tok: scoring.token_scores(eqx.combine(p, static), tok, tok, 512))
    shapes = [set(s.split("x")) for s in re.findall(r"tensor<([0-9x]+)x[a-z]", fn.lower(params, tokens).as_text())]
    vocab = str(big.vocab_size)
    assert not [s for s in shapes if {"65536", vocab} <= s]
    assert {"512", vocab} in shapes   # the head's block of logits


def test_continuation_scores_run_the_head_in_blocks():
    """OLMo in-loop requests: the LM head runs 128 positions at a time, so a row of the 7B at
    2,048 tokens holds no [2048, vocab] fp32 logits (0.8 GB a row before), with the numbers of
    a full forward at a length that is no multiple of 128."""
    model = olmo3.OLMo3(CFG, jax.random.key(6))
    rng = np.random.default_rng(6)
    R, T = 2, 200
    b = random_score_batch(rng, rows=R, seq=T, choices=3)
    b["pos"] = np.array([7, 199], np.int32)   # an early position and the last one
    ll, choice = scoring.continuation_scores_jit(model, {k: jnp.asarray(v) for k, v in b.items()})
    for r in range(R):
        lp = log_softmax64(forward(model, list(b["tokens"][r])))
        want = lp[np.arange(T), b["targets"][r]][b["weights"][r] > 0].sum()
        np.testing.assert_allclose(ll[r], want, rtol=1e-5)
        np.testing.assert_allclose(choice[r], lp[b["pos"][r], b["choices"][r]], rtol=1e-5, atol=1e-5)

    big = olmo3.Config.olmo3_7b().replace(n_layers=4)
    abstract = eqx.filter_eval_shape(olmo3.OLMo3, big, jax.random.key(0))
    params, static = eqx.partition(abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    rows = {"tokens": (2, 2048), "targets": (2, 2048), "weights": (2, 2048), "pos": (2,), "choices": (2, 4)}
    batch = {k: jax.ShapeDtypeStruct(v, jnp.float32 if k == "weights" else jnp.int32) for k, v in rows.items()}
    fn = jax.jit(lambda p, bt: scoring.continuation_scores(eqx.combine(p, static), bt))
    shapes = [set(s.split("x")) for s in re.findall(r"tensor<([0-9x]+)x[a-z]", fn.lower(params, batch).as_text())]
    vocab = str(big.vocab_size)
    assert not [s for s in shapes if {"2048", vocab} <= s]
    assert {"128", vocab} in shapes   # the head's block of logits


def test_local_multiple_choice_task_end_to_end():
    """acc / acc_norm from hand-built prompts and per-choice log-likelihoods of full forwards."""
    model = olmo3.OLMo3(CFG, jax.random.key(3))
    tok = ByteTokenizer()
    path, pool_path = (os.path.join(FIXTURES, f"tiny_mc{s}.jsonl") for s in ("", ".fewshot"))
    docs, pool = scoring.load_task(path)
    got = eval_script.downstream_report(model, [path], num_fewshot=1, tokenizer=tok)
    shot = pool[0]
    acc, acc_norm = [], []
    for d in docs:
        prompt = shot["context"] + " " + shot["choices"][shot["gold"]] + "\n\n" + d["context"]
        lls = []
        for ch in d["choices"]:
            ctx, cont = tok.encode(prompt), tok.encode(" " + ch)
            lp = log_softmax64(forward(model, ctx + cont, pad=256))
            lls.append(sum(lp[len(ctx) - 1 + i, c] for i, c in enumerate(cont)))
        acc.append(np.argmax(lls) == d["gold"])
        acc_norm.append(np.argmax(np.array(lls) / [len(ch) for ch in d["choices"]]) == d["gold"])
    assert got["task/tiny_mc/acc"] == pytest.approx(np.mean(acc))
    assert got["task/tiny_mc/acc_norm"] == pytest.approx(np.mean(acc_norm))
    assert got["task/tiny_mc/acc_stderr"] == pytest.approx(np.std(acc, ddof=1) / math.sqrt(len(acc)))
    with pytest.raises(ValueError, match=re.escape(f"{pool_path}: num_fewshot=2 but it holds 1 examples")):
        eval_script.downstream_report(model, [path], num_fewshot=2, tokenizer=tok)


def test_multiple_choice_scores_as_lm_evals_multiple_choice_task():
    """acc / acc_norm and their stderr from given log-likelihoods, against lm-eval's own
    MultipleChoiceTask.process_results and mean_stderr: acc_norm divides by the choice's
    characters, not its UTF-8 bytes (non-ASCII choices where the two pick differently)."""
    task = pytest.importorskip("lm_eval.api.task")
    from lm_eval.api.metrics import mean_stderr
    rng = np.random.default_rng(8)
    words = ["été", "naïve", "abcd", "日本語", "x", "Ωμέγα", "tree"]
    docs = [{"context": f"q{i}", "choices": list(rng.choice(words, size=3, replace=False)), "gold": int(rng.integers(3))}
            for i in range(12)]
    docs[0].update(choices=["ééé", "abcd"], gold=1)     # -3.3 / 3 chars < -4 / 4 chars; per byte the other way
    lls = {(d["context"], " " + c): float(-len(c) * rng.uniform(0.8, 1.2)) for d in docs for c in d["choices"]}
    lls[("q0", " ééé")], lls[("q0", " abcd")] = -3.3, -4.0

    class Stub(scoring.Scorer):   # the two calls multiple_choice makes, with fixed log-likelihoods
        def __init__(self):
            pass

        def split_encode(self, context, continuation):
            return context, continuation

        def loglikelihood(self, context, continuation):
            return lls[(context, continuation)], False

    got = scoring.multiple_choice(Stub(), docs)
    want = [task.MultipleChoiceTask.process_results(None, d, [(lls[(d["context"], " " + c)], False) for c in d["choices"]])
            for d in docs]
    assert want[0]["acc_norm"] == 1.0 and got["n"] == 12
    for d, w in zip(docs, want):   # document by document (in the means, flips either way could cancel)
        one = scoring.multiple_choice(Stub(), [d])
        assert (one["acc"], one["acc_norm"]) == (w["acc"], w["acc_norm"]), d
    for m in ("acc", "acc_norm"):
        values = [w[m] for w in want]
        assert got[m] == pytest.approx(np.mean(values)) and got[f"{m}_stderr"] == pytest.approx(mean_stderr(values))


def test_fewshot_prompt_from_the_task_itself():
    docs = [{"context": f"q{i}", "choices": ["a", "b"], "gold": i % 2} for i in range(6)]
    p = scoring.fewshot_prompt(docs[2], 2, docs, None, 3)
    shots, last = p.split("\n\n")[:-1], p.split("\n\n")[-1]
    assert last == "q2" and len(shots) == 3 and "q2 " not in p
    assert all(s in {f"q{i} {'ab'[i % 2]}" for i in range(6)} for s in shots) and len(set(shots)) == 3
    # the documented draw: k of the other documents, numpy's generator seeded 1234 + the document's index
    for i, doc in enumerate(docs):
        others = [d for d in docs if d is not doc]
        picks = np.random.default_rng(1234 + i).choice(len(others), size=3, replace=False)
        assert scoring.fewshot_prompt(doc, i, docs, None, 3) == \
            "".join(f"{others[j]['context']} {'ab'[others[j]['gold']]}\n\n" for j in picks) + doc["context"]
    # a document that appears twice is not its own shot (its answer in its prompt), as in lm-eval
    dup = [docs[0], dict(docs[0]), docs[1], docs[2]]
    assert scoring.fewshot_prompt(dup[0], 0, dup, None, 2).split("\n\n")[:-1] in (["q1 b", "q2 a"], ["q2 a", "q1 b"])
    with pytest.raises(ValueError, match="num_fewshot=3 but only 2 examples available"):
        scoring.fewshot_prompt(dup[0], 0, dup, None, 3)


def test_token_ids_outside_the_vocabulary_are_named():
    """A tokenizer that does not match the model: JAX's gather clamps an id past the vocabulary,
    so the scores would be wrong without an error. The message named the largest id, not the bad one."""
    scorer = scoring.Scorer(olmo3.OLMo3(CFG, jax.random.key(0)))
    scorer._check([0, CFG.vocab_size - 1])
    for tokens, bad in (([5, CFG.vocab_size], CFG.vocab_size), ([5, -1], -1)):
        with pytest.raises(ValueError, match=rf"^token id {bad} is outside the model's vocabulary of "
                                             rf"{CFG.vocab_size}: the tokenizer does not match the model$"):
            scorer._check(tokens)


def lm_eval_task(directory, task: str, data_file: str, spec: str) -> None:
    """An lm-eval task YAML `<directory>/<task>.yaml` over a local JSON Lines file; `spec` holds
    its output_type, prompts, metrics and the rest."""
    (directory / f"{task}.yaml").write_text(f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                            f"    test: {data_file}\ntest_split: test\n{spec}")


def test_loglikelihood_rolling_scores_lm_evals_own_windows():
    """loglikelihood_rolling against lm-eval's own windowing (lm_eval.utils.get_rolling_token_windows
    with context_len 1 and make_disjoint_window, as HFLM.loglikelihood_rolling calls them), each
    window scored by a full forward: documents shorter than, equal to and many times max_length."""
    lm_utils = pytest.importorskip("lm_eval.utils")
    model = olmo3.OLMo3(CFG, jax.random.key(7))
    rng = np.random.default_rng(7)
    for n, max_length in ((1, 8), (7, 8), (8, 8), (21, 8), (40, 13), (130, 64)):
        t = [int(x) for x in rng.integers(0, 256, size=n)]
        want = 0.0
        for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(t, 256, max_length, 1)):
            seq = ctx + cont
            lp = log_softmax64(forward(model, seq[:-1]))
            want += sum(lp[len(seq) - len(cont) - 1 + i, c] for i, c in enumerate(cont))
        got = scoring.Scorer(model, max_length=max_length).loglikelihood_rolling(t, 256)
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"{n} tokens, max_length {max_length}")


def test_lm_eval_harness_drives_the_adapter(tmp_path):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    model = olmo3.OLMo3(CFG, jax.random.key(4))
    tok = ByteTokenizer()
    lm_eval_task(tmp_path, "tiny_mc_local", os.path.join(FIXTURES, "tiny_mc.jsonl"), """output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{gold}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""")
    lm_eval_task(tmp_path, "tiny_gen_local", os.path.join(FIXTURES, "tiny_gen.jsonl"), """output_type: generate_until
doc_to_text: "{{context}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
metric_list:
  - metric: exact_match
""")
    res = lm_eval.simple_evaluate(model=scoring.lm_eval_adapter(model, tok, max_length=256),
                                  tasks=["tiny_mc_local", "tiny_gen_local"], log_samples=True,
                                  task_manager=TaskManager(include_path=str(tmp_path)))
    ours = scoring.multiple_choice(scoring.Scorer(model, tok, 256), *scoring.load_task(os.path.join(FIXTURES, "tiny_mc.jsonl")))
    assert res["results"]["tiny_mc_local"]["acc,none"] == pytest.approx(ours["acc"])
    assert res["results"]["tiny_mc_local"]["acc_norm,none"] == pytest.approx(ours["acc_norm"])
    for sample in res["samples"]["tiny_gen_local"]:
        seq = tok.encode(sample["doc"]["context"])
        out = []
        for _ in range(6):  # oracle greedy decode, full forward per token
            nxt = int(np.argmax(forward(model, seq + out)[-1]))
            out.append(nxt)
            if nxt == tok.eot_token or "\n" in tok.decode(out):
                break
        assert sample["resps"][0][0] == tok.decode(out).split("\n")[0]


def test_lm_eval_report_keeps_every_filters_score(tmp_path, monkeypatch):
    """A task scored through several filters (gsm8k: strict-match and flexible-extract) reports
    "exact_match,<filter>" once per filter; each is its own number under lm_eval/<task>/<filter>/
    (with its stderr beside it, so --model_b's deltas pair them). Before, the filter name was cut
    and the last filter's score overwrote the others under one key."""
    lm_eval = pytest.importorskip("lm_eval")
    lm_eval_task(tmp_path, "tiny_gen_filters", os.path.join(FIXTURES, "tiny_gen.jsonl"), """output_type: generate_until
doc_to_text: "{{context}}"
doc_to_target: "x"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 2
metric_list:
  - metric: exact_match
filter_list:
  - name: raw
    filter:
      - function: take_first
  - name: always_x
    filter:
      - function: map
        default_value: "x"
      - function: take_first
""")
    runs, evaluate = [], lm_eval.simple_evaluate
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kw: runs.append(evaluate(**kw)) or runs[-1])
    model = olmo3.OLMo3(CFG.replace(vocab_size=data.VOCAB_SIZE), jax.random.key(4))
    got = eval_script.lm_eval_report(model, ["tiny_gen_filters"], include=str(tmp_path), max_length=256)
    want = runs[0]["results"]["tiny_gen_filters"]
    assert want["exact_match,always_x"] == 1.0 and want["exact_match,raw"] == 0.0
    for f in ("raw", "always_x"):
        assert got[f"lm_eval/tiny_gen_filters/{f}/exact_match"] == want[f"exact_match,{f}"]
        assert got[f"lm_eval/tiny_gen_filters/{f}/exact_match_stderr"] == want[f"exact_match_stderr,{f}"]


# A multiple-choice task whose YAML asks for 2 shots (lm-eval's own num_fewshot)
TINY_MC_2SHOT = """output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{gold}}"
num_fewshot: 2
fewshot_split: test
metric_list:
  - metric: acc
"""


def test_lm_eval_report_keeps_a_tasks_shots_and_says_what_it_cut(tmp_path, monkeypatch, caplog):
    """eval.py passed --num_fewshot's default 0 to lm-eval, which then overwrote a task YAML's own
    num_fewshot (2 here: scored 0-shot under the task's name); without the flag the task's own holds,
    as on lm-eval's command line; a YAML's 0 shots win over the flag, now said. Contexts cut from the left to fit --max_length were cut without a
    word: now counted and said. lm-eval's sample_len is a document count (/n), not a score."""
    lm_eval = pytest.importorskip("lm_eval")
    lm_eval_task(tmp_path, "tiny_mc_2shot", os.path.join(FIXTURES, "tiny_mc.jsonl"), TINY_MC_2SHOT)
    lm_eval_task(tmp_path, "tiny_mc_0shot", os.path.join(FIXTURES, "tiny_mc.jsonl"), """output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{gold}}"
num_fewshot: 0
fewshot_split: test
metric_list:
  - metric: acc
""")
    runs, evaluate = [], lm_eval.simple_evaluate
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kw: runs.append(evaluate(**kw)) or runs[-1])
    model = olmo3.OLMo3(CFG.replace(vocab_size=data.VOCAB_SIZE), jax.random.key(4))
    got = eval_script.lm_eval_report(model, ["tiny_mc_2shot"], include=str(tmp_path), max_length=256)
    assert runs[0]["n-shot"]["tiny_mc_2shot"] == 2
    assert got["lm_eval/tiny_mc_2shot/n"] == 6 and "lm_eval/tiny_mc_2shot/sample_len" not in got
    assert not [r for r in caplog.records if "were cut from the left" in r.getMessage()]
    eval_script.lm_eval_report(model, ["tiny_mc_2shot"], num_fewshot=0, include=str(tmp_path), max_length=256)
    assert runs[1]["n-shot"]["tiny_mc_2shot"] == 0
    with caplog.at_level("WARNING"):   # a YAML's 0 shots win over --num_fewshot (lm-eval said it at INFO)
        eval_script.lm_eval_report(model, ["tiny_mc_0shot", "tiny_mc_2shot"], num_fewshot=1, include=str(tmp_path),
                                   max_length=256)
    assert runs[2]["n-shot"] == {"tiny_mc_0shot": 0, "tiny_mc_2shot": 1}
    assert [r.getMessage() for r in caplog.records if "shots its YAML fixes" in r.getMessage()] == [
        "--num_fewshot=1: lm-eval scored tiny_mc_0shot with the shots its YAML fixes (0), not 1"]
    with caplog.at_level("WARNING"):   # 2-shot prompts of ~40 tokens: every request cut at 24
        eval_script.lm_eval_report(model, ["tiny_mc_2shot"], include=str(tmp_path), max_length=24)
    said = [r.getMessage() for r in caplog.records if "were cut from the left" in r.getMessage()]
    assert said == ["--lm_eval_tasks: 18 of 18 requests were cut from the left to fit --max_length=24, so their "
                    "scores saw less context; give a larger --max_length (at most max_position_embeddings) to "
                    "score them whole"]


def test_lm_eval_task_yamls_that_are_no_tasks_are_named_before_any_model(tmp_path):
    """A YAML file given as --lm_eval_tasks that is not YAML, or not a task, failed after the model
    loaded (a yaml traceback, exit 1; 'Unknown config shape' naming no file); a YAML under
    --lm_eval_include that lm-eval cannot read was left out unsaid, its task then 'unknown'."""
    pytest.importorskip("lm_eval")
    (tmp_path / "notyaml.yaml").write_text("a: [1\n b: 2\n")
    (tmp_path / "notask.yaml").write_text("foo: 1\n")
    for name, says in (("notyaml.yaml", "not YAML"), ("notask.yaml", "not an lm-eval task: no 'task', 'group' or")):
        with pytest.raises(app.UsageError, match=f"--lm_eval_tasks={re.escape(str(tmp_path / name))}: {says}"):
            eval_script.lm_eval_tasks([str(tmp_path / name)])
    (tmp_path / "fn.yaml").write_text("task: uses_a_function\nprocess_docs: !function utils.process\n")
    assert eval_script._task_yaml_problem(str(tmp_path / "fn.yaml")) is None   # lm-eval's tags are read
    with pytest.raises(app.UsageError, match=r"unknown task 'nope'.*these YAMLs under --lm_eval_include were not "
                                             r"read: notask\.yaml \(not an lm-eval task.*notyaml\.yaml \(not YAML"):
        eval_script.lm_eval_tasks(["nope"], include=str(tmp_path))


def test_generate_compiles_few_shapes_for_prompts_of_every_length(monkeypatch):
    """A chat file's or a generation task's prompts, 31 lengths from 5 to 1,775 tokens with room for
    256 new ones, compile 22 shapes of the prefill and the decode step (each minutes for the 7B on
    a GPU), not the 38 of buckets of 64. A cache is at most a quarter longer than the prompt and
    its answer need, or than the prompt's whole prefill chunks, and never longer than the context
    (rounded up to 64) but for those chunks. The answers are the full forward's."""
    model = olmo3.OLMo3(CFG.replace(max_position_embeddings=2048), jax.random.key(4))
    calls, extend = [], scoring._extend_jit
    monkeypatch.setattr(scoring, "_extend_jit", lambda m, kc, vc, t, a: calls.append((t.shape[0], kc.shape[1]))
                        or extend(m, kc, vc, t, a))
    rng = np.random.default_rng(4)
    scorer = scoring.Scorer(model, max_length=2040)
    for n in range(5, 1800, 59):
        prompt = rng.integers(0, 256, size=n).tolist()
        out = scorer.generate(prompt, 256, stop=lambda ids: len(ids) == 2)
        S, chunks = calls[-1][1], -(-n // 512) * 512
        assert n + 256 <= S <= max(1.25 * (n + 256), chunks) and S <= max(2048, chunks), (n, S)
        if n in (5, 1775):   # the oracle: greedy by full forwards
            want = []
            for _ in range(2):
                want.append(int(np.argmax(forward(model, prompt + want)[-1])))
            assert out == want
    assert len(set(calls)) == 22 and {t for t, _ in calls} == {1, 64, 128, 256, 512}
    scoring.Scorer(model, max_length=1100).generate(prompt[:774], 256, stop=lambda ids: True)
    assert calls[-1][1] == 1152   # 1,030 tokens: a quarter octave gives 1,280, the context 1,152

def test_generate_never_cuts_the_prompt_or_the_answer():
    """A prompt and max_new_tokens that do not fit the context are an error, not a prompt cut from
    the left (it lost the turns that open a chat) and an answer cut short, both unsaid."""
    model = olmo3.OLMo3(CFG, jax.random.key(3))
    tokens = [int(x) for x in np.random.default_rng(3).integers(0, 256, size=12)]
    scorer = scoring.Scorer(model, max_length=16)
    assert len(scorer.generate(tokens[:10], 6)) == 6
    with pytest.raises(ValueError, match="a prompt of 10 tokens and 7 new tokens do not fit the context of 16"):
        scorer.generate(tokens[:10], 7)
    with pytest.raises(ValueError, match="the prompt is empty"):
        scorer.generate([], 3)
    for top_p in (0.0, 1.5, float("nan")):   # numpy's "probabilities contain NaN" for 0 before
        with pytest.raises(ValueError, match="must be in \\(0, 1\\]"):
            scorer.generate(tokens[:4], 2, temperature=1.0, top_p=top_p)
    with pytest.raises(ValueError, match="give a temperature > 0"):   # greedy ignored it before
        scorer.generate(tokens[:4], 2, top_p=0.9)


def test_chat_prompt_that_does_not_fit_is_an_error_and_a_long_one_caps_the_answer(caplog, monkeypatch):
    model = olmo3.OLMo3(CFG.replace(vocab_size=data.VOCAB_SIZE), jax.random.key(0))
    messages = [{"role": "user", "content": "word " * 60}]
    n = len(data.chat.generation_prompt(messages))
    with pytest.raises(ValueError, match=f"prompt is {n} tokens, the model's context \\(--max_length\\) {n}"):
        eval_script.chat_answer(model, messages, max_new_tokens=4, max_length=n)
    asked, generate = [], scoring.Scorer.generate
    monkeypatch.setattr(scoring.Scorer, "generate", lambda self, prompt, new, **kw: asked.append(new) or generate(
        self, prompt, new, **kw))
    with caplog.at_level("WARNING"):
        eval_script.chat_answer(model, messages, max_new_tokens=8, max_length=n + 3)
    assert f"leave room for 3 of --max_new_tokens=8 in --max_length={n + 3}" in caplog.text
    assert asked == [3]   # the prompt and the answer fill the context exactly


def test_chat_answer_reads_from_the_think_its_prompt_opened():
    """olmo_thinker's generation prompt ends with "<think>": the answer printed beside a reference
    turn (which holds its "<think>") is the whole turn, "<think>" first. It printed from the first
    generated token, so a thinking model's answer read as if it never opened its thoughts."""
    model = olmo3.OLMo3(CFG.replace(vocab_size=data.VOCAB_SIZE), jax.random.key(0))
    messages = [{"role": "user", "content": "Hello there"}]
    for template, think in (("olmo_thinker", None), ("olmo_thinker", False), ("olmo3_instruct", True),
                            ("olmo3_instruct", None)):
        prompt = data.chat.generation_prompt(messages, template, think)
        ids = scoring.Scorer(model).generate(prompt, 6, vocab_size=data.VOCAB_SIZE)
        opened = data.chat.decode(prompt).endswith("<think>")
        assert opened == (think if think is not None else template == "olmo_thinker")
        answer = eval_script.chat_answer(model, messages, template, max_new_tokens=6, think=think)
        assert answer == "<think>" * opened + data.chat.decode(ids)


def test_nucleus_keeps_the_tokens_transformers_top_p_keeps():
    """Top-p against transformers' TopPLogitsWarper (HF generate's top_p) on random and peaked
    logits; sampling with it draws only kept tokens, and top_p = 1 is plain sampling."""
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import TopPLogitsWarper
    rng = np.random.default_rng(0)
    for case in range(300):
        logits = (rng.normal(size=200) * rng.choice([0.5, 2.0, 8.0])).astype(np.float32)
        top_p = float(rng.choice([0.05, 0.3, 0.5, 0.9, 0.95, 0.999]))
        hf = TopPLogitsWarper(top_p)(None, torch.tensor(logits)[None])[0].numpy()
        ours = scoring.nucleus(np.exp(logits.astype(np.float64) - logits.max()), top_p)
        assert np.array_equal(ours > 0, np.isfinite(hf)), (case, top_p)
        np.testing.assert_allclose(ours[ours > 0], np.exp(hf[ours > 0] - np.logaddexp.reduce(hf[ours > 0])),
                                   rtol=1e-5)
    for case in range(100):   # logits on a coarse grid (bf16-like) tie: as many kept, ties in any order
        logits = (np.round(rng.normal(size=200) * 4) / 4).astype(np.float32)
        top_p = float(rng.choice([0.05, 0.3, 0.5, 0.9, 0.95]))
        hf = TopPLogitsWarper(top_p)(None, torch.tensor(logits)[None])[0].numpy()
        ours = scoring.nucleus(np.exp(logits.astype(np.float64) - logits.max()), top_p)
        assert (ours > 0).sum() == np.isfinite(hf).sum(), (case, top_p)
        assert np.array_equal(np.sort(logits[ours > 0]), np.sort(logits[np.isfinite(hf)]))
    for weights, top_p in (([4, 2, 1, 1], 0.75), ([4, 2, 1, 1], 0.5), ([8, 4, 2, 1, 1], 0.75)):
        # the tokens before the cut-off hold exactly top_p (dyadic: exact in float32 too): it is not kept
        logits = np.log(np.array(weights, np.float32))
        hf = TopPLogitsWarper(top_p)(None, torch.tensor(logits)[None])[0].numpy()
        ours = scoring.nucleus(np.array(weights, np.float64), top_p)
        assert np.array_equal(ours > 0, np.isfinite(hf)) and (ours > 0).sum() == 1 + (top_p == 0.75), (weights, top_p)
    w = np.exp(rng.normal(size=50))
    np.testing.assert_array_equal(scoring.nucleus(w, 1.0), w / w.sum())
    model = olmo3.OLMo3(CFG, jax.random.key(6))
    prompt = [1, 2, 3]
    first = np.exp(log_softmax64(forward(model, prompt))[-1] / 0.7)
    kept = set(np.flatnonzero(scoring.nucleus(first, 0.5)))
    draws = {scoring.Scorer(model, max_length=64).generate(prompt, 1, temperature=0.7, top_p=0.5, seed=s)[0]
             for s in range(40)}
    assert draws <= kept and len(kept) < 512
    assert len(draws) > 1 or len(kept) == 1   # the seed is used: 40 seeds, not one draw
    # among tokens tied at the cut-off the lower ids are kept (a stable sort)
    assert np.flatnonzero(scoring.nucleus(np.array([1.0, 2.0, 1.0, 1.0, 2.0]), 0.6)).tolist() == [0, 1, 4]
    assert np.flatnonzero(scoring.nucleus(np.array([1.0, 1.0, 1.0, 1.0]), 0.5)).tolist() == [0, 1]


@pytest.mark.parametrize("flag", ["--temperature=0.7", "--top_p=0.9", "--max_new_tokens=32", "--sample_seed=3",
                                  "--chat_template=olmo_thinker", "--chat_think"])
def test_chat_flags_without_a_chat_are_an_error(flag, tmp_path):
    """--temperature and the other chat flags without --chat / --chat_file were ignored without a
    word: the held-out evaluation ran and the user believed they had sampled."""
    F = eval_script.F
    F.unparse_flags()
    F(["eval.py", f"--model={tmp_path / 'nowhere'}", flag])
    try:
        name = flag.split("=")[0]
        with pytest.raises(eval_script.app.UsageError, match=f"{name} applies to --chat / --chat_file only"):
            eval_script.main(["eval.py"])
    finally:
        F.unparse_flags()


def stub_lm_eval(monkeypatch):
    """Without lm-eval installed, a stand-in for the adapter's base class, all the adapter needs."""
    import sys
    import types
    if importlib.util.find_spec("lm_eval") is None:
        base = types.ModuleType("lm_eval.api.model")
        base.LM = type("LM", (), {"__init__": lambda self: None})
        for name, module in (("lm_eval", types.ModuleType("lm_eval")), ("lm_eval.api", types.ModuleType("lm_eval.api")),
                             ("lm_eval.api.model", base)):
            monkeypatch.setitem(sys.modules, name, module)


def test_generation_never_picks_a_padding_row_of_the_vocabulary(monkeypatch):
    """Every recipe pads dolma2's 100278 rows to OLMo-core's 100352; the padding rows are no token
    (the tokenizer cannot decode them; the HF export drops them). A padded model chats as its
    100278-row export does, greedy and sampled, even where it favours a padding row (chat died on
    `KeyError: Invalid token for decoding` at the end of the generation)."""
    V = data.VOCAB_SIZE
    trimmed = olmo3.OLMo3(CFG.replace(vocab_size=V), jax.random.key(4))
    messages = [{"role": "user", "content": "Hello there"}]
    prompt = data.chat.generation_prompt(messages)
    first = scoring.Scorer(trimmed).generate(prompt, 1)[0]
    pad = 100300
    head = jnp.zeros((CFG.d_model, 100352 - V)).at[:, pad - V].set(10 * trimmed.lm_head[:, first])
    padded = eqx.tree_at(lambda m: (m.embed, m.layers, m.norm, m.lm_head),
                         olmo3.OLMo3(CFG.replace(vocab_size=100352), jax.random.key(0)),
                         (jnp.concatenate([trimmed.embed, jnp.zeros((100352 - V, CFG.d_model))]), trimmed.layers,
                          trimmed.norm, jnp.concatenate([trimmed.lm_head, head], axis=1)))
    assert int(np.argmax(forward(padded, prompt)[-1])) == pad   # the model's own favourite is padding
    for kw in ({}, {"temperature": 1.0, "seed": 3}):
        want = eval_script.chat_answer(trimmed, messages, max_new_tokens=12, **kw)
        assert eval_script.chat_answer(padded, messages, max_new_tokens=12, **kw) == want
    stub_lm_eval(monkeypatch)
    lm, export = scoring.lm_eval_adapter(padded, max_length=256), scoring.lm_eval_adapter(trimmed, max_length=256)
    request = SimpleNamespace(args=("Hello there", {"until": ["\n\n"], "max_gen_toks": 6}))
    assert lm.generate_until([request]) == export.generate_until([request])
    # scored as HFLM scores the export: a softmax over the tokenizer's rows, where the padding row
    # the model favours (its head column is 10x the greedy token's) is no rival
    no = data.tokenizer.encode(" no")
    got = [lm.scorer.loglikelihood(prompt, c) for c in ([first], no)]
    want = [export.scorer.loglikelihood(prompt, c) for c in ([first], no)]
    assert [g for _, g in want] == [True, False] and [g for _, g in got] == [True, False]
    np.testing.assert_allclose([ll for ll, _ in got], [ll for ll, _ in want], rtol=1e-5)
    rolling = [SimpleNamespace(args=(data.dolma2().decode(prompt),))]
    np.testing.assert_allclose(lm.loglikelihood_rolling(rolling), export.loglikelihood_rolling(rolling), rtol=1e-5)
    everything = scoring.Scorer(padded, max_length=256)   # eval.py's own scores: the rows the model trained with
    assert everything.loglikelihood(prompt, [first])[0] < export.scorer.loglikelihood(prompt, [first])[0] - 1


def test_lm_eval_generate_until_like_hflm(monkeypatch):
    """generate_until as lm-eval's HFLM: EOS joins every stop list (a task's own `until` left
    "<|endoftext|>" in the answer), and the context keeps its last max_length - max_gen_toks tokens
    so that max_gen_toks can all be generated (the answer was cut short instead)."""
    stub_lm_eval(monkeypatch)
    seen = []

    def fake_generate(self, prompt, n, stop=None, eos_id=None, **kw):   # a model that says x, or ends at once
        seen.append((len(prompt), n))
        out = []
        for _ in range(n):
            out.append(eos_id if says == "eos" else x)
            if out[-1] == eos_id or (stop is not None and stop(out)):
                break
        return out

    monkeypatch.setattr(scoring.Scorer, "generate", fake_generate)
    x = data.tokenizer.encode("x")[0]
    lm = scoring.lm_eval_adapter(olmo3.OLMo3(CFG, jax.random.key(0)), max_length=64)
    request = lambda ctx, kw: SimpleNamespace(args=(ctx, kw))  # noqa: E731
    says = "eos"
    assert lm.generate_until([request("Question: 2+2?\nAnswer:", {"until": ["\n\n"], "max_gen_toks": 4}),
                              request("Question: 2+2?\nAnswer:", {"max_gen_toks": 4})]) == ["", ""]
    says, seen[:] = "x", []
    context = "word " * 100                      # 100 tokens, more than max_length 64
    assert lm.generate_until([request(context, {"until": ["\n\n"], "max_gen_toks": 8})]) == ["x" * 8]
    assert seen == [(56, 8)]                     # the context's last 64 - 8 tokens, all 8 new ones
    with pytest.raises(ValueError, match="max_gen_toks=64 leaves no room"):
        lm.generate_until([request(context, {"max_gen_toks": 64})])
    # the answer's length under lm-eval's other names for it, max_gen_toks first (HFLM's order)
    seen[:] = []
    assert lm.generate_until([request(context, {"max_new_tokens": 3}), request(context, {"max_tokens": 5}),
                              request(context, {"max_new_tokens": 3, "max_gen_toks": 2})]) == ["x" * 3, "x" * 5, "x" * 2]
    assert [n for _, n in seen] == [3, 5, 2]
    # lm-eval 0.4.13's HFLM samples when do_sample is set, or unset at a temperature above 0 (the
    # adapter decoded that greedily); a sampled task is refused, not decoded greedily unsaid
    assert lm.generate_until([request(context, {"max_gen_toks": 2, "temperature": 0.8, "do_sample": False})]) == ["x" * 2]
    for kw in ({"do_sample": True, "temperature": 0.8}, {"temperature": 0.8}):
        with pytest.raises(ValueError, match="asks for sampling \\(do_sample=(True|None), temperature=0.8\\)"):
            lm.generate_until([request(context, {"max_gen_toks": 2, **kw})])
    # HFLM stops on "" at once (its stop criterion finds "" in every text) and never splits on it
    assert lm.generate_until([request(context, {"until": ["", "\n\n"], "max_gen_toks": 4})]) == ["x"]
    with pytest.raises(ValueError, match="max_new_tokens=64 leaves no room"):
        lm.generate_until([request(context, {"max_new_tokens": 64})])
    if importlib.util.find_spec("lm_eval") is not None:   # the rule as lm-eval itself states it
        from lm_eval.models.utils import normalize_gen_kwargs
        assert normalize_gen_kwargs({"temperature": 0.8})["do_sample"] is True


class ByT5Ids:
    """transformers' ByT5Tokenizer without the tokenizer: UTF-8 byte b is id b + 3, end of text
    (its eos) 1, pad 0; decoding skips the special ids and drops bytes that are no UTF-8, as it does."""
    eot_token, n_vocab = 1, 259

    def encode(self, s):
        return [b + 3 for b in s.encode()]

    def decode(self, ids):
        return bytes(i - 3 for i in ids if i >= 3).decode(errors="ignore")


def test_adapter_scores_and_generates_as_lm_evals_hflm(tmp_path, request):
    """Our adapter against lm-eval's reference LM, HFLM over transformers' Olmo3ForCausalLM with
    the same weights (sliding window 5) and ByT5's byte tokenizer, through the same harness run:
    every choice's log-likelihood and is_greedy, acc and acc_norm (contexts longer than max_length
    32 cut on the left; an empty context scored after the prefix token), each document's rolling
    log-likelihood (one document of 5 windows) and perplexities, and greedy answers cut at `until`
    (one prompt cut to max_length - max_new_tokens).
    HFLM's settings that make it comparable: max_length 32, add_bos_token=False (by default the ByT5 tokenizer
    appends its eos to every string it encodes), batch_size 1, float32; its prefix token is then
    eos = 1 (the tokenizer has no bos), our eot_token."""
    lm_eval = pytest.importorskip("lm_eval")
    huggingface = pytest.importorskip("lm_eval.models.huggingface")   # needs torch, transformers, accelerate
    from lm_eval.tasks import TaskManager
    import torch
    import transformers
    # one torch thread: beside XLA's threads, torch's two took 4 ms per tiny matmul (70x) on 2 cores
    request.addfinalizer(lambda threads=torch.get_num_threads(): torch.set_num_threads(threads))
    torch.set_num_threads(1)
    ref, model = hf_and_ours(vocab_size=259, sliding_window=5, pad_token_id=0, eos_token_id=1)
    tok = ByT5Ids()

    # transformers' own greedy answer to a prompt: a choice made of its whole UTF-8 characters is
    # greedy (is_greedy True somewhere), and it says "d", a stop string, within 8 tokens
    prompt = "Count: 1 2 3 4"
    ids = ref.generate(torch.tensor([tok.encode(prompt)]), max_new_tokens=8, do_sample=False, pad_token_id=0,
                       attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    answer = tok.decode(ids)
    greedy = bytes(i - 3 for i in ids)
    while greedy and not greedy.decode(errors="ignore").encode() == greedy:
        greedy = greedy[:-1]
    assert greedy and "d" in answer
    mc = scoring.load_task(os.path.join(FIXTURES, "tiny_mc.jsonl"))[0]
    mc += [{"context": prompt, "choices": ["5", greedy.decode(), "x"], "gold": 1},
           {"context": "", "choices": ["A tree.", "Why?"], "gold": 0}]
    ppl = [{"text": "The quick brown fox jumps over the lazy dog. " * 3}, {"text": "short one"}, {"text": "x"}]
    gen = [{"context": "Count: 1 2 3 4", "answer": " 5"}, {"context": "Say hi:", "answer": " hi"},
           {"context": "A preamble longer than the context window. Repeat: abc abc ab", "answer": "c"}]
    for name, docs, spec in (
            ("mc", mc, 'output_type: multiple_choice\ntarget_delimiter: ""\ndoc_to_text: "{{context}}"\n'
                       'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{gold}}"\n'
                       'metric_list:\n  - metric: acc\n  - metric: acc_norm\n'),
            ("ppl", ppl, 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
                         'metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n'),
            ("gen", gen, 'output_type: generate_until\ndoc_to_text: "{{context}}"\ndoc_to_target: "{{answer}}"\n'
                         'generation_kwargs:\n  until: ["d", "L"]\n  max_new_tokens: 8\n'
                         'metric_list:\n  - metric: exact_match\n')):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        lm_eval_task(tmp_path, f"hflm_{name}", tmp_path / f"{name}.jsonl", spec)
    tasks = ["hflm_mc", "hflm_ppl", "hflm_gen"]
    manager = TaskManager(include_path=str(tmp_path), include_defaults=False)   # not lm-eval's thousands
    hflm = huggingface.HFLM(pretrained=ref, tokenizer=transformers.ByT5Tokenizer(), max_length=32, batch_size=1,
                            device="cpu", dtype=torch.float32, add_bos_token=False)
    want = lm_eval.simple_evaluate(model=hflm, tasks=tasks, log_samples=True, task_manager=manager)
    got = lm_eval.simple_evaluate(model=scoring.lm_eval_adapter(model, tok, max_length=32), tasks=tasks,
                                  log_samples=True, task_manager=manager)
    for task in tasks:
        for metric, v in want["results"][task].items():
            if "," in metric and "stderr" not in metric:
                assert got["results"][task][metric] == pytest.approx(v, rel=1e-4), (task, metric)
        for a, b in zip(want["samples"][task], got["samples"][task], strict=True):
            assert a["doc"] == b["doc"] and a["arguments"] == b["arguments"]
            if task == "hflm_gen":
                assert b["resps"] == a["resps"], a["doc"]
                continue
            for (want_r,), (got_r,) in zip(a["resps"], b["resps"], strict=True):
                want_r, got_r = np.atleast_1d(want_r), np.atleast_1d(got_r)   # (ll, is_greedy) or ll
                np.testing.assert_allclose(float(got_r[0]), float(want_r[0]), rtol=1e-4, err_msg=str(a["doc"]))
                assert got_r[1:].tolist() == want_r[1:].tolist(), a["doc"]
    # the cases are live: a greedy choice, a document of 5 windows, an answer cut at `until`
    assert sum(r[0][1] for s in want["samples"]["hflm_mc"] for r in s["resps"]) == 1
    assert len(tok.encode(ppl[0]["text"])) > 4 * 32
    assert want["samples"]["hflm_gen"][0]["resps"] == [[answer.split("d")[0]]]


# ---- step-aligned run comparison ----------------------------------------------------------------
RUN_CFG = CFG.replace(init_std=0.02)
SEQ, BATCH, STEPS, SAVE = 32, 8, 90, (30, 60, 90)
SYMBOLS, SUCCESSORS = 16, 2
TABLE = np.random.default_rng(123).integers(0, SYMBOLS, size=(SYMBOLS, SUCCESSORS))  # a Markov chain


def chain(rng, n_rows):
    rows = np.empty((n_rows, SEQ), np.int64)
    rows[:, 0] = rng.integers(0, SYMBOLS, n_rows)
    for t in range(1, SEQ):
        rows[:, t] = TABLE[rows[:, t - 1], rng.integers(0, SUCCESSORS, n_rows)]
    return rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three tiny runs: clean (seeds 0 and 1: fresh chain samples every step) and repeated (the
    same 2 sequences every step, the extreme of DESIGN §4 bug 1's resampling)."""
    root = tmp_path_factory.mktemp("runs")
    opt = optim.SkipStepAdamW(schedules.constant_schedule(3e-2), weight_decay=0.0, skip_steps=False)
    step_fn = make_train_step(opt, chunk=256, z_loss=0.0)
    repeated = chain(np.random.default_rng(77), 2)

    def train(name, seed, stream):
        run = str(root / name)
        model = olmo3.OLMo3(RUN_CFG, jax.random.key(seed))
        state = opt.init(model)
        mgr = CheckpointManager(run, keep=None, async_save=False)
        with open(os.path.join(run, "metrics.jsonl"), "w") as f:
            for s in range(1, STEPS + 1):
                tokens = stream(s - 1)
                batch = {"tokens": jnp.asarray(tokens, jnp.int32), "instance_mask": jnp.ones(BATCH, bool),
                         "segment_ids": jnp.zeros(tokens.shape, jnp.int32)}
                model, state, m = step_fn(model, state, batch)
                f.write(json.dumps({"step": s, "train/loss": float(m["train/loss"])}) + "\n")
                if s in SAVE:
                    mgr.save(s, {"model": model, "opt": state},
                             {"model_config": config_to_dict(RUN_CFG), "stage": 1})
        mgr.close()
        return run

    out = {"clean0": train("clean0", 0, lambda s: chain(np.random.default_rng(1000 + s), BATCH)),
           "clean1": train("clean1", 1, lambda s: chain(np.random.default_rng(5000 + s), BATCH)),
           "repeat": train("repeat", 0, lambda s: np.tile(repeated, (BATCH // 2, 1)))}
    heldout_sets = {d: data.FSLDataset(token_file(root / f"{d}.npy", chain(np.random.default_rng(k), 32)), SEQ,
                                  vocab_size=512) for k, d in ((9, "chain_a"), (10, "chain_b"))}
    out["sets_fn"] = lambda config: heldout_sets
    return out


def test_compare_flags_memorization_not_seed_noise(runs, tmp_path):
    # Bands from the runs, with tol as their floor: the runs' own noise does not see how far two
    # seeds' models drift apart (here a 0.055-nat gap against a 0.050 band at step 90, after
    # RoPE's frequencies were rounded once). The memorization signature is ten times that.
    kw = dict(sets_fn=runs["sets_fn"], train_loss_window=10, batch_size=8, max_batches=4, tol=0.08)
    bad = eval_script.compare_runs(runs["clean0"], runs["repeat"], out_dir=str(tmp_path / "bad"), **kw)
    clean = eval_script.compare_runs(runs["clean0"], runs["clean1"], out_dir=str(tmp_path / "ok"), **kw)
    last_bad, last_ok = bad["rows"][-1], clean["rows"][-1]
    for name, r in (("repeat vs clean", bad), ("seed 1 vs seed 0", clean)):
        for row in r["rows"]:
            print(name, {k: round(v, 3) for k, v in row.items() if isinstance(v, float)})
    assert [r["step"] for r in bad["rows"]] == list(SAVE)
    assert bad["flagged"] and "memorization" in bad["verdict"]
    assert last_bad["train_delta"] < -0.5 and last_bad["heldout_delta"] > 0.0  # the signature, by margin
    assert not clean["flagged"], clean["verdict"]
    assert not any(r["flag"] for r in clean["rows"])
    # Seed noise is far inside the signature: at least 10x smaller train delta and gap. (An absolute
    # bound is not: the two seeds differ by 0.060 held-out on a Zen 5 EPYC, by < 0.05 on earlier CPUs.)
    gap = lambda row: row["heldout_delta"] - row["train_delta"]  # noqa: E731
    assert 10 * abs(last_ok["train_delta"]) < -last_bad["train_delta"] and 10 * abs(gap(last_ok)) < gap(last_bad)
    assert last_ok["kl_AB"] > 0 and set(last_ok) >= {"heldout/chain_a_delta", "heldout/chain_b_delta"}
    for row in clean["rows"] + bad["rows"]:  # the bands are measured, finite and positive
        assert 0 < row["train_se"] < 0.2 and 0 < row["heldout_se"] < 1 and row["train_band"] == max(0.08, 3 * row["train_se"])
    for p in bad["paths"].values():
        assert os.path.getsize(p) > 0
    assert open(bad["paths"]["png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert "memorization signature" in open(bad["paths"]["md"]).read()
    with open(bad["paths"]["csv"]) as f:
        assert f.readline().startswith("step,train_A,train_B,train_delta")


def test_compare_rows_against_direct_formulas(runs, monkeypatch):
    """One row of --compare against its definitions: per-domain held-out deltas B - A and the
    per-batch losses' paired standard error (statistics.stdev of the differences / sqrt(n)) from
    heldout.heldout on each checkpoint; train_se = the two runs' residual std about a numpy lstsq
    line (ddof 2) / sqrt(n), in quadrature; the verdict judged with exactly these two."""
    import statistics

    from olmo3 import comparison
    judged = []
    real = comparison.verdict
    monkeypatch.setattr(comparison, "verdict", lambda *a, **kw: judged.append(kw) or real(*a, **kw))
    row = eval_script.compare_runs(runs["clean0"], runs["repeat"], sets_fn=runs["sets_fn"], steps=[90],
                                   train_loss_window=10, batch_size=8, max_batches=2)["rows"][0]
    losses = {}
    for name in ("clean0", "repeat"):
        model = load.load_model(os.path.join(runs[name], "checkpoints", "90"))[0]
        for d, ds in runs["sets_fn"](None).items():
            losses[name, d] = heldout.heldout(model, ds, batch_size=8, max_batches=2)
    diffs = []
    for d in runs["sets_fn"](None):
        a, b = losses["clean0", d], losses["repeat", d]
        assert row[f"heldout/{d}_delta"] == pytest.approx(b["loss"] - a["loss"], rel=1e-6)
        diffs += list(np.subtract(b["batch_losses"], a["batch_losses"]))
    assert row["heldout_se"] == pytest.approx(statistics.stdev(diffs) / math.sqrt(len(diffs)), rel=1e-9)
    se = []
    for name in ("clean0", "repeat"):
        logged = [json.loads(line) for line in open(os.path.join(runs[name], "metrics.jsonl"))]
        y = np.array([m["train/loss"] for m in logged if 80 < m["step"] <= 90])
        x = np.arange(81, 91, dtype=np.float64)
        coef, *_ = np.linalg.lstsq(np.stack([x, np.ones_like(x)], 1), y, rcond=None)
        r = y - (coef[0] * x + coef[1])
        se.append(math.sqrt((r @ r) / 8) / math.sqrt(10))
    assert row["train_se"] == pytest.approx(math.hypot(*se), rel=1e-6)
    assert judged == [{"train_se": row["train_se"], "heldout_se": row["heldout_se"], "z": comparison.Z}]


def test_unmeasurable_noise_flags_nothing_and_says_so(runs, tmp_path):
    """A noise band that cannot be measured (2 logged training losses: no line to take the trend
    out) is not a band of zero: the memorization pair is not flagged on it, the row says why, and --tol alone
    still judges. (Before, NaN counted as 0 and any gap was flagged.)"""
    from olmo3 import comparison
    assert comparison.verdict(-0.001, 0.0, train_se=float("nan"), heldout_se=float("nan")) is None
    assert comparison.bands(float("nan"), 0.01, tol=0.05) == (0.05, pytest.approx(max(0.05, 3 * 0.01)))
    assert comparison.bands(0.01, float("nan")) == (pytest.approx(3 * 0.01), math.inf)   # the gap's noise unknown
    assert not comparison.measurable(0.01, float("nan")) and comparison.measurable(0.01, float("nan"), tol=0.1)
    kw = dict(sets_fn=runs["sets_fn"], train_loss_window=2, max_batches=2, steps=[90])
    r = eval_script.compare_runs(runs["clean0"], runs["repeat"], out_dir=str(tmp_path / "u"), **kw)
    assert not r["flagged"] and r["rows"][0]["flag"].startswith(
        "undetermined: noise not measurable (2 logged training losses in the 2-step window, need 10)")
    assert r["verdict"].startswith("step 90 undetermined") and "--train_loss_window" in r["verdict"]
    assert eval_script.compare_runs(runs["clean0"], runs["repeat"], tol=0.1, out_dir=str(tmp_path / "t"), **kw)["flagged"]
    one_set = {"chain_a": runs["sets_fn"](None)["chain_a"]}   # one domain, one batch: no spread between batches
    one = eval_script.compare_runs(runs["clean0"], runs["repeat"], out_dir=str(tmp_path / "o"),
                                   **{**kw, "max_batches": 1, "sets_fn": lambda *a, **k: one_set})
    assert one["rows"][0]["flag"].startswith("undetermined: noise not measurable (2 logged training losses in the "
                                             "2-step window, need 10, 1 held-out batch(es), need 2)")


def test_compare_on_padded_documents(runs, tmp_path):
    """--compare --eval_padded: held-out documents padded, KL on fixed-length windows of the same
    files (it crashed on the padded rows before)."""
    windows = runs["sets_fn"](None)
    documents = {d: data.PaddedFSLDataset(ds.paths, SEQ, vocab_size=512, eos_id=0, pad_id=511)   # symbol 0 ends one
                 for d, ds in windows.items()}
    r = eval_script.compare_runs(runs["clean0"], runs["clean1"], train_loss_window=10, max_batches=2, steps=[90],
                                 sets_fn=lambda config, padded=True: documents if padded else windows,
                                 out_dir=str(tmp_path / "p"))
    assert r["rows"][0]["kl_AB"] > 0 and math.isfinite(r["rows"][0]["heldout_delta"])


def test_compare_warns_once_per_run_scored_in_another_precision(runs, monkeypatch, caplog, tmp_path):
    """Two bf16 runs compared in fp32 (the default): a warning line names each run once, not
    once per step, with the flags that score it as it scored itself."""
    real = load.load_model

    def bf16_run(*args, **kw):   # as train.py records a --compute_dtype=bfloat16 run's checkpoints
        model, info = real(*args, **kw)
        return model, {**info, "precision": {"compute_dtype": "bfloat16", "float8": False}}
    monkeypatch.setattr(load, "load_model", bf16_run)
    eval_script.compare_runs(runs["clean0"], runs["clean1"], train_loss_window=10, max_batches=1, steps=[60, 90],
                             kl_instances=1, sets_fn=runs["sets_fn"], out_dir=str(tmp_path / "r"))
    warned = [r.getMessage() for r in caplog.records if "in-loop ones" in r.getMessage()]
    assert len(warned) == 2 and runs["clean0"] in warned[0] and runs["clean1"] in warned[1], warned
    assert all("add --compute_dtype=bfloat16 to reproduce" in w for w in warned), warned


def test_compare_with_downstream_stderr_in_quadrature(runs, monkeypatch):
    calls = {}

    def fake(model, tasks, **kw):  # per-model downstream numbers, to check the combination
        i = calls.setdefault(id(model), len(calls))
        return {"task/t/acc": 0.5 + 0.1 * (i % 2), "task/t/acc_stderr": 0.03 + 0.01 * (i % 2)}

    monkeypatch.setattr(eval_script, "downstream_report", fake)
    r = eval_script.compare_runs(runs["clean0"], runs["clean1"], sets_fn=runs["sets_fn"], tasks=["/x/t.jsonl"],
                                 steps=[30], train_loss_window=10, max_batches=1)
    row = r["rows"][0]
    assert row["t_acc_delta"] == pytest.approx(0.1)
    assert row["t_acc_delta_se"] == pytest.approx(math.hypot(0.03, 0.04))


def test_compare_with_olmo_tasks_beside_heldout(runs, monkeypatch):
    """--compare --olmo_tasks: each row holds A, B and B - A of every task's primary metric and
    gold bpb (the per-model numbers come from olmo_tasks_report, tested in test_oe_tasks.py)."""
    seen = {}

    def fake(model, labels, **kw):
        i = seen.setdefault(id(model), len(seen)) % 2
        return {"downstream/codex_humaneval_gold_bpb_3shot/bpb_v2": 2.0 - 0.25 * i,
                "downstream/arc_easy_rc_5shot/acc_v2": 0.25 + 0.5 * i, "downstream/arc_easy_rc_5shot/bpb_v2": 3.0}

    monkeypatch.setattr(eval_script, "olmo_tasks_report", fake)
    r = eval_script.compare_runs(runs["clean0"], runs["clean1"], sets_fn=runs["sets_fn"], steps=[30],
                                 olmo_tasks=["codex_humaneval_gold_bpb_3shot", "arc_easy_rc_5shot"],
                                 train_loss_window=10, max_batches=1)
    row = r["rows"][0]
    assert row["codex_humaneval_gold_bpb_3shot/bpb_v2_delta"] == pytest.approx(-0.25)
    assert (row["arc_easy_rc_5shot/acc_v2_A"], row["arc_easy_rc_5shot/acc_v2_B"]) == (0.25, 0.75)
    assert row["arc_easy_rc_5shot/bpb_v2_delta"] == 0.0


def test_heldout_windows_same_instances_on_any_device_count(tmp_path):
    """train.py's held-out loss of fixed-length windows (data.eval_plan + get_eval_batch under the
    sharded eval_fn) counts the same instances on 1, 2 and 8 devices (it dropped a device-count-
    dependent remainder), and equals eval.py's heldout() with another batch size: every one of
    the 13 windows, filler rows counting nothing."""
    from olmo3 import sharding
    model = olmo3.OLMo3(CFG, jax.random.key(0))
    rng = np.random.default_rng(4)
    ds = data.FSLDataset([token_file(tmp_path / "w.npy", rng.integers(0, 500, size=13 * 32 + 5))], 32,
                         vocab_size=512, eos_id=510, pad_id=511)
    got = []
    for devices in (1, 2, 8):
        mesh = sharding.make_mesh(f"fsdp:{devices}", jax.devices()[:devices])
        eval_fn = sharding.make_eval_fn(mesh, sharding.param_specs(model, mesh), chunk=64)
        rows, batches = data.eval_plan(len(ds), batches=0, global_batch=8, devices=devices)
        sums = [eval_fn(model, sharding.global_batch(data.get_eval_batch(ds, rows, b), mesh)) for b in range(batches)]
        got.append((sum(float(s) for s, _ in sums), sum(float(c) for _, c in sums)))
    assert [c for _, c in got] == [13 * 31] * 3
    for ce, _ in got[1:]:
        assert ce == pytest.approx(got[0][0], rel=1e-5)
    assert heldout.heldout(model, ds, batch_size=5)["loss"] == pytest.approx(got[0][0] / got[0][1], rel=1e-5)


def test_olmo_core_ce_equals_olmo_cores_lm_evaluator(tmp_path):
    """train.py's eval/<domain>/olmo_core_ce on padded documents (--eval_padded) against OLMo-core's
    own LMEvaluator fed per-position losses from a numpy oracle: 8 documents in batches of 3 rows
    (the last holds a filler row, which OLMo-core never sees)."""
    torch = pytest.importorskip("torch")
    lm_evaluator = pytest.importorskip("olmo_core.eval.lm_evaluator")
    from olmo3.step import eval_loss
    model = olmo3.OLMo3(CFG, jax.random.key(0))
    rng = np.random.default_rng(2)
    eos, pad, T, rows = 510, 511, 32, 3
    docs = [list(rng.integers(0, 500, size=int(n))) + [eos] for n in rng.integers(1, 40, size=8)]
    ds = data.PaddedFSLDataset([token_file(tmp_path / "p.npy", np.concatenate(docs))], T, vocab_size=512,
                               eos_id=eos, pad_id=pad)
    theirs = lm_evaluator.LMEvaluator(name="lm", batches=[], labels=["d"], device=torch.device("cpu"))
    ce = n = 0.0
    documents = 0
    for b in range(-(-len(ds) // rows)):
        batch = data.get_eval_batch(ds, rows, b)
        s, c = eqx.filter_jit(eval_loss)(model, {k: jnp.asarray(batch[k]) for k in ("tokens", "instance_mask",
                                                                                    "label_mask")}, chunk=64)
        ce, n = ce + float(s), n + float(c)
        documents += data.eval_batch_instances(len(ds), rows, b)
        real = batch["label_mask"].any(axis=1)
        tokens, mask = batch["tokens"][real], batch["label_mask"][real]
        per_position = np.zeros(tokens.shape)   # OLMo-core: labels shifted after the mask, 0 where ignored
        for i, row in enumerate(tokens):
            lp = log_softmax64(forward(model, row, pad=T))
            for t in range(T - 1):
                if mask[i, t + 1]:
                    per_position[i, t] = -lp[t, row[t + 1]]
        theirs.update_metrics({"metadata": [{"label": "d"}] * len(tokens), "label_mask": torch.tensor(mask)},
                              torch.tensor(per_position), None)
    assert documents == len(ds) == 8 and n == sum(min(len(d), T) - 1 for d in docs)
    want = float(theirs.compute_metrics()["d/CE loss"])
    np.testing.assert_allclose(heldout.olmo_core_ce(ce, n, documents), want, rtol=1e-5)
    assert abs(ce / n - want) > 1e-3 * want   # the true CE differs: one zero-loss position per document


def test_context_length_defaults_to_the_trained_context():
    """eval.py scores at the run's own --seq_len (as train.py's in-loop evaluation does), an HF
    model at OLMo 3's 8192 (OLMo-core's in-loop length), never past the model's positions."""
    info = lambda seq_len, positions: {"seq_len": seq_len,  # noqa: E731
                                       "config": SimpleNamespace(max_position_embeddings=positions, yarn=None)}
    assert eval_script.context_length(info(256, 4096), None) == 256
    assert eval_script.context_length(info(None, 65536), None) == 8192
    assert eval_script.context_length(info(None, 4096), None) == 4096
    assert eval_script.context_length(info(256, 4096), 1024) == 1024
    with pytest.raises(Exception, match="--max_length=0 must be positive"):
        eval_script.context_length(info(256, 4096), 0)


def test_load_model_reads_the_step_asked_for(tmp_path):
    """load_model(run, step) (eval.py --model_step) restores that step, not the latest; a
    checkpoints/ directory alone gives the latest; the extra JSON's loader seq_len, doc_lengths,
    eval_padded and precision come back in info."""
    run = str(tmp_path / "run")
    mgr = CheckpointManager(run, keep=None, async_save=False)
    models = {s: olmo3.OLMo3(CFG, jax.random.key(s)) for s in (3, 5)}
    for s, m in models.items():
        mgr.save(s, {"model": m}, {"model_config": config_to_dict(CFG), "loader": {"seq_len": 10 * s},
                                   "stage": "1", "doc_lengths": s == 5, "eval_padded": s == 3,
                                   "precision": {"compute_dtype": "float32", "float8": False}})
    mgr.close()
    for path, step, want in ((run, 3, 3), (os.path.join(run, "checkpoints"), None, 5)):
        model, info = load.load_model(path, step)
        assert (info["kind"], info["step"], info["seq_len"]) == ("orbax", want, 10 * want), (path, step)
        assert (info["doc_lengths"], info["eval_padded"]) == (want == 5, want == 3)
        assert info["precision"] == {"compute_dtype": "float32", "float8": False}
        np.testing.assert_array_equal(np.asarray(model.embed), np.asarray(models[want].embed))


def test_compare_bad_inputs(runs, tmp_path):
    kw = dict(sets_fn=runs["sets_fn"], train_loss_window=10, max_batches=1)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step\(s\) \[45\]"):
        eval_script.compare_runs(runs["clean0"], runs["clean1"], steps=[30, 45], **kw)
    other = str(tmp_path / "other")
    mgr = CheckpointManager(other, keep=None, async_save=False)
    cfg = RUN_CFG.replace(vocab_size=640)
    mgr.save(30, {"model": olmo3.OLMo3(cfg, jax.random.key(0))}, {"model_config": config_to_dict(cfg)})
    mgr.close()
    with pytest.raises(ValueError, match=r"different model configs \{'vocab_size': \(512, 640\)\}"):
        eval_script.compare_runs(runs["clean0"], other, **kw)
    lonely = str(tmp_path / "lonely")
    mgr = CheckpointManager(lonely, keep=None, async_save=False)
    mgr.save(7, {"model": olmo3.OLMo3(RUN_CFG, jax.random.key(0))}, {"model_config": config_to_dict(RUN_CFG)})
    mgr.close()
    with pytest.raises(ValueError, match="share no checkpoint step"):
        eval_script.compare_runs(runs["clean0"], lonely, **kw)
    with pytest.raises(ValueError, match="different vocab sizes"):
        heldout.model_agreement(olmo3.OLMo3(RUN_CFG, jax.random.key(0)), olmo3.OLMo3(cfg, jax.random.key(0)),
                           np.zeros((1, 8), np.int32))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="corrupt or truncated"):
        hf.SafetensorsReader(str(tmp_path / "hf"))


def test_cli_one_model_two_models_and_two_runs(runs, tmp_path):
    F = eval_script.F
    files = ",".join(f"{d}={ds.paths[0]}" for d, ds in runs["sets_fn"](None).items())
    common = [f"--heldout={files}", "--eval_seq_len=32", "--max_eval_batches=2"]
    F.unparse_flags()
    F(["eval.py", f"--model={runs['clean0']}", f"--model_b={runs['clean0']}/checkpoints/30", *common,
       f"--out={tmp_path / 'one'}", "--kl_instances=3"])
    eval_script.main(["eval.py"])
    res = json.load(open(tmp_path / "one" / "eval.json"))
    assert res["step"] == 90 and res["eval/chain_a/loss_delta"] > 0.1 and res["kl/mean"] > 0.01
    model, _ = load.load_model(runs["clean0"])
    # KL(A || B) over the first --kl_instances windows of each domain (model_agreement: the direct formulas' above)
    rows = np.concatenate([np.stack([ds[i] for i in range(3)]) for _, ds in sorted(runs["sets_fn"](None).items())])
    agree = heldout.model_agreement(model, load.load_model(runs["clean0"], step=30)[0], rows.astype(np.int32))
    assert [res[f"kl/{k}"] for k in ("mean", "max", "top1", "top10")] == pytest.approx(
        [agree[k] for k in ("kl_mean", "kl_max", "top1", "top10")], rel=1e-6)
    want = heldout.heldout(model, runs["sets_fn"](None)["chain_a"], batch_size=8, max_batches=2)["loss"]
    assert res["eval/chain_a/loss"] == pytest.approx(want, rel=1e-6)
    F.unparse_flags()
    F(["eval.py", f"--model={runs['clean0']}", *common, f"--tasks={os.path.join(FIXTURES, 'tiny_mc.jsonl')}"])
    # dolma2 ids vs vocab 512: refused before the held-out evaluation (it was refused after it)
    with pytest.raises(app.UsageError, match="its vocabulary has 512 rows, fewer than the 100278 tokens of dolma2"):
        eval_script.main(["eval.py"])
    F.unparse_flags()
    F(["eval.py", f"--compare={runs['clean0']},{runs['repeat']}", *common, "--tol=0.1", "--train_loss_window=10",
       f"--out={tmp_path / 'cmp'}"])
    with pytest.raises(SystemExit) as e:  # exit status 2: flagged
        eval_script.main(["eval.py"])
    assert e.value.code == 2 and (tmp_path / "cmp" / "report.png").exists()
    # a clean seed pair: exit 0, and the report says so
    F.unparse_flags()
    F(["eval.py", f"--compare={runs['clean0']},{runs['clean1']}", *common, "--max_eval_batches=4", "--tol=0.08",
       "--train_loss_window=10", f"--out={tmp_path / 'ok'}"])
    with pytest.raises(SystemExit) as e:
        eval_script.main(["eval.py"])
    assert e.value.code == 0 and "no memorization signature" in open(tmp_path / "ok" / "report.md").read()
    assert os.path.getsize(tmp_path / "ok" / "report.csv") > 0
    F.unparse_flags()


def test_cli_model_b_scores_the_tasks_of_both_models(tmp_path, caplog):
    """--model_b with --tasks: B's task scores beside A's, as deltas B - A with their standard
    error in quadrature (before, B was scored on held-out data only and the tasks were A's). A B
    trained in another precision than it is scored in gets A's warning (it had none)."""
    F = eval_script.F
    cfg = CFG.replace(vocab_size=data.VOCAB_SIZE)
    for name, seed in (("a", 0), ("b", 1)):
        mgr = CheckpointManager(str(tmp_path / name), keep=None, async_save=False)
        run = {"compute_dtype": "bfloat16" if name == "b" else "float32", "float8": False}
        mgr.save(1, {"model": olmo3.OLMo3(cfg, jax.random.key(seed))},
                 {"model_config": config_to_dict(cfg), "precision": run})
        mgr.close()
    np.arange(64, dtype=np.uint32).tofile(tmp_path / "h.npy")
    task = os.path.join(FIXTURES, "tiny_mc.jsonl")
    F.unparse_flags()
    F(["eval.py", f"--model={tmp_path / 'a'}", f"--model_b={tmp_path / 'b'}", f"--heldout=h={tmp_path / 'h.npy'}",
       "--eval_seq_len=32", f"--tasks={task}", f"--out={tmp_path / 'out'}"])
    try:
        with caplog.at_level("WARNING"):
            eval_script.main(["eval.py"])
    finally:
        F.unparse_flags()
    warned = [r.getMessage() for r in caplog.records if "was trained with" in r.getMessage()]
    assert len(warned) == 1 and f"{tmp_path / 'b'}" in warned[0] and "--compute_dtype=bfloat16" in warned[0]
    got = json.load(open(tmp_path / "out" / "eval.json"))
    ra, rb = (scoring.multiple_choice(scoring.Scorer(load.load_model(str(tmp_path / n))[0], data.dolma2(), 512),
                                      *scoring.load_task(task)) for n in ("a", "b"))
    for m in ("acc", "acc_norm"):
        assert got[f"task/tiny_mc/{m}"] == pytest.approx(ra[m])
        assert got[f"task/tiny_mc/{m}_delta"] == pytest.approx(rb[m] - ra[m])
        assert got[f"task/tiny_mc/{m}_delta_stderr"] == pytest.approx(math.hypot(ra[f"{m}_stderr"], rb[f"{m}_stderr"]))
    assert ra != rb and "task/tiny_mc/acc_stderr_delta" not in got


def test_heldout_domains_from_a_data_mix(tmp_path, monkeypatch):
    """--data_mix: one held-out domain per label of a mix file (data/mixes.py), files under --data_root."""
    mixes = pytest.importorskip("data.mixes")
    tok_dir = mixes.tokenizer_dir("local-ppl", "dolma2")
    for label, k in (("c4_en", 0), ("wiki", 1)):
        d = tmp_path / "root" / "ppl" / tok_dir / label
        d.mkdir(parents=True)
        token_file(d / "part-0.npy", np.random.default_rng(k).integers(0, 512, size=(4, 32)))
    (tmp_path / "mixes").mkdir()
    (tmp_path / "mixes" / "local-ppl.txt").write_text(
        "# label,path\nc4_en,ppl/{TOKENIZER}/c4_en/part-0.npy\nwiki,ppl/{TOKENIZER}/wiki/part-0.npy\n")
    monkeypatch.setenv("OLMO3_MIXES_DIR", str(tmp_path / "mixes"))
    sets = eval_script.heldout_sets("stdlib", 32, 512, data_mix="local-ppl", data_root=str(tmp_path / "root"))
    assert sorted(sets) == ["c4_en", "wiki"] and all(len(ds) == 4 for ds in sets.values())


def test_local_task_with_a_bad_document_names_it(tmp_path):
    """A 'gold' out of range names the document and its choices (the message listed keys that
    were all present); a line that is not an object says so. Choices that are no strings (a
    TypeError traceback, exit 1, after the model and held-out loss) or empty, and a few-shot pool
    of other documents (KeyError) or of too few, are named by file and document too."""
    good = '{"context": "a", "choices": ["x", "y"], "gold": 0}'
    for lines, shots, says in (
            ([good, '{"context": "b", "choices": ["x"], "gold": 3}'], None,
             "document 1 has 'gold' 3, not an index into its 1 choices (0..0)"),
            (['[1, 2]'], None, "1: a JSON list, not an object"),
            (['{"context": "b", "choices": [2, 3], "gold": 0}'], None,
             "document 0 needs 'context' (str), 'choices' (a non-empty list of non-empty strings) and 'gold' (an "
             "index into choices); got keys ['choices', 'context', 'gold'], choices [2, 3]"),
            (['{"context": "b", "choices": ["", "y"], "gold": 0}'], None,
             "document 0 needs 'context' (str), 'choices' (a non-empty list of non-empty strings) and 'gold' (an "
             "index into choices); got keys ['choices', 'context', 'gold'], choices ['', 'y']"),
            ([good], ['{"context": "s", "answer": "x"}'], "document 0 needs 'context' (str)"),
            ([good, good], None, "num_fewshot=2 but each document takes its shots from the other 1"),
            ([good], [good], "num_fewshot=2 but it holds 1 examples")):
        (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
        (tmp_path / "t.fewshot.jsonl").unlink(missing_ok=True)
        if shots:
            (tmp_path / "t.fewshot.jsonl").write_text("\n".join(shots) + "\n")
        where = tmp_path / ("t.fewshot.jsonl" if shots else "t.jsonl")
        with pytest.raises(ValueError, match=re.escape(f"{where}") + ":? ?" + re.escape(says)):
            scoring.load_task(str(tmp_path / "t.jsonl"), num_fewshot=2)


def test_cli_quiets_library_logs_before_jax_starts(monkeypatch):
    """eval.py sets the libraries' log levels before cluster.start starts JAX's backend, whose C++
    log level is read then (olmo3/logs.py quiet_library_logs), as train.py and bench.py do."""
    from absl import logging as absl_logging
    from olmo3 import cluster, logs

    class Started(Exception):
        pass

    def start(*args, **kwargs):
        assert logs._FILTER in absl_logging.get_absl_handler().filters
        raise Started
    F = eval_script.F
    handler = absl_logging.get_absl_handler()
    monkeypatch.setattr(cluster, "start", start)
    monkeypatch.setattr(handler, "filters", [f for f in handler.filters if f is not logs._FILTER])
    F.unparse_flags()
    F(["eval.py", "--model=unused"])
    try:
        with pytest.raises(Started):
            eval_script.main(["eval.py"])
    finally:
        F.unparse_flags()


def test_results_files_are_strict_json(tmp_path):
    """eval.json held NaN (the standard error of one document, a bucket no document reaches),
    which strict JSON readers (jq, JSON.parse) refuse for the whole file: it is null now."""
    def refuse(constant):
        raise ValueError(f"{constant} is no JSON")
    eval_script.write_json(str(tmp_path), "eval.json", {"a": float("nan"), "b": [1.5, float("-inf")], "c": "x"},
                           indent=1)
    assert json.loads((tmp_path / "eval.json").read_text(), parse_constant=refuse) == {"a": None, "b": [1.5, None],
                                                                                       "c": "x"}


def test_yarn_extends_the_positions_eval_scores_up_to(tmp_path):
    """--eval_seq_len past max_position_embeddings advised '--yarn to extend it', and with --yarn the
    same error came back: --yarn set YaRN's factor, never the bound. With --yarn the bound is the
    context YaRN extends to (factor x original, convert.py's config.json), and the score at that
    length is the one heldout() gives the YaRN model."""
    F = eval_script.F
    hf.to_hf(olmo3.OLMo3(RUN_CFG.replace(max_position_embeddings=16), jax.random.key(0)), tmp_path / "hf")
    held = token_file(tmp_path / "h.npy", chain(np.random.default_rng(3), 4))
    common = [f"--model={tmp_path / 'hf'}", f"--heldout=h={held}", f"--out={tmp_path / 'out'}"]
    yarn = ["--yarn", "--yarn_factor=2", "--yarn_original_max_position=16"]
    for args, says in (([], "--eval_seq_len=32 exceeds the model's max_position_embeddings=16; give at most 16, or "
                            "--yarn with --yarn_factor x --yarn_original_max_position at least 32 to extend it"),
                       (["--eval_seq_len=64", *yarn], "--eval_seq_len=64 exceeds the model's max_position_embeddings"
                                                      "=16 and the context its YaRN extends it to (2 x 16); give at "
                                                      "most 32"),
                       # --yarn is --model's: B, without it, was scored past its positions
                       (["--eval_seq_len=32", *yarn, f"--model_b={tmp_path / 'hf'}"],
                        "--eval_seq_len=32 exceeds --model_b's max_position_embeddings=16; give at most 16")):
        F.unparse_flags()
        F(["eval.py", *common, *args] + ([] if args else ["--eval_seq_len=32"]))
        try:
            with pytest.raises(app.UsageError, match=re.escape(says)):
                eval_script.main(["eval.py"])
        finally:
            F.unparse_flags()
    F(["eval.py", *common, "--eval_seq_len=32", *yarn])
    try:
        eval_script.main(["eval.py"])
    finally:
        F.unparse_flags()
    model, _ = load.load_model(str(tmp_path / "hf"), yarn=olmo3.YaRN(factor=2.0, original_max_position=16))
    want = heldout.heldout(model, data.FSLDataset([held], 32, vocab_size=512), batch_size=8)["loss"]
    assert json.load(open(tmp_path / "out" / "eval.json"))["eval/h/loss"] == pytest.approx(want, rel=1e-6)


def test_task_deltas_and_the_doc_lengths_flag_over_the_checkpoints_setting():
    """--model_b's deltas: B - A per score, standard errors in quadrature, nothing for a count
    (`/n`) or for a standard error itself. --doc_lengths / --nodoc_lengths win over the setting
    the checkpoint's run scored with; left out, that setting (off where unknown: an HF model)."""
    a = {"arc/acc": 0.5, "arc/acc_stderr": 0.03, "arc/n": 100, "mmlu/bpb": 1.2}
    b = {"arc/acc": 0.6, "arc/acc_stderr": 0.04, "arc/n": 100, "mmlu/bpb": 1.0}
    assert eval_script.task_deltas(a, b) == pytest.approx({"arc/acc_delta": 0.1, "arc/acc_delta_stderr": 0.05,
                                                           "mmlu/bpb_delta": -0.2})
    for flag, saved, want in ((True, False, True), (False, True, False), (None, True, True), (None, None, False)):
        assert eval_script.segments_for({"doc_lengths": saved}, flag) is want


def test_a_failed_results_write_leaves_the_old_file_whole(tmp_path):
    """eval.py's results files are written whole or not at all: a result that is no JSON (a numpy
    float32 score, which json cannot write) fails the write and leaves the previous eval.json as it
    was, and no stray file beside it. Reference: the file system."""
    (tmp_path / "eval.json").write_text('{"old": 1}\n')
    with pytest.raises(TypeError, match="float32"):
        eval_script.write_json(str(tmp_path), "eval.json", {"a": 1.0, "b": "x" * 100, "c": np.float32(2.0)}, indent=2)
    assert (tmp_path / "eval.json").read_text() == '{"old": 1}\n'
    assert os.listdir(tmp_path) == ["eval.json"]


def test_eval_padded_checkpoint_scores_documents_and_kl_reads_windows(tmp_path):
    """eval.py on a checkpoint whose run scored padded held-out documents (extra eval_padded, train.py
    --eval_padded): without --eval_padded the held-out loss is the padded documents' (as the run's own
    eval/<domain>/loss), and --model_b's KL reads fixed-length windows of the same files, never the
    padded rows. Reference: heldout.heldout on data.PaddedFSLDataset (itself against a numpy oracle in
    test_eval.py) and heldout.model_agreement on data.FSLDataset windows."""
    cfg = CFG.replace(vocab_size=data.VOCAB_SIZE)
    for name, seed in (("a", 0), ("b", 1)):
        mgr = CheckpointManager(str(tmp_path / name), keep=None, async_save=False)
        mgr.save(1, {"model": olmo3.OLMo3(cfg, jax.random.key(seed))},
                 {"model_config": config_to_dict(cfg), "eval_padded": True})
        mgr.close()
    rng = np.random.default_rng(3)
    docs = [list(rng.integers(0, 500, size=int(n))) + [data.EOS_ID] for n in rng.integers(5, 30, size=12)]
    path = str(tmp_path / "h.npy")
    np.concatenate(docs).astype(np.uint32).tofile(path)
    F = eval_script.F
    F.unparse_flags()
    F(["eval.py", f"--model={tmp_path / 'a'}", f"--model_b={tmp_path / 'b'}", f"--heldout=h={path}",
       "--eval_seq_len=32", "--kl_instances=4", f"--out={tmp_path / 'out'}"])
    try:
        eval_script.main(["eval.py"])
    finally:
        F.unparse_flags()
    got = json.load(open(tmp_path / "out" / "eval.json"))
    a, b = (load.load_model(str(tmp_path / n))[0] for n in ("a", "b"))
    padded = data.PaddedFSLDataset([path], 32, vocab_size=cfg.vocab_size)
    windows = data.FSLDataset([path], 32, vocab_size=cfg.vocab_size)
    want = heldout.heldout(a, padded, batch_size=8, max_batches=4)["loss"]
    assert got["eval/h/loss"] == pytest.approx(want, rel=1e-6)
    assert got["eval/h/loss"] != pytest.approx(heldout.heldout(a, windows, batch_size=8, max_batches=4)["loss"],
                                               rel=1e-3)
    rows = np.stack([windows[i] for i in range(min(4, len(windows)))]).astype(np.int32)
    agree = heldout.model_agreement(a, b, rows)
    assert [got[f"kl/{k}"] for k in ("mean", "max", "top1", "top10")] == pytest.approx(
        [agree[k] for k in ("kl_mean", "kl_max", "top1", "top10")], rel=1e-6)


def test_lm_eval_tasks_keep_their_own_shots_unless_num_fewshot_is_given(tmp_path, monkeypatch):
    """eval.py's --lm_eval_tasks without --num_fewshot leaves each task its own shots (lm-eval's command
    line: num_fewshot None; a YAML's num_fewshot: 2 is scored 2-shot), with it the flag's. Reference:
    lm-eval-harness's own record of the shots it scored (results["n-shot"])."""
    lm_eval = pytest.importorskip("lm_eval")
    lm_eval_task(tmp_path, "tiny_mc_2shot", os.path.join(FIXTURES, "tiny_mc.jsonl"), TINY_MC_2SHOT)
    runs, evaluate = [], lm_eval.simple_evaluate
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kw: runs.append(evaluate(**kw)) or runs[-1])
    model = olmo3.OLMo3(CFG.replace(vocab_size=data.VOCAB_SIZE), jax.random.key(4))
    F = eval_script.F
    for extra, shots in (([], 2), (["--num_fewshot=0"], 0), (["--num_fewshot=1"], 1)):
        F.unparse_flags()
        F(["eval.py", "--model=unused", "--lm_eval_tasks=tiny_mc_2shot", f"--lm_eval_include={tmp_path}", *extra])
        try:
            got = eval_script.tasks_report(model, 256)
        finally:
            F.unparse_flags()
        assert runs[-1]["n-shot"]["tiny_mc_2shot"] == shots, extra
        assert got["lm_eval/tiny_mc_2shot/acc"] == runs[-1]["results"]["tiny_mc_2shot"]["acc,none"]


def test_olmo_tasks_get_limit_batch_rows_and_context(monkeypatch):
    """--olmo_tasks gets --limit, --olmo_batch_rows and the context length: the arguments
    olmo_tasks_report receives."""
    seen = []
    monkeypatch.setattr(eval_script, "olmo_tasks_report", lambda model, labels, **kw: seen.append((labels, kw)) or {})
    F = eval_script.F
    F.unparse_flags()
    F(["eval.py", "--model=unused", "--olmo_tasks=arc_easy_rc_5shot", "--limit=5", "--olmo_batch_rows=3"])
    try:
        eval_script.tasks_report(None, 321)
    finally:
        F.unparse_flags()
    assert seen == [(["arc_easy_rc_5shot"], {"limit": 5, "max_length": 321, "batch_rows": 3})]
