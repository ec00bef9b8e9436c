"""olmo3.attention's banded sliding-window path against the dense oracle of test_splash.py
(materialized [seq, seq] mask written from the mask definition alone), values and gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo3 import attention
from test_splash import documents, oracle, random_qkv

# (heads, kv_heads, seq, head_dim, window, segment lengths)
CASES = [
    (2, 2, 512, 16, 128, None),        # the CPU benchmark's shape class: 4 whole blocks
    (6, 2, 300, 8, 64, (40, 170)),     # GQA, seq not a multiple of the window, 3 documents
    (4, 1, 77, 8, 16, (5,)),           # MQA, ragged last block, a 5-token first document
    (2, 2, 96, 8, 1, None),            # window 1: each query sees only itself
]


@pytest.mark.parametrize("heads,kv_heads,seq,head_dim,window,lengths", CASES)
def test_local_attention_matches_dense_oracle(heads, kv_heads, seq, head_dim, window, lengths):
    seg = None if lengths is None else documents(seq, lengths)
    q, k, v, ct = random_qkv(heads, kv_heads, seq, head_dim, jnp.float32, seed=seq)
    ours = lambda q, k, v: attention.local_attention(q, k, v, window=window, segment_ids=seg)
    ref = lambda q, k, v: oracle(q, k, v, window, seg)
    np.testing.assert_allclose(ours(q, k, v), ref(q, k, v), atol=2e-6, rtol=0)
    loss = lambda fn: (lambda q, k, v: jnp.sum(fn(q, k, v) * ct))
    for name, g, w in zip("qkv", jax.grad(loss(ours), argnums=(0, 1, 2))(q, k, v),
                          jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(g, w, atol=2e-5 * np.abs(w).max(), rtol=0, err_msg=f"d{name}")


def test_xla_dispatch_uses_blocks_only_past_two_windows(monkeypatch):
    calls = []
    real = attention.local_attention
    monkeypatch.setattr(attention, "local_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, _ = random_qkv(2, 2, 64, 8, jnp.float32)
    for window, banded in ((16, True), (32, False), (None, False)):
        calls.clear()
        out = attention.attention(q, k, v, window=window, segment_ids=None, impl="xla")
        assert bool(calls) == banded, window
        np.testing.assert_allclose(out, oracle(q, k, v, window), atol=2e-6, rtol=0)


@pytest.mark.parametrize("window", [None, 1, 16])
def test_cudnn_call_means_our_mask(window, monkeypatch):
    """impl="cudnn" without documents is jax.nn.dot_product_attention(implementation="cudnn"),
    which needs a GPU; its arguments (causal, local_window_size) are held to the dense oracle
    through JAX's own XLA implementation of the same call, which any backend runs."""
    real = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention",
                        lambda *a, implementation, **kw: real(*a, implementation="xla", **kw))
    q, k, v, _ = random_qkv(4, 2, 48, 8, jnp.float32, seed=3)
    out = attention.attention(q, k, v, window=window, segment_ids=None, impl="cudnn")
    np.testing.assert_allclose(out, oracle(q, k, v, window), atol=2e-6, rtol=0)


@pytest.mark.parametrize("impl,platform,tiles,refused,fix", [
    ("cudnn", "gpu", (), False, None), ("cudnn", "cpu", (), True, "--attention=xla"),
    ("cudnn", "tpu", (), True, "--attention=xla"), ("splash", "cpu", (), False, None),
    ("splash", "tpu", ("splash_block_q",), False, None),
    ("xla", "tpu", ("splash_block_q",), True, "add --attention=splash"),
    ("splash", "gpu", ("splash_block_kv",), True, "drop --splash_block_kv"),
    ("splash", "cpu", ("splash_block_q", "splash_block_kv"), True, "drop --splash_block_q"),
])
def test_unusable_here_names_the_flag_and_the_fix(impl, platform, tiles, refused, fix):
    """The platform checks train.py, eval.py and bench.py make before building a model: cuDNN on
    NVIDIA GPUs only, the Mosaic tiles only where the Mosaic kernel runs (a TPU with splash)."""
    problem = attention.unusable_here(impl, platform, tiles)
    assert (problem is not None) == refused, problem
    if refused:
        assert fix in problem and f"--attention={impl}" in problem, problem


@pytest.mark.parametrize("seq, window", [(48, 32), (96, 16)])   # one block (reference_attention); blocks
def test_bf16_attention_takes_its_softmax_in_fp32(seq, window):
    """bf16 q, k, v through --attention=xla against a float64 oracle of what the module documents:
    fp32 scores and softmax, the probabilities rounded to bf16 for the second matmul, fp32
    accumulation. A softmax of bf16 scores left half the outputs more than one bf16 ulp off (0.50 of
    them, mean relative error 0.0043); the documented path leaves 1 in 10^4 (0.0014). The model's
    bf16 parity test (KL < 5e-3 against transformers) did not see it."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(0, 1.5, (h, seq, 64)), jnp.bfloat16) for h in (4, 2, 2))
    ours = np.asarray(attention.attention(q, k, v, window=window, segment_ids=None, impl="xla"), np.float64)
    qf, kf, vf = np.asarray(q, np.float64), *(np.repeat(np.asarray(x, np.float64), 2, 0) for x in (k, v))
    s = np.einsum("hqd,hkd->hqk", qf, kf) / 8.0
    i, j = np.arange(seq)[:, None], np.arange(seq)[None]
    s = np.where((j <= i) & (i - j < window), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = np.asarray(jnp.asarray((p / p.sum(-1, keepdims=True)).astype(np.float32)).astype(jnp.bfloat16), np.float64)
    want = np.einsum("hqk,hkd->hqd", p, vf)
    err = np.abs(ours - want)
    assert (err > np.abs(want) * 2.0 ** -8).mean() < 1e-3
    assert err.mean() / np.abs(want).mean() < 2e-3
