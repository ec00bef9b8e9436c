"""olmo3/sharding.py on 8 host CPU devices, against the single-device step as the reference.

Tolerances. Every mesh computes the same float32 sums in a different order (per-device partial
sums, psum and reduce-scatter trees, microbatch accumulation), so results agree to float32
rounding, not bit for bit:
- losses: rtol 2e-6;
- grad norm of every step: 1e-5 relative (measured: first-step gradients agree to ~3e-7 per
  weight in L2 norm, q_norm ~1.3e-6 with 2 microbatches);
- Adam's mu, nu after 3 steps, per weight in L2 norm: 1e-4 relative (measured up to 3.3e-5:
  steps 2 and 3 take gradients at parameters that already differ, see the next point);
- the parameter UPDATE (new - initial), per weight in L2 norm: 1e-3 relative. Not elementwise:
  Adam's first step is g / (|g| + eps) ~ sign(g), so rounding noise in a gradient entry that is
  itself ~1e-9 moves that one weight by a visible fraction of lr (measured: one entry in 32768
  off by 2.5e-5 = 2.5% of lr on the 4x2 mesh).
"""
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import olmo3
from olmo3 import sharding as sh
from olmo3.optim import SkipStepAdamW
from olmo3.step import make_train_step as single_device_step

CFG = olmo3.Config.tiny(vocab_size=512, d_model=64, n_heads=4, n_kv_heads=4, head_dim=16,
                        mlp_hidden=128, n_layers=4, window=8, remat="none")
B, T = 16, 32           # global batch rows, sequence length
STEPS = 3
MESHES = {"8x1": "fsdp:8,data:1", "4x2": "fsdp:4,data:2", "2x4": "data:4,fsdp:2", "1x1": None}


def optimizer():
    return SkipStepAdamW(lambda s: 1e-3, decay_mask=olmo3.model.decay_mask)


def fresh():
    model = olmo3.OLMo3(CFG, jax.random.key(0))
    return model, optimizer().init(model)


def batches(n=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        mask = np.ones(B, bool)
        mask[rng.integers(B)] = False                          # one instance masked from the loss
        out.append({"tokens": rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32),
                    "instance_mask": mask, "step": 0})
    return out


def mesh_of(name):
    if name == "1x1":
        return sh.make_mesh(None, devices=jax.devices()[:1])
    return sh.make_mesh(MESHES[name])


def rel_err(got, want):
    return float(jnp.linalg.norm((got - want).ravel()) / jnp.linalg.norm(want.ravel()))


_STEPS = {}


def sharded_step(mesh, microbatches):
    """One jitted step per (mesh, microbatches), shared by the tests (compiles dominate)."""
    key = (mesh, microbatches)
    if key not in _STEPS:
        specs = sh.param_specs(eqx.filter_eval_shape(fresh)[0], mesh)
        _STEPS[key] = sh.make_train_step(optimizer(), mesh, specs, microbatches=microbatches,
                                         chunk=64)
    return _STEPS[key]


def run_sharded(mesh, state, data, microbatches, with_gnorm=False):
    step = sharded_step(mesh, microbatches)
    model, opt = state
    losses, gnorms, z_losses = [], [], []
    for b in data:
        model, opt, m = step(model, opt, sh.global_batch(b, mesh))
        losses.append(float(m["train/loss"]))
        gnorms.append(float(m["optim/grad_norm"]))
        z_losses.append(float(m["train/z_loss"]))
    return (model, opt), ((losses, gnorms, z_losses) if with_gnorm else losses)


@pytest.fixture(scope="module")
def reference():
    """Single-device step (olmo3.step, no shard_map), 3 steps, the batch in 2 microbatches (the
    sharded runs split it in 1, 2 and 4; their losses agree with the one-microbatch sums too)."""
    step = single_device_step(optimizer(), microbatches=2, chunk=64)
    model, opt = fresh()
    losses, gnorms, z_losses = [], [], []
    for b in batches():
        model, opt, m = step(model, opt, {k: jnp.asarray(v) for k, v in b.items() if k != "step"})
        losses.append(float(m["train/loss"]))
        gnorms.append(float(m["optim/grad_norm"]))
        z_losses.append(float(m["train/z_loss"]))
    return (model, opt), (losses, gnorms, z_losses)


