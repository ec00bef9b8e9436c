"""olmo3.splash against an independent dense oracle (materialized mask, plain softmax).

The oracle below is written from the mask definition alone (DESIGN.md §2, transformers'
`kv > q - sliding_window`): query i sees key j iff j <= i, i - j < window, same segment.
Numerics run in both CPU interpret modes; lowering runs for the real TPU target (Mosaic)
through jax.export on this CPU-only machine.
"""
import equinox as eqx
import jax
import jax.export  # `import jax` does not load it in JAX 0.6
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from olmo3 import splash

# Tolerances, as max|kernel - oracle| / max|oracle| per tensor:
# fp32: 2e-5 (fp32 eps 1.2e-7, different summation order over <= 512 keys; measured <= 3e-6).
# bf16: 1e-2 (the oracle is fp32 on the same bf16 inputs; the kernel rounds p and dS to bf16
#       before the MXU matmuls and the outputs to bf16, eps 2^-8 = 3.9e-3; measured <= 4e-3).
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1e-2}


def dense_mask(seq, window=None, segment_ids=None):
    i = np.arange(seq)[:, None]
    j = np.arange(seq)[None, :]
    mask = j <= i
    if window is not None:
        mask = mask & (i - j < window)
    if segment_ids is not None:
        seg = np.asarray(segment_ids)
        mask = mask & (seg[:, None] == seg[None, :])
    return mask


def oracle(q, k, v, window=None, segment_ids=None):
    """Dense fp32 attention with a materialized [seq, seq] mask; GQA by repeating kv heads."""
    heads, seq, head_dim = q.shape
    group = heads // k.shape[0]
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    k, v = jnp.repeat(k, group, axis=0), jnp.repeat(v, group, axis=0)    # head h -> kv h//group
    s = jnp.einsum("hqd,hkd->hqk", q, k) / np.sqrt(head_dim)
    s = jnp.where(dense_mask(seq, window, segment_ids), s, -jnp.inf)
    return jnp.einsum("hqk,hkd->hqd", jax.nn.softmax(s, axis=-1), v)


def random_qkv(heads, kv_heads, seq, head_dim, dtype, seed=0):
    kq, kk, kv, kr = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(kq, (heads, seq, head_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (kv_heads, seq, head_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (kv_heads, seq, head_dim), jnp.float32).astype(dtype)
    cotangent = jax.random.normal(kr, (heads, seq, head_dim), jnp.float32)
    return q, k, v, cotangent


def documents(seq, lengths):
    """Segment ids for documents of the given lengths (the rest is one last document)."""
    ids = np.repeat(np.arange(len(lengths) + 1), list(lengths) + [seq - sum(lengths)])
    return jnp.asarray(ids, jnp.int32)


def tile_kinds_from_dense(mask, bq, bkv):
    nq, nk = mask.shape[0] // bq, mask.shape[1] // bkv
    tiles = mask.reshape(nq, bq, nk, bkv).transpose(0, 2, 1, 3).reshape(nq, nk, -1)
    return np.where(~tiles.any(-1), splash.EMPTY,
                    np.where(tiles.all(-1), splash.FULL, splash.PARTIAL))


# ---------------------------------------------------------------------------------------------
# Block table
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seq,bq,bkv,window", [
    (256, 32, 32, None), (256, 32, 64, 100), (256, 64, 32, 100), (512, 128, 128, 200),
    (384, 128, 128, 1), (512, 128, 256, None), (1024, 64, 128, 300), (96, 32, 32, 96),
    (256, 32, 32, 63), (256, 32, 32, 64), (256, 32, 32, 33), (256, 32, 32, 32),  # boundaries
])
def test_block_kinds_match_dense_mask(seq, bq, bkv, window):
    got = splash.block_kinds(seq, bq, bkv, window)
    want = tile_kinds_from_dense(dense_mask(seq, window), bq, bkv)
    np.testing.assert_array_equal(got, want)
    # with segment ids nothing can be proven FULL; EMPTY stays EMPTY
    seg = splash.block_kinds(seq, bq, bkv, window, segmented=True)
    np.testing.assert_array_equal(seg, np.where(want == splash.FULL, splash.PARTIAL, want))


