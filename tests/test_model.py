"""Parity of olmo3.OLMo3 with transformers' Olmo3ForCausalLM (the independent reference)."""
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import olmo3
from olmo3 import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# (name, HF config overrides, sequence length)
CASES = [
    ("mha_window_lt_seq", dict(num_attention_heads=4, num_key_value_heads=4), 48),
    ("gqa", dict(num_attention_heads=6, num_key_value_heads=2), 40),
    ("seq_shorter_than_window", dict(num_attention_heads=4, num_key_value_heads=4, sliding_window=64), 33),
    # window < seq <= 2 x window: the one-block path reference_attention takes (the 7B at seq 8192,
    # window 4096, on --attention=xla); above 2 x window it is local_attention's.
    ("window_lt_seq_le_2window", dict(num_attention_heads=4, num_key_value_heads=2), 12),
    # seq = window + 1: the shortest sequence whose last query loses a key to the window (the model
    # skips the window where it covers the whole sequence)
    ("seq_is_window_plus_one", dict(num_attention_heads=4, num_key_value_heads=2), 8),
    ("yarn_full_layers", dict(num_attention_heads=4, num_key_value_heads=2, rope_parameters={
        "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
                           "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}}), 64),
    ("yarn_mscale_ratio", dict(num_attention_heads=4, num_key_value_heads=2, rope_parameters={
        "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0, "mscale": 1.0,
                           "mscale_all_dim": 0.5, "original_max_position_embeddings": 16},
        "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}}), 64),
    ("odd_sizes", dict(hidden_size=40, intermediate_size=72, num_attention_heads=5, num_key_value_heads=1,
                       head_dim=12, sliding_window=5, num_hidden_layers=8), 23),
]


def hf_config(**over):
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                rms_norm_eps=1e-6, sliding_window=7, pad_token_id=None, eos_token_id=None,
                tie_word_embeddings=False)
    base.update(over)
    return transformers.Olmo3Config(**base)


def random_hf_model(cfg, seed=0):
    torch.manual_seed(seed)
    m = transformers.Olmo3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms at 1 would hide a swapped norm weight: randomize them too
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return m


def kl_and_top1(ref_logits, our_logits):
    p = jax.nn.log_softmax(jnp.asarray(ref_logits, jnp.float64 if jax.config.x64_enabled else jnp.float32))
    q = jax.nn.log_softmax(jnp.asarray(our_logits, p.dtype))
    kl = np.asarray(jnp.sum(jnp.exp(p) * (p - q), axis=-1))
    top1 = float(np.mean(np.argmax(ref_logits, -1) == np.argmax(our_logits, -1)))
    return kl, top1


@pytest.mark.parametrize("name,over,seq", CASES, ids=[c[0] for c in CASES])
def test_parity_with_transformers_fp32(name, over, seq):
    cfg = hf_config(**over)
    ref = random_hf_model(cfg)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, seq))
    with torch.no_grad():
        ref_logits = ref(torch.tensor(tokens)).logits.float().numpy()
    model = hf.from_hf({k: v for k, v in ref.state_dict().items()}, hf.config_from_hf(cfg.to_dict()))
    ours = np.asarray(jax.vmap(model)(jnp.asarray(tokens, jnp.int32)))
    kl, top1 = kl_and_top1(ref_logits, ours)
    assert kl.max() < 1e-6, f"{name}: max KL {kl.max():.3g}"
    assert top1 == 1.0
    np.testing.assert_allclose(ours, ref_logits, atol=2e-4, rtol=1e-4)


def test_yarn_without_truncation_is_refused():
    """truncate=false (an unrounded YaRN ramp, which transformers 4.x honours) is not what OLMo 3
    computes: config_from_hf names it rather than load a model that disagrees with transformers."""
    c = hf.config_to_hf(olmo3.Config.olmo3_7b_long())
    c["rope_scaling"]["truncate"] = False
    del c["rope_parameters"]   # the flat keys, as transformers 4.x reads them
    with pytest.raises(ValueError, match="truncate=false"):
        hf.config_from_hf(c)


def test_fields_left_out_of_config_json_take_transformers_defaults():
    """A config.json without layer_types, num_key_value_heads, head_dim, sliding_window, rope,
    rms_norm_eps or max_position_embeddings computes as transformers reads it: against
    Olmo3Config's own defaults written out (its rms_norm_eps is 1e-5, not OLMo 3's 1e-6; its layer
    pattern full every 4th layer; its context 2048 positions, not OLMo 3's 65,536)."""
    from olmo3.config import config_diff
    minimal = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4)
    full = transformers.Olmo3Config(**minimal).to_dict()
    ours = hf.config_from_hf({"model_type": "olmo3", **minimal})
    assert config_diff(ours, hf.config_from_hf(full)) == {}
    assert ours.max_position_embeddings == full["max_position_embeddings"] == 2048


def test_parity_unrolled_layer_groups():
    """Config.scan_layers=False (a Python loop over the 2 layer groups) against transformers,
    logits and the scanned model's gradients."""
    cfg = hf_config(**next(over for name, over, _ in CASES if name == "odd_sizes"))
    ref = random_hf_model(cfg)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, 23))
    with torch.no_grad():
        ref_logits = ref(torch.tensor(tokens)).logits.float().numpy()
    config = hf.config_from_hf(cfg.to_dict()).replace(scan_layers=False)
    assert config.n_groups == 2
    model, scanned = (hf.from_hf({k: v for k, v in ref.state_dict().items()}, c)
                      for c in (config, config.replace(scan_layers=True)))
    ours = np.asarray(eqx.filter_jit(lambda m, t: jax.vmap(m)(t))(model, jnp.asarray(tokens, jnp.int32)))
    np.testing.assert_allclose(ours, ref_logits, atol=2e-4, rtol=1e-4)
    loss = lambda m: jnp.sum(jax.vmap(m)(jnp.asarray(tokens, jnp.int32)) ** 2)  # noqa: E731
    g_loop, g_scan = (eqx.filter_jit(eqx.filter_grad(loss))(m) for m in (model, scanned))
    for a, b in zip(jax.tree.leaves(g_loop), jax.tree.leaves(g_scan)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4 * float(jnp.abs(b).max()))