def loss_oracle(model, batch):
    """(CE mean, z-loss term) of a [B, T] batch in float64 numpy from the model's logits: targets
    tokens[:, 1:] where the label mask allows; a masked instance trains nothing and counts all T
    positions (OLMo-core's instance filter); z = 1e-5 x logsumexp^2 over the trained targets; both
    sums divided by the counted tokens of the whole batch (at least 1)."""
    tokens, keep = batch["tokens"], batch["instance_mask"]
    logits = np.asarray(jax.jit(jax.vmap(model))(jnp.asarray(tokens)), np.float64)[:, :-1]
    top = logits.max(-1)
    lse = top + np.log(np.exp(logits - top[..., None]).sum(-1))
    target = np.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0]
    ok = batch.get("label_mask", np.ones(tokens.shape, bool))[:, 1:]
    trained = ok & keep[:, None]
    n = max(ok[keep].sum() + tokens.shape[1] * (~keep).sum(), 1)
    return (trained * (lse - target)).sum() / n, 1e-5 * (trained * lse ** 2).sum() / n


def test_reference_step_equals_an_oracle(reference):
    """The single-device reference itself (olmo3.step in 2 microbatches): the first step's logged
    loss and z-loss equal the float64 oracle from the initial model's logits (rtol 1e-5)."""
    want_ce, want_z = loss_oracle(fresh()[0], batches()[0])
    (ce, *_), _, (z, *_) = reference[1]
    np.testing.assert_allclose([ce, z], [want_ce, want_z], rtol=1e-5)


@pytest.mark.parametrize("name,microbatches", [("8x1", 1), ("4x2", 2), ("2x4", 1), ("1x1", 4)])
def test_sharded_step_matches_single_device(reference, name, microbatches):
    mesh = mesh_of(name)
    (model, opt), (losses, gnorms, z_losses) = run_sharded(mesh, sh.shard_state(*fresh(), mesh), batches(),
                                                           microbatches, with_gnorm=True)
    (ref_model, ref_opt), (ref_losses, ref_gnorms, ref_z_losses) = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    np.testing.assert_allclose(z_losses, ref_z_losses, rtol=2e-6)   # the logged metric: summed, / n
    np.testing.assert_allclose(gnorms, ref_gnorms, rtol=1e-5)
    init = fresh()[0]
    for got, want, base in zip(jax.tree.leaves(model), jax.tree.leaves(ref_model), jax.tree.leaves(init)):
        assert rel_err(got - base, want - base) < 1e-3
    for got, want in zip(jax.tree.leaves((opt.mu, opt.nu)), jax.tree.leaves((ref_opt.mu, ref_opt.nu))):
        assert rel_err(got, want) < 1e-4
    # State stays on its shardings across steps (params, moments over fsdp; scalars replicated).
    specs = sh.param_specs(model, mesh)
    for leaf, spec in zip(jax.tree.leaves(model), jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, jax.P))):
        assert leaf.sharding.is_equivalent_to(jax.NamedSharding(mesh, spec), leaf.ndim)
    assert opt.step.sharding.is_fully_replicated and int(opt.step) == STEPS


