"""Context parallelism (`--mesh=fsdp:N,context:C`, olmo3/sharding.py) on 8 host CPU devices.

References: the attention kernels against `reference_attention` over the WHOLE sequence (the
oracle of olmo3/attention.py), the sharded gradient against the single-device gradient of
olmo3.step (no shard_map, no context axis). Rows have documents (segment ids) that cross the
chunk boundaries, a label mask, a masked instance, sliding-window and YaRN full-attention layers.
Tolerances: float32 reduction order only (losses rtol 2e-6, gradients 1e-5 relative per weight
in L2 norm; measured ~2e-6).
"""
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import olmo3
from olmo3 import attention as attn
from olmo3 import sharding as sh
from olmo3.loss import labels_and_weights
from olmo3.optim import SkipStepAdamW
from olmo3.rope import YaRN
from olmo3.step import accumulate_grads, eval_loss

CFG = olmo3.Config.tiny(vocab_size=256, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16,
                        mlp_hidden=128, n_layers=2, layer_pattern=("sliding", "full"), window=8,
                        yarn=YaRN(), remat="none", splash_block_q=8, splash_block_kv=8)
B = 4


def rows(T, seed=0):
    rng = np.random.default_rng(seed)
    segs = np.cumsum(rng.random((B, T)) < 0.15, axis=1).astype(np.int32)   # ~5 docs per row
    return {"tokens": rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32),
            "segment_ids": segs, "label_mask": rng.random((B, T)) > 0.1,
            "instance_mask": np.array([True, True, False, True])}


def reference(model, batch):
    """(CE mean, grads) on one device: olmo3.step, whole rows, no shard_map."""
    b = {k: jnp.asarray(v) for k, v in batch.items()}
    n = jnp.maximum(jnp.sum(labels_and_weights(b["tokens"], b["instance_mask"], b["label_mask"])[2]), 1.0)
    grads, ce, _ = eqx.filter_jit(lambda m, b: accumulate_grads(
        m, b, n, microbatches=1, chunk=64, z_loss=1e-5, use_segments=True))(model, b)
    return float(ce / n), grads


def rel_err(got, want):
    return float(jnp.linalg.norm((got - want).ravel()) / jnp.linalg.norm(want.ravel()))


def test_layout_balances_causal_work():
    """Rank r holds chunks r and 2C-1-r; un-permuting the gathered chunks restores position
    order; every rank's queries see the same number of causal keys."""
    T, C = 64, 4
    order = sh.context_order(T, C)
    assert sorted(order) == list(range(T))
    np.testing.assert_array_equal(order[:16], list(range(8)) + list(range(56, 64)))
    np.testing.assert_array_equal(sh._natural(jnp.asarray(order), C, axis=0), np.arange(T))
    work = [int(np.sum(order[r * 16:(r + 1) * 16] + 1)) for r in range(C)]
    assert len(set(work)) == 1, work