@pytest.mark.parametrize("remat", ["none", "full", "save_proj", "save_dots"])
def test_every_remat_policy_gives_transformers_gradients(remat):
    """Config.remat decides what the backward recomputes, never what it computes: each policy's
    gradient of the mean next-token cross entropy equals torch autograd's through transformers on
    the same weights (full and save_dots were run by no test: a stop_gradient in the remat'd
    layer zeroed every layer weight's gradient unseen)."""
    cfg = hf_config(**next(over for name, over, _ in CASES if name == "odd_sizes"))
    ref = random_hf_model(cfg)
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, size=(1, 23))
    ref.zero_grad()
    ref(torch.tensor(tokens), labels=torch.tensor(tokens)).loss.backward()
    theirs = {name: p.grad.float().numpy() for name, p in ref.named_parameters()}
    model = hf.from_hf({k: v for k, v in ref.state_dict().items()}, hf.config_from_hf(cfg.to_dict()).replace(remat=remat))

    def loss(m):
        lp = jax.nn.log_softmax(m(jnp.asarray(tokens[0], jnp.int32))[:-1])
        return -jnp.mean(jnp.take_along_axis(lp, jnp.asarray(tokens[0, 1:, None]), axis=-1))

    ours = hf.state_dict(eqx.filter_jit(eqx.filter_grad(loss))(model))   # torch's names and layout
    assert set(ours) == set(theirs)
    for name, want in theirs.items():
        np.testing.assert_allclose(np.asarray(ours[name]), want, rtol=1e-4, atol=1e-5 * np.abs(want).max(),
                                   err_msg=name)


def test_parity_bf16_compute_reported(capsys):
    cfg = hf_config(num_attention_heads=4, num_key_value_heads=4)
    ref = random_hf_model(cfg)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, size=(2, 48))
    with torch.no_grad():
        ref_logits = ref(torch.tensor(tokens)).logits.float().numpy()
    model = hf.from_hf(dict(ref.state_dict()), hf.config_from_hf(cfg.to_dict(), compute_dtype="bfloat16"))
    ours = np.asarray(jax.vmap(model)(jnp.asarray(tokens, jnp.int32)))
    kl, top1 = kl_and_top1(ref_logits, ours)
    print(f"bf16 compute vs fp32 HF: mean KL {kl.mean():.3g}, max KL {kl.max():.3g}, top-1 {top1:.4f}")
    # bf16 has 8 mantissa bits; a wrong kernel gives KL ~ 1, rounding gives ~1e-3 or less.
    assert kl.mean() < 5e-3 and top1 > 0.9


