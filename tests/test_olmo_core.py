"""convert.py's olmo-core: path against OLMo-core itself (tests/olmo_core_reference.py builds,
trains and checkpoints a small OLMo 3 with OLMo-core's own model, train module, SkipStepAdamW and
Checkpointer): logits, parameters and Adam moments after conversion, one further training step,
the way back into OLMo-core, and the command line."""
import dataclasses
import json
import os
import re
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("olmo_core.train.train_module", reason="pip install --no-deps ai2-olmo-core==3.0.0 + test extras")

import olmo_core_reference as R  # noqa: E402

from olmo3 import checkpoint, heldout, load, olmo_core, optim, schedules, step  # noqa: E402
from olmo3.model import OLMo3, decay_mask  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from test_train import source_corpus  # noqa: E402
from test_convert import convert  # noqa: E402  (one convert.py per process: absl flags are global)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """OLMo-core's run saved at step2, converted to Orbax once; the reference numbers."""
    d = tmp_path_factory.mktemp("olmo_core")
    eval_tokens = R.batches(seed=5)[0]
    out = R.build(str(d / "run"), eval_tokens)
    out["eval_tokens"] = eval_tokens
    out["config"] = convert.olmo_core_to_orbax(str(d / "run" / "step2"), str(d / "orbax"))
    out["dir"] = d
    return out


def restore(orbax_dir, config):
    abstract = eqx.filter_eval_shape(OLMo3, config, jax.random.key(0))
    opt = optim.SkipStepAdamW(schedules.constant_schedule(0.0))
    run, s = checkpoint.locate(orbax_dir)
    mgr = checkpoint.CheckpointManager(run, read_only=True)
    s = mgr.latest_step() if s is None else s
    state, extra = mgr.restore(s, {"model": abstract, "opt": eqx.filter_eval_shape(opt.init, abstract)})
    mgr.close()
    return state["model"], state["opt"], extra, s


def ours_by_olmo_core_name(tree, n_layers):
    """OLMo-core parameter name -> our tensor in OLMo-core's layout (transposed back)."""
    out = {}
    for field, layer, name, t in olmo_core.param_names(n_layers):
        a = np.asarray(getattr(tree.layers, field)[layer] if layer is not None else getattr(tree, field))
        out[name] = a.T if t else a
    return out


def test_rms_norm_in_bf16_equals_olmo_core_under_fsdp_mixed_precision():
    """bf16 compute over an fp32 norm weight off the bf16 grid (a trained master weight): our
    rms_norm against OLMo-core's RMSNorm run as its FSDP runs it, on the bf16 parameter that
    MixedPrecisionPolicy(param_dtype=bfloat16) materialises (olmo_core/nn/transformer/model.py
    apply_fsdp). Forward and weight gradient equal bit for bit; multiplying the fp32 weight
    itself instead matched about 73% of the outputs."""
    from olmo_core.nn.layer_norm import RMSNorm

    from olmo3.model import rms_norm
    rng = np.random.default_rng(0)
    d, eps = 512, 1e-6
    x = jnp.asarray(rng.standard_normal((64, d)), jnp.bfloat16)
    w = (1 + 0.05 * rng.standard_normal(d)).astype(np.float32)
    g = jnp.asarray(rng.standard_normal((64, d)), jnp.bfloat16)      # the gradient arriving, bf16
    norm = RMSNorm(size=d, eps=eps, bias=False)
    norm.weight = torch.nn.Parameter(torch.tensor(w).bfloat16())     # what FSDP hands the module
    out = norm(torch.tensor(np.asarray(x.astype(jnp.float32))).bfloat16())
    (out.float() * torch.tensor(np.asarray(g.astype(jnp.float32)))).sum().backward()

    f = lambda w: rms_norm(x, w, eps).astype(jnp.float32)              # noqa: E731
    ours, vjp = jax.vjp(f, jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(ours), out.detach().float().numpy())
    np.testing.assert_array_equal(np.asarray(vjp(g.astype(jnp.float32))[0]), norm.weight.grad.float().numpy())


def test_config_read_from_olmo_core_config_json(ref):
    c = ref["config"]
    assert (c.vocab_size, c.d_model, c.n_layers, c.n_heads, c.head_dim, c.mlp_hidden, c.window) == (
        R.VOCAB, 64, 4, 4, 16, 192, R.WINDOW)
    assert c.layer_pattern == ("sliding", "sliding", "sliding", "full") and c.norm_eps == 1e-6
    assert c.rope_theta == 500_000 and c.yarn is None


def test_a_model_unlike_the_7b_goes_through_olmo_core_s_config_and_back():
    """Every architecture field away from the 7B's (GQA, head_dim, window, pattern, theta, eps,
    YaRN) survives OLMo-core's own TransformerConfig (from_dict, as_config_dict) unchanged."""
    from olmo_core.nn.transformer import TransformerConfig

    from olmo3.config import Config, YaRN, config_diff
    c = Config.tiny(vocab_size=128, d_model=32, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=16, mlp_hidden=48,
                    window=9, layer_pattern=("sliding", "full"), rope_theta=1e4, norm_eps=1e-5,
                    yarn=YaRN(factor=2.0, original_max_position=64, beta_fast=8.0, beta_slow=2.0))
    theirs = TransformerConfig.from_dict(json.loads(json.dumps(olmo_core.config_to_olmo_core(c))))
    assert theirs.num_params == c.num_params()
    assert config_diff(c, olmo_core.config_from_olmo_core(json.loads(json.dumps(theirs.as_config_dict())))) == {}


def test_7b_preset_is_olmo_core_s_olmo3_7b():
    """Config.olmo3_7b() against OLMo-core's TransformerConfig.olmo3_7B (the recipe's training code):
    widths, heads, MLP, the sliding pattern and window, RoPE theta and the RMSNorm eps."""
    from olmo_core.nn.transformer import TransformerConfig

    from olmo3.config import Config
    ref, c = TransformerConfig.olmo3_7B(vocab_size=100278), Config.olmo3_7b()
    attn = ref.block.sequence_mixer
    assert (c.d_model, c.n_layers, c.n_heads, c.mlp_hidden) == (
        ref.d_model, ref.n_layers, attn.n_heads, ref.block.feed_forward.hidden_size)
    assert c.n_kv_heads == (attn.n_kv_heads or attn.n_heads) and c.head_dim == ref.d_model // attn.n_heads
    assert [c.window if t == "sliding" else -1 for t in c.layer_pattern] == attn.sliding_window.pattern
    assert c.rope_theta == attn.rope.theta and attn.rope.scaling is None and c.yarn is None
    assert c.norm_eps == ref.block.layer_norm.eps == attn.qk_norm.eps


