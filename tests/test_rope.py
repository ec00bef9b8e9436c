"""RoPE tables against a numpy oracle, and compiled once per step (not per head and batch row).

The rotation itself is checked end to end against transformers in test_model.py (plain RoPE and
YaRN layers, even and odd head counts).
"""
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import olmo3
from olmo3 import rope
from olmo3.config import Config, YaRN


@pytest.mark.parametrize("head_dim,yarn", [(64, None), (12, None), (128, YaRN())])
def test_cos_sin_match_numpy(head_dim, yarn):
    positions = np.array([0, 1, 2, 7, 4095, 8191, 8192, 40_000, 65_535], np.int32)
    inv_freq, scale = rope.inv_frequencies(head_dim, 5e5, yarn)
    angles = (positions.astype(np.float32)[:, None] * inv_freq[None, :]).astype(np.float64)
    angles = np.concatenate([angles, angles], axis=-1)          # rotate-half: both halves alike
    cos, sin = rope.cos_sin(jnp.asarray(positions), head_dim, 5e5, yarn)
    assert cos.shape == sin.shape == (len(positions), head_dim)
    np.testing.assert_allclose(np.asarray(cos), np.cos(angles) * scale, rtol=0, atol=2e-6)
    np.testing.assert_allclose(np.asarray(sin), np.sin(angles) * scale, rtol=0, atol=2e-6)
    if yarn is not None:
        assert scale == pytest.approx(0.1 * np.log(8.0) + 1.0)


def test_7b_frequencies_and_tables_equal_transformers_and_olmo_core():
    """The 7B's frequencies (head_dim 128, theta 5e5; YaRN 8 over 8192 on full layers) bit for
    bit against transformers' Olmo3 rotary embedding and OLMo-core's RotaryEmbedding (both torch),
    and the cos/sin tables at positions up to 65,535 within float32 cos/sin rounding."""
    torch = pytest.importorskip("torch")
    from transformers import Olmo3Config
    from transformers.models.olmo3.modeling_olmo3 import Olmo3RotaryEmbedding
    yarn = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0, "original_max_position_embeddings": 8192,
            "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 0.1 * np.log(8.0) + 1.0}
    cfg = Olmo3Config(hidden_size=4096, num_attention_heads=32, max_position_embeddings=65536,
                      rope_parameters={"full_attention": yarn,
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}})
    hf = Olmo3RotaryEmbedding(cfg)
    positions = np.array([[0, 1, 7, 4095, 8191, 8192, 40_000, 65_534, 65_535]])
    x = torch.zeros(1, positions.shape[1], 128)
    for layer_type, ours in (("sliding_attention", None), ("full_attention", YaRN())):
        inv_freq, _ = rope.inv_frequencies(128, 5e5, ours)
        np.testing.assert_array_equal(inv_freq, getattr(hf, f"{layer_type}_inv_freq").numpy())
        want_cos, want_sin = (t.numpy()[0] for t in hf(x, torch.from_numpy(positions), layer_type=layer_type))
        cos, sin = rope.cos_sin(jnp.asarray(positions[0], jnp.int32), 128, 5e5, ours)
        np.testing.assert_allclose(np.asarray(cos), want_cos, rtol=0, atol=3e-7)
        np.testing.assert_allclose(np.asarray(sin), want_sin, rtol=0, atol=3e-7)
    olmo_rope = pytest.importorskip("olmo_core.nn.rope")
    for scaling, ours in ((None, None), (olmo_rope.YaRNRoPEScalingConfig(factor=8, beta_fast=32, beta_slow=1,
                                                                         old_context_len=8192), YaRN())):
        theirs = olmo_rope.RotaryEmbedding(head_size=128, theta=500000, scaling=scaling)
        sin, cos = theirs._get_rotary_embedding(65_536, torch.device("cpu"))
        ours_cos, ours_sin = rope.cos_sin(jnp.asarray(positions[0], jnp.int32), 128, 5e5, ours)
        np.testing.assert_allclose(np.asarray(ours_cos), cos.numpy()[positions[0]], rtol=0, atol=3e-7)
        np.testing.assert_allclose(np.asarray(ours_sin), sin.numpy()[positions[0]], rtol=0, atol=3e-7)