def test_to_hf_round_trip(tmp_path):
    c = olmo3.Config.tiny(vocab_size=101, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, mlp_hidden=48,
                          n_layers=4, window=5)
    model = olmo3.OLMo3(c, jax.random.key(3))
    # Non-trivial norms, each leaf its own: with one key the norms of a shape came out identical
    # and an export that swapped two of them (post-attention / post-feedforward) passed.
    leaves, tree = jax.tree.flatten(model)
    model = jax.tree.unflatten(tree, [a + 0.05 * jax.random.normal(jax.random.fold_in(jax.random.key(4), i), a.shape)
                                      for i, a in enumerate(leaves)])
    hf.to_hf(model, tmp_path / "hf")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    theirs = ref.state_dict()   # transformers' names for the norms, read by transformers
    for i in range(c.n_layers):
        for name, ours in (("self_attn.q_norm", "q_norm"), ("self_attn.k_norm", "k_norm"),
                           ("post_attention_layernorm", "post_attention_norm"),
                           ("post_feedforward_layernorm", "post_feedforward_norm")):
            np.testing.assert_array_equal(theirs[f"model.layers.{i}.{name}.weight"].numpy(),
                                          np.asarray(getattr(model.layers, ours)[i]), err_msg=f"{i} {name}")
    tokens = np.random.default_rng(5).integers(0, c.vocab_size, size=(1, 20))
    with torch.no_grad():
        ref_logits = ref(torch.tensor(tokens)).logits.numpy()[0]
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens[0], jnp.int32))), ref_logits,
                               atol=1e-5, rtol=1e-5)
    back = hf.from_hf(tmp_path / "hf")
    assert back.config == model.config
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))