def test_stage3_config_from_hf_builds_in_olmo_core():
    """The long-context 7B read from an HF config (which carries YaRN's attention factor) and
    written as an OLMo-core config: OLMo-core's TransformerConfig.from_dict takes it, and its
    rope (YaRN on the full-attention layers only) and size are those of olmo3_7B().with_rope_scaling
    as the long-context script builds them."""
    from olmo_core.nn.rope import YaRNRoPEScalingConfig
    from olmo_core.nn.transformer import TransformerConfig

    from olmo3 import hf
    from olmo3.config import Config
    c = hf.config_from_hf(hf.config_to_hf(Config.olmo3_7b_long().replace(vocab_size=100352)))
    assert c.yarn.attention_factor is not None
    model = olmo_core.config_to_olmo_core(c)
    got = TransformerConfig.from_dict(json.loads(json.dumps(model)))
    want = TransformerConfig.olmo3_7B(vocab_size=100352).with_rope_scaling(
        YaRNRoPEScalingConfig(factor=8, beta_fast=32, beta_slow=1, old_context_len=8192), full_attn_layers_only=True)
    assert got.num_params == want.num_params
    rope = lambda block: block.sequence_mixer.rope.as_config_dict()   # noqa: E731
    assert rope(got.block) == rope(want.block)
    assert sorted(got.block_overrides) == sorted(want.block_overrides) == [3, 7, 11, 15, 19, 23, 27, 31]
    for i in want.block_overrides:
        assert rope(got.block_overrides[i]) == rope(want.block_overrides[i])
    assert olmo_core.config_from_olmo_core(model) == c.replace(yarn=dataclasses.replace(c.yarn, attention_factor=None))
    # The OLMo 3 runs' own config.json (OLMo-core 2.x) call the mixer `attention`; 3.0 reads both.
    legacy = json.loads(json.dumps(model))
    for block in [legacy["block"], *legacy["block_overrides"].values()]:
        block["attention"] = block.pop("sequence_mixer")
    assert TransformerConfig.from_dict(json.loads(json.dumps(legacy))).num_params == want.num_params
    assert olmo_core.config_from_olmo_core(legacy) == olmo_core.config_from_olmo_core(model)


def test_settings_olmo3_lacks_are_refused(tmp_path):
    """OLMo-core settings that change what the model computes, and that OLMo 3 does not use: each
    is refused naming its field (the weights of such a model converted bit for bit into an OLMo 3
    that computes something else, exit 0). OLMo 3's own configs, YaRN included, pass."""
    import copy

    from olmo_core.nn.attention import GateConfig
    from olmo_core.nn.feed_forward import ActivationFunction
    from olmo_core.nn.layer_norm import LayerNormConfig, LayerNormType
    from olmo_core.nn.moe import MoEConfig
    from olmo_core.nn.rope import (ABFRoPEScalingConfig, PIRoPEScalingConfig, StepwiseRoPEScalingConfig,
                                   YaRNRoPEScalingConfig)
    from olmo_core.nn.transformer import TransformerConfig
    as_json = lambda c: json.loads(json.dumps(c.as_config_dict()))   # noqa: E731
    base = TransformerConfig.olmo3_7B(vocab_size=100352)
    long = base.with_rope_scaling(YaRNRoPEScalingConfig(factor=8, old_context_len=8192), full_attn_layers_only=True)
    for ok in (base, long):
        olmo_core.config_from_olmo_core(as_json(ok))
    # OLMo 3's own configs were written before OLMo-core 3.0.0 dropped YaRN's unused
    # attention_rescale_factor (PR #456); OLMo-core still reads them (_IGNORE_FIELDS), and so do we.
    written_before = as_json(long)
    for over in written_before["block_overrides"].values():
        over["sequence_mixer"]["rope"]["scaling"]["attention_rescale_factor"] = 1.0
    assert TransformerConfig.from_dict(written_before) == long
    assert olmo_core.config_from_olmo_core(written_before) == olmo_core.config_from_olmo_core(as_json(long))

    def changed(c, set_):
        c = copy.deepcopy(c)
        set_(c)
        return as_json(c)

    mixer = lambda c: c.block.sequence_mixer   # noqa: E731

    def edited(c, path, value):   # in the dict: olmo3_7B's three norms are one object
        model = as_json(c)
        *keys, last = path.split(".")
        d = model
        for k in keys:
            d = d[k]
        d[last] = value
        return model

    partial_yarn = as_json(long)
    del partial_yarn["block_overrides"]["31"]
    cases = {
        "embed_scale": changed(base, lambda c: setattr(c, "embed_scale", 8.0)),
        "tie_word_embeddings": changed(base, lambda c: setattr(c, "tie_word_embeddings", True)),
        "attention.clip_qkv": changed(base, lambda c: setattr(mixer(c), "clip_qkv", 0.05)),
        "attention.bias": changed(base, lambda c: setattr(mixer(c), "bias", None)),   # unset: a bias
        "block.layer_norm": changed(base, lambda c: setattr(c.block.layer_norm, "name", LayerNormType.default)),
        "feed_forward.activation": changed(base, lambda c: setattr(c.block.feed_forward, "activation",
                                                                   ActivationFunction.gelu_tanh)),
        "block_overrides[3]": changed(long, lambda c: setattr(c.block_overrides[3].feed_forward, "hidden_size", 64)),
        "attention.gate": changed(base, lambda c: setattr(mixer(c), "gate", GateConfig())),
        "embedding_norm": changed(base, lambda c: setattr(c, "embedding_norm", LayerNormConfig())),
        "attention.rope.partial_rotary_factor": changed(base, lambda c: setattr(mixer(c).rope, "partial_rotary_factor",
                                                                                0.5)),
        "block.feed_forward_moe": changed(base, lambda c: setattr(c.block, "feed_forward_moe",
                                                                  MoEConfig(num_experts=2, hidden_size=64))),
        "qk_norm": edited(base, "block.sequence_mixer.qk_norm.name", "default"),
        "norm eps differ (block.layer_norm.eps=1e-06, qk_norm.eps=0.001": edited(
            base, "block.sequence_mixer.qk_norm.eps", 1e-3),
        "lm_head.layer_norm.eps=0.01)": edited(base, "lm_head.layer_norm.eps", 1e-2),
        # YaRN on some full-attention layers only, or on every layer: neither is OLMo 3's
        "block_overrides on layers [3, 7, 11, 15, 19, 23, 27]": partial_yarn,
        "RoPE scaling on every layer": as_json(base.with_rope_scaling(
            YaRNRoPEScalingConfig(factor=8, old_context_len=8192), full_attn_layers_only=False)),
    }
    # Other RoPE scalings on the full-attention layers: Stepwise (Llama 3's) has YaRN's factor and
    # old_context_len and was read as YaRN; PI and ABF were a KeyError.
    for scaling in (StepwiseRoPEScalingConfig(factor=8, old_context_len=8192), PIRoPEScalingConfig(factor=8),
                    ABFRoPEScalingConfig(new_theta=8e6)):
        cases[f"block_overrides[3].attention.rope.scaling is {type(scaling).__name__}"] = \
            as_json(base.with_rope_scaling(scaling, full_attn_layers_only=True))
    for field, model in cases.items():
        with pytest.raises(olmo_core.NotOLMo3, match=re.escape(field)):
            olmo_core.config_from_olmo_core(model)
    # Beside a checkpoint: one line naming the file (convert.py exits 2), not the advice to delete it.
    (tmp_path / "config.json").write_text(json.dumps({"model": cases["embed_scale"]}))
    with pytest.raises(olmo_core.UserError, match=r"config\.json: embed_scale is 8\.0 where OLMo 3 has None; .*OLMo 3 only"):
        olmo_core.read_config(str(tmp_path), object.__new__(olmo_core.DistCheckpointReader))   # not read
    # Sections of another type, and an empty window pattern: an AttributeError / ZeroDivisionError
    # traceback (exit 1), where a config.json of another shape is one line naming it.
    empty = as_json(base)
    empty["block"]["sequence_mixer"]["sliding_window"]["pattern"] = []
    for model in ({"block": "x"}, {"block": {"sequence_mixer": ["x"]}}, empty):
        (tmp_path / "config.json").write_text(json.dumps({"model": model}))
        with pytest.raises(olmo_core.UserError, match=r"config\.json: not an OLMo-core experiment config"):
            olmo_core.read_config(str(tmp_path), object.__new__(olmo_core.DistCheckpointReader))