def test_eval_fn_with_segments_matches_single_device():
    """Held-out loss under shard_map (stage-3 intra-document masking on) vs olmo3.step.eval_loss
    on one device: CE sum rtol 1e-6 (reduction order), token count exact."""
    from olmo3.step import eval_loss
    model = fresh()[0]
    b = batches(1, seed=2)[0]
    rng = np.random.default_rng(3)
    b["segment_ids"] = np.sort(rng.integers(0, 3, (B, T)), axis=1).astype(np.int32)  # 1-3 docs/row
    want_ce, want_n = eqx.filter_jit(eval_loss)(model, {k: jnp.asarray(v) for k, v in b.items()
                                                        if k != "step"}, chunk=64, use_segments=True)
    no_seg_ce, _ = eqx.filter_jit(eval_loss)(model, {k: jnp.asarray(v) for k, v in b.items()
                                                     if k not in ("step", "segment_ids")}, chunk=64)
    assert abs(float(no_seg_ce) - float(want_ce)) > 1e-3 * float(want_ce)   # segments matter here
    mesh = mesh_of("4x2")
    m = sh.shard_state(model, optimizer().init(model), mesh)[0]
    eval_fn = sh.make_eval_fn(mesh, sh.param_specs(m, mesh), chunk=64, use_segments=True)
    ce, n = eval_fn(m, sh.global_batch(b, mesh))
    np.testing.assert_allclose(float(ce), float(want_ce), rtol=1e-6)
    # T - 1 targets per row; the masked instance counts all T positions (OLMo-core's instance filter)
    assert float(n) == float(want_n) == B * (T - 1) + 1


def test_a_batch_with_no_counted_token_is_a_zero_loss_step():
    """An SFT batch whose label masks hide every target (say, prompts cut before any assistant
    token) counts no token: the step divides by at least 1, so the loss and the gradient are 0,
    not 0/0, and the step is taken (not skipped as non-finite), on one device and under shard_map."""
    b = batches(1, seed=4)[0]
    b["instance_mask"][:] = True
    b["label_mask"] = np.zeros((B, T), bool)
    model, opt = fresh()
    single = single_device_step(optimizer(), chunk=64)(model, opt, {k: jnp.asarray(v) for k, v in b.items()
                                                                    if k != "step"})[2]
    mesh = mesh_of("4x2")
    sharded = sh.make_train_step(optimizer(), mesh, sh.param_specs(model, mesh), chunk=64)(
        *sh.shard_state(*fresh(), mesh), sh.global_batch(b, mesh))[2]
    for m in (single, sharded):
        assert [float(m[k]) for k in ("train/loss", "train/z_loss", "optim/grad_norm", "optim/step_skipped")] \
            == [0.0, 0.0, 0.0, 0.0], m


def test_param_specs_rule():
    """The largest fsdp-divisible axis (earlier on a tie), never the stacked layer axis."""
    model = eqx.filter_eval_shape(olmo3.OLMo3, CFG, jax.random.key(0))
    P = jax.P
    specs = sh.param_specs(model, 4)
    assert specs.embed == P("fsdp", None)                  # [512, 64]: vocab
    assert specs.lm_head == P(None, "fsdp")                # [64, 512]: vocab
    assert specs.norm == P("fsdp")
    assert specs.layers.q_proj == P(None, "fsdp", None)    # [4, 64, 64]: tie -> d_model in
    assert specs.layers.gate_proj == P(None, None, "fsdp")  # [4, 64, 128]: mlp
    assert specs.layers.down_proj == P(None, "fsdp", None)  # [4, 128, 64]: mlp
    assert specs.layers.q_norm == P(None, "fsdp")          # [4, 64]: never the layer axis
    # Vocab 100 is not divisible by 8: the embedding falls back to d_model.
    small = eqx.filter_eval_shape(olmo3.OLMo3, CFG.replace(vocab_size=100), jax.random.key(0))
    assert sh.param_specs(small, 8).embed == P(None, "fsdp")
    # The 7B at 512 devices: mlp 11008 = 2^8 x 43 is not divisible by 512 -> d_model 4096.
    big = eqx.filter_eval_shape(olmo3.OLMo3, olmo3.Config.olmo3_7b(), jax.random.key(0))
    assert sh.param_specs(big, 512).layers.gate_proj == P(None, "fsdp", None)
    assert sh.param_specs(big, 128).layers.gate_proj == P(None, None, "fsdp")
    assert sh.param_specs(big, 512).embed == P(None, "fsdp")   # vocab 100278 = 2 x 3 x 16713
    # q_norm [8, 60] at fsdp 8: only the stacked layer axis divides, and it is never split
    # (the scan gathers one layer at a time): refused, naming the weight.
    thin = eqx.filter_eval_shape(olmo3.OLMo3, CFG.replace(n_layers=8, n_heads=3, n_kv_heads=3, head_dim=20),
                                 jax.random.key(0))
    with pytest.raises(ValueError, match=r"weight model\.layers\.[qk]_norm of shape \(8, 60\) has no axis"):
        sh.param_specs(thin, 8)