@pytest.mark.parametrize("window", [None, 8])
def test_chunk_attention_is_rows_of_the_whole(window):
    """xla query chunks (offset traced, as on a context rank) = rows of reference_attention."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((4, 48, 16), (2, 48, 16), (2, 48, 16)))
    seg = jnp.asarray(np.cumsum(rng.random(48) < 0.1), jnp.int32)
    whole = attn.reference_attention(q, k, v, window=window, segment_ids=seg)
    chunk = jax.jit(lambda q, off: attn.chunk_attention(q, k, v, q_offset=off, window=window, segment_ids=seg))
    for off in (0, 4, 20, 36):
        got = chunk(jax.lax.dynamic_slice_in_dim(q, off, 12, axis=1), jnp.int32(off))
        np.testing.assert_allclose(got, whole[:, off:off + 12], atol=1e-6)


@pytest.mark.parametrize("off", [16, 20])
def test_splash_query_chunk_matches_reference(off):
    """The splash kernel (interpret mode) on a query chunk: output and q/k/v gradients equal
    those rows of the whole-sequence reference. At an offset that is no multiple of the query
    block too (a dk / dv kernel that rounded it down to one was off by 1.7 in a mutation audit)."""
    from olmo3.splash import splash_attention
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((4, 32, 16), (2, 32, 16), (2, 32, 16)))
    seg = jnp.asarray(np.cumsum(rng.random(32) < 0.1), jnp.int32)
    w = jnp.asarray(rng.standard_normal((4, 8, 16)), jnp.float32)

    def kernel(qc, k, v):
        return jnp.sum(w * splash_attention(qc, k, v, window=8, segment_ids=seg, q_offset=off,
                                            block_q=8, block_kv=8, interpret=True))

    def oracle(qc, k, v):
        qf = jnp.concatenate([q[:, :off], qc, q[:, off + 8:]], axis=1)
        return jnp.sum(w * attn.reference_attention(qf, k, v, window=8, segment_ids=seg)[:, off:off + 8])

    got, want = (jax.value_and_grad(f, argnums=(0, 1, 2))(q[:, off:off + 8], k, v) for f in (kernel, oracle))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, r in zip(got[1], want[1]):
        np.testing.assert_allclose(g, r, atol=2e-6)


@pytest.mark.parametrize("C", [2, 4])
def test_context_splash_attention_is_the_whole_sequences_in_context_order(C):
    """Splash attention on context:C (each rank attends its two query chunks to the gathered K/V
    at their static global offsets, one lax.switch branch per rank): the rows of
    reference_attention over the whole sequence, in context order. Forward only (xla and the
    gradients: test_context_grads_*; splash gradients: the slow test below)."""
    T = 32
    rng = np.random.default_rng(8)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((4, T, 16), (2, T, 16), (2, T, 16)))
    seg = jnp.asarray(np.cumsum(rng.random(T) < 0.1), jnp.int32)
    want = attn.reference_attention(q, k, v, window=8, segment_ids=seg)
    order = sh.context_order(T, C)
    mesh = sh.make_mesh(f"context:{C}", devices=jax.devices()[:C])

    def attend(q, k, v):
        return sh._context_attention(CFG.replace(attention="splash"), seg, head_stride=2)(q, k, v, window=8)

    chunks = jax.P(None, "context")
    got = jax.jit(jax.shard_map(attend, mesh=mesh, in_specs=(chunks,) * 3, out_specs=chunks, check_vma=False))(
        q[:, order], k[:, order], v[:, order])
    np.testing.assert_allclose(got, want[:, order], atol=1e-5)


def context_grads(model, batch, spec, head_stride, microbatches=1):
    mesh = sh.make_mesh(spec)
    m = sh.shard_state(model, SkipStepAdamW(lambda s: 1e-3).init(model), mesh)[0]
    specs = sh.param_specs(m, mesh)
    fn = eqx.filter_jit(sh.make_grad_fn(mesh, specs, microbatches=microbatches, chunk=64,
                                        use_segments=True, head_stride=head_stride))
    grads, ce, _ = fn(m, sh.global_batch(batch, mesh))
    return float(ce), grads, m


@pytest.fixture(scope="module")
def single_device():
    model, batch = olmo3.OLMo3(CFG, jax.random.key(0)), rows(32)
    return (model, batch, *reference(model, batch))


@pytest.mark.parametrize("spec,head_stride,microbatches", [
    ("fsdp:4,context:2", 1, 1),                                         # 2 K/V head groups (lax.map)
    pytest.param("fsdp:2,context:4", 2, 2, marks=pytest.mark.slow),     # one group, chunks of 4
    pytest.param("data:2,fsdp:2,context:2", 2, 1, marks=pytest.mark.slow),  # + data replicas
])
def test_context_grads_equal_single_device(single_device, spec, head_stride, microbatches):
    model, batch, want_ce, want = single_device
    got_ce, got, m = context_grads(model, batch, spec, head_stride, microbatches)
    np.testing.assert_allclose(got_ce, want_ce, rtol=2e-6)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert rel_err(g, r) < 1e-5
    # weights (and so their gradients) are split over fsdp x context
    assert m.layers.gate_proj.sharding.spec == jax.P(None, None, ("fsdp", "context"))
    mesh = m.layers.gate_proj.sharding.mesh
    shards = mesh.shape["fsdp"] * sh.context_size(mesh)
    assert got.layers.gate_proj.addressable_shards[0].data.shape == (2, 64, 128 // shards)


def test_context_grads_with_kv_heads_the_stride_does_not_divide():
    """6 K/V heads at the recipe's head_stride 4 (--n_kv_heads is a flag; the stride is not):
    gathered 3 at a time, the gradient equals the single-device one."""
    model, batch = olmo3.OLMo3(CFG.replace(n_heads=6, n_kv_heads=6, head_dim=8), jax.random.key(1)), rows(32, seed=5)
    want_ce, want = reference(model, batch)
    got_ce, got, _ = context_grads(model, batch, "fsdp:4,context:2", sh.HEAD_STRIDE)
    np.testing.assert_allclose(got_ce, want_ce, rtol=2e-6)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert rel_err(g, r) < 1e-5
    assert [sh.kv_group(4, kv) for kv in (1, 2, 3, 4, 6, 8, 32)] == [1, 2, 3, 4, 3, 4, 4]


@pytest.mark.slow
def test_context_grads_with_splash_equal_single_device(single_device):
    _, batch, want_ce, want = single_device
    model = olmo3.OLMo3(CFG.replace(attention="splash"), jax.random.key(0))
    got_ce, got, _ = context_grads(model, batch, "fsdp:4,context:2", 1)
    np.testing.assert_allclose(got_ce, want_ce, rtol=2e-6)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert rel_err(g, r) < 1e-5


@pytest.mark.slow
def test_context_eval_equals_single_device():
    model = olmo3.OLMo3(CFG, jax.random.key(0))
    batch = rows(32, seed=3)
    want_ce, want_n = eqx.filter_jit(eval_loss)(model, {k: jnp.asarray(v) for k, v in batch.items()},
                                                chunk=64, use_segments=True)
    mesh = sh.make_mesh("fsdp:2,context:4")
    m = sh.shard_state(model, SkipStepAdamW(lambda s: 1e-3).init(model), mesh)[0]
    ce, n = sh.make_eval_fn(mesh, sh.param_specs(m, mesh), chunk=64, use_segments=True)(m, sh.global_batch(batch, mesh))
    np.testing.assert_allclose(float(ce), float(want_ce), rtol=1e-6)
    assert float(n) == float(want_n)


@pytest.mark.parametrize("label_mask", [True, False])
def test_context_rows_are_the_whole_rows_labels_in_context_order(label_mask):
    """Host side (`global_batch`'s `_context_rows`): put back in position order, a row's labels
    are olmo3.loss.labels_and_weights' (next token, -100 at the last position and where the label
    mask refuses the target), its positions 0..T-1, its tokens and segment ids the row's own."""
    T, C = 32, 4
    batch = rows(T, seed=6)
    if not label_mask:
        del batch["label_mask"]
    out = sh._context_rows(batch, C)
    back = np.argsort(sh.context_order(T, C))
    want = labels_and_weights(jnp.asarray(batch["tokens"]), jnp.asarray(batch["instance_mask"]),
                              jnp.asarray(batch["label_mask"]) if label_mask else None)[0]
    np.testing.assert_array_equal(out["labels"][:, back], np.asarray(want))
    np.testing.assert_array_equal(out["positions"][:, back], np.broadcast_to(np.arange(T), (B, T)))
    for key in ("tokens", "segment_ids"):
        np.testing.assert_array_equal(out[key][:, back], batch[key])
    np.testing.assert_array_equal(out["instance_mask"], batch["instance_mask"])
    assert "label_mask" not in out