@pytest.mark.parametrize("pattern,first,last,n_layers", [
    ([4096, 4096, 4096, -1], False, True, 32),    # OLMo 3 7B
    ([4096, 4096, 4096, -1], True, True, 8),      # OLMo-core's defaults: a forced first layer shifts the pattern
    ([8, -1], False, True, 6),                    # the forced last layer is already full
    ([8, 8, -1], False, True, 4),                 # ... or not: one period of 4 layers
    ([8], True, False, 4),
])
def test_layer_windows_follow_olmo_core(pattern, first, last, n_layers):
    """Per-layer windows read from an OLMo-core config equal its SlidingWindowAttentionConfig's,
    and the Config's layer types follow them."""
    from olmo_core.nn.attention import SlidingWindowAttentionConfig
    sw = SlidingWindowAttentionConfig(pattern=pattern, force_full_attention_on_first_layer=first,
                                      force_full_attention_on_last_layer=last)
    want = [sw._get_window_size(i, n_layers) for i in range(n_layers)]
    assert olmo_core.layer_windows(json.loads(json.dumps(sw.as_config_dict())), n_layers) == want
    if first and last:   # a config that leaves both out (written by hand, or before them): OLMo-core's defaults
        unset = json.loads(json.dumps(SlidingWindowAttentionConfig(pattern=pattern).as_config_dict()))
        for key in ("force_full_attention_on_first_layer", "force_full_attention_on_last_layer"):
            del unset[key]
        assert olmo_core.layer_windows(unset, n_layers) == want
    model = olmo_core.config_to_olmo_core(olmo3_config(n_layers))
    model["block"]["sequence_mixer"]["sliding_window"] = sw.as_config_dict()
    c = olmo_core.config_from_olmo_core(model)
    assert [("full" if w == -1 else "sliding") for w in want] == list(c.layer_types())


@pytest.mark.parametrize("pattern", [("full", "sliding"), ("sliding",), ("sliding", "full"),
                                     ("sliding", "sliding", "full")])
def test_exported_windows_are_olmo_core_s(pattern):
    """Our layer pattern written as OLMo-core's config (convert.py --to=olmo-core:) is read by
    OLMo-core as the same per-layer windows, a last layer that slides included (OLMo-core forces
    its last layer full unless told not to)."""
    import dataclasses

    from olmo_core.nn.transformer import TransformerConfig
    c = dataclasses.replace(olmo3_config(len(pattern) * 2), layer_pattern=pattern)
    theirs = TransformerConfig.from_dict(json.loads(json.dumps(olmo_core.config_to_olmo_core(c))))
    sw = theirs.block.sequence_mixer.sliding_window
    got = ["full" if sw._get_window_size(i, c.n_layers) == -1 else "sliding" for i in range(c.n_layers)]
    assert got == list(c.layer_types())
    assert {sw._get_window_size(i, c.n_layers) for i in range(c.n_layers)} - {-1} <= {c.window}


def olmo3_config(n_layers):
    from olmo3.config import Config
    return Config(vocab_size=512, d_model=64, n_layers=n_layers, n_heads=4, n_kv_heads=4, head_dim=16, mlp_hidden=128,
                  window=8, layer_pattern=("full",))


def test_logits_equal_olmo_core_fp32(ref):
    """Our forward on the converted weights vs OLMo-core's Transformer on the same tokens: every one
    of the 100352 padded-vocabulary logits, sliding and full layers, QK-norm gains away from 1."""
    model, info = load.load_model(str(ref["dir"] / "orbax"))
    ours = np.asarray(jax.vmap(model)(jnp.asarray(ref["eval_tokens"], jnp.int32)))
    theirs = ref["logits"]
    assert ours.shape == theirs.shape == (R.BATCH, R.SEQ, R.VOCAB)
    r = heldout.logit_agreement(theirs, ours)
    assert r["kl_max"] < 1e-9 and r["top1"] == 1.0, r  # fp32 floor (DESIGN §5: ~1e-6 or better)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
    pad = slice(R.TOKENIZER_VOCAB, None)  # the padded rows of lm_head score like any other
    np.testing.assert_allclose(ours[..., pad], theirs[..., pad], rtol=0, atol=1e-5)


def test_params_and_adam_moments_bit_equal(ref):
    model, opt, extra, label = restore(str(ref["dir"] / "orbax"), ref["config"])
    st = ref["state"]
    L = ref["config"].n_layers
    params = ours_by_olmo_core_name(model, L)
    mu, nu = ours_by_olmo_core_name(opt.mu, L), ours_by_olmo_core_name(opt.nu, L)
    assert len(params) == len([k for k in st if k.startswith("model.")]) == 3 + 11 * L
    for name in params:
        np.testing.assert_array_equal(params[name], st[f"model.{name}"], err_msg=name)
        np.testing.assert_array_equal(mu[name], st[f"optim.state.{name}.exp_avg"], err_msg=name)
        np.testing.assert_array_equal(nu[name], st[f"optim.state.{name}.exp_avg_sq"], err_msg=name)
        assert st[f"optim.state.{name}.step"] == R.STEPS
    assert mu["embeddings.weight"].dtype == np.float32 and np.abs(mu["embeddings.weight"]).max() > 0
    # Adam count = OLMo-core's per-parameter step; training step = the checkpoint's; windows empty
    assert int(opt.count) == R.STEPS and int(opt.step) == R.STEPS and label == R.STEPS
    assert int(opt.n_seen) == 0 and not np.any(np.asarray(opt.loss_window))
    assert extra["olmo_core_step"] == R.STEPS and extra["adam_count"] == R.STEPS


