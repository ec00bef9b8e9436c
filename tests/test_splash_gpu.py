"""olmo3.splash_gpu (Pallas Triton) against the independent dense oracle of test_splash.py, and
its CUDA lowering on this CPU-only machine.

Numerics run in Pallas interpret mode (the kernels as plain JAX on CPU). Lowering runs for the
real target through `jax.export(platforms=["cuda"])`, which emits the `__gpu$xla.gpu.triton`
custom call carrying the kernel's Triton IR (DESIGN.md §7); nothing here runs on a GPU.
"""
import re

import equinox as eqx
import jax
import jax.export  # `import jax` does not load it in JAX 0.6
import jax.numpy as jnp
import numpy as np
import pytest

import olmo3
from olmo3 import attention, splash_gpu
from olmo3.model import OLMo3
from test_splash import (TOL, check_against_oracle, dense_mask, documents, far_below_zero,
                         FAR_GRAD_TOL, OFFSET_BF16_BOUNDS, offset_bf16_grad_errors, oracle, random_qkv)

TRITON = "__gpu$xla.gpu.triton"
CUDA = dict(platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])


def export(fn, *args, **kw):
    """jax.export of jax.jit(fn); for CUDA under splash_gpu.target_gpu() (an H100), which JAX >= 0.11
    needs to lower a Triton kernel on this CPU-only machine."""
    if kw.get("platforms") == ["cuda"]:
        with splash_gpu.target_gpu():
            return jax.export.export(jax.jit(fn), **kw)(*args)
    return jax.export.export(jax.jit(fn), **kw)(*args)
# Small tiles so seq 256 has many of them; fwd 64 x 32, dq 32 x 64, dkv 32 keys x 64 queries.
SMALL = splash_gpu.BlockSizes(fwd_q=64, fwd_kv=32, dq_q=32, dq_kv=64, dkv_kv=32, dkv_q=64,
                              fwd_warps=4, bwd_warps=4)


def seq_squared_tensors(module_text, seq, rows=None):
    """StableHLO tensor types with two dimensions equal to seq (e.g. tensor<2x512x512xf32>);
    with `rows`, those holding a dimension `rows` and a dimension `seq` in either order."""
    a, b = seq, seq if rows is None else rows
    return re.findall(rf"tensor<(?:\d+x)*(?:{a}x(?:\d+x)*{b}|{b}x(?:\d+x)*{a})x", module_text)


# ---------------------------------------------------------------------------------------------
# Block tables and tile kinds
# ---------------------------------------------------------------------------------------------

def dense_tiles(mask, bq, bkv):
    nq, nk = mask.shape[0] // bq, mask.shape[1] // bkv
    return mask.reshape(nq, bq, nk, bkv).transpose(0, 2, 1, 3).reshape(nq, nk, -1)


def visited_kinds(seq, bq, bkv, window, seg=None):
    """What the forward's loops do with every tile, from its visit bounds: 'E' visited but all
    masked, 'P' visited with the mask, 'F' visited without it, '' not visited; and the dense
    tiles [q blocks, kv blocks, bq * bkv]."""
    tiles = dense_tiles(dense_mask(seq, window, seg), bq, bkv)
    reach, full = splash_gpu.tile_classes(seq, bq, bkv, window,
                                          None if seg is None else jnp.asarray(seg))
    lo, flo, fhi, hi = np.asarray(splash_gpu.visit_bounds(reach, full)).T[:, :, None]
    assert ((lo <= flo) & (flo <= fhi) & (fhi <= hi)).all()   # the three loops, in order
    cols = np.arange(tiles.shape[1])[None, :]
    kind = np.where((cols >= lo) & (cols < hi), "P", "")
    kind = np.where((cols >= flo) & (cols < fhi), "F", kind)
    return np.where((kind == "P") & ~tiles.any(-1), "E", kind), tiles