def test_init_sharded_equals_placed_fresh_state():
    """Building the state under jit with sharded outputs gives bitwise the single-device init,
    already on the target shardings (what train.py uses for a fresh run)."""
    mesh = mesh_of("4x2")
    built = sh.init_sharded(fresh, mesh)
    want = fresh()
    abstract = sh.abstract_state(want, mesh)
    for got, ref, a in zip(jax.tree.leaves(built), jax.tree.leaves(want), jax.tree.leaves(abstract)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
        assert got.sharding.is_equivalent_to(a.sharding, got.ndim)
    assert built[0].layers.q_proj.addressable_shards[0].data.shape == (4, 16, 64)


def test_memory_scales_as_one_over_fsdp():
    cfg = olmo3.Config.olmo3_7b()
    r1, r128, r512 = (sh.memory_report(cfg, n) for n in (1, 128, 512))
    n = cfg.num_params()
    assert r1["param_bytes"] == 4 * n                      # fp32 params
    assert r1["opt_bytes"] == 8 * n + 2 * 128 * 4 + 3 * 4  # fp32 mu + nu, windows, counters
    for r, d in ((r128, 128), (r512, 512)):
        assert r["param_bytes"] == 4 * n // d              # every weight divides evenly
        assert r["opt_bytes"] == 8 * n // d + 2 * 128 * 4 + 3 * 4
    # Whole on every device during the step: embedding, lm_head, final norm and one layer (fp32)
    model = eqx.filter_eval_shape(olmo3.OLMo3, cfg, jax.random.key(0))
    one_layer = sum(x.size // cfg.n_layers for x in jax.tree.leaves(model.layers))
    assert r512["gathered_bytes"] == 4 * (model.embed.size + model.lm_head.size + model.norm.size + one_layer)


def _collectives(hlo: str, op: str) -> list[list[tuple[int, ...]]]:
    """Result shapes of every `op` instruction in HLO text (tuple results give several)."""
    out = []
    for line in hlo.splitlines():
        m = re.search(r"= (.*?) " + op + r"(-start)?\(", line)
        if m:
            out.append([tuple(int(d) for d in dims.split(",") if d)
                        for dims in re.findall(r"[a-z]+\d*\[([\d,]*)\]", m.group(1))])
    return out


def test_hlo_collectives():
    """all-gather + reduce-scatter present; every all-reduce is of fsdp shards (the data-replica
    sum of the reduce-scattered gradients) or scalars, never of a full weight: an all-reduce of
    full gradients would mean the FSDP split was lost somewhere."""
    mesh = mesh_of("4x2")                                  # fsdp 4, data 2: both kinds needed
    model, opt = sh.shard_state(*fresh(), mesh)
    step = sharded_step(mesh, 2)
    hlo = step.lower(model, opt, sh.global_batch(batches(1)[0], mesh)).compile().compiled.as_text()
    assert _collectives(hlo, "all-gather") and _collectives(hlo, "reduce-scatter")
    leaves = jax.tree.leaves(model)
    shard_shapes = {tuple(x.addressable_shards[0].data.shape) for x in leaves}
    n_params = sum(x.size for x in leaves)
    reduced = 0
    for shapes in _collectives(hlo, "all-reduce"):
        for s in shapes:
            assert s == () or s in shard_shapes, f"all-reduce of {s}, not a shard {shard_shapes}"
            reduced += int(np.prod(s))
    assert reduced <= n_params // 4 + 64, (reduced, n_params)   # each shard at most once


def test_optimizer_update_gathers_nothing():
    """The update is elementwise on each shard plus one partial sum of squares per leaf for the
    grad norm: all-reduced scalars, no all-gather. (A norm by jnp.vdot ravels each leaf, which
    all-gathered every leaf sharded on an axis other than its first: the stacked layer weights,
    27.5 of the 7B's 29.2 GB of fp32 gradient on fsdp:8.)"""
    mesh = mesh_of("8x1")
    model, opt = sh.shard_state(*fresh(), mesh)
    specs = jax.tree.leaves(sh.param_specs(model, mesh), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    assert any(s[0] is None and any(a is not None for a in s) for s in specs)   # stacked [L, ...] leaves
    grads = jax.tree.map(lambda x: 1e-3 * x if eqx.is_inexact_array(x) else x, model)   # sharded as params
    update = eqx.filter_jit(lambda g, o, m: optimizer().update(g, o, m, jnp.float32(1.0)))
    hlo = update.lower(grads, opt, model).compile().compiled.as_text()
    assert not _collectives(hlo, "all-gather")
    assert all(s == () for shapes in _collectives(hlo, "all-reduce") for s in shapes)
    _, _, metrics = update(grads, opt, model)
    host = [np.asarray(x, np.float64) for x in jax.tree.leaves(grads) if eqx.is_inexact_array(x)]
    want = np.sqrt(sum((x ** 2).sum() for x in host))
    assert float(metrics["optim/grad_norm"]) == pytest.approx(want, rel=1e-6)


def test_checkpoint_8_devices_resumes_on_2(tmp_path):
    """Save after 2 steps on 8 devices (fsdp 8), restore onto a 2-device mesh, run 2 more:
    the losses equal an uninterrupted 8-device run (float32 reduction order, rtol 2e-6)."""
    from olmo3.checkpoint import CheckpointManager
    data = batches(4, seed=1)
    mesh8 = mesh_of("8x1")
    uninterrupted = run_sharded(mesh8, sh.shard_state(*fresh(), mesh8), data, 1)[1]

    state, first = run_sharded(mesh8, sh.shard_state(*fresh(), mesh8), data[:2], 1)
    ckpt = CheckpointManager(str(tmp_path), async_save=False)
    ckpt.save(2, {"model": state[0], "opt": state[1]})
    ckpt.wait()
    mesh2 = sh.make_mesh("fsdp:2", devices=jax.devices()[:2])
    abstract = sh.abstract_state(eqx.filter_eval_shape(fresh), mesh2)
    restored, _ = ckpt.restore(2, {"model": abstract[0], "opt": abstract[1]})
    assert restored["model"].layers.q_proj.sharding.mesh.size == 2
    _, rest = run_sharded(mesh2, (restored["model"], restored["opt"]), data[2:], 2)
    np.testing.assert_allclose(first + rest, uninterrupted, rtol=2e-6)


def test_bad_inputs():
    with pytest.raises(ValueError, match="does not divide the 8 global devices"):
        sh.make_mesh("fsdp:3")
    with pytest.raises(ValueError, match="data:2 x fsdp:2 = 4 devices"):
        sh.make_mesh("fsdp:2,data:2")
    with pytest.raises(ValueError, match="'fsdp:N' or 'data:M'"):
        sh.make_mesh("tp:8")
    with pytest.raises(ValueError, match="with a positive integer"):
        sh.make_mesh("fsdp:0,data:8")
    with pytest.raises(ValueError, match="with a positive integer"):   # str.isdigit's '²': int() raised, naming no flag
        sh.make_mesh("fsdp:\u00b2")
    with pytest.raises(ValueError, match="axis 'fsdp' given twice"):
        sh.make_mesh("fsdp:8,fsdp:8")
    mesh = sh.make_mesh(None)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 8}
    with pytest.raises(ValueError, match="global batch 12 is not divisible by the 8 global devices"):
        sh.microbatches(12, 1, mesh)
    with pytest.raises(ValueError, match=r"^--micro_batch=3: 4 rows per device \(--global_batch=32 / 8 global "
                                         r"devices\) are not divisible by it"):
        sh.microbatches(32, 3, mesh)
    with pytest.raises(ValueError, match=r"^--batch=12: the global batch 12 is not divisible"):   # bench.py's flag
        sh.microbatches(12, 1, mesh, flags=("--batch", "--micro_batch"))
    assert sh.microbatches(512, 1, mesh) == 64 and sh.microbatches(512, None, mesh) == 1
    # 7B vocab 100278 = 2 x 3 x 16713: the embedding falls back to d_model; a d_model that no
    # fsdp size divides leaves no axis at all -> refused, naming the weight.
    odd = eqx.filter_eval_shape(olmo3.OLMo3, CFG.replace(vocab_size=513, d_model=60, n_heads=3, n_kv_heads=3,
                                                         head_dim=20, mlp_hidden=90),
                                jax.random.key(0))
    with pytest.raises(ValueError, match=r"weight model\.embed of shape \(513, 60\) has no axis "
                                         r"divisible by the fsdp size 8"):
        sh.param_specs(odd, 8)
    with pytest.raises(ValueError, match="rows must split evenly over the 8 local devices"):
        sh.global_batch({"tokens": np.zeros((12, T), np.int32)}, mesh)
    with pytest.raises(ValueError, match="multi-process launch needs all of"):
        sh.initialize_distributed(coordinator=None, num_processes=2, process_id=None)


def test_initialize_distributed_reads_env(monkeypatch):
    """Flags win over JAX_* variables; a partial multi-process setup is refused before JAX's
    runtime is touched; a single process initializes nothing."""
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    assert sh.initialize_distributed() == (0, 1)
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    with pytest.raises(ValueError, match=r"--process_id / JAX_PROCESS_ID missing"):
        sh.initialize_distributed()
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    with pytest.raises(ValueError, match=r"--process_id / JAX_PROCESS_ID = 2 must be in \[0, --num_processes / JAX_NUM_PROCESSES = 2\)"):
        sh.initialize_distributed()
    with pytest.raises(ValueError, match=r"--process_id / JAX_PROCESS_ID = 7 must be in \[0, --num_processes / JAX_NUM_PROCESSES = 2\)"):
        sh.initialize_distributed(process_id=7)          # the flag wins over JAX_PROCESS_ID=2


def test_eval_fn_in_microbatches_sums_the_same_and_holds_less():
    """Held-out batches in pieces of at most `micro_rows` rows per device (train.py passes the
    training microbatch's): the same CE sum (rtol 1e-6, summation order) and token count, with
    less device memory for temporaries (XLA's own buffer assignment, memory_analysis)."""
    config = CFG.replace(mlp_hidden=1024)      # activations, not the fixed logits chunk, dominate
    model = olmo3.OLMo3(config, jax.random.key(0))
    mesh = sh.make_mesh("fsdp:2", devices=jax.devices()[:2])
    m = sh.shard_state(model, optimizer().init(model), mesh)[0]
    rng = np.random.default_rng(5)
    batch = sh.global_batch({"tokens": rng.integers(0, 512, (16, 128)).astype(np.int32),   # 8 rows per device
                             "instance_mask": np.ones(16, bool), "step": 0}, mesh)
    specs = sh.param_specs(m, mesh)
    whole, pieces = (sh.make_eval_fn(mesh, specs, chunk=64, micro_rows=r) for r in (None, 3))   # 3 -> 2 rows
    (ce, n), (ce2, n2) = whole(m, batch), pieces(m, batch)
    np.testing.assert_allclose(float(ce2), float(ce), rtol=1e-6)
    assert float(n2) == float(n)
    temp = [f.lower(m, batch).compile().compiled.memory_analysis().temp_size_in_bytes for f in (whole, pieces)]
    assert temp[1] < 0.5 * temp[0], temp


def test_gathers_send_what_the_model_computes_with_and_change_no_bit():
    """FSDP gathers in bf16 compute over fp32 weights, with float8 linears: the projections cross
    the wire as e4m3 bytes (1 byte per element), the embedding, lm_head and norms in bf16
    (OLMo-core's FSDP param_dtype); every gradient is reduce-scattered in fp32. Against
    gathering the fp32 weights themselves (`_wire` off), the loss and every gradient are equal
    bit for bit."""
    config = CFG.replace(compute_dtype="bfloat16", float8=True)
    model = olmo3.OLMo3(config, jax.random.key(0))
    mesh = mesh_of("4x2")
    m = sh.shard_state(model, optimizer().init(model), mesh)[0]
    batch = sh.global_batch(batches(1)[0], mesh)
    specs = sh.param_specs(m, mesh)

    def grads(wire):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sh, "_wire", wire)
            fn = eqx.filter_jit(sh.make_grad_fn(mesh, specs, chunk=64))
            text = fn.lower(m, batch).as_text()             # what XLA is given, before any pass
            return fn(m, batch), text

    (got, loss, _), text = grads(sh._wire)
    (want, want_loss, _), plain = grads(lambda *a: None)
    assert float(loss) == float(want_loss)
    for name, a, b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(got), jax.tree.leaves(want)):
        assert bool(jnp.array_equal(a, b)), name[0]

    def gathered(t):   # {(element type, shape)} of every all_gather result
        return {(ty, tuple(int(d) for d in dims.split("x") if d))
                for dims, ty in re.findall(r'stablehlo\.all_gather.*-> tensor<((?:\d+x)*)(\w+)>', t)}

    d, V = config.d_model, config.vocab_size
    proj = {(d, config.q_dim), (d, config.kv_dim), (config.q_dim, d),
            (d, config.mlp_hidden), (config.mlp_hidden, d)}
    norms = {(config.q_dim,), (config.kv_dim,), (d,)}
    assert gathered(text) == ({("ui8", s) for s in proj} | {("bf16", (V, d)), ("bf16", (d, V))}
                              | {("bf16", s) for s in norms}), gathered(text)
    assert {ty for ty, _ in gathered(plain)} == {"f32"}

    def scattered(t):   # [(dims, element type)] of every reduce_scatter result
        return sorted(re.findall(r'stablehlo\.reduce_scatter.*?\) -> tensor<((?:\d+x)*)(\w+)>', t, re.S))

    assert {ty for _, ty in scattered(text)} == {"f32"}
    assert scattered(text) == scattered(plain)      # the same reduce-scatters, none per sequence