@pytest.mark.parametrize("seq,q_seq,offset,bq,bkv,window", [
    (256, 64, 33, 32, 32, None),   # offset 1 mod bkv: a q tile's last row is a kv tile's first key
    (256, 64, 31, 32, 32, None),   # offset -1 mod bkv: a q tile's first row is a kv tile's last key
    (256, 96, 97, 32, 64, 100), (256, 64, 95, 64, 32, 100), (256, 64, 192, 32, 32, None),
])
def test_chunk_block_kinds_match_dense_mask_rows(seq, q_seq, offset, bq, bkv, window):
    # A query chunk (context parallelism) at an offset that is not a multiple of any block:
    # the table must be the dense mask's rows [offset, offset + q_seq), tile by tile.
    got = splash.block_kinds(seq, bq, bkv, window, q_seq=q_seq, q_offset=offset)
    want = tile_kinds_from_dense(dense_mask(seq, window)[offset:offset + q_seq], bq, bkv)
    assert {splash.PARTIAL, splash.FULL} <= set(np.unique(want).tolist())
    np.testing.assert_array_equal(got, want)


def test_visit_lists_cover_exactly_the_non_empty_tiles():
    kinds = splash.block_kinds(1024, 64, 128, 300)
    for table in (kinds, kinds.T):
        index, kind, width = splash._visit_lists(table)
        index, kind = index.reshape(-1, width), kind.reshape(-1, width)
        assert width == np.count_nonzero(table, axis=1).max()
        for r in range(table.shape[0]):
            visited = index[r][kind[r] != splash.EMPTY]
            np.testing.assert_array_equal(visited, np.flatnonzero(table[r]))  # once, ascending
            np.testing.assert_array_equal(kind[r][kind[r] != splash.EMPTY],
                                          table[r][visited])
            assert (index[r][kind[r] == splash.EMPTY] == visited[-1]).all()   # padding: no DMA


def test_computed_block_fraction_at_7b_shapes():
    # seq 8192, 2048-token blocks (4 x 4 tiles). Causal: the 6 tiles above the diagonal are
    # empty -> 10/16. Window 4096: tile (q 3, kv 0) holds q >= 6144, k <= 2047, so every
    # distance is >= 4097 >= window -> empty too -> 9/16. Dense would be 16/16.
    assert splash.computed_block_fraction(8192, None, 2048, 2048) == 10 / 16
    assert splash.computed_block_fraction(8192, 4096, 2048, 2048) == 9 / 16
    # Smaller blocks approach the exact element shares (causal 0.5, window 0.375).
    mask_share = dense_mask(2048, 1024).mean()                    # same ratios at seq/8 scale
    frac = splash.computed_block_fraction(8192, 4096, 256, 256)
    assert mask_share < frac < mask_share + 256 / 8192 * 1.5
    # Inside 2048-token tiles, compute skips empty 512 x 512 chunks: of the 16 x 16 chunks,
    # (i, j) is non-empty iff 0 <= i - j <= 8 ((i - j) * 512 - 511 < 4096): 16 + 15 + ... + 8
    # = 108 -> 108/256; causal only: 16 * 17 / 2 = 136 -> 136/256.
    assert splash.computed_score_fraction(8192, 4096, 2048, 2048) == 108 / 256
    assert splash.computed_score_fraction(8192, None, 2048, 2048) == 136 / 256


# ---------------------------------------------------------------------------------------------
# Numerics: forward and gradients against the dense oracle
# ---------------------------------------------------------------------------------------------