@pytest.mark.parametrize("spec, n", [("context:2", 2), ("data:2,context:2", 4), ("context:4", 4)])
def test_context_eval_equals_single_device_fast(single_device, spec, n):
    """Held-out CE sum and counted tokens on a context mesh: each rank's chunks summed over data x
    fsdp x context equal the whole rows' on one device (rtol 1e-6, count exact). With data
    replicas (their CE left out of the sum went unseen by the default suite), and at C = 4, where
    the second chunk's offset 2C - 1 - rank differs from the C + 1 - rank of C = 2."""
    model, batch = single_device[:2]
    want_ce, want_n = eqx.filter_jit(eval_loss)(model, {k: jnp.asarray(v) for k, v in batch.items()},
                                                chunk=64, use_segments=True)
    mesh = sh.make_mesh(spec, devices=jax.devices()[:n])
    m = sh.shard_state(model, SkipStepAdamW(lambda s: 1e-3).init(model), mesh)[0]
    ce, n = sh.make_eval_fn(mesh, sh.param_specs(m, mesh), chunk=64, use_segments=True)(m, sh.global_batch(batch, mesh))
    np.testing.assert_allclose(float(ce), float(want_ce), rtol=1e-6)
    assert float(n) == float(want_n)


def test_bad_context_mesh():
    with pytest.raises(ValueError, match="'context:3': 3 does not divide the 8 global devices"):
        sh.make_mesh("context:3")
    with pytest.raises(ValueError, match=r"data:1 x fsdp:2 x context:2 = 4 devices"):
        sh.make_mesh("fsdp:2,data:1,context:2")
    mesh = sh.make_mesh("context:4")
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "context": 4}
    with pytest.raises(ValueError, match="--seq_len=36 is not divisible by 2 x context = 8"):
        sh.check_context(mesh, 36)
    with pytest.raises(ValueError, match="--seq_len=36 is not divisible by 2 x context = 8"):
        sh.global_batch(rows(36), mesh)
    # 2 processes x 4 devices (4-chip hosts): context:8 would split each group over both processes
    class Device:
        def __init__(self, i):
            self.id, self.process_index = i, i // 4
    two_hosts = Mesh(np.array([Device(i) for i in range(8)]).reshape(1, 1, 8), ("data", "fsdp", "context"))
    with pytest.raises(ValueError, match=r"context:8: a context group spans processes \[0, 1\], each with 4 "
                                         r"devices.*divides 4"):
        sh.check_context(two_hosts, 64)
    sh.check_context(Mesh(two_hosts.devices.reshape(1, 2, 4), ("data", "fsdp", "context")), 64)
    # rows are split over data x fsdp only: 2 row groups here
    assert sh.microbatches(4, 1, mesh) == 2
    with pytest.raises(ValueError, match=r"not divisible by the 2 row groups \(8 global devices / context 4\)"):
        sh.microbatches(3, 1, mesh)