def test_float8_gather_hands_over_the_whole_weights_cast():
    """The float8 FSDP gather (`_all_gather_as`, wire "float8") gives float8.linear a weight whose
    recast is the whole fp32 weight's own (torchao casts the fp32 master weight once): the same
    scale and float8 bytes, bit for bit, also for weights whose amax does not survive q / s (the
    entries float8 saturates: 448 x (1 / s) != amax, checked to occur among these)."""
    from olmo3 import float8
    mesh = sh.make_mesh("fsdp:2", devices=jax.devices()[:2])
    gather = jax.jit(jax.shard_map(lambda x: sh._all_gather_as(x, "fsdp", 0, "float8"), mesh=mesh,
                                   in_specs=jax.P("fsdp"), out_specs=jax.P(), check_vma=False))
    rng = np.random.default_rng(0)
    amax_moved = 0
    for _ in range(8):
        w = jnp.asarray(0.05 * rng.standard_normal((16, 8)), jnp.float32)
        want_q, want_s = float8.quantize(w, float8.E4M3, pow2=False)
        got_q, got_s = float8.quantize(gather(w), float8.E4M3, pow2=False)
        assert float(got_s) == float(want_s)
        np.testing.assert_array_equal(np.asarray(got_q).view(np.uint8), np.asarray(want_q).view(np.uint8))
        naive = float8.dequantize(want_q, want_s, jnp.float32)
        amax_moved += float(jnp.max(jnp.abs(naive))) != float(jnp.max(jnp.abs(w)))
    assert amax_moved > 0