def test_one_further_step_matches_olmo_core(ref):
    """Step 3 here (olmo3/step.py + olmo3/optim.py) vs step 3 in OLMo-core (its train module) from
    the same converted state and batch. Same recipe on both sides: CE + z-loss 1e-5, clip at 1.0,
    linear lr at the same schedule position (OptState.step = 2 -> n = 3), no decay on the
    embedding, skip-step inactive (fewer than 64 losses seen on both sides: OLMo-core's windows
    start empty after a load, ours are empty after conversion).

    What differs is only fp32 summation order (XLA vs torch kernels): loss equal to 1e-7 relative,
    grad norm to 3e-6. Adam's update m / (sqrt(v) + 1e-8) is as sensitive to this step's gradient
    as the gradient is to summation order, and a rare token's row of lm_head gets a gradient
    that cancels (sum_t p_tj h_t over signed h). Measured (CPU), against updates up to 7e-4:
    params within 4.9e-7 on an Intel Xeon (lm_head); on an AMD EPYC within 1.2e-7 (norm gains:
    1 ulp at 1.0) but for one element, lm_head row 92703 (nu 2.6e-14), off by 2.4e-6 = 0.6% of
    its update of 4.1e-4. Moments within 6e-6 of their largest value. Tolerances: each
    parameter's update within 1e-6 + 1% of its own size (weight decay and the decay mask are
    test_optim.py's, against an oracle); 2e-5."""
    model, opt, _, _ = restore(str(ref["dir"] / "orbax"), ref["config"])
    sched = schedules.linear_schedule(R.LR, 0, R.MAX_STEPS)
    m3 = ref["metrics3"]
    assert float(sched(opt.step)) == pytest.approx(m3["optim/LR (group 0)"], rel=1e-6)
    optimizer = optim.SkipStepAdamW(sched, decay_mask=decay_mask, max_grad_norm=1.0)
    train_step = step.make_train_step(optimizer, chunk=R.SEQ, z_loss=1e-5)
    batch = {"tokens": jnp.asarray(ref["batch3"], jnp.int32), "instance_mask": jnp.ones((R.BATCH,), bool)}
    model, opt, metrics = train_step(model, opt, batch)
    assert float(metrics["train/loss"]) == pytest.approx(m3["train/CE loss"], rel=1e-6)
    assert float(metrics["train/z_loss"]) == pytest.approx(m3["train/Z loss"], rel=1e-5)   # multiplier included
    assert float(metrics["optim/grad_norm"]) == pytest.approx(m3["optim/total grad norm"], rel=1e-5)
    assert float(metrics["optim/step_skipped"]) == m3["optim/step skipped"] == 0.0
    assert int(opt.count) == R.STEPS + 1
    st = ref["state3"]
    L = ref["config"].n_layers
    params = ours_by_olmo_core_name(model, L)
    mu, nu = ours_by_olmo_core_name(opt.mu, L), ours_by_olmo_core_name(opt.nu, L)
    moved = 0.0
    for name in params:
        before = ref["state"][f"model.{name}"]
        moved = max(moved, float(np.abs(st[f"model.{name}"] - before).max()))
        np.testing.assert_allclose(np.asarray(params[name], np.float64) - before,
                                   st[f"model.{name}"].astype(np.float64) - before, rtol=1e-2, atol=1e-6,
                                   err_msg=f"{name}: the step's update")
        for ours_m, key in ((mu, "exp_avg"), (nu, "exp_avg_sq")):
            theirs = st[f"optim.state.{name}.{key}"]
            np.testing.assert_allclose(ours_m[name], theirs, rtol=0, atol=2e-5 * float(np.abs(theirs).max()),
                                       err_msg=f"{name}.{key}")
    assert moved > 5e-4  # the step really moved the weights (by ~lr), far beyond the tolerance


def test_back_to_olmo_core_loads_in_olmo_core_bit_exact(ref, tmp_path):
    """Orbax -> OLMo-core: OLMo-core builds the model from our config.json (TransformerConfig.from_dict)
    and its Checkpointer loads our DCP directory (load_trainer_state=False, as its stage-2/3
    scripts do); every parameter and moment equals the original checkpoint's."""
    from olmo_core.nn.attention import AttentionBackendName
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.train.checkpoint import Checkpointer
    convert.orbax_to_olmo_core(str(ref["dir"] / "orbax"), str(tmp_path / "back"))
    cfg = TransformerConfig.from_dict(json.load(open(tmp_path / "back" / "config.json"))["model"])
    cfg.block.sequence_mixer.backend = AttentionBackendName.torch  # the CPU backend; flash is OLMo-core's default
    assert cfg.num_params == R.olmo_core_config().num_params
    tm = R.train_module(cfg.build(init_device="cpu"), torch)
    recipe = [(len(g["params"]), tuple(g["betas"]), g["eps"], g["weight_decay"]) for g in tm.optim.param_groups]
    # The load_path README and convert.py name: a checkpoint to OLMo-core's Trainer (which
    # skips a directory dir_is_checkpoint refuses: "No checkpoint found", training from scratch).
    load_path = str(tmp_path / "back" / "model_and_optim")
    assert Checkpointer.dir_is_checkpoint(load_path) and not Checkpointer.dir_is_checkpoint(str(tmp_path / "back"))
    Checkpointer(work_dir=str(tmp_path / "work")).load(load_path, tm, load_trainer_state=False)
    got = R.numpy_state(tm)
    assert set(got) == set(ref["state"])
    # The param groups loaded with the state (betas, eps, weight decay: no decay on the embedding)
    # are those of OLMo-core's recipe (R.train_module's SkipStepAdamWConfig)
    assert [(len(g["params"]), tuple(g["betas"]), g["eps"], g["weight_decay"]) for g in tm.optim.param_groups] == recipe
    for k, v in ref["state"].items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


def test_back_to_olmo_core_carries_the_runs_adamw_settings(ref, tmp_path, caplog):
    """The param groups OLMo-core loads are the run's betas, eps and weight decay (train.py
    records them: a DPO run's b2 0.999 and weight decay 0 came out as the recipe's 0.95 and 0.1,
    without a word), still none on the embedding; a checkpoint that records none says so. A
    weights-only conversion prints load_optim_state=False (True made OLMo-core's load fail)."""
    import shutil
    from olmo_core.nn.attention import AttentionBackendName
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.train.checkpoint import Checkpointer
    shutil.copytree(ref["dir"] / "orbax", tmp_path / "dpo")
    meta = next((tmp_path / "dpo" / "checkpoints").glob("*/extra/metadata"))
    extra = json.loads(meta.read_text())
    extra["flags"] = {**extra.get("flags", {}), "lr": 5e-7, "b1": 0.9, "b2": 0.999, "eps": 1e-6, "weight_decay": 0.0}
    meta.write_text(json.dumps(extra))
    convert.orbax_to_olmo_core(str(tmp_path / "dpo"), str(tmp_path / "back"))
    assert "does not record its run's AdamW settings" not in caplog.text
    cfg = TransformerConfig.from_dict(json.load(open(tmp_path / "back" / "config.json"))["model"])
    cfg.block.sequence_mixer.backend = AttentionBackendName.torch
    tm = R.train_module(cfg.build(init_device="cpu"), torch)
    Checkpointer(work_dir=str(tmp_path / "work")).load(str(tmp_path / "back" / "model_and_optim"), tm,
                                                       load_trainer_state=False)
    assert {(tuple(g["betas"]), g["eps"], g["weight_decay"]) for g in tm.optim.param_groups} == {((0.9, 0.999), 1e-6, 0.0)}
    convert.orbax_to_olmo_core(str(ref["dir"] / "orbax"), str(tmp_path / "recipe"))   # from OLMo-core: no flags
    assert "does not record its run's AdamW settings: the OLMo-core param groups get the recipe's" in caplog.text
    convert.olmo_core_to_orbax(str(ref["dir"] / "run" / "step2"), str(tmp_path / "w"), with_optimizer_state=False)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "convert.py"), f"--from=orbax:{tmp_path / 'w'}",
                        f"--to=olmo-core:{tmp_path / 'wo'}"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "load_trainer_state=False, load_optim_state=False (the model's weights only" in r.stdout


def test_weights_only_and_step_label(ref, tmp_path):
    """--nowith_optimizer_state: the model alone (train.py --init_weights_only); --step relabels."""
    convert.olmo_core_to_orbax(str(ref["dir"] / "run" / "step2"), str(tmp_path / "w"), step=0, with_optimizer_state=False)
    mgr = checkpoint.CheckpointManager(str(tmp_path / "w"), read_only=True)
    assert mgr.all_steps() == [0] and not any(k.startswith("opt.") for k in mgr.stored_tensors(0))
    np.testing.assert_array_equal(np.asarray(convert.read_stored(mgr, 0, "model.embed", None)),
                                  ref["state"]["model.embeddings.weight"])