def train_py(tmp_path, mesh, *flags):
    """train.py on 8 CPU devices, a tiny model on five of our own source files, optim.py held out
    (--doc_lengths: segment ids); returns its metrics rows and stderr."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    docs = tmp_path / "docs"
    if not docs.exists():
        docs.mkdir()
        for name in ("model.py", "rope.py", "loss.py", "attention.py", "optim.py"):
            (docs / f"{name}.txt").write_text(open(os.path.join(root, "olmo3", name)).read())
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": root}
    run_dir = tmp_path / mesh.replace(":", "").replace(",", "_")
    p = subprocess.run(
        [sys.executable, os.path.join(root, "train.py"), "--model=tiny", "--d_model=32",
         "--n_layers=4", "--n_heads=2", "--n_kv_heads=2", "--head_dim=16", "--mlp_hidden=64",
         "--window=16", "--warmup_steps=1", "--loader_workers=0", "--notune_cpu", "--doc_lengths",
         f"--data={docs}", f"--data_dir={tmp_path / 'data'}", f"--run_dir={run_dir}", f"--mesh={mesh}", *flags],
        capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")], p.stderr


@pytest.mark.slow
def test_train_py_context_mesh_matches_fsdp(tmp_path):
    """train.py, stage-3 style (--doc_lengths: segment ids), 4 steps: --mesh=fsdp:2,context:4
    logs the losses of --mesh=fsdp:8 (float32 reduction order: rtol 2e-6; measured 2e-7)."""
    losses = {}
    for mesh in ("fsdp:8", "fsdp:2,context:4"):
        rows, _ = train_py(tmp_path, mesh, "--seq_len=32", "--global_batch=8", "--total_steps=4",
                           "--save_interval=4", "--eval_interval=2")
        losses[mesh] = [r[k] for r in rows for k in sorted(r) if k.endswith("loss") and k != "train/z_loss"]
    assert len(losses["fsdp:8"]) == 6            # 4 train losses + 2 held-out evaluations
    np.testing.assert_allclose(losses["fsdp:2,context:4"], losses["fsdp:8"], rtol=2e-6)


def test_train_py_context_evaluates_by_row_groups(tmp_path):
    """Held-out batches split over row groups (devices / context), not devices: with fsdp:2,
    context:4 and a global batch of 2, the domain is evaluated (it was skipped as 'fewer than the 8
    devices')."""
    rows, _ = train_py(tmp_path, "fsdp:2,context:4", "--seq_len=256", "--global_batch=2",
                            "--total_steps=1", "--save_interval=1")
    assert np.isfinite(rows[-1]["eval/docs/loss"])


def test_memory_report_stage3_context():
    """Stage-3 7B on 64 devices: context:8 divides the activations one instance leaves per
    device by 8 (seq 65,536 -> 8,192 tokens each) and, with fsdp:1, splits the weights over the
    8 ranks of the context group as OLMo-core's hsdp(shard_degree=1) + cp(8) does."""
    cfg = olmo3.Config.olmo3_7b_long(vocab_size=100352, compute_dtype="bfloat16")
    plain = sh.memory_report(cfg, 64, data=8, seq_len=65536)
    cp = sh.memory_report(cfg, 64, data=8, context=8, seq_len=65536)
    assert plain["activation_bytes"] == 8 * cp["activation_bytes"]
    n = cfg.num_params()
    assert cp["param_bytes"] == plain["param_bytes"] == 4 * n // 8    # fp32 master weights / 8
    # save_proj keeps q, k, v, gate, up + o, down, layer input: 46,592 bf16 values per token-layer
    assert cp["activation_bytes"] == 8192 * 32 * 46592 * 2
    # K and V of one head_stride=4 group, whole sequence, bf16: the 128 MiB of the module docstring
    assert cp["kv_gathered_bytes"] == 2 * 4 * 65536 * 128 * 2 == 128 * 2**20
    assert sh.memory_report(cfg, 64, data=1, context=8)["param_bytes"] == 4 * n // 64


def random_score_batch(rng, rows: int, seq: int, choices: int) -> dict:
    """A random batch for olmo3.scoring.continuation_scores (byte vocabulary): tokens, targets,
    half the positions weighted, a random choice position per row and `choices` choice tokens."""
    return {"tokens": rng.integers(0, 256, (rows, seq)).astype(np.int32),
            "targets": rng.integers(0, 256, (rows, seq)).astype(np.int32),
            "weights": (rng.random((rows, seq)) > 0.5).astype(np.float32),
            "pos": rng.integers(0, seq, (rows,)).astype(np.int32),
            "choices": rng.integers(0, 256, (rows, choices)).astype(np.int32)}


def test_score_fn_on_a_context_mesh_scores_whole_rows():
    """Downstream scoring on a context mesh: every context rank scores whole rows (of any
    length, here 24, not a multiple of 2C), equal to the single-device scorer."""
    from olmo3 import scoring
    model = olmo3.OLMo3(CFG, jax.random.key(0))
    rng = np.random.default_rng(4)
    b = random_score_batch(rng, rows=8, seq=24, choices=4)
    want = scoring.continuation_scores_jit(model, {k: jnp.asarray(v) for k, v in b.items()})
    mesh = sh.make_mesh("fsdp:4,context:2")
    m = sh.shard_state(model, SkipStepAdamW(lambda s: 1e-3).init(model), mesh)[0]
    got = sh.make_score_fn(mesh, sh.param_specs(m, mesh))(m, b)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, np.asarray(w), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_checkpoint_of_fsdp8_resumes_on_a_context_mesh(tmp_path):
    """Save after 2 steps on fsdp:8, restore onto fsdp:2,context:4 (weights resharded over
    fsdp x context), 2 more steps: losses equal the uninterrupted fsdp:8 run (rtol 2e-6)."""
    from olmo3.checkpoint import CheckpointManager

    def opt():
        return SkipStepAdamW(lambda s: 1e-3, decay_mask=olmo3.model.decay_mask)

    def fresh():
        model = olmo3.OLMo3(CFG, jax.random.key(0))
        return model, opt().init(model)

    data = []
    for seed in range(4):
        b = rows(32, seed=10 + seed)
        data.append({k: np.concatenate([v, v]) for k, v in b.items()})   # 8 rows
    meshes = {name: sh.make_mesh(name) for name in ("fsdp:8", "fsdp:2,context:4")}

    def run(mesh, state, batches):
        specs = sh.param_specs(state[0], mesh)
        step = sh.make_train_step(opt(), mesh, specs, chunk=64, use_segments=True)
        model, o = state
        losses = []
        for b in batches:
            model, o, m = step(model, o, sh.global_batch(b, mesh))
            losses.append(float(m["train/loss"]))
        return (model, o), losses

    m8 = meshes["fsdp:8"]
    _, uninterrupted = run(m8, sh.shard_state(*fresh(), m8), data)
    state, first = run(m8, sh.shard_state(*fresh(), m8), data[:2])
    ckpt = CheckpointManager(str(tmp_path), async_save=False)
    ckpt.save(2, {"model": state[0], "opt": state[1]})
    ckpt.wait()
    mc = meshes["fsdp:2,context:4"]
    abstract = sh.abstract_state(eqx.filter_eval_shape(fresh), mc)
    restored, _ = ckpt.restore(2, {"model": abstract[0], "opt": abstract[1]})
    assert restored["model"].layers.gate_proj.sharding.spec == jax.P(None, None, ("fsdp", "context"))
    _, rest = run(mc, (restored["model"], restored["opt"]), data[2:])
    np.testing.assert_allclose(first + rest, uninterrupted, rtol=2e-6)


@pytest.mark.slow
def test_hlo_collectives_of_the_context_step():
    """The compiled context-parallel gradient (fsdp:4,context:2, head_stride 1, seq 48) moves
    only what the design says: all-gathers of one row's K/V head group [1, 1, 48, hd], its
    segment ids [1, 48] and full weights; reduce-scatters of dK/dV [1, 1, 24, hd] and weight
    shards; all-reduces of scalars. No hidden state [.., 48, d_model] ever crosses devices."""
    from test_sharding import _collectives
    model = olmo3.OLMo3(CFG, jax.random.key(0))
    mesh = sh.make_mesh("fsdp:4,context:2")
    m = sh.shard_state(model, SkipStepAdamW(lambda s: 1e-3).init(model), mesh)[0]
    fn = eqx.filter_jit(sh.make_grad_fn(mesh, sh.param_specs(m, mesh), chunk=64, use_segments=True,
                                        head_stride=1))
    hlo = fn.lower(m, sh.global_batch(rows(48), mesh)).compile().compiled.as_text()
    shapes = lambda op: {s for shapes in _collectives(hlo, op) for s in shapes}   # noqa: E731
    leaves = [x for x in jax.tree.leaves(m) if hasattr(x, "addressable_shards")]
    full = {tuple(x.shape[1:]) if x.ndim == 3 or (x.ndim == 2 and x.shape[0] == CFG.n_layers) else tuple(x.shape)
            for x in leaves}
    local = {tuple(x.addressable_shards[0].data.shape[1:]) for x in leaves} | \
            {tuple(x.addressable_shards[0].data.shape) for x in leaves}
    hd = CFG.head_dim
    assert shapes("all-gather") - full == {(1, 1, 48, hd), (1, 48)}
    assert shapes("reduce-scatter") - local == {(1, 1, 24, hd)}
    assert shapes("all-reduce") <= {()}
    assert not shapes("all-to-all") and not shapes("collective-permute")
