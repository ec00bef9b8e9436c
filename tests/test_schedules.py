"""Schedules vs a plain-Python transcription of OLMo-core's `optim/scheduler.py` get_lr,
evaluated at OLMo-core's 1-based global step n = step + 1, plus DESIGN §3 landmarks."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo3 import schedules as S


# --- oracle: OLMo-core get_lr(initial_lr, current, t_max), plain Python floats -------------
def cos_with_warmup(lr, n, warmup, t_max, alpha_f=0.1):
    eta_min = lr * alpha_f
    if n < warmup:
        return lr * min(n, warmup) / warmup
    if n >= t_max:
        return eta_min
    return eta_min + (lr - eta_min) * (1 + math.cos(math.pi * (n - warmup) / (t_max - warmup))) / 2


def half_cos_with_warmup(lr, n, warmup, t_max, alpha_f=0.1):
    eta_min = lr * alpha_f
    if n < warmup:
        return (eta_min + (lr - eta_min) / 2) * min(n, warmup) / warmup
    if n >= t_max:
        return eta_min
    cur, t = n - warmup, t_max - warmup
    cur += t
    t *= 2
    return eta_min + (lr - eta_min) * (1 + math.cos(math.pi * cur / t)) / 2


def linear_with_warmup(lr, n, warmup, t_max, alpha_f=0.0):
    eta_min = lr * alpha_f
    if n < warmup:
        return lr * min(n, warmup) / warmup
    if n >= t_max:
        return eta_min
    return lr - (lr - eta_min) * ((n - warmup) / (t_max - warmup))


def joined_oracle(step):
    """pretrain-1 (5T horizon) until its checkpoint step596047, then pretrain-2 (7T)."""
    n = step + 1
    batch = 8192 * 512
    first_total = math.ceil(5e12 / batch)            # trainer.max_steps for Duration.tokens(5e12)
    second_total = math.ceil(7e12 / batch)
    if n <= 596047:
        return cos_with_warmup(3e-4, n, 2000, first_total)
    return half_cos_with_warmup(3e-4, n, int(5e12) // batch // 2 + 2000 // 2, second_total)


def _vals(sched, steps):
    return np.asarray(jax.jit(jax.vmap(sched))(jnp.asarray(steps, jnp.int32)), np.float64)


def test_stage1_landmarks():
    f = S.stage1_schedule()
    assert float(f(1999)) == pytest.approx(3e-4, rel=1e-7)          # the 2000th step: peak
    assert float(f(S.STAGE1_TOTAL - 1)) == pytest.approx(3e-5, rel=1e-7)  # the last step
    assert float(f(0)) == pytest.approx(3e-4 / 2000, rel=1e-6)       # first step is never lr 0
    assert 3e-5 < float(f(S.STAGE1_TOTAL // 2)) < 3e-4


def test_stage1_matches_olmo_core():
    steps = [0, 1, 999, 1998, 1999, 2000, 2001, 10_000, 500_000, 1_000_000, 1_413_812,
             1_413_813, 1_413_814, 1_500_000]
    got = _vals(S.stage1_schedule(), steps)
    want = [cos_with_warmup(3e-4, s + 1, 2000, 1_413_814) for s in steps]
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-12)


@pytest.mark.parametrize("name,kw,peak,warmup,total", [
    ("stage2", dict(), S.STAGE2_PEAK, 0, 47_684),
    ("stage3", dict(warmup=200, total=12_000), S.STAGE2_PEAK, 200, 12_000),
])
def test_linear_matches_olmo_core(name, kw, peak, warmup, total):
    f = S.linear_schedule(**kw)
    steps = [0, 1, 198, 199, 200, 201, total // 3, total - 2, total - 1, total, total + 5]
    want = [linear_with_warmup(peak, s + 1, warmup, total) for s in steps]
    np.testing.assert_allclose(_vals(f, steps), want, rtol=2e-6, atol=1e-12)


def test_stage2_landmarks():
    f = S.linear_schedule(S.STAGE2_PEAK, 0, S.STAGE2_TOTAL)
    # First step: 2.0712e-4 to 4 digits (OLMo-core has already taken 1/47684 of the decay).
    assert float(f(0)) == pytest.approx(2.0712e-4, rel=1e-4)
    assert float(f(0)) == pytest.approx(S.STAGE2_PEAK * (1 - 1 / 47_684), rel=1e-6)
    assert float(f(S.STAGE2_TOTAL - 1)) == 0.0                        # the last step
    g = S.linear_schedule(S.STAGE2_PEAK, 200, 1000)                  # stage 3 shape
    assert float(g(199)) == pytest.approx(S.STAGE2_PEAK, rel=1e-7)


def test_joined_matches_olmo_core_and_is_continuous():
    f = S.stage1_schedule(total=S.STAGE1_JOINED_TOTAL, joined_at=S.STAGE1_JOINED_AT)
    steps = [0, 1999, 2000, 300_000, 596_045, 596_046, 596_047, 596_048, 597_044, 597_045,
             597_046, 900_000, 1_413_813, 1_668_929, 1_668_930, 1_700_000]
    np.testing.assert_allclose(_vals(f, steps), [joined_oracle(s) for s in steps],
                               rtol=2e-6, atol=1e-12)
    # Continuity at the join: the half cosine starts where the first cosine stood (<0.4% dip).
    a, b = float(f(596_046)), float(f(596_047))
    assert abs(b - a) / a < 4e-3
    assert float(f(1_413_813)) == pytest.approx(joined_oracle(1_413_813), rel=1e-6)
    assert 3.8e-5 < float(f(1_413_813)) < 4.0e-5  # AI2's stage 1 ended above 3e-5


def test_make_schedule_and_errors():
    np.testing.assert_allclose(float(S.make_schedule("linear", peak=1.0, warmup=0, total=10)(4)), 0.5)
    assert float(S.make_schedule("constant", peak=0.1)(7)) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="choose one of"):
        S.make_schedule("cosinus")
    with pytest.raises(ValueError, match="bad arguments"):
        S.make_schedule("linear", peek=1.0)
    with pytest.raises(ValueError, match="joined_at"):
        S.stage1_schedule(total=100, joined_at=200, first_total=150)


@pytest.mark.parametrize("warmup", [0, 1, 5])
def test_constant_matches_olmo_core_constant_with_warmup(warmup):
    """--schedule=constant honours --warmup_steps (it used to drop it): OLMo-core's own
    ConstantWithWarmup.get_lr at its 1-based step, warmup 0 being a plain constant."""
    scheduler = pytest.importorskip("olmo_core.optim.scheduler")
    f = jax.jit(S.constant_schedule(3e-4, warmup))
    for s in range(12):
        want = scheduler.ConstantWithWarmup(warmup=warmup).get_lr(3e-4, s + 1, 100) if warmup else 3e-4
        np.testing.assert_allclose(float(f(s)), want, rtol=1e-6)


@pytest.mark.parametrize("final_ratio,total", [(0.0, 100), (0.25, 100), (0.25, 10)])
def test_final_ratio_matches_olmo_core_alpha_f(final_ratio, total):
    """--final_lr_ratio (cosine; the recipe's 0.1 is what the other tests pin) and the linear
    schedule's floor, against OLMo-core's own CosWithWarmup / LinearWithWarmup(alpha_f). Total
    10 = the warmup: the last step is the floor, as OLMo-core has it, not the peak."""
    scheduler = pytest.importorskip("olmo_core.optim.scheduler")
    steps = [s for s in [0, 4, 8, 9, 10, 30, 60, 98, 99, 100, 120] if s <= total + 20]
    for ours, theirs in ((S.stage1_schedule(1e-3, 10, total, final_ratio), scheduler.CosWithWarmup),
                         (S.linear_schedule(1e-3, 10, total, final_ratio), scheduler.LinearWithWarmup)):
        want = [float(theirs(warmup=10, alpha_f=final_ratio).get_lr(1e-3, s + 1, total)) for s in steps]
        # atol 1e-8 * peak: at floor 0 the cosine's 1 + cos(pi * frac) cancels in float32 near the end
        np.testing.assert_allclose(_vals(ours, steps), want, rtol=2e-6, atol=1e-11)


def test_joined_with_odd_horizon_and_warmup_matches_olmo_core():
    """The second script's warmup W = first_total // 2 + warmup // 2, each halved on its own (as
    OLMo-core's long-context script computes it): with both odd, (first_total + warmup) // 2 is
    one step more, and the half cosine ~0.9% off."""
    scheduler = pytest.importorskip("olmo_core.optim.scheduler")
    f = S.stage1_schedule(1e-3, 11, 201, 0.1, joined_at=60, first_total=101)
    half = scheduler.HalfCosWithWarmup(warmup=101 // 2 + 11 // 2, alpha_f=0.1)
    steps = [60, 61, 100, 150, 200]
    np.testing.assert_allclose(_vals(f, steps), [float(half.get_lr(1e-3, s + 1, 201)) for s in steps], rtol=2e-6)


def test_joined_with_an_unchanged_horizon_is_one_cosine():
    """first_total == total (allowed): the second script's half cosine over [W, total], with
    W = total // 2 + warmup // 2, is the second half of the first cosine, so after the join's
    own warmup branch (steps joined_at..W-1, none here: joined_at > W) the joined schedule is the
    plain cosine, OLMo-core's CosWithWarmup throughout."""
    f = S.stage1_schedule(1e-3, 10, 100, 0.1, joined_at=60, first_total=100)
    steps = list(range(0, 110, 3)) + [58, 59, 60, 61, 99]
    np.testing.assert_allclose(_vals(f, steps), [cos_with_warmup(1e-3, s + 1, 10, 100) for s in steps],
                               rtol=2e-6, atol=1e-12)
