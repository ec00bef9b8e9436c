"""Float8 linears (olmo3/float8.py) against torchao's own `Float8Linear`, the module OLMo-core's
stage-3 recipe trains with, run in torchao's emulation mode on CPU under FSDP as OLMo-core runs it
(one rank here): the casts bit for bit, one linear's output and gradients, and a whole
transformers `Olmo3ForCausalLM` converted the way OLMo-core converts it (every linear but the LM
head)."""
import contextlib
import os
import subprocess
import sys

import equinox as eqx
import jax
import jax.export  # `import jax` does not load it in JAX 0.6
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
torchao_float8 = pytest.importorskip("torchao.float8")

from olmo3 import float8, hf  # noqa: E402
from test_model import hf_config, random_hf_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@contextlib.contextmanager
def as_olmo_core_trains(module, dtype="float32", **convert):
    """`module` with its linears converted by torchao as OLMo-core converts them:
    AOFloat8LinearConfig.recommended() (OLMo-core float8/ao.py; CPU emulation here), then FSDP2
    over one gloo rank, params in `dtype`, gradients reduced in fp32. Under FSDP the weight is cast
    to float8 in the all-gather hook, with an unrounded scale (olmo3/float8.py); without FSDP
    torchao would round it to a power of 2 like the others."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    config = torchao_float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True, round_scales_to_power_of_2=True,
                                               emulate=True)
    torchao_float8.convert_to_float8_training(module, config=config, **convert)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        fully_shard(module, mesh=init_device_mesh("cpu", (1,)),
                    mp_policy=MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[dtype], reduce_dtype=torch.float32))
        yield module
    finally:
        dist.destroy_process_group()


def full(t):
    """A gradient that FSDP left as a DTensor, whole."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def to_torch(x, dtype):
    return torch.tensor(np.asarray(jnp.asarray(x, jnp.float32)), dtype=TORCH_DTYPES[dtype])