@pytest.mark.parametrize("head_dim,theta,factor,original,beta_fast,beta_slow", [
    (32, 100.0, 4.0, 4096, 32.0, 1.0),    # the slow end clamps at head_dim - 1 (past head_dim // 2)
    (16, 5e5, 4.0, 16, 32.0, 5.0),        # both ends clamp to 0: a zero-width ramp, widened by 0.001
    (64, 1e4, 16.0, 2048, 16.0, 2.0),
    (64, 1e4, 1.0, 2048, 32.0, 1.0),      # factor 1: no interpolation, attention factor 1 (its mscale's else)
])
def test_yarn_ramp_edges_match_transformers(head_dim, theta, factor, original, beta_fast, beta_slow):
    """YaRN frequencies at the correction range's clamps, and its attention factor, against
    transformers' _compute_yarn_parameters (via Olmo3RotaryEmbedding): the range is cut to
    [0, head_dim - 1] and a zero-width one widened by 0.001 (a 0/0 ramp would make NaN frequencies)."""
    pytest.importorskip("torch")
    from transformers import Olmo3Config
    from transformers.models.olmo3.modeling_olmo3 import Olmo3RotaryEmbedding
    yarn = {"rope_type": "yarn", "rope_theta": theta, "factor": factor,
            "original_max_position_embeddings": original, "beta_fast": beta_fast, "beta_slow": beta_slow}
    cfg = Olmo3Config(hidden_size=2 * head_dim, num_attention_heads=2, max_position_embeddings=int(original * factor),
                      rope_parameters={"full_attention": yarn,
                                       "sliding_attention": {"rope_type": "default", "rope_theta": theta}})
    theirs = Olmo3RotaryEmbedding(cfg)
    want = theirs.full_attention_inv_freq.numpy()
    ours = YaRN(factor=factor, original_max_position=original, beta_fast=beta_fast, beta_slow=beta_slow)
    got, _ = rope.inv_frequencies(head_dim, theta, ours)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    assert ours.mscale == pytest.approx(theirs.full_attention_attention_scaling, rel=1e-12)


def test_yarn_without_betas_in_config_json_takes_transformers_defaults():
    """A YaRN rope_parameters without beta_fast / beta_slow (OLMo 3's own config.json lists them;
    a hand-written one may not): hf.config_from_hf's frequencies equal transformers' for it."""
    pytest.importorskip("torch")
    from transformers import Olmo3Config
    from transformers.models.olmo3.modeling_olmo3 import Olmo3RotaryEmbedding

    from olmo3 import hf
    yarn = {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0, "original_max_position_embeddings": 8192}
    cfg = Olmo3Config(vocab_size=128, hidden_size=256, num_attention_heads=2, intermediate_size=64,
                      max_position_embeddings=65536, rope_parameters={
                          "full_attention": yarn, "sliding_attention": {"rope_type": "default", "rope_theta": 5e5}})
    c = hf.config_from_hf(cfg.to_dict())
    got, scale = rope.inv_frequencies(c.head_dim, c.rope_theta, c.yarn)
    np.testing.assert_allclose(got, Olmo3RotaryEmbedding(cfg).full_attention_inv_freq.numpy(), rtol=1e-6, atol=0)


def _fusion_outputs_with(hlo: str, ops: tuple[str, ...]) -> list[int]:
    """Element counts of the fusions (and unfused instructions) of an optimized HLO module that
    compute any of `ops`."""
    computation = r"^%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}"            # name ... {\n body \n}
    bodies = {m.group(1): m.group(2) for m in re.finditer(computation, hlo, re.M | re.S)}
    computes = {name for name, body in bodies.items() if any(f" {op}(" in body for op in ops)}
    sizes = []
    for shape, rest in re.findall(r"^\s*(?:ROOT )?%[\w.\-]+ = (\S+) (\w[\w-]*\(.*)$", hlo, re.M):
        called = re.search(r"calls=%([\w.\-]+)", rest)
        if (called and called.group(1) in computes) or rest.split("(")[0] in ops:
            sizes.append(sum(int(np.prod([int(x) for x in dims.split(",") if x]))
                             for dims in re.findall(r"\[([\d,]*)\]", shape)))
    return sizes


def test_tables_are_computed_once_per_step():
    """The CPU forward + backward of a batch computes sin and cos on table-sized buffers only:
    no fusion recomputes them per batch row and head (olmo3/rope.py cos_sin)."""
    config = Config.tiny(vocab_size=128, n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16,
                         mlp_hidden=96, window=8, yarn=YaRN(factor=4.0, original_max_position=16),
                         remat="none", scan_layers=False)
    batch, seq = 3, 32
    model = olmo3.OLMo3(config, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (batch, seq)), jnp.int32)
    params, static = eqx.partition(model, eqx.is_array)
    loss = lambda p: jnp.mean(jax.vmap(eqx.combine(p, static))(tokens) ** 2)  # noqa: E731
    hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
    sizes = _fusion_outputs_with(hlo, ("sine", "cosine"))
    assert sizes, "no sin/cos found in the compiled step: the check would pass vacuously"
    table = 2 * seq * config.head_dim          # cos and sin stacked: [2 x seq, head_dim]
    assert max(sizes) <= table, (
        f"sin/cos computed into buffers of {sorted(set(sizes))} elements; the tables hold {table}: "
        f"XLA fused them into the per-head RoPE fusions")