@pytest.mark.parametrize("seq,bq,bkv,window,seg", [
    (256, 64, 32, None, None), (256, 32, 64, 100, None), (512, 128, 64, 200, None),
    (256, 32, 32, 32, None), (256, 32, 32, 33, None), (256, 64, 64, 1, None),
    (256, 32, 32, 63, None), (256, 32, 32, 64, None),   # window = q1 - k0: full or not
    (256, 64, 32, 100, (50, 130)), (256, 32, 64, None, (64, 64, 100)),
    (256, 32, 32, 90, "unsorted"), (128, 32, 32, None, "mixed"),
])
def test_visit_bounds_match_dense_mask(seq, bq, bkv, window, seg):
    if seg == "unsorted":      # ids repeat: tiles with overlapping id ranges but nothing shared
        seg = np.tile(np.repeat([0, 1], 32), seq // 64)
    elif seg == "mixed":       # unsorted, kv block 0 holds ids 0 and 1, q blocks 2, 3 only 0:
        seg = np.repeat([0, 1, 1, 0], [16, 16, 32, 64])   # same min id, yet not one id: masked
    elif seg is not None:
        seg = np.asarray(documents(seq, seg))
    kind, tiles = visited_kinds(seq, bq, bkv, window, seg)
    assert (kind[tiles.any(-1)] != "").all()             # every visible tile is visited
    assert tiles[kind == "F"].all()                      # unmasked tiles need no mask
    if seg is None or not isinstance(seg, np.ndarray) or (np.diff(seg) >= 0).all():
        assert (kind != "E").all()                       # positions / sorted ids: tight bounds
        np.testing.assert_array_equal(kind == "F", tiles.all(-1))   # every full tile unmasked


def test_block_sizes_fit_shared_memory():
    # H100/H200 defaults at head_dim 128 in bf16 (module docstring), untouched by the budget
    sizes = splash_gpu.block_sizes(128, jnp.bfloat16)
    assert (sizes.fwd_q, sizes.fwd_kv, sizes.fwd_warps, sizes.fwd_stages) == (128, 64, 8, 3)
    assert splash_gpu.smem_bytes(sizes, 128, 2)["fwd"] == 128 * 1024 + 16 * 1024
    for head_dim in (64, 96, 128, 256):
        for dtype in (jnp.bfloat16, jnp.float32):
            sizes = splash_gpu.block_sizes(head_dim, dtype)
            use = splash_gpu.smem_bytes(sizes, head_dim, jnp.dtype(dtype).itemsize)
            assert max(use.values()) <= splash_gpu.SMEM_BUDGET, (head_dim, dtype, use)
            assert min(sizes.blocks()) >= splash_gpu.MIN_DIM


# ---------------------------------------------------------------------------------------------
# Numerics in interpret mode: forward and dq, dk, dv against the dense oracle
# ---------------------------------------------------------------------------------------------

def gpu_kernel(sizes):
    def run(q, k, v, *, window, segment_ids, block_q, block_kv, interpret):
        del block_q, block_kv                                   # the TPU kernel's arguments
        return splash_gpu.splash_attention(q, k, v, window=window, segment_ids=segment_ids,
                                           sizes=sizes, interpret=interpret)
    return run


# (id, heads, kv_heads, seq, head_dim, dtype, window, segments, forward tiles visited: E all
# masked, P masked, F unmasked)
CASES = [
    # window + ragged documents + GQA (4 query heads on 2 kv heads)
    ("window_segments_gqa_f32", 4, 2, 256, 64, jnp.float32, 100, (50, 150), "PF"),
    # MQA in bf16 with repeating (unsorted) ids: all-masked tiles inside the loop bounds
    ("unsorted_segments_mqa_bf16", 4, 1, 256, 64, jnp.bfloat16, None, "unsorted", "EPF"),
    # plain causal (full layers) with padding: seq 200 -> 256 and head_dim 40 -> 64
    ("padded_causal_mha_f32", 2, 2, 200, 40, jnp.float32, None, None, "PF"),
]
SLOW_CASES = [
    ("causal_mha_f32", 2, 2, 256, 64, jnp.float32, None, None, "PF"),
    ("padded_window_gqa_f32", 4, 2, 200, 40, jnp.float32, 120, None, "PF"),
    ("causal_gqa_bf16", 8, 2, 256, 128, jnp.bfloat16, None, None, "PF"),
    ("window_mqa_bf16", 4, 1, 512, 64, jnp.bfloat16, 128, None, "PF"),
    ("segments_window_f32_head_dim_128", 2, 1, 512, 128, jnp.float32, 200, (10, 300, 5), "PF"),
]


def segment_case(seq, spec):
    if spec == "unsorted":
        return jnp.asarray(np.tile(np.repeat([0, 1], 64), seq // 128), jnp.int32)
    return None if spec is None else documents(seq, spec)


def run_case(case):
    _, heads, kv_heads, seq, head_dim, dtype, window, spec, present = case
    seg = segment_case(seq, spec)
    pad = -(-seq // 64) * 64                                  # the kernel's padded length
    seg_pad = None if seg is None else np.pad(np.asarray(seg), (0, pad - seq), mode="edge")
    kind, _ = visited_kinds(pad, SMALL.fwd_q, SMALL.fwd_kv, window, seg_pad)
    assert set(np.unique(kind[kind != ""])) == set(present)  # the case exercises what it claims
    q, k, v, ct = random_qkv(heads, kv_heads, seq, head_dim, dtype)
    check_against_oracle(q, k, v, ct, window=window, segment_ids=seg, bq=0, bkv=0,
                         interpret=True, kernel=gpu_kernel(SMALL))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_oracle_interpret(case):
    run_case(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=[c[0] for c in SLOW_CASES])
def test_matches_oracle_interpret_slow(case):
    run_case(case)


def test_scores_far_below_zero_interpret():
    # softmax is shift-invariant: the oracle's answer does not depend on where the scores sit.
    # A running max started at 0 rather than at the mask value gives exp2(s - 0) = 0, 0 / 0.
    q, k, v, ct = far_below_zero(2, 1, 64, 16, seed=6)
    check_against_oracle(q, k, v, ct, window=40, segment_ids=documents(64, (20,)), bq=0,
                         bkv=0, interpret=True, kernel=gpu_kernel(SMALL), grad_tol=FAR_GRAD_TOL)


def test_dkv_query_blocks_longer_than_the_other_kernels_interpret():
    # Every block_sizes() choice has fwd_q >= dkv_q; a user's BlockSizes need not. The dk / dv
    # kernel then walks its own query blocks over a padded length that must cover them: with
    # queries padded only for the forward's 32, rows 64-95 of seq 96 were never visited (dk off by
    # 0.99, dv by 0.48 in a mutation audit).
    sizes = splash_gpu.BlockSizes(fwd_q=32, fwd_kv=32, dq_q=32, dq_kv=32, dkv_kv=32, dkv_q=64)
    q, k, v, ct = random_qkv(1, 1, 96, 16, jnp.float32, seed=7)
    check_against_oracle(q, k, v, ct, window=None, segment_ids=None, bq=0, bkv=0, interpret=True,
                         kernel=gpu_kernel(sizes))


def test_bf16_backward_keeps_rowsum_of_do_times_o_in_fp32_interpret():
    # test_splash.offset_bf16_grad_errors: values and cotangents of a common offset make D large
    err = offset_bf16_grad_errors(gpu_kernel(SMALL), 64, 0, 0)
    assert all(e < bound for e, bound in zip(err, OFFSET_BF16_BOUNDS)), err


@pytest.mark.slow
def test_default_block_sizes_and_vmap_with_per_example_segments():
    heads, kv_heads, seq, d = 4, 2, 256, 128
    q, k, v, ct = random_qkv(2 * heads, 2 * kv_heads, seq, d, jnp.float32, seed=3)
    q, k, v, ct = (x.reshape(2, -1, seq, d) for x in (q, k, v, ct))   # batch of 2
    seg = jnp.stack([documents(seq, (70,)), documents(seq, (10, 150))])
    for b in range(2):
        check_against_oracle(q[b], k[b], v[b], ct[b], window=90, segment_ids=seg[b], bq=0,
                             bkv=0, interpret=True, kernel=gpu_kernel(None))
    fn = lambda q, k, v, s: splash_gpu.splash_attention(q, k, v, window=90, segment_ids=s,
                                                        interpret=True)
    out = jax.vmap(fn)(q, k, v, seg)
    for b in range(2):
        np.testing.assert_allclose(out[b], fn(q[b], k[b], v[b], seg[b]), rtol=0,
                                   atol=TOL[jnp.float32] * np.abs(out[b]).max())


# ---------------------------------------------------------------------------------------------
# CUDA lowering on this CPU-only machine; dispatch by lowering platform
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seq,window,segmented", [(8192, 4096, False), (65536, None, True)])
def test_lowers_for_cuda_at_7b_shapes(seq, window, segmented):
    # OLMo 3 7B attention (DESIGN.md §2): 32 heads, 32 kv heads, head_dim 128, bf16; stage 2's
    # seq 8192 with the 4096 window, and stage 3's seq 65,536 with documents (full layer).
    # ShapeDtypeStructs: nothing is allocated. Batch 1 under vmap, as the model calls it.
    x = jax.ShapeDtypeStruct((1, 32, seq, 128), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, seq), jnp.int32)
    fwd = jax.vmap(lambda q, k, v, s: attention.attention(
        q, k, v, window=window, segment_ids=s if segmented else None, impl="splash"))
    grad = jax.grad(lambda *a: fwd(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    for fn, kernels in ((fwd, 1), (grad, 3)):                 # forward; forward + dq + dkv
        exported = export(fn, x, x, x, seg, **CUDA)
        text = exported.mlir_module()
        assert exported.platforms == ("cuda",)
        assert text.count(TRITON) == kernels and "tpu_custom_call" not in text
        assert seq_squared_tensors(text, seq) == []           # no [.., seq, seq] buffer


def test_seq_squared_check_can_fail():
    # the dense path at seq 512 does hold [heads, 512, 512] scores, and the check sees them
    x = jax.ShapeDtypeStruct((2, 512, 64), jnp.float32)
    fn = lambda q, k, v: attention.attention(q, k, v, window=None, segment_ids=None, impl="xla")
    text = export(fn, x, x, x, platforms=["cuda"]).mlir_module()
    assert seq_squared_tensors(text, 512)


@pytest.mark.parametrize("impl,platform,present,absent", [
    ("splash", "cuda", TRITON, "tpu_custom_call"),
    ("splash", "tpu", "tpu_custom_call", TRITON),
    ("splash", "cpu", "splash_gpu_fwd", TRITON), # the GPU kernel interpreted: plain HLO
    ("cudnn", "cuda", TRITON, "__cudnn"),        # documents: cuDNN cannot, the GPU kernel does
])
def test_dispatch_by_lowering_platform(impl, platform, present, absent):
    q = jax.ShapeDtypeStruct((4, 256, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 128), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((256,), jnp.int32)
    fn = lambda q, k, v, s: attention.attention(q, k, v, window=100, segment_ids=s, impl=impl,
                                                block_q=128, block_kv=128)
    grad = jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    kw = CUDA if platform == "cuda" else dict(platforms=[platform])
    text = export(grad, q, kv, kv, seg, **kw).mlir_module()
    if present:
        assert present in text
    assert absent not in text and "__cudnn" not in text


def test_xla_refuses_seq_squared_scores_at_stage3_shapes():
    x = jax.ShapeDtypeStruct((32, 65536, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"attention='xla' at seq 65536 .* use --attention=splash"):
        jax.eval_shape(lambda q: attention.attention(q, q, q, window=None, segment_ids=None,
                                                     impl="xla"), x)


@pytest.mark.slow   # the 65,536-token layer exports above already check the attention alone
@pytest.mark.parametrize("impl", ["splash", "cudnn"])
def test_stage3_model_gradient_lowers_for_cuda_without_seq_squared(impl):
    # The stage-3 recipe's shape (seq 65,536, documents, 3 sliding + 1 full layer, head_dim 128)
    # on a narrow model: every attention is the Triton kernel and no buffer is seq x seq.
    seq = 65536
    cfg = olmo3.Config.tiny(vocab_size=128, d_model=256, n_heads=2, n_kv_heads=2, head_dim=128,
                            mlp_hidden=256, window=4096, attention=impl)
    model = eqx.filter_eval_shape(lambda: OLMo3(cfg, jax.random.PRNGKey(0)))
    params, static = eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    ids = jax.ShapeDtypeStruct((1, seq), jnp.int32)

    def loss(params, tokens, segment_ids):
        m = eqx.combine(params, static)
        logits = jax.vmap(lambda t, s: m(t, segment_ids=s))(tokens, segment_ids)
        return jnp.mean(logits.astype(jnp.float32))

    text = export(jax.grad(loss), params, ids, ids, **CUDA).mlir_module()
    assert text.count(TRITON) >= 3 * len(cfg.layer_pattern)   # fwd, dq, dkv of every layer
    assert seq_squared_tensors(text, seq) == []


# ---------------------------------------------------------------------------------------------
# Query chunks (context parallelism): rows [offset, offset + q_seq) against all seq keys
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seq,q_seq,offset,bq,bkv,window,seg", [
    (256, 64, 96, 32, 32, None, None), (256, 96, 100, 32, 64, 50, None),
    (256, 128, 128, 64, 32, None, (50, 130)), (256, 64, 37, 32, 32, 40, (60, 20)),
    (256, 64, 33, 32, 32, None, None),   # a q tile's last row is a kv tile's first key
    (256, 64, 31, 32, 32, 100, None),    # a q tile's first row is a kv tile's last key
])
def test_chunk_visit_bounds_match_dense_mask_rows(seq, q_seq, offset, bq, bkv, window, seg):
    seg = None if seg is None else np.asarray(documents(seq, seg))
    mask = dense_mask(seq, window, seg)[offset:offset + q_seq]            # the chunk's rows
    tiles = dense_tiles(mask, bq, bkv)
    reach, full = splash_gpu.tile_classes(seq, bq, bkv, window,
                                          None if seg is None else jnp.asarray(seg),
                                          q_seq=q_seq, q_offset=offset)
    lo, flo, fhi, hi = np.asarray(splash_gpu.visit_bounds(reach, full)).T[:, :, None]
    assert ((lo <= flo) & (flo <= fhi) & (fhi <= hi)).all()
    cols = np.arange(tiles.shape[1])[None, :]
    visited, unmasked = (cols >= lo) & (cols < hi), (cols >= flo) & (cols < fhi)
    assert visited[tiles.any(-1)].all()                  # every visible tile is visited
    assert not (visited & ~tiles.any(-1)).any()          # sorted ids: tight bounds
    np.testing.assert_array_equal(unmasked, tiles.all(-1))


def check_chunk(heads, kv_heads, seq, head_dim, dtype, q_seq, offset, window, spec, kernel):
    """kernel(q_chunk, k, v, seg, offset) against the chunk's rows of the dense oracle (fp32,
    [seq, seq] mask): output and dq (chunk rows), dk, dv (all keys) under a random cotangent."""
    seg = segment_case(seq, spec)
    q, k, v, ct = random_qkv(heads, kv_heads, seq, head_dim, dtype, seed=5)
    rows = slice(offset, offset + q_seq)
    qc, ct = q[:, rows], ct[:, rows]
    loss = lambda out: jnp.sum(out.astype(jnp.float32) * ct)
    ours = jax.jit(jax.value_and_grad(lambda qc, k, v: loss(kernel(qc, k, v, seg, offset)),
                                      argnums=(0, 1, 2)))
    _, grads = ours(qc, k, v)
    out = jax.jit(lambda qc, k, v: kernel(qc, k, v, seg, offset))(qc, k, v)
    f32 = lambda x: x.astype(jnp.float32)

    def ref_loss(qc, k, v):                               # the chunk's rows of the whole
        return loss(oracle(q.astype(jnp.float32).at[:, rows].set(qc), k, v, window, seg)[:, rows])

    want = oracle(*map(f32, (q, k, v)), window, seg)[:, rows]
    want_grads = jax.grad(ref_loss, argnums=(0, 1, 2))(*map(f32, (qc, k, v)))
    tol = TOL[dtype]
    assert out.shape == qc.shape and out.dtype == dtype
    np.testing.assert_allclose(f32(out), want, atol=tol * np.abs(want).max(), rtol=0)
    for name, g, w in zip("qkv", grads, want_grads):
        np.testing.assert_allclose(f32(g), w, atol=tol * np.abs(w).max(), rtol=0,
                                   err_msg=f"d{name}")


# (id, heads, kv_heads, seq, head_dim, dtype, q_seq, offset, window, segments): offsets that
# are not multiples of any block, chunks that end before seq, documents crossing the chunk's
# first row.
CHUNK_CASES = [
    ("window_segments_gqa_f32", 4, 2, 256, 64, jnp.float32, 96, 70, 60, (50, 110)),
    ("causal_mqa_bf16_last_rows", 4, 1, 256, 64, jnp.bfloat16, 64, 192, None, None),
    # the last rows, padded (40 -> 64 queries) past the last key (88 + 64 > 128), and a window
    # (50) wider than the chunk but narrower than the sequence
    ("padded_past_keys_window_segments_f32", 2, 1, 128, 16, jnp.float32, 40, 88, 50, (30, 70)),
]
SLOW_CHUNK_CASES = [
    ("segments_causal_gqa_f32_first_rows", 4, 2, 256, 64, jnp.float32, 128, 0, None, (30, 90)),
    ("padded_window_f32", 2, 2, 200, 40, jnp.float32, 50, 123, 70, (140,)),
    ("unsorted_segments_window_bf16", 4, 2, 256, 64, jnp.bfloat16, 128, 64, 100, "unsorted"),
]


def run_chunk_case(case):
    _, heads, kv_heads, seq, head_dim, dtype, q_seq, offset, window, spec = case
    kernel = lambda qc, k, v, seg, offset: splash_gpu.splash_attention(
        qc, k, v, window=window, segment_ids=seg, sizes=SMALL, interpret=True, q_offset=offset)
    check_chunk(heads, kv_heads, seq, head_dim, dtype, q_seq, offset, window, spec, kernel)


@pytest.mark.parametrize("case", CHUNK_CASES, ids=[c[0] for c in CHUNK_CASES])
def test_chunk_matches_oracle_rows_interpret(case):
    run_chunk_case(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CHUNK_CASES, ids=[c[0] for c in SLOW_CHUNK_CASES])
def test_chunk_matches_oracle_rows_interpret_slow(case):
    run_chunk_case(case)


def test_attention_chunk_dispatch_matches_chunk_attention():
    # attention(q_offset=...) with impl splash on CPU: the same dispatch as the whole sequence
    # (interpret mode), against the dense `chunk_attention` at a traced-offset-capable path.
    seq, q_seq, offset, window = 128, 48, 53, 40
    q, k, v, _ = random_qkv(4, 2, seq, 32, jnp.float32, seed=7)
    seg = documents(seq, (20, 70))
    qc = q[:, offset:offset + q_seq]
    got = attention.attention(qc, k, v, window=window, segment_ids=seg, impl="splash",
                              q_offset=offset)
    want = attention.chunk_attention(qc, k, v, q_offset=offset, window=window, segment_ids=seg)
    np.testing.assert_allclose(got, want, atol=TOL[jnp.float32] * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("impl,platform,present,absent", [
    ("splash", "cuda", TRITON, "tpu_custom_call"),
    ("splash", "tpu", "tpu_custom_call", TRITON),
    ("splash", "cpu", "splash_gpu_fwd", TRITON),
    ("cudnn", "cuda", TRITON, "__cudnn"),        # cuDNN's causal mask cannot be offset
])
def test_chunk_dispatch_by_lowering_platform(impl, platform, present, absent):
    q = jax.ShapeDtypeStruct((4, 256, 128), jnp.bfloat16)               # rows 256..511 of 1024
    kv = jax.ShapeDtypeStruct((2, 1024, 128), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1024,), jnp.int32)
    fn = lambda q, k, v, s: attention.attention(q, k, v, window=None, segment_ids=s, impl=impl,
                                                block_q=128, block_kv=128, q_offset=256)
    grad = jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    kw = CUDA if platform == "cuda" else dict(platforms=[platform])
    text = export(grad, q, kv, kv, seg, **kw).mlir_module()
    if present:
        assert present in text
    assert absent not in text and "__cudnn" not in text


@pytest.mark.parametrize("impl", ["splash", "cudnn"])
def test_context_chunk_lowers_for_cuda_at_stage3_shapes(impl):
    # Stage 3 with context:8 (olmo3/sharding.py): a rank's queries against all 65,536 keys of
    # the 7B (32 heads, head_dim 128, bf16, documents). Dense, that is 32 x 8192 x 65,536 fp32
    # scores (64 GiB); the Triton kernel holds no [8192, 65536]-like buffer.
    seq, q_seq, offset = 65536, 8192, 7 * 4096
    q = jax.ShapeDtypeStruct((1, 32, q_seq, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 32, seq, 128), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, seq), jnp.int32)
    fwd = jax.vmap(lambda q, k, v, s: attention.attention(
        q, k, v, window=None, segment_ids=s, impl=impl, q_offset=offset))
    grad = jax.grad(lambda *a: fwd(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    for fn, kernels in ((fwd, 1), (grad, 3)):
        text = export(fn, q, kv, kv, seg, **CUDA).mlir_module()
        assert text.count(TRITON) == kernels and "tpu_custom_call" not in text
        assert seq_squared_tensors(text, seq, rows=q_seq) == []
        assert seq_squared_tensors(text, seq) == []


def test_chunk_buffer_check_can_fail():
    # xla's dense chunk path does hold [.., 512, 2048] scores, and the check sees them
    q, kv = jax.ShapeDtypeStruct((2, 512, 64), jnp.float32), jax.ShapeDtypeStruct((2, 2048, 64),
                                                                                  jnp.float32)
    fn = lambda q, k, v: attention.attention(q, k, v, window=None, segment_ids=None, impl="xla",
                                             q_offset=1024)
    text = export(fn, q, kv, kv, platforms=["cuda"]).mlir_module()
    assert seq_squared_tensors(text, 2048, rows=512)


def test_xla_refuses_chunk_scores_at_stage3_shapes():
    q = jax.ShapeDtypeStruct((32, 8192, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((32, 65536, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"attention='xla' on a 8192-row query chunk .* "
                                         r"use --attention=splash"):
        jax.eval_shape(lambda q, kv: attention.attention(
            q, kv, kv, window=None, segment_ids=None, impl="xla", q_offset=7 * 4096), q, kv)