def test_step_outputs_keep_every_state_sharding_and_donate_the_old_state():
    """The sharded step hands back the state on its own shardings, the optimizer moments too
    (sh.abstract_state, the checkpoint-restore target: mu and nu like the params), and the old
    state's buffers are donated. Replicated moments compute the same numbers, but hold the whole
    fp32 mu and nu on every device (56 GB for the 7B) and recompile the next step."""
    mesh = sh.make_mesh("fsdp:4,data:2")
    state = sh.shard_state(*fresh(), mesh)
    want = jax.tree.leaves(sh.abstract_state(state, mesh))
    step = sh.make_train_step(optimizer(), mesh, sh.param_specs(state[0], mesh), chunk=64)
    old = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
    *new, _ = step(*state, sh.global_batch(batches(1)[0], mesh))
    got = jax.tree_util.tree_leaves_with_path(tuple(new))
    assert len(got) == len(want)
    for (path, g), w in zip(got, want):
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (jax.tree_util.keystr(path), g.sharding, w.sharding)
    assert new[1].mu.layers.q_proj.addressable_shards[0].data.shape == (4, 16, 64)   # 1/4 of [4, 64, 64]
    assert all(x.is_deleted() for x in old)


@pytest.mark.parametrize("spec", ["fsdp:4,data:2", "data:4,fsdp:2", "data:8"])
def test_microbatches_divide_by_every_row_device(spec):
    """Rows per device are the global batch over every device that holds rows (data x fsdp), not
    over the fsdp axis alone: plain arithmetic, and the rows a device really holds."""
    mesh = sh.make_mesh(spec)
    assert sh.microbatches(512, 1, mesh) == 512 // 8 and sh.microbatches(512, 4, mesh) == 512 // 8 // 4
    assert sh.microbatches(512, None, mesh) == 1
    with pytest.raises(ValueError, match=r"4 rows per device \(--global_batch=32 / 8 global devices\)"):
        sh.microbatches(32, 3, mesh)
    rows = sh.global_batch({"tokens": np.zeros((32, 8), np.int32)}, mesh)["tokens"].addressable_shards[0].data.shape[0]
    assert rows == 4 and rows // 2 == sh.microbatches(32, 2, mesh)