def test_skipped_steps_keep_the_training_step_apart_from_the_adam_count(ref, tmp_path):
    """SkipStepAdamW does not advance a parameter's `step` on a skipped step, so a checkpoint of
    training step 5 may hold Adam step 2 (here: the step-2 checkpoint under the name step5).
    OptState.step (the schedule position) is the training step, OptState.count (bias
    correction) Adam's."""
    import shutil
    shutil.copytree(ref["dir"] / "run" / "step2", tmp_path / "run" / "step5")
    convert.olmo_core_to_orbax(str(tmp_path / "run" / "step5"), str(tmp_path / "orbax"))
    _, opt, extra, label = restore(str(tmp_path / "orbax"), ref["config"])
    assert int(opt.step) == 5 and label == 5 and extra["olmo_core_step"] == 5
    assert int(opt.count) == R.STEPS == 2 and extra["adam_count"] == 2


def test_torch_missing_is_one_clear_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(olmo_core.UserError, match="needs torch.*pip install"):
        olmo_core.torch_module()


def test_command_line(ref, tmp_path):
    """The save folder (newest stepN) -> Orbax through convert.py; bad inputs are one line, exit 2."""
    def run(*args):
        return subprocess.run([sys.executable, os.path.join(ROOT, "convert.py"), *args], capture_output=True,
                              text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    r = run(f"--from=olmo-core:{ref['dir'] / 'run'}", f"--to=orbax:{tmp_path / 'o'}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "converted olmo-core:" in r.stdout
    assert checkpoint.CheckpointManager(str(tmp_path / "o"), read_only=True).all_steps() == [R.STEPS]
    r = run(f"--from=olmo-core:{ref['dir'] / 'run'}", f"--to=orbax:{tmp_path / 'z'}", "--verify")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-1000:]
    assert r.stderr.strip().splitlines()[-1].startswith("convert.py: error: --verify applies to hf:")
    # the other user errors are the types cli.run turns into that one line and exit 2
    with pytest.raises(FileNotFoundError, match="no such directory"):
        convert.olmo_core_to_orbax(str(tmp_path / "nothing"), str(tmp_path / "x"))
    with pytest.raises(FileNotFoundError, match="not an OLMo-core checkpoint"):
        convert.olmo_core_to_orbax(str(tmp_path / "o"), str(tmp_path / "y"))
    with pytest.raises(FileExistsError, match="already holds checkpoints"):
        convert.olmo_core_to_orbax(str(ref["dir"] / "run"), str(tmp_path / "o"))
    with pytest.raises(FileExistsError, match="not empty"):
        convert.orbax_to_olmo_core(str(tmp_path / "o"), str(ref["dir"] / "run"))


def test_url_reads_by_byte_range_like_local(ref, tmp_path):
    """olmo-core:http://.../step2, the form of OLMo-core's own load_path, through data/storage.py's
    byte-range reads (test_storage's range server): the Orbax checkpoint equals the local one's."""
    from test_storage import RangeServer
    with RangeServer(ref["dir"] / "run") as srv:
        convert.olmo_core_to_orbax(f"{srv.url}/step2/", str(tmp_path / "remote"))
        assert srv.requests.get("GET", 0) > 0
    local, remote = (checkpoint.CheckpointManager(str(d), read_only=True) for d in (ref["dir"] / "orbax", tmp_path / "remote"))
    names = local.stored_tensors()
    assert names == remote.stored_tensors()
    for name in names:
        a, b = (np.asarray(convert.read_stored(m, R.STEPS, name, None)) for m in (local, remote))
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_a_missing_shard_is_one_line_local_or_remote(ref, tmp_path):
    """An incomplete download: a .distcp file the .metadata lists is gone. Local: Orbax's writer
    thread logged two tracebacks before the line, which was the bare errno; by URL the line gave a
    data mix's advice (--data_root, --tokenizer)."""
    import shutil

    from test_storage import RangeServer
    step = f"step{R.STEPS}"
    shutil.copytree(ref["dir"] / "run" / step, tmp_path / "oc" / step)
    shard = sorted((tmp_path / "oc" / step / "model_and_optim").glob("*.distcp"))[0]
    shard.unlink()
    r = subprocess.run([sys.executable, os.path.join(ROOT, "convert.py"), f"--from=olmo-core:{tmp_path / 'oc' / step}",
                        f"--to=orbax:{tmp_path / 'o'}"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT})
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert lines[-1] == f"convert.py: error: {shard} is missing: the checkpoint is incomplete; download (or copy) all " \
                        "of its files again", lines[-1]
    assert not (tmp_path / "o").exists()
    with RangeServer(tmp_path / "oc") as srv, pytest.raises(olmo_core.UserError, match=f"/{shard.name} is missing: "
                                                                                       "the checkpoint is incomplete"):
        convert.olmo_core_to_orbax(f"{srv.url}/{step}/", str(tmp_path / "remote"))


@pytest.mark.slow
def test_train_py_stage2_warm_start_from_olmo_core(ref, tmp_path):
    """train.py --stage=2 --init_from=<converted OLMo-core checkpoint>: its first loss equals
    OLMo-core's own loss (its model, loaded by its Checkpointer) on the same first batch, and the
    step continues AI2's Adam: the saved Adam count is the checkpoint's + 1."""
    import data
    from olmo_core.train.checkpoint import Checkpointer
    docs = source_corpus(tmp_path / "docs")
    run = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--stage=2", "--model=tiny", "--d_model=64",
           "--n_layers=4", "--n_heads=4", "--n_kv_heads=4", "--head_dim=16", "--mlp_hidden=192",
           f"--window={R.WINDOW}", f"--vocab_size={R.VOCAB}", f"--data={docs}", f"--seq_len={R.SEQ}",
           "--global_batch=4", "--max_steps=1", "--total_steps=10", "--warmup_steps=0", f"--lr={R.LR}", f"--run_dir={run}",
           f"--init_from={ref['dir'] / 'orbax'}", "--save_interval=1", "--eval_interval=1",
           "--loader_workers=0", "--seed=7"]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "PYTHONPATH": ROOT}
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=str(tmp_path), env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    loss = json.loads(open(run / "metrics.jsonl").readline())["train/loss"]
    splits = data.ensure_corpus(str(tmp_path / "data" / "docs"), str(docs))
    batch = torch.as_tensor(data.get_batch(data.FSLDataset(splits["train"], R.SEQ), 4, 7, 0)["tokens"],
                            dtype=torch.long)
    tm = R.train_module(R.olmo_core_config().build(init_device="cpu"), torch)
    Checkpointer(work_dir=str(tmp_path / "work")).load(str(ref["dir"] / "run" / "step2"), tm, load_trainer_state=False)
    with torch.no_grad():
        lp = torch.log_softmax(tm.model(batch)[:, :-1].float(), -1)
        want = -lp.gather(-1, batch[:, 1:, None]).mean().item()
    assert abs(loss - want) < 1e-5, (loss, want)
    _, opt, _, label = restore(str(run), ref["config"])
    assert label == 1 and int(opt.count) == R.STEPS + 1