def test_a_packed_documents_offset_changes_rounding_only():
    """A packed document (segment ids) is rotated from its offset in the instance, as OLMo 3 was
    trained (olmo3/rope.py): its hidden states are those of its forward alone at positions
    offset..offset+n and, RoPE being relative, those from position 0 (OLMo-core's later
    intra-document RoPE), both to float32 rounding."""
    config = Config.tiny(vocab_size=256, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, mlp_hidden=128,
                         n_layers=4, window=8, remat="none")
    model = olmo3.OLMo3(config, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (48,), 0, 256)
    segments = jnp.asarray([0] * 20 + [1] * 28, jnp.int32)
    packed = np.asarray(model.hidden(tokens, segment_ids=segments)[20:])
    at_offset = np.asarray(model.hidden(tokens[20:], positions=jnp.arange(20, 48, dtype=jnp.int32)))
    from_zero = np.asarray(model.hidden(tokens[20:]))
    np.testing.assert_allclose(packed, at_offset, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed, from_zero, rtol=1e-5, atol=1e-5)


_YARN4 = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
_ROPE_CONFIGS = [   # (id, the config.json's rope fields, whether hf.config_from_hf refuses it)
    ("flat_yarn_rope_parameters", {"rope_parameters": {**_YARN4, "rope_theta": 1e4}}, True),   # transformers 5: ignored
    ("flat_default_rope_parameters", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, True),
    ("flat_rope_parameters_as_transformers_reads_them", {"rope_parameters": {"rope_type": "default",
                                                                             "rope_theta": 5e5}}, False),
    ("full_entry_only", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}}, True),
    ("entries_without_theta", {"rope_parameters": {"full_attention": {"rope_type": "default"},
                                                   "sliding_attention": {"rope_type": "default"}}}, False),
    ("yarn_entry_without_theta", {"rope_parameters": {"full_attention": dict(_YARN4),
                                                      "sliding_attention": {"rope_type": "default"}}}, False),
    ("theta_beside_entries_without_one", {"rope_theta": 1e4, "rope_parameters": {
        "full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}}, True),
    ("theta_beside_entries_with_it", {"rope_theta": 1e4, "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e4},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, False),
    ("yarn_on_sliding_layers", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                                                    "sliding_attention": {**_YARN4, "rope_theta": 5e5}}}, True),
    ("transformers_4_yarn", {"rope_theta": 5e5, "rope_scaling": dict(_YARN4)}, False),   # AI2's long-context format
    ("transformers_4_default", {"rope_theta": 5e5, "rope_scaling": None}, False),
]


@pytest.mark.parametrize("fields,refused", [c[1:] for c in _ROPE_CONFIGS], ids=[c[0] for c in _ROPE_CONFIGS])
def test_rope_fields_of_a_config_json_read_as_transformers_computes_them_or_refused(tmp_path, fields, refused):
    """Each layer type's frequencies and scale as transformers 5's Olmo3 computes them from the same
    config.json, or a refusal: a flat rope_parameters (transformers fills in default entries and
    ignores it) and a top-level rope_theta beside an entry without one were read here as the
    parameters of every layer, a model other than transformers'. (A transformers 4.x config.json
    with a rope_theta other than 500,000 is left out: transformers 5.24 gives it to the
    full-attention layers only, 4.57, OLMo 3's release, to all of them, as here.)"""
    pytest.importorskip("torch")
    import json

    from transformers import AutoConfig
    from transformers.models.olmo3.modeling_olmo3 import Olmo3RotaryEmbedding

    from olmo3 import hf
    raw = {"model_type": "olmo3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 4, "num_attention_heads": 2, "max_position_embeddings": 256, **fields}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    if refused:
        with pytest.raises(ValueError, match="config.json"):
            hf.read_hf_config(str(tmp_path))
        return
    c = hf.read_hf_config(str(tmp_path))
    ref = Olmo3RotaryEmbedding(AutoConfig.from_pretrained(str(tmp_path)))
    for layer_type, yarn in (("sliding_attention", None), ("full_attention", c.yarn)):
        inv_freq, scale = rope.inv_frequencies(c.head_dim, c.rope_theta, yarn)
        np.testing.assert_allclose(inv_freq, getattr(ref, f"{layer_type}_inv_freq").numpy(), rtol=1e-6, atol=0)
        assert scale == pytest.approx(getattr(ref, f"{layer_type}_attention_scaling"), rel=1e-6)