def to_numpy(t):
    return t.detach().float().numpy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_cast_is_torchaos_bit_for_bit(dtype, fmt):
    """Scale and float8 bits of tensors whose maxima span the formats' ranges (tiny, huge, zero)."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig
    ours_dtype, theirs_dtype = {"e4m3": (float8.E4M3, torch.float8_e4m3fn),
                                "e5m2": (float8.E5M2, torch.float8_e5m2)}[fmt]
    rng = np.random.default_rng(0)
    for magnitude in (1e-9, 3e-3, 0.7, 1.0, 448.0, 5e4, 3e7):
        x = jnp.asarray(magnitude * rng.standard_normal((33, 40)), dtype)
        q, s = float8.quantize(x, ours_dtype)
        t = hp_tensor_to_float8_dynamic(to_torch(x, dtype), theirs_dtype, LinearMMConfig(),
                                        round_scales_to_power_of_2=True)
        assert float(s) == float(t._scale), (magnitude, float(s), float(t._scale))
        np.testing.assert_array_equal(np.asarray(q).view(np.uint8), t._data.view(torch.uint8).numpy())
        # A weight's scale under FSDP: torchao's precompute_float8_dynamic_scale_for_fsdp, max / amax
        # in fp64, then fp32, not rounded.
        amax = np.abs(np.asarray(x, np.float32)).max()
        theirs = np.float32(np.float64(torch.finfo(theirs_dtype).max) / np.float64(amax))
        assert float(float8.quantize(x, ours_dtype, pow2=False)[1]) == theirs, magnitude
    q, s = float8.quantize(jnp.zeros((4, 4), dtype), ours_dtype)
    assert not np.asarray(q, np.float32).any() and np.isfinite(float(s))
    # An all-zero weight (unrounded scale): torchao clamps its amax at EPS = 1e-12, so the scale
    # is max / 1e-12 and the weight casts to zeros, not 0 x inf = NaN.
    q, s = float8.quantize(jnp.zeros((4, 4), dtype), ours_dtype, pow2=False)
    eps = np.float64(np.float32(1e-12))     # torch.clamp(fp32 amax, EPS), then fp64
    assert float(s) == np.float32(np.float64(torch.finfo(theirs_dtype).max) / eps)
    assert not np.asarray(q, np.float32).any()
    for bad in (np.inf, np.nan):   # a non-finite entry: NaN where torchao has NaN, never saturated away
        x = jnp.asarray(rng.standard_normal((8, 8)), dtype).at[3, 5].set(bad)
        q, _ = float8.quantize(x, ours_dtype)
        t = hp_tensor_to_float8_dynamic(to_torch(x, dtype), theirs_dtype, LinearMMConfig(),
                                        round_scales_to_power_of_2=True)
        theirs = t._data.float().numpy()
        np.testing.assert_array_equal(np.isnan(np.asarray(q, np.float32)), np.isnan(theirs))
        assert np.isnan(theirs[3, 5]) and np.isnan(np.asarray(float8.qdq(x, ours_dtype, jnp.float32))).any()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_linear_and_its_gradients_equal_torchaos(dtype):
    """y = x @ w, dx and dw for a given dy, x in the compute dtype and w the fp32 master weight:
    equal to torchao's Float8Linear up to fp32 rounding order (rounded once more to bf16 in
    the bf16 case), and far from the same linear without float8 (the test can tell). With bf16
    activations torchao computes dw = x8^T @ dy8 in dy's dtype (bf16) and only then accumulates it
    into the fp32 master's gradient: every entry of ours is a bf16 value, and (summation order
    aside) torchao's; a dw kept in fp32 passes the tolerance while matching almost none of them."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((48, 64)), dtype)
    w = jnp.asarray(0.05 * rng.standard_normal((64, 96)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((48, 96)), dtype)
    y, vjp = jax.vjp(float8.linear, x, w)
    dx, dw = vjp(dy)
    assert (y.dtype, dx.dtype, dw.dtype) == (x.dtype, x.dtype, jnp.float32)

    lin = torch.nn.Linear(64, 96, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor(np.asarray(w).T))
    with as_olmo_core_trains(torch.nn.Sequential(lin), dtype) as seq:
        xt = to_torch(x, dtype).requires_grad_(True)
        yt = seq(xt)
        yt.backward(to_torch(dy, dtype))
        dw_theirs = full(seq[0].weight.grad).T
    ulp = 2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -20   # relative, of each tensor's largest entry
    plain = jax.vjp(lambda x, w: jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype),
                    x, w)
    plain = (plain[0], *plain[1](dy))
    for name, ours, theirs, without in zip(("y", "dx", "dw"), (y, dx, dw), (yt, xt.grad, dw_theirs), plain):
        theirs = to_numpy(theirs)
        tol = ulp * np.abs(theirs).max()
        np.testing.assert_allclose(np.asarray(ours, np.float32), theirs, rtol=0, atol=tol, err_msg=name)
        assert np.abs(np.asarray(without, np.float32) - theirs).max() > 4 * tol, name   # float8's own effect
    if dtype == "bfloat16":
        dw = np.asarray(dw)
        np.testing.assert_array_equal(dw, np.asarray(jnp.asarray(dw, jnp.bfloat16), np.float32))
        assert np.mean(dw == to_numpy(dw_theirs)) > 0.99, np.mean(dw == to_numpy(dw_theirs))