@pytest.mark.slow
def test_peak_rss_is_one_tensor_not_the_state(tmp_path):
    """A 474M-parameter OLMo-core-shaped checkpoint with moments (5.7 GB fp32: d_model 1024, 16
    layers, MLP 4096, vocab 100352) through convert.py both ways, each in its own process: peak
    RSS is the process (~0.45 GB with torch, JAX and Orbax loaded) plus about two copies of the
    largest tensor (the 411 MB embedding: its stored bytes and the decoded tensor), not the state.
    Measured (Intel(R) Xeon(R) Processor, 2 cores, two runs): 1.71-1.92 GB in 62-72 s there,
    1.66-1.74 GB in 61 s back."""
    import olmo3
    c = olmo3.Config.tiny(d_model=1024, n_layers=16, n_heads=8, n_kv_heads=8, head_dim=128, mlp_hidden=4096,
                          window=4096, vocab_size=R.VOCAB)
    src = tmp_path / "oc" / "step100"
    rng = np.random.default_rng(0)
    specs = {}
    for field, layer, name, t in olmo_core.param_names(c.n_layers):
        shape = {"embed": (c.vocab_size, c.d_model), "lm_head": (c.vocab_size, c.d_model), "norm": (c.d_model,),
                 "q_proj": (c.q_dim, c.d_model), "k_proj": (c.kv_dim, c.d_model), "v_proj": (c.kv_dim, c.d_model),
                 "o_proj": (c.d_model, c.q_dim), "q_norm": (c.q_dim,), "k_norm": (c.kv_dim,),
                 "gate_proj": (c.mlp_hidden, c.d_model), "up_proj": (c.mlp_hidden, c.d_model),
                 "down_proj": (c.d_model, c.mlp_hidden)}.get(field, (c.d_model,))
        specs[f"model.{name}"] = specs[f"optim.state.{name}.exp_avg"] = specs[f"optim.state.{name}.exp_avg_sq"] = (
            shape, np.float32)
        specs[f"optim.state.{name}.step"] = ((), np.float32)
    state_gb = sum(4 * int(np.prod(s)) for s, _ in specs.values()) / 1e9

    def produce(name):
        shape, _ = specs[name]
        return np.asarray(100.0, np.float32) if name.endswith(".step") else rng.standard_normal(shape, np.float32)
    olmo_core.write_dist_checkpoint(str(src / "model_and_optim"), specs, produce, {})
    (src / "config.json").write_text(json.dumps({"model": olmo_core.config_to_olmo_core(c)}))

    def peak(*args):
        r = subprocess.run([sys.executable, os.path.join(ROOT, "convert.py"), *args], capture_output=True, text=True,
                           cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
        assert r.returncode == 0, r.stderr[-2000:]
        return float(r.stdout.split("peak RSS ")[1].split()[0]), r.stdout.strip()
    there, out1 = peak(f"--from=olmo-core:{src}", f"--to=orbax:{tmp_path / 'orbax'}")
    back, out2 = peak(f"--from=orbax:{tmp_path / 'orbax'}", f"--to=olmo-core:{tmp_path / 'back'}")
    print(f"state {state_gb:.2f} GB | {out1} | {out2}")
    assert there < 0.45 * state_gb and back < 0.45 * state_gb, (state_gb, there, back)


@pytest.mark.slow
def test_fsdp_sharded_checkpoint_reassembled(tmp_path):
    """A checkpoint OLMo-core saved from FSDP over 2 processes (every tensor in 2 shards, as AI2's
    are in many): our conversion equals what OLMo-core's own loader (torch's resharding) puts into
    an unsharded model, bit for bit, weights and moments."""
    import socket
    from olmo_core.train.checkpoint import Checkpointer
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "olmo_core_fsdp_worker.py"), str(tmp_path / "run"),
                        port], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    dcp_dir = tmp_path / "run" / "step2" / "model_and_optim"
    reader = olmo_core.DistCheckpointReader(str(dcp_dir))
    assert len(reader.tensors["model.embeddings.weight"].chunks) == 2
    tm = R.train_module(R.olmo_core_config().build(init_device="cpu"), torch)
    Checkpointer(work_dir=str(tmp_path / "work")).load(str(tmp_path / "run" / "step2"), tm, load_trainer_state=False)
    want = R.numpy_state(tm)
    # no config.json here (no ConfigSaverCallback): the shapes, with this model's head_dim
    with pytest.raises(olmo_core.UserError, match="head_dim 128"):
        convert.olmo_core_to_orbax(str(tmp_path / "run"), str(tmp_path / "never"))
    (tmp_path / "run" / "step2" / "config.json").write_text(json.dumps({"model": R.olmo_core_config().as_config_dict()}))
    config = convert.olmo_core_to_orbax(str(tmp_path / "run"), str(tmp_path / "orbax"))
    model, opt, _, _ = restore(str(tmp_path / "orbax"), config)
    L = config.n_layers
    for tree, key in ((model, "model.{}"), (opt.mu, "optim.state.{}.exp_avg"), (opt.nu, "optim.state.{}.exp_avg_sq")):
        for name, a in ours_by_olmo_core_name(tree, L).items():
            np.testing.assert_array_equal(a, want[key.format(name)], err_msg=key.format(name))
    assert int(opt.count) == R.STEPS


