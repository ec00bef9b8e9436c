"""The OLMo 3 transformer as an Equinox PyTree (transformers' `Olmo3ForCausalLM`, DESIGN §2).

    x = embed[tokens]
    for each layer:                          # 3 sliding-window layers, then 1 full, repeated
        h = x + post_attention_norm(attn(x))   # "reordered norm": no input norm
        x = h + post_feedforward_norm(mlp(h))
    logits = norm(x) @ lm_head               # untied

Weights are stored [in, out] (`x @ w`); torch's Linear stores [out, in], see olmo3/hf.py.
Every per-layer weight is stacked on a leading [n_layers] axis and the layers run under
`jax.lax.scan` over repeating pattern groups, so compile time does not grow with depth
(`Config.scan_layers=False` unrolls the groups: small CPU models run faster that way).
`__call__` works on one sequence; batch with `jax.vmap`.
"""
from __future__ import annotations

from typing import Callable, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from beartype import beartype
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int, PRNGKeyArray, jaxtyped

from olmo3 import float8, rope
from olmo3.attention import attention
from olmo3.config import Config, float8_eligible, matmul_precision

# Names of the projection outputs the "save_proj" remat policy keeps (DESIGN §6: the policy
# that fit the 7B saves the attention and MLP projections and recomputes the rest).
_PROJ_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Layer(eqx.Module):
    """One decoder layer's weights. In `OLMo3.layers` every leaf has a leading [n_layers] axis."""

    q_proj: Float[Array, "*L d_model q_dim"]
    k_proj: Float[Array, "*L d_model kv_dim"]
    v_proj: Float[Array, "*L d_model kv_dim"]
    o_proj: Float[Array, "*L q_dim d_model"]
    q_norm: Float[Array, "*L q_dim"]          # QK-norm over the full projection, before RoPE
    k_norm: Float[Array, "*L kv_dim"]
    gate_proj: Float[Array, "*L d_model mlp"]
    up_proj: Float[Array, "*L d_model mlp"]
    down_proj: Float[Array, "*L mlp d_model"]
    post_attention_norm: Float[Array, "*L d_model"]
    post_feedforward_norm: Float[Array, "*L d_model"]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """OLMo/HF RMSNorm: float32 statistics, weight multiplied in float32, cast back.

    The weight takes x's (the compute) dtype first, as every other weight does: OLMo-core's FSDP
    materialises every parameter, the norms' too, in `param_dtype` (bf16 in the recipe;
    olmo_core/nn/transformer/model.py `apply_fsdp`, MixedPrecisionPolicy), and its RMSNorm then
    upcasts that bf16 weight (`self.weight.type_as(x)`); HF's bf16 model holds it in bf16 too.
    Its gradient is rounded the same way, as the bf16 parameter's gradient is there. In float32
    compute this is the float32 weight."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(x.dtype).astype(jnp.float32) * xf).astype(x.dtype)


def uses_float8(cfg: Config, name: str, shape: tuple[int, ...]) -> bool:
    """Whether the layer weight `name` of (whole, unsharded) `shape` runs through float8: the
    stage-3 recipe's torchao Float8Linear (olmo3/float8.py) on the linears OLMo-core's
    Float8Config converts, those whose every dimension is a multiple of 16."""
    return cfg.float8 and name in _PROJ_NAMES and float8_eligible(shape)


def _proj(cfg: Config, x: jax.Array, w: jax.Array, name: str) -> jax.Array:
    if uses_float8(cfg, name, w.shape):
        y = float8.linear(x, w)
    else:
        y = jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32,
                    precision=matmul_precision(x.dtype)).astype(x.dtype)
    return checkpoint_name(y, name)


def attention_inputs(cfg: Config, p: Layer, x: jax.Array, cos: jax.Array, sin: jax.Array):
    """q (T, H, hd), k and v (T, KV, hd) of one layer: QK-norm over the full projection, then RoPE."""
    T = x.shape[0]
    q = rms_norm(_proj(cfg, x, p.q_proj, "q_proj"), p.q_norm, cfg.norm_eps)   # (T, H*hd)
    k = rms_norm(_proj(cfg, x, p.k_proj, "k_proj"), p.k_norm, cfg.norm_eps)   # (T, KV*hd)
    v = _proj(cfg, x, p.v_proj, "v_proj")                                     # (T, KV*hd)
    q = rope.apply_rope(q.reshape(T, cfg.n_heads, cfg.head_dim), cos, sin)     # (T, H, hd)
    k = rope.apply_rope(k.reshape(T, cfg.n_kv_heads, cfg.head_dim), cos, sin)  # (T, KV, hd)
    return q, k, v.reshape(T, cfg.n_kv_heads, cfg.head_dim)


def layer_output(cfg: Config, p: Layer, x: jax.Array, o: jax.Array) -> jax.Array:
    """The rest of the layer given the attention output o (T, H*hd): reordered norms + SwiGLU."""
    h = x + rms_norm(_proj(cfg, o, p.o_proj, "o_proj"), p.post_attention_norm, cfg.norm_eps)
    gate = _proj(cfg, h, p.gate_proj, "gate_proj")
    up = _proj(cfg, h, p.up_proj, "up_proj")
    # silu in float32, rounded once, as torch's F.silu (HF's Olmo3MLP, OLMo-core) does in bf16;
    # jax.nn.silu on bf16 rounds sigmoid(gate) first (1 bf16 ulp off in ~40% of elements)
    act = jax.nn.silu(gate.astype(jnp.float32)).astype(gate.dtype)
    mlp = _proj(cfg, act * up, p.down_proj, "down_proj")                             # (T, d)
    return h + rms_norm(mlp, p.post_feedforward_norm, cfg.norm_eps)


def layer_forward(cfg: Config, p: Layer, x: jax.Array, layer_type: str, cos: jax.Array,
                  sin: jax.Array, segment_ids: Optional[jax.Array],
                  attend: Optional[Callable] = None) -> jax.Array:
    """One decoder layer on one sequence x [seq, d_model]; `p` holds unstacked weights.
    `attend(q, k, v, window=)` replaces `attention` (olmo3/sharding.py's context parallelism:
    x is then this device's chunk of the sequence and attend gathers the other chunks' K/V)."""
    T = x.shape[0]
    q, k, v = attention_inputs(cfg, p, x, cos, sin)
    q, k, v = (y.transpose(1, 0, 2) for y in (q, k, v))                  # (heads, T, hd)
    if attend is not None:
        o = attend(q, k, v, window=cfg.window if layer_type == "sliding" else None)
    else:
        window = cfg.window if layer_type == "sliding" and cfg.window < T else None
        o = attention(q, k, v, window=window, segment_ids=segment_ids, impl=cfg.attention,
                      block_q=cfg.splash_block_q, block_kv=cfg.splash_block_kv)   # (H, T, hd)
    return layer_output(cfg, p, x, o.transpose(1, 0, 2).reshape(T, cfg.q_dim))


def _remat(fn: Callable, policy: str) -> Callable:
    if policy == "none":
        return fn
    if policy == "full":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)
    if policy == "save_proj":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.save_only_these_names(*_PROJ_NAMES))
    if policy == "save_dots":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    raise ValueError(f"Unknown remat policy {policy!r}")


class OLMo3(eqx.Module):
    """OLMo 3 causal LM. `model(tokens)` -> float32 logits for one sequence."""

    embed: Float[Array, "vocab d_model"]
    layers: Layer
    norm: Float[Array, " d_model"]
    lm_head: Float[Array, "d_model vocab"]
    config: Config = eqx.field(static=True)

    def __init__(self, config: Config, key: PRNGKeyArray):
        """OLMo-core init: truncated normal std 0.02 cut at +-3 std for every matrix; norms 1."""
        c = config
        dt = c.pdtype
        L = c.n_layers
        keys = iter(jax.random.split(key, 10))

        def trunc(shape):
            return (c.init_std * jax.random.truncated_normal(next(keys), -3.0, 3.0, shape,
                                                             jnp.float32)).astype(dt)

        ones = lambda *shape: jnp.ones(shape, dt)
        self.config = c
        self.embed = trunc((c.vocab_size, c.d_model))
        self.layers = Layer(
            q_proj=trunc((L, c.d_model, c.q_dim)), k_proj=trunc((L, c.d_model, c.kv_dim)),
            v_proj=trunc((L, c.d_model, c.kv_dim)), o_proj=trunc((L, c.q_dim, c.d_model)),
            q_norm=ones(L, c.q_dim), k_norm=ones(L, c.kv_dim),
            gate_proj=trunc((L, c.d_model, c.mlp_hidden)), up_proj=trunc((L, c.d_model, c.mlp_hidden)),
            down_proj=trunc((L, c.mlp_hidden, c.d_model)),
            post_attention_norm=ones(L, c.d_model), post_feedforward_norm=ones(L, c.d_model))
        self.norm = ones(c.d_model)
        self.lm_head = trunc((c.d_model, c.vocab_size))

    @jaxtyped(typechecker=beartype)
    def hidden(
        self,
        tokens: Int[Array, " seq"],
        *,
        segment_ids: Optional[Int[Array, " seq"]] = None,
        positions: Optional[Int[Array, " seq"]] = None,
        gather: Optional[Callable[[Layer], Layer]] = None,
        attend: Optional[Callable] = None,
    ) -> Float[Array, "seq d_model"]:
        """Final-normed hidden states in the compute dtype.

        `gather` (used by olmo3/sharding.py) maps one layer's local weight shards to the full
        weights inside the scanned body, so FSDP all-gathers one layer at a time. `attend`
        (context parallelism, olmo3/sharding.py) replaces every layer's attention: `tokens` are
        then this device's chunk of the sequence, at global `positions`.
        """
        c = self.config
        T = tokens.shape[0]
        if positions is None:
            positions = jnp.arange(T, dtype=jnp.int32)
        rope_tables = {  # YaRN on full-attention layers only (OLMo-core)
            "sliding": rope.cos_sin(positions, c.head_dim, c.rope_theta, None),
            "full": rope.cos_sin(positions, c.head_dim, c.rope_theta, c.yarn),
        }
        x = self.embed[tokens].astype(c.dtype)                               # (T, d)
        P = len(c.layer_pattern)
        grouped = jax.tree.map(lambda w: w.reshape(c.n_groups, P, *w.shape[1:]), self.layers)

        def one_layer(x, p, layer_type):
            if gather is not None:
                p = gather(p)
            cos, sin = rope_tables[layer_type]
            return layer_forward(c, p, x, layer_type, cos, sin, segment_ids, attend)

        layer_fns = {t: _remat(lambda x, p, t=t: one_layer(x, p, t), c.remat) for t in set(c.layer_pattern)}

        def group(x, gp):  # one repeat of the layer pattern, e.g. sliding x3 + full
            for i, layer_type in enumerate(c.layer_pattern):
                x = layer_fns[layer_type](x, jax.tree.map(lambda w: w[i], gp))
            return x, None

        if c.scan_layers:
            x, _ = jax.lax.scan(group, x, grouped)
        else:   # Config.scan_layers: the same groups, unrolled
            for g in range(c.n_groups):
                x, _ = group(x, jax.tree.map(lambda w: w[g], grouped))
        return rms_norm(x, self.norm, c.norm_eps)

    @jaxtyped(typechecker=beartype)
    def __call__(
        self,
        tokens: Int[Array, " seq"],
        *,
        segment_ids: Optional[Int[Array, " seq"]] = None,
        positions: Optional[Int[Array, " seq"]] = None,
    ) -> Float[Array, "seq vocab"]:
        return self.head(self.hidden(tokens, segment_ids=segment_ids, positions=positions))

    @jaxtyped(typechecker=beartype)
    def head(self, h: Float[Array, "*seq d_model"]) -> Float[Array, "*seq vocab"]:
        """The untied LM head: final-normed hidden states to float32 logits."""
        return jnp.dot(h, self.lm_head.astype(h.dtype), preferred_element_type=jnp.float32,
                       precision=matmul_precision(h.dtype))


def decay_mask(model: OLMo3) -> OLMo3:
    """Weight-decay mask: True everywhere except the input embedding (OLMo-core stage 1 script:
    norm weights ARE decayed)."""
    mask = jax.tree.map(lambda _: True, model)
    return eqx.tree_at(lambda m: m.embed, mask, False)