def test_model_equals_transformers_converted_by_torchao():
    """The whole model with Config.float8 against transformers' Olmo3ForCausalLM whose linears
    torchao converted as OLMo-core's `Transformer.apply_fp8` does (the LM head left alone): the
    logits and every weight's gradient of the mean cross entropy, one sequence (the recipe's one
    instance per microbatch), fp32, under FSDP as OLMo-core trains. Measured: logits within 3.0e-5
    of theirs where float8 itself moves them by 0.56, every gradient within 8.1e-5 of float8's own
    effect on it; bound: 1e-3 of it. The difference is rounding order, which can move a value across
    a float8 rounding boundary: torchao's CPU emulation rounds each w8 / sw to fp32 before its dot,
    where we (and a float8 GEMM) scale the dot's result; with torchao's order here, 9.5e-7 and
    1.5e-6."""
    cfg = hf_config(vocab_size=128, intermediate_size=96)
    ref = random_hf_model(cfg)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, size=(1, 40))
    with as_olmo_core_trains(ref, module_filter_fn=lambda m, fqn: fqn != "lm_head"):
        assert type(ref.model.layers[0].mlp.down_proj).__name__ == "Float8Linear"
        assert type(ref.lm_head).__name__ == "Linear"
        out = ref(torch.tensor(tokens), labels=torch.tensor(tokens))
        out.loss.backward()
        ref_grads = {name: to_numpy(full(p.grad)) for name, p in ref.named_parameters()}
    config = hf.config_from_hf(cfg.to_dict())
    model, plain = (hf.from_hf(state, config.replace(float8=f)) for f in (True, False))

    def loss(m):
        logits = m(jnp.asarray(tokens[0], jnp.int32))
        lp = jax.nn.log_softmax(logits[:-1])
        return -jnp.mean(jnp.take_along_axis(lp, jnp.asarray(tokens[0, 1:, None]), axis=-1)), logits

    (l8, logits8), g8 = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))(model)
    (_, logits), g = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))(plain)
    theirs = to_numpy(out.logits[0])
    effect = np.abs(np.asarray(logits) - theirs).max()   # float8's own effect on the logits
    assert effect > 1e-2, effect
    assert np.abs(np.asarray(logits8) - theirs).max() < 1e-3 * effect
    assert abs(float(l8) - out.loss.item()) < 1e-4
    grads, plain_grads = hf.state_dict(g8), hf.state_dict(g)   # torch names and [out, in] layout
    for name, theirs in ref_grads.items():
        effect = np.abs(np.asarray(plain_grads[name]) - theirs).max()
        err = np.abs(np.asarray(grads[name]) - theirs).max()
        assert err < 1e-3 * effect + 1e-7, (name, err, effect)


def test_float8_names_the_linears_it_leaves_out_and_refuses_none(tmp_path):
    """Config.float8_left_out against the model itself: the projections whose weights
    olmo3.model.uses_float8 keeps in the compute dtype (a dimension not a multiple of 16: torchao's
    Float8Linear condition). A config where that is all seven did train, bit for bit as without
    --float8, while its checkpoints said float8: refused, by train.py with exit 2 before any work."""
    import olmo3
    from olmo3.model import uses_float8
    def config(**over):
        return olmo3.Config.tiny(**{"vocab_size": 512, "d_model": 64, "n_heads": 2, "n_kv_heads": 1, "head_dim": 24,
                                    "mlp_hidden": 200, "n_layers": 4, **over})
    partial = config(float8=True)   # q 48, kv 24, mlp 200
    layer = olmo3.OLMo3(partial, jax.random.key(0)).layers
    left = {n for n in partial.projection_shapes() if not uses_float8(partial, n, getattr(layer, n).shape)}
    assert left == {"k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"}
    assert partial.float8_left_out() == ["k_proj (64x24)", "v_proj (64x24)", "gate_proj (64x200)",
                                         "up_proj (64x200)", "down_proj (200x64)"]
    assert config().float8_left_out() == [] and _tiny(float8=True).float8_left_out() == []
    with pytest.raises(ValueError, match="no projection has both dimensions multiples of 16"):
        config(float8=True, d_model=72)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--flagfile=tiny.flags", "--float8",
                          "--d_model=72", "--n_heads=4", "--n_kv_heads=4", "--head_dim=18", "--mlp_hidden=200",
                          "--max_steps=1", f"--run_dir={tmp_path / 'run'}"],
                         cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "float8=True, but no projection has both dimensions multiples of 16" in out.stderr.splitlines()[-1]