def synthetic_checkpoint(src, n_layers=4, moments=True, more=None, config_layers=None, drop=(), d_model=32,
                         kv_dim=None):
    """An OLMo-core step directory of a tiny OLMo 3 (2 heads of d_model / 2, ones for weights,
    moments and Adam step 2) written by our DCP writer, with its config.json (of `config_layers`),
    without the tensors in `drop`. `kv_dim`: K and V projections of that width (the config.json
    then does not match: for checkpoints read without it)."""
    import olmo3
    c = olmo3.Config.tiny(d_model=d_model, n_layers=config_layers or n_layers, n_heads=2, n_kv_heads=2,
                          head_dim=d_model // 2, mlp_hidden=64, window=16, vocab_size=128)
    d = d_model
    shapes = {"embed": (128, d), "lm_head": (128, d), "q_proj": (d, d), "k_proj": (kv_dim or d, d),
              "v_proj": (kv_dim or d, d), "k_norm": (kv_dim or d,),
              "o_proj": (d, d), "gate_proj": (64, d), "up_proj": (64, d), "down_proj": (d, 64)}
    specs = {f"model.{name}": (shapes.get(field, (d,)), np.float32) for field, _, name, _ in olmo_core.param_names(n_layers)}
    if moments:
        for name, (shape, dtype) in list(specs.items()):
            for m in ("exp_avg", "exp_avg_sq", "step"):
                specs[f"optim.state.{name[len('model.'):]}.{m}"] = (shape if m != "step" else (), dtype)
    specs.update(more or {})
    for name in drop:
        specs.pop(name)
    olmo_core.write_dist_checkpoint(str(src / "model_and_optim"), specs,
                                    lambda name: np.full(specs[name][0], 2.0 if name.endswith(".step") else 1.0,
                                                         np.float32), {})
    (src / "config.json").write_text(json.dumps({"model": olmo_core.config_to_olmo_core(c)}))
    return specs


def test_without_config_json_the_model_comes_from_the_tensor_shapes(tmp_path):
    """A checkpoint saved without OLMo-core's ConfigSaverCallback (no config.json beside it): the
    model is read from the tensor shapes with OLMo 3 7B's head_dim 128, window, RoPE and eps, and
    a width that is not a multiple of 128 is named. (A missing file's one-line error, added for
    incomplete downloads, had made config.json required: every such conversion failed.)"""
    import olmo3
    src = tmp_path / "oc" / "step3"
    synthetic_checkpoint(src, moments=False, d_model=256, kv_dim=128)   # grouped-query: 2 heads share 1 K/V
    os.remove(src / "config.json")
    config = convert.olmo_core_to_orbax(str(src), str(tmp_path / "orbax"), with_optimizer_state=False)
    seven_b = olmo3.Config()
    assert (config.d_model, config.n_layers, config.n_heads, config.n_kv_heads, config.head_dim,
            config.mlp_hidden, config.vocab_size) == (256, 4, 2, 1, 128, 64, 128)
    assert (config.window, config.rope_theta, config.norm_eps) == (seven_b.window, seven_b.rope_theta,
                                                                   seven_b.norm_eps)
    assert os.listdir(tmp_path / "orbax" / "checkpoints") == ["3"]
    narrow = tmp_path / "narrow" / "step3"
    synthetic_checkpoint(narrow, moments=False)   # 2 heads of 16
    os.remove(narrow / "config.json")
    with pytest.raises(olmo_core.UserError, match="attention width 32 is not a multiple of OLMo 3's head_dim 128"):
        convert.olmo_core_to_orbax(str(narrow), str(tmp_path / "never"), with_optimizer_state=False)
    assert not os.path.exists(tmp_path / "never")


def test_config_json_of_the_save_folder_is_read_for_its_steps(tmp_path):
    """OLMo-core's ConfigSaverCallback writes config.json into the save folder (the parent of
    stepN/) as well: a step directory without its own copy reads it there, not the 7B's guesses."""
    step = tmp_path / "run" / "step3"
    synthetic_checkpoint(step, moments=False)   # head_dim 16, window 16: nothing like the 7B's
    os.rename(step / "config.json", tmp_path / "run" / "config.json")
    config, where = olmo_core.read_config(str(step), object.__new__(olmo_core.DistCheckpointReader))   # not read
    assert where == str(tmp_path / "run" / "config.json") and (config.head_dim, config.window) == (16, 16)


def test_a_save_folder_converts_its_newest_step(tmp_path):
    """A save folder given as --from=olmo-core: its newest complete stepN (step10 after step9: by
    number, not name; a step without its .metadata is incomplete)."""
    for n in (2, 9, 10, 11):
        (tmp_path / f"step{n}" / "model_and_optim").mkdir(parents=True)
        if n != 11:
            (tmp_path / f"step{n}" / "model_and_optim" / ".metadata").touch()
    newest = tmp_path / "step10"
    assert olmo_core.locate(str(tmp_path)) == (str(newest), str(newest / "model_and_optim"), 10)


def test_yarn_without_betas_takes_olmo_core_s_defaults():
    """YaRN scaling written without beta_fast / beta_slow reads as OLMo-core's own defaults."""
    from olmo_core.nn.rope import YaRNRoPEScalingConfig
    from olmo_core.nn.transformer import TransformerConfig
    yarn = YaRNRoPEScalingConfig(factor=8, old_context_len=8192)
    model = json.loads(json.dumps(TransformerConfig.olmo3_7B(vocab_size=100352).with_rope_scaling(
        yarn, full_attn_layers_only=True).as_config_dict()))
    for over in model["block_overrides"].values():
        scaling = over["sequence_mixer"]["rope"]["scaling"]
        del scaling["beta_fast"], scaling["beta_slow"]
    c = olmo_core.config_from_olmo_core(model)
    assert (c.yarn.beta_fast, c.yarn.beta_slow) == (yarn.beta_fast, yarn.beta_slow)


def test_tensors_outside_olmo3_are_refused_not_dropped(tmp_path):
    """An OLMo-core checkpoint of a variant with parameters this model lacks (an lm_head bias), or
    with more layers than its config.json says: the conversion names them and writes nothing,
    instead of converting without them."""
    src = tmp_path / "oc" / "step3"
    synthetic_checkpoint(src, moments=False, more={"model.lm_head.w_out.bias": ((128,), np.float32)})
    with pytest.raises(ValueError, match=r"model.lm_head.w_out.bias.*not part of an OLMo 3 model"):
        convert.olmo_core_to_orbax(str(src), str(tmp_path / "orbax"), with_optimizer_state=False)
    assert not os.path.exists(tmp_path / "orbax")
    deeper = tmp_path / "deeper" / "step3"
    synthetic_checkpoint(deeper, n_layers=6, moments=False, config_layers=4)
    with pytest.raises(ValueError, match=r"blocks up to 5, more than the 4 layers of the model config \(.*config.json\)"):
        convert.olmo_core_to_orbax(str(deeper), str(tmp_path / "orbax"), with_optimizer_state=False)


def test_missing_moments_are_named_before_writing(tmp_path):
    """A parameter without Adam moments (frozen in OLMo-core) is named before anything is written,
    with the flag that converts the weights alone; it used to fail mid-write as a bare KeyError
    (exit 1, retried). The weights alone then convert."""
    src = tmp_path / "oc" / "step3"
    synthetic_checkpoint(src, drop=["optim.state.lm_head.w_out.weight.exp_avg"])
    with pytest.raises(ValueError, match=r"optim.state.lm_head.w_out.weight.exp_avg.*--nowith_optimizer_state"):
        convert.olmo_core_to_orbax(str(src), str(tmp_path / "orbax"))
    assert not os.path.exists(tmp_path / "orbax")
    convert.olmo_core_to_orbax(str(src), str(tmp_path / "orbax"), with_optimizer_state=False)
    assert os.listdir(tmp_path / "orbax" / "checkpoints") == ["3"]


def test_a_failed_orbax_write_leaves_nothing_behind(tmp_path, monkeypatch):
    """A tensor that cannot be read mid-write (a damaged file found only then) leaves no
    half-written Orbax directory at --to, so the rerun is not refused for the directory it left."""
    src = tmp_path / "oc" / "step3"
    synthetic_checkpoint(src)
    read_layer = olmo_core.read_layer

    def damaged(reader, name, transpose, dtype):
        if name == "model.lm_head.w_out.weight":
            raise olmo_core.UserError(f"{name} does not decode")
        return read_layer(reader, name, transpose, dtype)

    monkeypatch.setattr(olmo_core, "read_layer", damaged)
    with pytest.raises(olmo_core.UserError, match="does not decode"):
        convert.olmo_core_to_orbax(str(src), str(tmp_path / "orbax"))
    assert sorted(os.listdir(tmp_path)) == ["oc"]   # neither --to nor a temporary sibling
    monkeypatch.setattr(olmo_core, "read_layer", read_layer)
    convert.olmo_core_to_orbax(str(src), str(tmp_path / "orbax"))
    assert os.listdir(tmp_path / "orbax" / "checkpoints") == ["3"]


def test_a_tensor_saved_in_chunks_is_read_whole(tmp_path):
    """An FSDP checkpoint stores a tensor as chunks, one per rank that held a shard, at the offsets
    its .metadata lists (written here with torch's own metadata classes; the slow
    test_fsdp_sharded_checkpoint_reassembled has OLMo-core save one): read back whole, whatever the
    order of the chunks in the file."""
    import io
    import pickle

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)
    full = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    blobs, chunks, where = b"", [], {}
    for start in (2, 0):   # the second rank's rows first in the file
        buf = io.BytesIO()
        torch.save(full[start:start + 2].clone(), buf)
        offsets = torch.Size([start, 0])
        where[MetadataIndex("x", offsets)] = _StorageInfo("__0_0.distcp", len(blobs), len(buf.getvalue()))
        chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([2, 3])))
        blobs += buf.getvalue()
    (tmp_path / "__0_0.distcp").write_bytes(blobs)
    tensor = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 3]), chunks)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={"x": tensor}, storage_data=where)))
    np.testing.assert_array_equal(olmo_core.DistCheckpointReader(str(tmp_path)).numpy("x", np.float32), full.numpy())