def test_to_hf_writes_bf16_as_bf16(tmp_path):
    """A bf16 checkpoint goes to HF as BF16 tensors (half the bytes of fp32), bit for bit: read back
    by transformers/torch, the independent reader, every tensor equals ours exactly."""
    c = olmo3.Config.tiny(vocab_size=101, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, mlp_hidden=48,
                          n_layers=4, window=5, param_dtype="bfloat16")
    model = olmo3.OLMo3(c, jax.random.key(3))
    hf.to_hf(model, tmp_path / "hf")
    with open(tmp_path / "hf" / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto")
    assert ref.dtype == torch.bfloat16   # config.json's dtype: "auto" loads what it names
    theirs = {k: v.float().numpy() for k, v in ref.state_dict().items()}
    for name, ours in hf.state_dict(model).items():
        assert ours.dtype == jnp.bfloat16, name
        np.testing.assert_array_equal(ours.astype(np.float32), theirs[name], err_msg=name)

def test_a_checkpoint_s_model_config_keeps_every_field_of_the_math():
    """config_to_dict -> JSON (a checkpoint's extra) -> config_from_dict gives back every field
    that changes what the model computes, each away from its default; the fields left out are
    ways of computing (README: they may change between runs of one checkpoint)."""
    import dataclasses

    from olmo3.config import YaRN, config_from_dict, config_to_dict
    math_fields = {"vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_hidden", "window",
                   "layer_pattern", "rope_theta", "yarn", "norm_eps", "param_dtype"}
    ways = {"max_position_embeddings", "compute_dtype", "attention", "remat", "scan_layers", "float8", "init_std",
            "splash_block_q", "splash_block_kv"}
    assert {f.name for f in dataclasses.fields(olmo3.Config)} == math_fields | ways
    c = olmo3.Config(vocab_size=300, d_model=48, n_layers=6, n_heads=3, n_kv_heads=1, head_dim=20, mlp_hidden=80,
                     window=9, layer_pattern=("sliding", "full"), rope_theta=1e4, norm_eps=1e-5, param_dtype="bfloat16",
                     yarn=YaRN(factor=2.0, original_max_position=64, beta_fast=8.0, beta_slow=2.0, attention_factor=1.5))
    back = config_from_dict(json.loads(json.dumps(config_to_dict(c))))
    assert {f: getattr(back, f) for f in math_fields} == {f: getattr(c, f) for f in math_fields}


def test_7b_preset_numbers():
    c = olmo3.Config.olmo3_7b()
    assert c.num_params() == 7_298_011_136
    assert c.params_per_layer() == 202_391_552
    abstract = eqx.filter_eval_shape(olmo3.OLMo3, c, jax.random.key(0))
    assert sum(x.size for x in jax.tree.leaves(abstract)) == 7_298_011_136
    tflop = c.train_flops_per_token(8192, "writeup") * 512 * 8192 / 128 / 1e12
    assert abs(tflop - 1565) / 1565 < 0.005
    assert c.train_flops_per_token(8192, "sliding") < c.train_flops_per_token(8192, "writeup")
    wide = olmo3.Config.olmo3_7b_16x256()
    assert wide.num_params() == c.num_params()
    assert wide.train_flops_per_token(8192) == c.train_flops_per_token(8192)
    assert olmo3.Config.olmo3_7b_long().yarn.mscale == pytest.approx(1.2079, abs=1e-4)


@pytest.mark.parametrize("name", ["gqa", "odd_sizes"])
def test_counts_of_gqa_and_odd_sizes(name):
    """The 7B is MHA with q_dim = d_model; where they differ: num_params is transformers'
    parameter count, and the write-up's attention term counts query heads (6 x seq x heads x
    head_dim a layer): fewer K/V heads shrink the K/V projections, not QK^T or PV."""
    cfg = hf_config(**dict((n, over) for n, over, _ in CASES)[name])
    c = hf.config_from_hf(cfg.to_dict())
    assert c.num_params() == sum(p.numel() for p in transformers.Olmo3ForCausalLM(cfg).parameters())
    T = 40
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = 6 * T * cfg.num_attention_heads * head_dim * cfg.num_hidden_layers
    embed = cfg.vocab_size * cfg.hidden_size
    assert c.train_flops_per_token(T, "writeup") == 6 * (c.num_params() - embed) + attn


@pytest.mark.parametrize("T", [12, 5, 3])   # longer than, as long as and shorter than the window
def test_sliding_flops_match_dense_mask_count(T):
    c = olmo3.Config.tiny(window=5, n_layers=4)
    i, j = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
    sliding_keys = ((j <= i) & (i - j < 5)).sum() / T
    full_keys = (j <= i).sum() / T
    attn = 12 * c.q_dim * (3 * sliding_keys + full_keys)
    assert c.train_flops_per_token(T, "sliding") == pytest.approx(6 * c.num_params(False) + attn)


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="multiple of the layer pattern"):
        olmo3.Config.tiny(n_layers=6)
    # Architectures that cannot be built, or would compute NaN or something else deep inside a
    # step, are refused when the Config is made, naming the field; the nearest valid values pass.
    from olmo3.config import YaRN
    for over, says in ((dict(window=0), "window=0 must be >= 1"), (dict(head_dim=63), "head_dim=63 must be even"),
                       (dict(n_heads=6, n_kv_heads=4), "n_heads=6 is not a multiple of n_kv_heads=4"),
                       (dict(layer_pattern=()), r"layer_pattern=\(\) is empty"),
                       (dict(yarn=YaRN(attention_factor=float("nan"))), "attention_factor must be finite"),
                       (dict(yarn=YaRN(attention_factor=0.0)), "attention_factor must be finite"),
                       (dict(yarn=YaRN(beta_slow=float("inf"))), "beta_slow and attention_factor must be")):
        with pytest.raises(ValueError, match=says):
            olmo3.Config.tiny(**over)
    olmo3.Config.tiny(window=1, head_dim=62, n_heads=6, n_kv_heads=3, layer_pattern=("full",),
                      yarn=YaRN(attention_factor=1.5))
    cfg = hf_config()
    with pytest.raises(ValueError, match="expected an Olmo3ForCausalLM"):
        hf.config_from_hf({**cfg.to_dict(), "model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    ref = random_hf_model(cfg)
    sd = dict(ref.state_dict())
    wrong = hf.config_from_hf(cfg.to_dict(), d_model=32, head_dim=8)
    with pytest.raises(ValueError, match="has shape .* config expects"):
        hf.from_hf(sd, wrong)
    q = "model.layers.0.self_attn.q_proj.weight"
    quantized = {**sd, q: sd[q].to(torch.int32)}   # weights of a quantized export: never cast without a word
    with pytest.raises(ValueError, match=rf"tensor '{q}' has dtype int32"):
        hf.from_hf(quantized, hf.config_from_hf(cfg.to_dict()))
    sd.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight.*download complete"):
        hf.from_hf(sd, hf.config_from_hf(cfg.to_dict()))
    # A bool or a fraction where a count belongs (read as 1 layer, as 64 wide) is named.
    for field, value in (("num_hidden_layers", True), ("hidden_size", 64.5)):
        with pytest.raises(ValueError, match=rf"field '{field}' is {value!r}; expected an integer"):
            hf.config_from_hf({**cfg.to_dict(), field: value})
    # eos_token_id is dolma2's <|endoftext|> (100257) only where the vocabulary holds it.
    assert hf.config_to_hf(olmo3.Config.tiny(vocab_size=100257))["eos_token_id"] is None
    assert hf.config_to_hf(olmo3.Config.tiny(vocab_size=100258))["eos_token_id"] == 100257


def test_safetensors_writer_refuses_a_block_past_the_tensors_end(tmp_path):
    """Blocks of rows that overrun a tensor would shift every later tensor of the file."""
    f32 = np.dtype(np.float32)
    w = hf.SafetensorsWriter(str(tmp_path / "a.safetensors"), [("a", (4, 2), f32), ("b", (1,), f32)])
    w.write("a", np.zeros((3, 2)))
    with pytest.raises(ValueError, match=r"tensor 'a': block \(3, 2\) does not continue shape \(4, 2\) at row 3"):
        w.write("a", np.zeros((3, 2)))


def test_bf16_mlp_bit_exact_with_transformers():
    """A bf16 layer's feed-forward half equals HF's bf16 Olmo3DecoderLayer bit for bit: torch's
    F.silu rounds once from float32 (jax.nn.silu on bf16 rounds sigmoid first: ~40% of the
    elements 1 ulp off). The attention output is zero, so h = x and only the MLP + norms run."""
    from olmo3.model import layer_output
    cfg = hf_config(intermediate_size=256)
    ref = random_hf_model(cfg).to(torch.bfloat16)
    layer = ref.model.layers[0]
    x = torch.randn(37, cfg.hidden_size).to(torch.bfloat16)
    with torch.no_grad():
        want = (x + layer.post_feedforward_layernorm(layer.mlp(x))).float().numpy()
    config = hf.config_from_hf(cfg.to_dict(), compute_dtype="bfloat16", param_dtype="bfloat16")
    model = hf.from_hf(dict(ref.state_dict()), config)
    p = jax.tree.map(lambda w: w[0], model.layers)
    got = layer_output(config, p, jnp.asarray(x.float().numpy(), jnp.bfloat16),
                       jnp.zeros((37, config.q_dim), jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)


def test_bf16_norm_and_head_of_float32_parameters_round_the_weight_to_bf16():
    """float32 parameters, bf16 compute (OLMo-core's FSDP mixed precision; HF's bf16 model): every
    weight is rounded to bf16 before use. The norm is transformers' Olmo3RMSNorm in bf16 bit for
    bit; the head is a float64 numpy product with the bf16-rounded lm_head. Logits of the unrounded
    weight differ by ~1e-3 relative, which the bf16 parity test's KL bound cannot see."""
    from transformers.models.olmo3.modeling_olmo3 import Olmo3RMSNorm

    from olmo3.model import rms_norm
    rng = np.random.default_rng(1)
    x = np.asarray(jnp.asarray(rng.standard_normal((37, 64)), jnp.bfloat16).astype(jnp.float32))   # bf16 values
    w = (1 + 0.2 * rng.standard_normal(64)).astype(np.float32)                                       # not bf16 values
    norm = Olmo3RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor(w))
        want = norm(torch.tensor(x).to(torch.bfloat16)).float().numpy()
    got = rms_norm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w), 1e-6)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)
    c = olmo3.Config.tiny(vocab_size=512, d_model=64, n_heads=4, n_kv_heads=4, head_dim=16, mlp_hidden=96,
                          compute_dtype="bfloat16", param_dtype="float32")
    model = olmo3.OLMo3(c, jax.random.key(0))
    h = jax.random.normal(jax.random.key(1), (16, 64)).astype(jnp.bfloat16)
    want = np.asarray(h.astype(jnp.float32), np.float64) @ np.asarray(
        model.lm_head.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    np.testing.assert_allclose(np.asarray(model.head(h), np.float64), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_init_is_a_normal_truncated_at_three_std():
    """OLMo3.__init__ as OLMo-core's InitMethod.normal: every matrix a normal of std init_std cut at
    +-3 std, each its own draw, every norm weight 1. Oracle: the truncated normal's closed-form std,
    init_std x sqrt(1 - 2 x 3 phi(3) / (2 Phi(3) - 1)) = 0.98658 x init_std."""
    c = olmo3.Config.tiny(vocab_size=4096, n_layers=4)
    model = olmo3.OLMo3(c, jax.random.key(0))
    mats = {"embed": model.embed, "lm_head": model.lm_head,
            **{n: getattr(model.layers, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                     "gate_proj", "up_proj", "down_proj")}}
    for name, w in mats.items():
        w = np.asarray(w, np.float64)
        assert 2.9 * c.init_std < np.abs(w).max() <= 3 * c.init_std + 1e-7, name   # the tails reach the cut
        assert abs(w.mean()) < 1e-3 and w.std() == pytest.approx(0.98658 * c.init_std, rel=0.03), (name, w.std())
    for name in ("q_norm", "k_norm", "post_attention_norm", "post_feedforward_norm"):
        assert np.all(np.asarray(getattr(model.layers, name)) == 1.0), name
    assert np.all(np.asarray(model.norm) == 1.0)
    assert not np.array_equal(np.asarray(model.layers.gate_proj), np.asarray(model.layers.up_proj))


def _dot_precisions(jaxpr) -> list:
    """The `precision` of every dot_general in a jaxpr, through scans, remat, custom_vjp, pjit."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append(eqn.params["precision"])
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (list, tuple)) else [v]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += _dot_precisions(inner)
    return out


@pytest.mark.parametrize("window", [8, 64], ids=["local", "dense"])
def test_float32_compute_matmuls_are_float32(window):
    """float32 compute (HF verification, convert.py --verify) asks every matmul of the loss and its
    gradient for float32 ('highest'): by default TPUs take one bf16 pass and NVIDIA tensor cores
    TF32 for float32 inputs (the CPU ignores it). bf16 compute keeps the platform's default."""
    from olmo3 import step
    P = jax.lax.Precision
    for dtype in ("float32", "bfloat16"):
        config = olmo3.Config.preset("tiny").replace(compute_dtype=dtype, window=window)
        model = olmo3.OLMo3(config, jax.random.key(0))
        tokens = jnp.arange(64, dtype=jnp.int32).reshape(2, 32) % config.vocab_size
        batch = {"tokens": tokens, "instance_mask": jnp.ones(2, bool),
                 "segment_ids": jnp.repeat(jnp.arange(4, dtype=jnp.int32), 16).reshape(2, 32)}
        with jax.default_matmul_precision("default"):   # conftest makes every test's default 'highest'
            jaxpr = jax.make_jaxpr(lambda m: step.accumulate_grads(
                m, batch, jnp.float32(62), microbatches=1, chunk=16, z_loss=1e-5, use_segments=True))(model)
            precisions = [p[0] for p in _dot_precisions(jaxpr.jaxpr) + _dot_precisions(
                jax.make_jaxpr(model)(tokens[0]).jaxpr)]
        if dtype == "float32":
            assert len(precisions) >= 12 and set(precisions) == {P.HIGHEST}, precisions
        else:   # only the RoPE tables' own float32 dot (rope.cos_sin) asks for HIGHEST
            assert precisions.count(P.DEFAULT) >= 12 and set(precisions) == {P.DEFAULT, P.HIGHEST}, precisions


def test_float32_kernels_matmuls_are_float32():
    """The same for the Splash kernels, forward and backward, in every branch the dispatch
    lowers (Mosaic for TPU: contract_precision fp32; Triton for CUDA: IEEE, not TF32; interpret)."""
    from olmo3.attention import attention
    seg = jnp.repeat(jnp.arange(2, dtype=jnp.int32), 128)
    for dtype, want in ((jnp.float32, jax.lax.Precision.HIGHEST), (jnp.bfloat16, jax.lax.Precision.DEFAULT)):
        q, kv = jnp.ones((4, 256, 64), dtype), jnp.ones((2, 256, 64), dtype)
        f = lambda q, k, v: jnp.sum(attention(q, k, v, window=64, segment_ids=seg,  # noqa: E731
                                              impl="splash").astype(jnp.float32))
        with jax.default_matmul_precision("default"):
            precisions = [p[0] for p in _dot_precisions(jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, kv, kv).jaxpr)]
        assert len(precisions) >= 3 * 9 and set(precisions) == {want}, (dtype, set(precisions))