def test_float8_projections_cross_the_wire_as_bytes_when_their_shards_are_thin():
    """Whether a weight crosses the FSDP gather as float8 bytes follows the WHOLE weight's shape
    (model.uses_float8: what float8.linear does with the gathered weight), not the local shard's:
    at fsdp:8 a [64, 64] projection's shard is [8, 64], no multiple of 16, and it still travels as
    e4m3 bytes (torchao's enable_fsdp_float8_all_gather), not bf16 (twice the bytes, and a scale
    from bf16-rounded weights). Reference: the model's own decision, and the lowered all-gathers."""
    from olmo3.model import uses_float8
    cfg = CFG.replace(compute_dtype="bfloat16", float8=True, mlp_hidden=128)
    model = olmo3.OLMo3(cfg, jax.random.key(0))
    mesh = sh.make_mesh("fsdp:8")
    m = sh.shard_state(model, optimizer().init(model), mesh)[0]
    thin = [name for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
            if uses_float8(cfg, name, getattr(model.layers, name).shape[1:])
            and not uses_float8(cfg, name, getattr(m.layers, name).addressable_shards[0].data.shape[1:])]
    assert thin, "no thin float8 shard at fsdp:8"
    batch = sh.global_batch({"tokens": np.random.default_rng(0).integers(0, 512, (8, 32)).astype(np.int32),
                             "instance_mask": np.ones(8, bool)}, mesh)
    text = eqx.filter_jit(sh.make_grad_fn(mesh, sh.param_specs(m, mesh), chunk=64)).lower(m, batch).as_text()
    gathered = {(ty, tuple(int(d) for d in dims.split("x") if d))
                for dims, ty in re.findall(r'stablehlo\.all_gather.*-> tensor<((?:\d+x)*)(\w+)>', text)}
    d, V = cfg.d_model, cfg.vocab_size
    proj = {(d, cfg.q_dim), (d, cfg.kv_dim), (cfg.q_dim, d), (d, cfg.mlp_hidden), (cfg.mlp_hidden, d)}
    assert gathered == ({("ui8", s) for s in proj} | {("bf16", (V, d)), ("bf16", (d, V))}
                        | {("bf16", s) for s in {(cfg.q_dim,), (cfg.kv_dim,), (d,)}}), (thin, gathered)
