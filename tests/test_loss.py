"""Chunked cross entropy + z-loss (plain and fused-gradient) against a float64 numpy oracle."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo3.loss import EXP_SAFE, IGNORE, chunked_cross_entropy, column_norm_max

N, D, V = 37, 16, 53   # 37 tokens in chunks of 8: the last chunk is padded


def data(scale=1.0):
    rng = np.random.default_rng(0)
    h = (scale * rng.normal(size=(N, D))).astype(np.float32)
    w = rng.normal(size=(D, V)).astype(np.float32)
    labels = rng.integers(0, V, N).astype(np.int32)
    labels[5] = IGNORE
    weights = ((labels != IGNORE) & (rng.random(N) > 0.2)).astype(np.float32)
    return h, w, labels, weights


def oracle(h, w, labels, weights, c_ce, c_z):
    """Sums and the gradient of c_ce * CE + c_z * z wrt h and lm_head, in float64."""
    h, w, wt = h.astype(np.float64), w.astype(np.float64), weights.astype(np.float64)
    logits = h @ w
    m = logits.max(1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(1, keepdims=True)))[:, 0]
    rows, safe = np.arange(N), np.maximum(labels, 0)
    onehot = np.zeros_like(logits)
    onehot[rows, safe] = 1
    p = np.exp(logits - lse[:, None])
    dlogits = (wt * (c_ce + 2 * c_z * lse))[:, None] * p - c_ce * wt[:, None] * onehot
    ce = np.sum(wt * (lse - logits[rows, safe]))
    return ce, np.sum(wt * lse * lse), dlogits @ w.T, h.T @ dlogits


# scale 1: every chunk's logit bound is below EXP_SAFE, the softmax skips the row max; scale 8:
# logits up to ~100, above it, the row max is subtracted (olmo3/loss.py's module docstring).
@pytest.mark.parametrize("chunk", [8, 64])   # 5 chunks (the last padded); one chunk, no loop
@pytest.mark.parametrize("scale", [1.0, 8.0])
@pytest.mark.parametrize("z_loss", [None, 1e-5, 0.3])
@pytest.mark.parametrize("c_ce,c_z", [("step", "step"), (1.0, 0.0), (0.0, 1.0), (0.7, 0.21)])
def test_sums_and_gradients(z_loss, c_ce, c_z, scale, chunk):
    h, w, labels, weights = data(scale)
    bound = np.sqrt((h.astype(np.float64) ** 2).sum(1)).max() * float(column_norm_max(jnp.asarray(w)))
    assert (bound + np.log(V) < EXP_SAFE) == (scale == 1.0)   # both branches are exercised
    n = 31.0
    if c_ce == "step":   # what the train step differentiates: (ce + z_loss * z) / n
        zl = 1e-5 if z_loss is None else z_loss
        combine = lambda ce, z: (ce + zl * z) / n  # noqa: E731
        c_ce, c_z = 1 / n, zl / n
    else:                # any other cotangents: the fused path must fall back, still exact
        combine = lambda ce, z: c_ce * ce + c_z * z  # noqa: E731

    def f(h, w):
        ce, z = chunked_cross_entropy(h, w, jnp.asarray(labels), jnp.asarray(weights), chunk=chunk,
                                      z_loss=z_loss)
        return combine(ce, z), (ce, z)

    (_, (ce, z)), (gh, gw) = jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))(
        jnp.asarray(h), jnp.asarray(w))
    ce_ref, z_ref, gh_ref, gw_ref = oracle(h, w, labels, weights, c_ce, c_z)
    np.testing.assert_allclose(float(ce), ce_ref, rtol=1e-5)
    np.testing.assert_allclose(float(z), z_ref, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gh), gh_ref, rtol=1e-4, atol=1e-5 * np.abs(gh_ref).max())
    np.testing.assert_allclose(np.asarray(gw), gw_ref, rtol=1e-4, atol=1e-5 * np.abs(gw_ref).max())


@pytest.mark.parametrize("z_loss", [None, 0.3])
def test_gradient_wrt_weights(z_loss):
    """d(c_ce * CE + c_z * z)/d weights[i] = c_ce * (lse_i - logit_i[label]) + c_z * lse_i^2, from
    the float64 oracle's per-token terms (the fused custom_vjp returns it too; no caller of today
    differentiates the weights, a per-token loss weighting would)."""
    h, w, labels, weights = data()
    c_ce, c_z = 0.7, 0.21

    def f(wt):
        ce, z = chunked_cross_entropy(jnp.asarray(h), jnp.asarray(w), jnp.asarray(labels), wt,
                                      chunk=8, z_loss=z_loss)
        return c_ce * ce + c_z * z

    got = np.asarray(jax.jit(jax.grad(f))(jnp.asarray(weights)))
    logits = h.astype(np.float64) @ w.astype(np.float64)
    lse = np.log(np.exp(logits).sum(1))
    want = c_ce * (lse - logits[np.arange(N), np.maximum(labels, 0)]) + c_z * lse ** 2
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_one_large_row_takes_the_row_max():
    """A chunk of tiny hidden states but one whose largest logit is 150 (exp overflows float32):
    the logit bound uses the chunk's LARGEST |h_i|, so this chunk subtracts the row max and stays
    finite; a bound from the rows' mean square |h|^2 would skip the max and overflow."""
    h, w, labels, weights = data(scale=0.01)
    j = np.argmax((w.astype(np.float64) ** 2).sum(0))
    h[3] = w[:, j] * (150.0 / (w[:, j].astype(np.float64) ** 2).sum())   # logit 150 at label j
    sq = (h[:8].astype(np.float64) ** 2).sum(1)                            # the first chunk's rows
    cmax = float(column_norm_max(jnp.asarray(w)))
    assert np.sqrt(sq.max()) * cmax + np.log(V) > EXP_SAFE > np.sqrt(sq.mean()) * cmax + np.log(V)
    for z_loss in (None, 1e-5):
        def f(h, w):
            ce, z = chunked_cross_entropy(h, w, jnp.asarray(labels), jnp.asarray(weights), chunk=8,
                                          z_loss=z_loss)
            return ce + 1e-5 * z, (ce, z)

        (_, (ce, z)), (gh, gw) = jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))(
            jnp.asarray(h), jnp.asarray(w))
        ce_ref, z_ref, gh_ref, gw_ref = oracle(h, w, labels, weights, 1.0, 1e-5)
        np.testing.assert_allclose(float(ce), ce_ref, rtol=1e-5)
        np.testing.assert_allclose(float(z), z_ref, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(gh), gh_ref, rtol=1e-4, atol=1e-5 * np.abs(gh_ref).max())
        np.testing.assert_allclose(np.asarray(gw), gw_ref, rtol=1e-4, atol=1e-5 * np.abs(gw_ref).max())


def test_labels_without_label_mask_match_olmo_core():
    """Pretraining batches carry no label mask: labels are the next tokens and the last position
    has none (OLMo-core `get_labels`); a masked instance trains nothing and counts T positions."""
    torch = pytest.importorskip("torch")
    get_labels = pytest.importorskip("olmo_core.data.utils").get_labels
    from olmo3.loss import labels_and_weights
    tokens = np.random.default_rng(2).integers(0, 50, (3, 9)).astype(np.int32)
    keep = np.array([True, False, True])
    labels, weights, counted = labels_and_weights(jnp.asarray(tokens), jnp.asarray(keep))
    ref = get_labels({"input_ids": torch.tensor(tokens, dtype=torch.long)}).numpy()
    np.testing.assert_array_equal(np.asarray(labels), ref)
    np.testing.assert_array_equal(np.asarray(weights), (ref != IGNORE) & keep[:, None])
    np.testing.assert_array_equal(np.asarray(counted), np.where(keep[:, None], ref != IGNORE, 1.0))