def _tiny(**over):
    import olmo3
    return olmo3.Config.tiny(vocab_size=512, d_model=64, n_heads=4, n_kv_heads=4, head_dim=16, mlp_hidden=128,
                             n_layers=4, window=8, remat="none", **over)


def test_fsdp_and_data_parallel_gradients_equal_one_devices():
    """On an fsdp:4 x data:2 mesh each layer's weights are gathered whole before the cast (the
    weight's maximum is the full tensor's, as torchao's precomputed FSDP scales are), activation
    and gradient maxima are per sequence: the gradients equal one device's to fp32 summation
    order, bounded by 1e-3 of float8's own effect on them. The order differs (a sequence alone
    on a device, eight in one batch), and a last-bit difference can move an activation across a
    float8 rounding boundary: here every leaf is within 2.4e-6, but down_proj, the last two norms
    and lm_head, 5.4e-5 to 8.5e-5 (float8 moves down_proj's by 0.29). The logits of 8 sequences
    batched and one by one differed so in 3 of 6 seeds, with power-of-2 weight scales as with
    these."""
    import olmo3
    from olmo3 import sharding as sh
    from olmo3.loss import labels_and_weights
    from olmo3.step import accumulate_grads
    rng = np.random.default_rng(4)
    batch = {"tokens": rng.integers(0, 512, (8, 32)).astype(np.int32), "instance_mask": np.ones(8, bool)}
    n = jnp.sum(labels_and_weights(jnp.asarray(batch["tokens"]), jnp.asarray(batch["instance_mask"]))[2])

    def one_device(config):
        model = olmo3.OLMo3(config, jax.random.key(0))
        grads, ce, _ = eqx.filter_jit(lambda m, b: accumulate_grads(m, b, n, microbatches=1, chunk=64, z_loss=1e-5,
                                                                    use_segments=False))(
            model, {k: jnp.asarray(v) for k, v in batch.items()})
        return model, grads, float(ce / n)

    model, want, want_loss = one_device(_tiny(float8=True))
    _, plain, _ = one_device(_tiny())
    mesh = sh.make_mesh("fsdp:4,data:2")
    from olmo3.optim import SkipStepAdamW
    sharded = sh.shard_state(model, SkipStepAdamW(lambda s: 1e-3).init(model), mesh)[0]
    grad_fn = eqx.filter_jit(sh.make_grad_fn(mesh, sh.param_specs(sharded, mesh), chunk=64))
    grads, loss, _ = grad_fn(sharded, sh.global_batch({**batch, "step": 0}, mesh))
    assert abs(float(loss) - want_loss) < 1e-6 * want_loss
    for (path, got), w, p in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want),
                                 jax.tree.leaves(plain)):
        err, effect = (float(jnp.linalg.norm((a - w).ravel()) / jnp.linalg.norm(w.ravel())) for a in (got, p))
        assert err < 1e-3 * effect and effect > 1e-3, (jax.tree_util.keystr(path), err, effect)


def test_lowers_for_cuda_with_float8_operands():
    """The gradient of a float8 model exports for CUDA from this CPU host, the casts in place: e4m3
    activations and weights, e5m2 output gradients (what XLA's GPU GEMM rewriter turns into
    cuBLASLt float8 GEMMs on Hopper and later)."""
    import olmo3
    model = olmo3.OLMo3(_tiny(float8=True, compute_dtype="bfloat16"), jax.random.key(0))
    loss = lambda m, t: jnp.mean(jax.vmap(m)(t) ** 2)  # noqa: E731
    params, static = eqx.partition(model, eqx.is_array)
    f = jax.jit(lambda p, t: jax.grad(lambda p: loss(eqx.combine(p, static), t))(p))
    exported = jax.export.export(f, platforms=["cuda"])(params, jnp.zeros((2, 32), jnp.int32))
    text = exported.mlir_module()
    assert "f8E4M3FN" in text and "f8E5M2" in text
