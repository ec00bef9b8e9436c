"""Skip-step AdamW vs a plain-numpy (float64) re-implementation of OLMo-core's SkipStepAdamW:
`optim/skip_step_optimizer.py` (lists capped at 129, decide once len >= 64, mean/std(ddof=1) over
all but the latest) and `optim/adamw.py::adamw_step` (decoupled decay times lr, step += factor),
with torch-style grad clipping."""
from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo3.optim import OptState, SkipStepAdamW, global_norm, no_decay_on
from olmo3.schedules import linear_schedule


class Tiny(eqx.Module):
    embed: jax.Array
    w: jax.Array
    norm: jax.Array
    buf: jax.Array                  # int array: not a parameter
    act: Callable = jax.nn.relu     # non-array leaf
    n: int = eqx.field(static=True, default=3)


def tiny(dtype=jnp.float32, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return Tiny(embed=jax.random.normal(k1, (5, 4), dtype), w=jax.random.normal(k2, (4, 3), dtype),
                norm=jnp.ones((3,), dtype), buf=jnp.arange(3))


NAMES = ("embed", "w", "norm")
MASK = {"embed": 0.0, "w": 1.0, "norm": 1.0}      # embedding not decayed, norms decayed


class NumpySkipStepAdamW:
    """OLMo-core semantics, float64, dict of named arrays."""

    def __init__(self, params, lr_fn, wd=0.1, b1=0.9, b2=0.95, eps=1e-8, max_norm=1.0,
                 interval=128, sigma=6):
        self.p = {k: np.asarray(v, np.float64) for k, v in params.items()}
        self.m = {k: np.zeros_like(v) for k, v in self.p.items()}
        self.v = {k: np.zeros_like(v) for k, v in self.p.items()}
        self.step_t = 0.0           # OLMo-core per-param state["step"]
        self.global_step = 0
        self.losses, self.norms = [], []
        self.lr_fn, self.wd, self.b1, self.b2, self.eps = lr_fn, wd, b1, b2, eps
        self.max_norm, self.interval, self.sigma = max_norm, interval, sigma

    def step(self, grads, loss):
        g = {k: np.asarray(v, np.float64) for k, v in grads.items()}
        norm = np.sqrt(sum(np.sum(x * x) for x in g.values()))
        coef = min(1.0, self.max_norm / (norm + 1e-6))
        g = {k: x * coef for k, x in g.items()}
        self.losses.append(loss)
        self.norms.append(norm)
        self.losses = self.losses[-(self.interval + 1):]
        self.norms = self.norms[-(self.interval + 1):]
        factor = 1.0
        if len(self.losses) >= max(2, self.interval // 2):
            lp, gp = np.array(self.losses[:-1]), np.array(self.norms[:-1])
            ok = (loss - lp.mean() <= self.sigma * lp.std(ddof=1)
                  and norm - gp.mean() <= self.sigma * gp.std(ddof=1))
            factor = 1.0 if ok else 0.0
        lr = self.lr_fn(self.global_step)
        self.global_step += 1
        for k in self.p:
            self.p[k] *= 1 - factor * lr * self.wd * MASK[k]
            self.m[k] += factor * (1 - self.b1) * (g[k] - self.m[k])
            self.v[k] = self.v[k] * (1 - factor * (1 - self.b2)) + factor * (1 - self.b2) * g[k] ** 2
            bc1 = 1 - self.b1 ** (self.step_t + 1)
            bc2 = 1 - self.b2 ** (self.step_t + 1)
            denom = np.sqrt(self.v[k]) / np.sqrt(bc2) + self.eps
            self.p[k] += factor * (-lr / bc1) * self.m[k] / denom
        self.step_t += factor
        return factor == 0.0, norm


def named(tree):
    return {k: getattr(tree, k) for k in NAMES}


def make_opt(**kw):
    return SkipStepAdamW(linear_schedule(peak=1e-2, warmup=10, total=400),
                         decay_mask=no_decay_on(lambda m: m.embed), **kw)


def scripted(T=230, seed=1):
    """Loss/grad-norm sequences with spikes before and after the window fills."""
    rng = np.random.default_rng(seed)
    loss = 3.0 - 0.002 * np.arange(T) + 0.02 * rng.standard_normal(T)
    gnorm = 0.8 + 0.05 * rng.standard_normal(T)
    loss[20] += 2.0      # before 64 values: cannot be skipped
    gnorm[40] *= 6.0     # before 64 values: cannot be skipped (and gets clipped)
    loss[62] += 2.0      # the 63rd value: len(_losses) = 63 < 64, not skipped
    loss[63] += 6.0      # the 64th value: first step that can be skipped
    loss[100] += 8.0     # loss spike
    gnorm[150] *= 5.0    # grad-norm spike alone
    loss[199] = -5.0     # a DROP is never skipped (one-sided test)
    loss[220] += 1.0; gnorm[220] *= 4.0
    return loss, gnorm, rng


def test_skip_step_and_adamw_match_numpy_oracle():
    loss, gnorm, rng = scripted()
    model = tiny()
    opt = make_opt()
    state = opt.init(model)
    ref = NumpySkipStepAdamW(named(model), lambda s: float(linear_schedule(1e-2, 10, 400)(s)))
    upd = eqx.filter_jit(opt.update)
    skipped = []
    for t in range(len(loss)):
        d = {k: rng.standard_normal(getattr(model, k).shape) for k in NAMES}
        scale = gnorm[t] / np.sqrt(sum(np.sum(x * x) for x in d.values()))
        grads = Tiny(**{k: jnp.asarray(d[k] * scale, jnp.float32) for k in NAMES},
                     buf=jnp.zeros(3, jnp.int32))
        before = (model, state)
        model, state, met = upd(grads, state, model, jnp.float32(loss[t]))
        ref_skip, ref_norm = ref.step({k: np.asarray(getattr(grads, k)) for k in NAMES}, float(loss[t]))
        assert bool(met["optim/step_skipped"]) == ref_skip, t
        np.testing.assert_allclose(float(met["optim/grad_norm"]), ref_norm, rtol=1e-5)
        if ref_skip:
            skipped.append(t)
            # A skipped step changes neither params nor moments nor the Adam count...
            for a, b in zip(jax.tree.leaves(before[0]), jax.tree.leaves(model)):
                assert np.array_equal(np.asarray(a), np.asarray(b))
            for f in ("mu", "nu", "count"):
                for a, b in zip(jax.tree.leaves(getattr(before[1], f)),
                                jax.tree.leaves(getattr(state, f))):
                    assert np.array_equal(np.asarray(a), np.asarray(b)), f
        # ...but the schedule step and the windows always advance.
        assert int(state.step) == t + 1 and int(state.n_seen) == t + 1
    assert skipped == [63, 100, 150, 220]
    assert int(state.count) == len(loss) - len(skipped)
    for k in NAMES:
        np.testing.assert_allclose(np.asarray(getattr(model, k)), ref.p[k], rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(np.asarray(getattr(state.mu, k)), ref.m[k], rtol=2e-5, atol=1e-7)
        np.testing.assert_allclose(np.asarray(getattr(state.nu, k)), ref.v[k], rtol=2e-5, atol=1e-9)
    assert np.array_equal(np.asarray(model.buf), np.arange(3)) and model.act is jax.nn.relu


def test_weight_decay_mask_and_lr_coupling():
    """Zero gradients: Adam's update is 0, so p -> p * (1 - lr * wd) except the embedding."""
    model = tiny()
    opt = SkipStepAdamW(lambda s: jnp.float32(0.5), weight_decay=0.1,
                        decay_mask=no_decay_on(lambda m: m.embed))
    zeros = jax.tree.map(lambda x: jnp.zeros_like(x) if eqx.is_inexact_array(x) else x, model)
    new, _, met = opt.update(zeros, opt.init(model), model, jnp.float32(1.0))
    np.testing.assert_array_equal(np.asarray(new.embed), np.asarray(model.embed))
    for k in ("w", "norm"):
        np.testing.assert_allclose(np.asarray(getattr(new, k)),
                                   np.asarray(getattr(model, k)) * (1 - 0.5 * 0.1), rtol=1e-6)
    assert float(met["optim/lr"]) == 0.5


def test_fp32_moments_with_bf16_params():
    model = tiny(jnp.bfloat16)
    opt = make_opt()
    state = opt.init(model)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves((state.mu, state.nu)))
    g = jax.tree.map(lambda x: (x * 1.37 + 0.001).astype(jnp.bfloat16) if eqx.is_inexact_array(x)
                     else x, model)
    new, state, _ = eqx.filter_jit(opt.update)(g, state, model, jnp.float32(2.0))
    assert all(getattr(new, k).dtype == jnp.bfloat16 for k in NAMES)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves((state.mu, state.nu)))
    gn = float(np.sqrt(sum(np.sum(np.asarray(getattr(g, k), np.float64) ** 2) for k in NAMES)))
    c = min(1.0, 1.0 / (gn + 1e-6))
    for k in NAMES:
        g64 = np.asarray(getattr(g, k), np.float64) * c
        # bf16 moments would be off by ~4e-3 relative; fp32 ones match to 1e-6.
        np.testing.assert_allclose(np.asarray(getattr(state.mu, k)), 0.1 * g64, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(getattr(state.nu, k)), 0.05 * g64 ** 2, rtol=1e-6)


def test_global_norm_matches_float64_over_large_leaves():
    """The clip factor and the skip-step test read this norm. Leaves shaped like a 100k vocabulary's
    lm_head and stacked layers, of one sign after squaring, so a long fp32 running sum drifts (on
    jaxlib 0.8.1-0.10.1 a flat jnp.vdot per leaf came out 7% low here); odd sizes and a scalar too."""
    rng = np.random.default_rng(0)
    shapes = [(512, 100278), (8, 512, 1536), (8, 1536, 512), (8, 512), (7, 3), ()]
    leaves = [(rng.standard_normal(s) * (1e-3 + rng.random(s))).astype(np.float32) for s in shapes]
    tree = {"w": [jnp.asarray(x) for x in leaves], "bf16": jnp.asarray(leaves[3], jnp.bfloat16),
            "ints": jnp.arange(5)}
    want = np.sqrt(sum((x.astype(np.float64) ** 2).sum() for x in leaves)
                   + (np.asarray(tree["bf16"], np.float64) ** 2).sum())
    assert float(jax.jit(global_norm)(tree)) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("norm,clipped,max_norm", [(10.0, True, 1.0), (0.5, False, 1.0), (2e-6, True, 1e-6)])
def test_clip(norm, clipped, max_norm):
    # max_norm 1e-6: torch's factor max / (norm + 1e-6) is 1/3 there, max / norm would be 1/2
    model = tiny()
    opt = make_opt(max_grad_norm=max_norm)
    d = jax.tree.map(lambda x: jnp.ones_like(x) if eqx.is_inexact_array(x) else x, model)
    n0 = float(global_norm(eqx.filter(d, eqx.is_inexact_array)))
    g = jax.tree.map(lambda x: x * (norm / n0) if eqx.is_inexact_array(x) else x, d)
    _, state, met = opt.update(g, opt.init(model), model, jnp.float32(1.0))
    assert float(met["optim/grad_norm"]) == pytest.approx(norm, rel=1e-6)   # pre-clip
    assert bool(met["optim/clipped"]) == clipped
    want_g = (norm / n0) * (max_norm / (norm + 1e-6) if clipped else 1.0)   # torch clip_grad_norm_
    np.testing.assert_allclose(np.asarray(state.mu.w), 0.1 * want_g, rtol=1e-6)


def test_nonfinite_is_skipped_even_early():
    model = tiny()
    opt = make_opt()
    g = jax.tree.map(lambda x: jnp.ones_like(x) if eqx.is_inexact_array(x) else x, model)
    new, state, met = opt.update(g, opt.init(model), model, jnp.float32(np.nan))
    assert float(met["optim/step_skipped"]) == 1.0 and int(state.count) == 0
    np.testing.assert_array_equal(np.asarray(new.w), np.asarray(model.w))


def test_warm_start_keeps_moments_resets_step_and_window():
    model = tiny()
    opt = make_opt()
    state = opt.init(model)
    g = jax.tree.map(lambda x: jnp.full_like(x, 0.1) if eqx.is_inexact_array(x) else x, model)
    for i in range(5):
        model, state, _ = opt.update(g, state, model, jnp.float32(3.0 + i))
    warm = opt.warm_start(state)
    assert int(warm.step) == 0 and int(warm.n_seen) == 0
    assert not np.any(np.asarray(warm.loss_window)) and not np.any(np.asarray(warm.gnorm_window))
    assert int(warm.count) == 5
    for a, b in zip(jax.tree.leaves((state.mu, state.nu)), jax.tree.leaves((warm.mu, warm.nu))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert isinstance(warm, OptState)


def test_bad_decay_mask_is_a_clear_error():
    model = tiny()
    opt = SkipStepAdamW(lambda s: jnp.float32(0.1), decay_mask={"embed": False})
    with pytest.raises(ValueError, match="decay_mask"):
        opt.update(model, opt.init(model), model, jnp.float32(1.0))


@pytest.mark.parametrize("z,skipped", [(6.0 * 1.004, False), (6.0 * 1.012, True)])
def test_threshold_uses_bessel_std_of_previous_values(z, skipped):
    """63 previous values, then one at z population-stds above their mean: Bessel's std is
    sqrt(63/62) = 1.008x larger, so 6.024 sigma_pop is kept and 6.072 sigma_pop is skipped."""
    rng = np.random.default_rng(3)
    prev = 3.0 + 0.1 * rng.standard_normal(63)
    losses = list(prev) + [prev.mean() + z * prev.std(ddof=0)]
    model, opt = tiny(), make_opt()
    state = opt.init(model)
    g = jax.tree.map(lambda x: jnp.full_like(x, 0.01) if eqx.is_inexact_array(x) else x, model)
    upd = eqx.filter_jit(opt.update)
    for loss in losses:                 # constant grad norm: only the loss can trigger
        model, state, met = upd(g, state, model, jnp.float32(loss))
    assert bool(met["optim/step_skipped"]) == skipped


@pytest.mark.parametrize("norm_scale", [1.0, 2.5])
def test_matches_olmo_core_skip_step_adamw(norm_scale):
    """Against OLMo-core itself: `SkipStepAdamW` (foreach, as SkipStepAdamWConfig builds it) driven
    the way its TransformerTrainModule drives it: latest_loss, total norm + clip_grads_with_norm_
    at 1.0, latest_grad_norm, lr set on every group, step(). Embedding group at weight decay 0.
    Same skip decision on every step (spikes before and after the window fills, a window that
    wraps, a NaN loss at the end), then the same params, moments and Adam step counts. At 2.5x
    the norms (~2, every step clipped) the window must hold the norms before clipping, as
    OLMo-core's latest_grad_norm: a window of clipped 1.0s had no spread and went unseen at 0.8."""
    torch = pytest.importorskip("torch")
    oc_optim = pytest.importorskip("olmo_core.optim")
    loss, gnorm, rng = scripted()
    gnorm = gnorm * norm_scale
    loss[225] = np.nan              # skipped by both; the NaN then fills both windows' statistics
    sched = linear_schedule(peak=1e-2, warmup=10, total=400)
    model = tiny()
    tp = {k: torch.nn.Parameter(torch.tensor(np.asarray(getattr(model, k)))) for k in NAMES}
    ref = oc_optim.SkipStepAdamW([{"params": [tp["embed"]], "weight_decay": 0.0},
                                  {"params": [tp["w"], tp["norm"]]}],
                                 betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                 rolling_interval_length=128, sigma_factor=6, foreach=True)
    opt = make_opt()
    state = opt.init(model)
    upd = eqx.filter_jit(opt.update)
    skipped = []
    for t in range(len(loss)):
        d = {k: rng.standard_normal(getattr(model, k).shape) for k in NAMES}
        scale = gnorm[t] / np.sqrt(sum(np.sum(x * x) for x in d.values()))
        g = {k: (d[k] * scale).astype(np.float32) for k in NAMES}
        for k in NAMES:
            tp[k].grad = torch.tensor(g[k])
        ref.latest_loss = torch.tensor(np.float32(loss[t]))
        total = torch.nn.utils.get_total_norm([p.grad for p in tp.values()], 2.0)
        torch.nn.utils.clip_grads_with_norm_(list(tp.values()), 1.0, total)
        ref.latest_grad_norm = total
        for group in ref.param_groups:
            group["lr"] = float(sched(t))
        ref.step()
        grads = Tiny(**{k: jnp.asarray(g[k]) for k in NAMES}, buf=jnp.zeros(3, jnp.int32))
        model, state, met = upd(grads, state, model, jnp.float32(loss[t]))
        assert float(met["optim/step_skipped"]) == float(ref.step_skipped), t
        assert float(met["optim/grad_norm"]) == pytest.approx(float(total), rel=1e-5)
        skipped += [t] if float(ref.step_skipped) else []
    assert skipped[:4] == [63, 100, 150, 220] and skipped[4:] == list(range(225, 230))
    for k in NAMES:
        st = ref.state[tp[k]]
        assert float(st["step"]) == int(state.count) == len(loss) - len(skipped)
        np.testing.assert_allclose(np.asarray(getattr(model, k)), tp[k].detach().numpy(),
                                   rtol=1e-5, atol=5e-6)
        np.testing.assert_allclose(np.asarray(getattr(state.mu, k)), st["exp_avg"].numpy(),
                                   rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(np.asarray(getattr(state.nu, k)), st["exp_avg_sq"].numpy(),
                                   rtol=1e-5, atol=1e-9)


def test_eps_is_added_to_sqrt_of_second_moment_as_torch_adamw():
    """Gradients of 1e-9..1e-7, where sqrt(v) is of the order of eps: torch.optim.AdamW's
    p -= lr * mhat / (sqrt(vhat) + eps) (eps outside the square root) over 3 steps, weight decay
    on every leaf. eps inside the root (optax's eps_root) would move these updates ~1000x."""
    torch = pytest.importorskip("torch")
    model = tiny()
    rng = np.random.default_rng(5)
    opt = SkipStepAdamW(lambda s: jnp.float32(1e-2), weight_decay=0.1)
    tp = {k: torch.nn.Parameter(torch.tensor(np.asarray(getattr(model, k)), dtype=torch.float64))
          for k in NAMES}
    ref = torch.optim.AdamW(list(tp.values()), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    state = opt.init(model)
    for _ in range(3):
        g = {k: rng.standard_normal(getattr(model, k).shape) * 10.0 ** rng.uniform(-9, -7)
             for k in NAMES}
        for k in NAMES:
            tp[k].grad = torch.tensor(g[k].astype(np.float32), dtype=torch.float64)
        ref.step()
        grads = Tiny(**{k: jnp.asarray(g[k], jnp.float32) for k in NAMES}, buf=jnp.zeros(3, jnp.int32))
        model, state, met = opt.update(grads, state, model, jnp.float32(1.0))
        assert float(met["optim/step_skipped"]) == 0.0
    for k in NAMES:
        np.testing.assert_allclose(np.asarray(getattr(model, k)), tp[k].detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # the oracle's std of one value: NaN
@pytest.mark.parametrize("window", [2, 3, 4, 5])
def test_small_window_skip_decisions_match_numpy_oracle(window):
    """Tight windows and sigma 1, so that most decisions hinge on every previous value: the
    statistics use exactly the last `window` values (OLMo-core's lists hold window + 1, the latest
    excluded), decisions start at max(2, window // 2) values, and a window of identical values
    keeps a step at the same value (loss - mean = 0 <= sigma * std = 0: not skipped). Windows 2
    and 3 decide from the second value on, over ONE previous value, whose Bessel std is NaN:
    OLMo-core (torch.std_mean) then skips the step whatever the loss."""
    T = 30
    rng = np.random.default_rng(window)
    loss = 3.0 + 0.3 * rng.standard_normal(T)
    gnorm = 0.5 + 0.1 * rng.standard_normal(T)
    loss[-8:], gnorm[-8:] = 2.0, 0.5          # an exact tie: 2.0 and sqrt(0.5**2) = 0.5
    model = tiny()
    sched = lambda s: 1e-3  # noqa: E731
    opt = SkipStepAdamW(lambda s: jnp.float32(1e-3), decay_mask=no_decay_on(lambda m: m.embed),
                        window=window, sigma=1.0)
    ref = NumpySkipStepAdamW(named(model), sched, interval=window, sigma=1.0)
    state = opt.init(model)
    upd = eqx.filter_jit(opt.update)
    got, want = [], []
    for t in range(T):
        g = {k: np.zeros(getattr(model, k).shape, np.float32) for k in NAMES}
        g["w"][0, 0] = gnorm[t]
        if t < T - 8:                         # spread it out, same norm
            g = {k: rng.standard_normal(getattr(model, k).shape) for k in NAMES}
            scale = gnorm[t] / np.sqrt(sum(np.sum(x * x) for x in g.values()))
            g = {k: (x * scale).astype(np.float32) for k, x in g.items()}
        grads = Tiny(**{k: jnp.asarray(g[k]) for k in NAMES}, buf=jnp.zeros(3, jnp.int32))
        model, state, met = upd(grads, state, model, jnp.float32(loss[t]))
        got.append(bool(met["optim/step_skipped"]))
        want.append(ref.step({k: np.asarray(g[k]) for k in NAMES}, float(np.float32(loss[t])))[0])
    assert got == want
    assert 0 < sum(want) < T - 8 and not any(want[-4:])      # both outcomes; ties kept