def check_against_oracle(q, k, v, cotangent, *, window, segment_ids, bq, bkv, interpret,
                         kernel=None, grad_tol=None):
    """kernel: a function with splash.splash_attention's signature (default: that one).
    grad_tol: the gradients' tolerance where it is not TOL's (see far_below_zero)."""
    kernel = kernel or splash.splash_attention

    def ours(q, k, v):
        return kernel(q, k, v, window=window, segment_ids=segment_ids,
                      block_q=bq, block_kv=bkv, interpret=interpret)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * cotangent)

    def loss_and_out(q, k, v):
        out = ours(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    ref = lambda q, k, v: oracle(q, k, v, window, segment_ids)
    tol = TOL[q.dtype.type]
    # one jit for the output and the gradients: interpret mode compiles once, not op by op
    grads, out = jax.jit(jax.grad(loss_and_out, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    want = ref(q, k, v)
    np.testing.assert_allclose(out.astype(jnp.float32), want, atol=tol * np.abs(want).max(),
                               rtol=0)
    # oracle gradients in fp32 from the same (possibly bf16-rounded) inputs
    want_grads = jax.grad(loss(ref), argnums=(0, 1, 2))(
        *(x.astype(jnp.float32) for x in (q, k, v)))
    for name, g, w, x in zip("qkv", grads, want_grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        np.testing.assert_allclose(g.astype(jnp.float32), w,
                                   atol=(grad_tol or tol) * np.abs(w).max(), rtol=0,
                                   err_msg=f"d{name}")


# (id, heads, kv_heads, seq, head_dim, dtype, window, segment lengths, bq, bkv, kinds present)
CASES = [
    # causal, MHA: EMPTY above the diagonal, FULL below, PARTIAL on it
    ("causal_mha_f32", 2, 2, 256, 128, jnp.float32, None, None, 128, 128, "EPF"),
    # segment ids (3 documents, boundaries inside tiles) + window + GQA, bq != bkv
    ("window_segments_gqa_f32", 4, 2, 512, 128, jnp.float32, 200, (50, 230), 128, 256, "EP"),
    # bf16, causal + segments, MQA-like (4 heads share one kv head)
    ("segments_mqa_bf16", 4, 1, 256, 128, jnp.bfloat16, None, (100,), 128, 128, "EP"),
    # plain interpret accepts small blocks: FULL, PARTIAL and window-EMPTY tiles all at once
    ("small_blocks_window_bf16", 2, 1, 256, 64, jnp.bfloat16, 100, None, 32, 32, "EPF"),
    # causal, bq < bkv (compute chunks 16 x 32 = the tiles): a PARTIAL tile whose first keys
    # precede its first query and whose last keys follow its last one
    ("causal_bq_lt_bkv_f32", 2, 1, 128, 16, jnp.float32, None, None, 16, 32, "EPF"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_oracle_plain_interpret(case):
    _, heads, kv_heads, seq, head_dim, dtype, window, lengths, bq, bkv, kinds = case
    seg = None if lengths is None else documents(seq, lengths)
    present = set(np.unique(splash.block_kinds(seq, bq, bkv, window, seg is not None)).tolist())
    assert present == {"EPF".index(c) for c in kinds}     # the case exercises what it claims
    q, k, v, ct = random_qkv(heads, kv_heads, seq, head_dim, dtype)
    check_against_oracle(q, k, v, ct, window=window, segment_ids=seg, bq=bq, bkv=bkv,
                         interpret=True)


def far_below_zero(heads, kv_heads, seq, head_dim, seed):
    """q, k, v, cotangent whose scores all lie near -130 (q and k point opposite ways along the
    first axis, +-23 there; N(0, 0.25) elsewhere): exp(score) underflows fp32, so only a
    softmax that subtracts its running max from the first key on sees anything.
    dq's first axis is scale * sum_j dS_ij k_j0 with sum_j dS_ij = 0 and k_j0 near -23: a
    cancellation that turns the kernels' fp32 rounding of scores near 130 (~1e-5, also
    lse's ln <-> log2 round trip in the GPU kernel) into ~3e-4 of max|dq|; hence FAR_GRAD_TOL."""
    q, k, v, ct = random_qkv(heads, kv_heads, seq, head_dim, jnp.float32, seed=seed)
    axis = 23.0 * jax.nn.one_hot(0, head_dim)
    return 0.5 * q + axis, 0.5 * k - axis, v, ct


FAR_GRAD_TOL = 1e-3


def test_scores_far_below_zero_plain_interpret():
    # softmax is shift-invariant: the oracle's answer does not depend on where the scores sit.
    # A running max started at 0 rather than at the mask value gives exp(s - 0) = 0, 0 / 0.
    q, k, v, ct = far_below_zero(1, 1, 32, 16, seed=6)
    check_against_oracle(q, k, v, ct, window=None, segment_ids=None, bq=32, bkv=32,
                         interpret=True, grad_tol=FAR_GRAD_TOL)


def offset_bf16_grad_errors(kernel, head_dim, bq, bkv):
    """max|err| / max|ref| of a kernel's dq, dk, dv in bf16 against the fp32 oracle on the same
    bf16 inputs, with values and cotangents of a common offset (v = 4 + N(0, 1), cotangent =
    1 + 0.1 N(0, 1)), as activations have. D = rowsum(dO * O) enters every dS = P * (dP - D); the
    offsets make D large and dP - D a difference of near numbers, so D taken in bf16 multiplies
    dq's and dk's error 4-7x. Zero-mean inputs (random_qkv) keep D small, where bf16 D passes.
    Even D in fp32 is off by a few percent here: it is taken from the bf16-rounded output, as
    FlashAttention-2 takes it, hence the callers' bounds rather than TOL."""
    q, k, v, ct = random_qkv(2, 1, 256, head_dim, jnp.float32, seed=0)
    v, ct = 4.0 + v, 1.0 + 0.1 * ct
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    ours = lambda q, k, v: jnp.sum(kernel(q, k, v, window=None, segment_ids=None, block_q=bq, block_kv=bkv,  # noqa: E731
                                          interpret=True).astype(jnp.float32) * ct)
    ref = lambda q, k, v: jnp.sum(oracle(q, k, v) * ct)  # noqa: E731
    got = jax.jit(jax.grad(ours, (0, 1, 2)))(q, k, v)
    want = jax.grad(ref, (0, 1, 2))(*(x.astype(jnp.float32) for x in (q, k, v)))
    return [float(jnp.abs(a.astype(jnp.float32) - b).max() / jnp.abs(b).max()) for a, b in zip(got, want)]


# D in fp32 / in bf16, measured in a mutation audit: TPU kernel (head_dim 128, blocks 128) dq
# 0.046 / 0.18, dk 0.021 / 0.16; GPU kernel (head_dim 64, test_splash_gpu's SMALL) dq 0.027 /
# 0.11, dk 0.013 / 0.072; dv 0.003 in all.
OFFSET_BF16_BOUNDS = (0.08, 0.05, 0.01)


def test_bf16_backward_keeps_rowsum_of_do_times_o_in_fp32_interpret():
    err = offset_bf16_grad_errors(splash.splash_attention, 128, 128, 128)
    assert all(e < bound for e, bound in zip(err, OFFSET_BF16_BOUNDS)), err


def test_compute_chunks_inside_tiles_plain_interpret(monkeypatch):
    # 128-wide compute chunks inside 256 x 512 tiles: chunk-level skipping and masking,
    # window 200 on seq 512, GQA 4 -> 2.
    monkeypatch.setattr(splash, "COMPUTE_CHUNK", 128)
    q, k, v, ct = random_qkv(4, 2, 512, 128, jnp.float32, seed=4)
    check_against_oracle(q, k, v, ct, window=200, segment_ids=None, bq=256, bkv=512,
                         interpret=True)


TPU_INTERPRET_CASES = [
    # every feature at once in fp32 (window, segments, GQA, bq != bkv) ...
    ("window_segments_gqa_f32", 4, 2, 512, 128, jnp.float32, 200, (50, 230), 256, 256),
    # ... and causal bf16 with FULL tiles
    ("causal_gqa_bf16", 4, 2, 256, 128, jnp.bfloat16, None, None, 256, 128),
]


@pytest.mark.parametrize("case", TPU_INTERPRET_CASES, ids=[c[0] for c in TPU_INTERPRET_CASES])
def test_matches_oracle_tpu_interpret(case, monkeypatch):
    monkeypatch.setattr(splash, "COMPUTE_CHUNK", 128)   # several compute chunks per tile
    _, heads, kv_heads, seq, head_dim, dtype, window, lengths, bq, bkv = case
    seg = None if lengths is None else documents(seq, lengths)
    q, k, v, ct = random_qkv(heads, kv_heads, seq, head_dim, dtype, seed=1)
    check_against_oracle(q, k, v, ct, window=window, segment_ids=seg, bq=bq, bkv=bkv,
                         interpret=pltpu.InterpretParams())


SLOW_CASES = CASES + [
    ("window_gqa_f32", 4, 2, 512, 128, jnp.float32, 200, None, 128, 128, "EP"),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=[c[0] for c in SLOW_CASES])
def test_matches_oracle_tpu_interpret_all_cases(case):
    _, heads, kv_heads, seq, head_dim, dtype, window, lengths, bq, bkv, _ = case
    if bq % 128 or bkv % 128 or head_dim not in (64, 128):
        pytest.skip("TPU interpret enforces Mosaic tiling")
    seg = None if lengths is None else documents(seq, lengths)
    q, k, v, ct = random_qkv(heads, kv_heads, seq, head_dim, dtype, seed=2)
    check_against_oracle(q, k, v, ct, window=window, segment_ids=seg, bq=bq, bkv=bkv,
                         interpret=pltpu.InterpretParams())


def test_vmap_over_batch_with_per_example_segments():
    heads, kv_heads, seq, d = 2, 1, 256, 128
    q, k, v, ct = random_qkv(2 * heads, 2 * kv_heads, seq, d, jnp.float32, seed=3)
    q, k, v, ct = (x.reshape(2, -1, seq, d) for x in (q, k, v, ct))   # batch of 2
    seg = jnp.stack([documents(seq, (70,)), documents(seq, (10, 150))])
    fn = lambda q, k, v, s: splash.splash_attention(q, k, v, window=90, segment_ids=s,
                                                    block_q=128, block_kv=128, interpret=True)
    out, vjp = jax.vjp(lambda q, k, v: jax.vmap(fn)(q, k, v, seg), q, k, v)
    grads = vjp(ct)
    for b in range(2):
        want, ref_vjp = jax.vjp(lambda q, k, v: oracle(q, k, v, 90, seg[b]), q[b], k[b], v[b])
        np.testing.assert_allclose(out[b], want, atol=2e-5 * np.abs(want).max(), rtol=0)
        for g, w in zip(grads, ref_vjp(ct[b])):
            np.testing.assert_allclose(g[b], w, atol=2e-5 * np.abs(w).max(), rtol=0)


# ---------------------------------------------------------------------------------------------
# TPU lowering on a CPU-only machine, and bad input
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("window,segmented,dtype", [(None, False, jnp.bfloat16),
                                                    (200, True, jnp.float32)])
def test_lowers_for_tpu(window, segmented, dtype):
    heads, kv_heads, seq, d = 4, 2, 512, 128
    q = jax.ShapeDtypeStruct((heads, seq, d), dtype)
    kv = jax.ShapeDtypeStruct((kv_heads, seq, d), dtype)
    seg = jax.ShapeDtypeStruct((seq,), jnp.int32)

    def fwd(q, k, v, s):
        return splash.splash_attention(q, k, v, window=window,
                                       segment_ids=s if segmented else None,
                                       block_q=256, block_kv=128)

    grad = jax.grad(lambda *a: fwd(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    for fn, kernels in ((fwd, 1), (grad, 3)):  # forward; forward + dq + dkv
        exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(q, kv, kv, seg)
        assert exported.platforms == ("tpu",)
        assert exported.mlir_module().count("tpu_custom_call") == kernels


def test_lowers_for_tpu_with_default_blocks_at_7b_seq_under_vmap():
    # seq 8192, window 4096, default 2048-token tiles (4 x 4 compute chunks each), batch of 2
    # under vmap as the model calls it; 2 heads instead of 32 keeps the trace short.
    x = jax.ShapeDtypeStruct((2, 2, 8192, 128), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, 8192), jnp.int32)
    attend = jax.vmap(lambda q, k, v, s: splash.splash_attention(q, k, v, window=4096,
                                                                 segment_ids=s))
    grad = jax.grad(lambda *a: attend(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    exported = jax.export.export(jax.jit(grad), platforms=["tpu"])(x, x, x, seg)
    assert exported.mlir_module().count("tpu_custom_call") == 3


@pytest.mark.parametrize("seq", [192, 2176])
def test_model_dispatch_lowers_for_tpu_at_evaluation_lengths(seq, monkeypatch):
    # Lengths the evaluation code picks itself: Scorer's buckets of 64 (scoring.score_shape(150)
    # is 192, a 192-token tile Mosaic refused) and OLMo's in-loop rows, multiples of 128 up to
    # the context (a 2100-token query is 2176, not a multiple of 2048). On a TPU the dispatch
    # raised instead of lowering; now the kernel pads to whole tiles (splash.kernels).
    from olmo3 import attention, scoring
    assert seq in (scoring.score_shape(150)[0], 128 * -(-2100 // 128))
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    q = jax.ShapeDtypeStruct((4, seq, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, seq, 128), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((seq,), jnp.int32)
    attend = lambda q, k, v, s: attention.attention(q, k, v, window=100, segment_ids=s,
                                                    impl="splash")
    grad = jax.grad(lambda *a: attend(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    exported = jax.export.export(jax.jit(grad), platforms=["tpu"])(q, kv, kv, seg)
    assert exported.mlir_module().count("tpu_custom_call") == 3


def test_kernels_pad_any_seq_tpu_interpret():
    # splash.kernels at seq 200 with 128-lane tiles: queries padded to 256 and keys to 256;
    # forward and gradients equal the oracle on the real 200 rows (window, segments, GQA).
    seq, window = 200, 60
    seg = documents(seq, (70,))
    q, k, v, ct = random_qkv(4, 2, seq, 128, jnp.float32, seed=5)

    def kernel(q, k, v, *, window, segment_ids, block_q, block_kv, interpret):
        fwd, bwd = splash.kernels(4, 2, seq, 128, window=window, segmented=True, block_q=block_q,
                                  block_kv=block_kv, interpret=interpret)

        @jax.custom_vjp
        def attend(q, k, v):
            return fwd(q, k, v, segment_ids)[0]

        def attend_fwd(q, k, v):
            o, lse = fwd(q, k, v, segment_ids)
            return o, (q, k, v, o, lse)

        attend.defvjp(attend_fwd, lambda res, do: bwd(*res[:3], segment_ids, *res[3:], do))
        return attend(q, k, v)

    check_against_oracle(q, k, v, ct, window=window, segment_ids=seg, bq=128, bkv=128,
                         interpret=pltpu.InterpretParams(), kernel=kernel)


@pytest.mark.parametrize("kwargs,shape,match", [
    (dict(block_q=192), (2, 512, 128), r"block_q=192 must be a positive multiple of 128"),
    (dict(block_kv=64), (2, 512, 128), r"block_kv=64 must be a positive multiple of 128"),
    (dict(block_q=256), (2, 384, 128), r"seq=384 must be a multiple of block_q=256"),
    (dict(), (2, 256, 96), r"head_dim=96 must be a multiple of 128, or 64"),
    (dict(window=0), (2, 256, 128), r"window=0 must be >= 1"),
])
def test_bad_tpu_shapes_raise_before_lowering(kwargs, shape, match):
    q = jnp.zeros(shape, jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        splash.splash_attention(q, q, q, **{"block_q": 128, "block_kv": 128, **kwargs})


def test_bad_gqa_and_interpret_blocks_raise():
    q = jnp.zeros((3, 64, 16), jnp.float32)
    k = jnp.zeros((2, 64, 16), jnp.float32)
    with pytest.raises(ValueError, match=r"heads \(3\) must be a multiple of kv_heads \(2\)"):
        splash.splash_attention(q, k, k, interpret=True)
    with pytest.raises(ValueError, match=r"block_q=12 must be a positive multiple of 8"):
        splash.splash_attention(q, q, q, block_q=12, interpret=True)


# ---------------------------------------------------------------------------------------------
# The model with attention="splash" against attention="xla"
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel", ["gpu", pytest.param("tpu", marks=pytest.mark.slow)])
def test_model_splash_matches_xla(kernel, monkeypatch):
    # On CPU "splash" runs one of the two kernels in interpret mode (olmo3.attention): the
    # Triton kernel by default, the Mosaic one when asked.
    import olmo3
    from olmo3 import attention
    from olmo3.model import OLMo3

    monkeypatch.setattr(attention, "INTERPRETED_KERNEL", kernel)

    seq = 128   # window 48 < seq: sliding layers are windowed, the full layer is causal
    cfg = olmo3.Config.tiny(vocab_size=97, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16,
                            mlp_hidden=96, window=48, splash_block_q=32, splash_block_kv=64)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, seq), 0, 97)
    seg = jnp.stack([documents(seq, (40,)), documents(seq, ())])

    def loss_and_logits(model):
        logits = jax.vmap(lambda t, s: model(t, segment_ids=s))(tokens, seg)
        return jnp.mean(logits ** 2), logits

    results = {}
    for impl in ("xla", "splash"):
        model = OLMo3(cfg.replace(attention=impl), jax.random.PRNGKey(0))
        (_, logits), grads = eqx.filter_value_and_grad(loss_and_logits, has_aux=True)(model)
        results[impl] = (logits, grads)
    np.testing.assert_allclose(results["splash"][0], results["xla"][0], atol=1e-5, rtol=1e-5)
    got = jax.tree.leaves(eqx.filter(results["splash"][1], eqx.is_inexact_array))
    want = jax.tree.leaves(eqx.filter(results["xla"][1], eqx.is_inexact_array))
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-5 * max(np.abs(w).max(), 1e-30), rtol=1e-4)