def test_metadata_pickle_cannot_run_code(tmp_path):
    """`.metadata` is a pickle (possibly fetched from a URL): one naming any other callable is
    refused with one line, before it can run."""
    import pickle
    d = tmp_path / "model_and_optim"
    d.mkdir()
    (d / ".metadata").write_bytes(pickle.dumps(os.system))  # pickles a reference to os.system
    with pytest.raises(olmo_core.UserError, match="does not read as torch distributed-checkpoint metadata"):
        olmo_core.DistCheckpointReader(str(d))


def test_safetensors_format_dcp_is_named_not_called_damaged(tmp_path):
    """torch can write a distributed checkpoint in safetensors format (whose chunk offsets torch's
    own FileSystemReader cannot read either); the refusal names the format and the fix instead of
    sending the user to download a checkpoint that is not damaged. The default format reads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    state = {"model.embeddings.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    for fmt in ("torch_save", "safetensors"):
        writer = dcp.FileSystemWriter(str(tmp_path / fmt), serialization_format=SerializationFormat(fmt))
        dcp.save(state, storage_writer=writer, no_dist=True)
    reader = olmo_core.DistCheckpointReader(str(tmp_path / "torch_save"))
    np.testing.assert_array_equal(reader.numpy("model.embeddings.weight", np.float32), np.arange(12).reshape(3, 4))
    reader = olmo_core.DistCheckpointReader(str(tmp_path / "safetensors"))
    with pytest.raises(olmo_core.UserError, match="safetensors-format.*save it again with the default"):
        reader.read("model.embeddings.weight")


@pytest.mark.parametrize("seq_len", [4096, 8192, 65536])
def test_sliding_flops_are_olmo_core_s_num_flops_per_token(seq_len):
    """perf/mfu_sliding's count is OLMo-core 3.0's own TransformerModel.num_flops_per_token (exact
    causal and sliding-window (query, key) pairs, lm_head included) plus the two block norms'
    6 x params, which OLMo-core leaves out: the 7B built on the meta device."""
    from olmo_core.nn.transformer import TransformerConfig

    from olmo3.config import Config
    theirs = TransformerConfig.olmo3_7B(vocab_size=100278).build(init_device="meta").num_flops_per_token(seq_len)
    c = Config.olmo3_7b()
    norms = 6 * 2 * c.d_model * c.n_layers
    assert c.train_flops_per_token(seq_len, "sliding") - norms == pytest.approx(theirs, rel=1e-12)


@pytest.mark.parametrize("seq_len", [8, 32, 64])   # shorter than the window of 16, twice it, four times it
def test_sliding_flops_of_a_gqa_model_are_olmo_core_s(seq_len):
    """The same against OLMo-core's count for a model unlike the 7B: GQA (2 K/V heads of 4), q_dim
    (64) above d_model (32), and sequences shorter than the window as well as longer."""
    from olmo_core.nn.transformer import TransformerConfig

    from olmo3.config import Config
    c = Config.tiny(vocab_size=128, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, mlp_hidden=48,
                    window=16)
    cfg = TransformerConfig.from_dict(olmo_core.config_to_olmo_core(c))
    assert c.num_params() == cfg.num_params
    theirs = cfg.build(init_device="meta").num_flops_per_token(seq_len)   # exact: q_dim 64 is a multiple of seq_len
    norms = 6 * 2 * c.d_model * c.n_layers
    assert c.train_flops_per_token(seq_len, "sliding") - norms == pytest.approx(theirs, rel=1e-12)


def test_yarn_olmo_core_cannot_express_and_adam_counts_that_disagree():
    """An attention factor other than OLMo-core's 0.1 ln(factor) + 1 (transformers' config.json
    may carry one) has no field in YaRNRoPEScalingConfig: refused, not written as the default.
    Parameters whose Adam `step` differ (a frozen one never steps) give the largest count."""
    from olmo_core.nn.transformer import TransformerConfig

    from olmo3.config import Config, YaRN
    c = Config.tiny(yarn=YaRN(factor=4.0, original_max_position=64))
    assert TransformerConfig.from_dict(olmo_core.config_to_olmo_core(c)).block_overrides
    with pytest.raises(ValueError, match=r"attention factor 1\.5 is not OLMo-core's 0\.1 ln\(4\.0\) \+ 1"):
        olmo_core.config_to_olmo_core(Config.tiny(yarn=YaRN(factor=4.0, original_max_position=64,
                                                            attention_factor=1.5)))

    class Steps(olmo_core.DistCheckpointReader):   # a DCP's tensors, without a DCP
        def __init__(self, values):
            self.path, self.tensors = "ck", values

        def read(self, name):
            return self.tensors[name]
    reader = Steps({"optim.state.a.step": 5.0, "optim.state.b.step": 3.0, "model.a": 0.0})
    assert olmo_core.adam_count(reader) == (5, {3.0, 5.0})


def convert_cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, os.path.join(ROOT, "convert.py"), *args], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": ROOT})


def test_cli_from_olmo_core_keeps_the_adam_moments_by_default(ref, tmp_path):
    """convert.py's command line from olmo-core: without --with_optimizer_state the checkpoint's own
    Adam moments come along (the flag's documented default: true), with --nowith_optimizer_state
    the weights alone. Reference: OLMo-core's own optimizer state (tests/olmo_core_reference.py,
    torch's AdamW exp_avg)."""
    r = convert_cli(f"--from=olmo-core:{ref['dir'] / 'run' / 'step2'}", f"--to=orbax:{tmp_path / 'o'}")
    assert r.returncode == 0, r.stderr[-2000:]
    _, opt, extra, label = restore(str(tmp_path / "o"), ref["config"])
    assert extra["with_optimizer_state"] is True and label == R.STEPS and int(opt.count) == R.STEPS
    mu = ours_by_olmo_core_name(opt.mu, ref["config"].n_layers)
    for name in mu:
        np.testing.assert_array_equal(mu[name], ref["state"][f"optim.state.{name}.exp_avg"], err_msg=name)
    r = convert_cli(f"--from=olmo-core:{ref['dir'] / 'run' / 'step2'}", f"--to=orbax:{tmp_path / 'w'}",
                    "--nowith_optimizer_state")
    assert r.returncode == 0, r.stderr[-2000:]
    mgr = checkpoint.CheckpointManager(str(tmp_path / "w"), read_only=True)
    assert not any(k.startswith("opt.") for k in mgr.stored_tensors(R.STEPS))


def test_cli_to_olmo_core_url_is_refused(tmp_path):
    """--to=olmo-core: takes a local or mounted directory, never a URL: os.path would write
    ./gs:/... in the working directory. Reference: the file system."""
    r = convert_cli(f"--from=orbax:{tmp_path / 'run'}", "--to=olmo-core:gs://bucket/ckpt", cwd=str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "olmo-core: takes a local or mounted directory, not a URL" in r.stderr.strip().splitlines()[-1]
    assert os.listdir(tmp_path) == []   # nothing written under ./gs:
