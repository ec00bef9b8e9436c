"""Learning-rate schedules of the three OLMo 3 stages, as pure functions `step -> lr`.

Step convention (the whole codebase): a schedule is called with `step` = the number of
optimizer steps already done (0-based, what optax passes and what `OptState.step` holds) and
returns the lr of the step about to run. OLMo-core's trainer increments `global_step` BEFORE it
sets the lr (`train/trainer.py::_fit_epoch`, then `scheduler.set_lr(..., trainer.global_step)` in
`train_module.optim_step`), so its formulas see the 1-based step number n = step + 1. We evaluate
OLMo-core's formulas at n = step + 1, which makes our lr equal to AI2's on every step:

    stage 1: step 1999 (the 2000th step, labelled 2000) has lr 3e-4 exactly; the first step has
             3e-4/2000 (never 0); the last step (labelled 1,413,814) has 3e-5 exactly.
    stage 2: the first step has 2.0712e-4 * (1 - 1/47684) = 2.07119e-4, the last step 0 exactly.
    stage 3: 200-step warmup to 2.0712e-4, then linear to 0.

Schedules are jnp-traceable (the step may be a traced int32), so they run inside the jitted
train step and work as optax schedules.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Union

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

Step = Union[int, Int[Array, ""]]
Schedule = Callable[[Step], Float[Array, ""]]

# OLMo-core `OLMo-3-1025-7B-pretrain-1.py`: LR = 3e-4, CosWithWarmup(warmup_steps=2000), alpha_f 0.1.
STAGE1_PEAK = 3e-4
STAGE1_WARMUP = 2000
STAGE1_TOTAL = 1_413_814          # one epoch of OLMo-mix-0625 at 512 x 8192 (the stage-2 load path is step1413814)
# pretrain-1 was scheduled for 5T tokens: trainer.max_steps = ceil(5e12 / 4_194_304).
STAGE1_FIRST_TOTAL = 1_192_093
# pretrain-2 loads `step596047` and extends the horizon to 7T tokens: ceil(7e12 / 4_194_304).
STAGE1_JOINED_AT = 596_047
STAGE1_JOINED_TOTAL = 1_668_931
# `OLMo-3-1025-7B-midtrain.py` / `-long-context.py`: LR, LinearWithWarmup(warmup=0 / 200, alpha_f=0.0).
STAGE2_PEAK = 0.00020712352850360292
STAGE2_TOTAL = 47_684
STAGE3_WARMUP = 200


def _n(step: Step) -> Array:
    """OLMo-core's 1-based global step n = step + 1, as float32 (exact below 2^24 steps)."""
    return jnp.asarray(step, jnp.int32).astype(jnp.float32) + 1.0


def _cosine(n, peak, warmup, total, final_ratio):
    """OLMo-core `CosWithWarmup.get_lr` (optim/scheduler.py) at 1-based step n."""
    eta_min = peak * final_ratio
    warm = peak * jnp.minimum(n, warmup) / max(warmup, 1)
    frac = (n - warmup) / max(total - warmup, 1)
    cos = eta_min + (peak - eta_min) * (1.0 + jnp.cos(math.pi * frac)) / 2.0
    return jnp.where(n < warmup, warm, jnp.where(n >= total, eta_min, cos))


def _half_cosine(n, peak, warmup, total, final_ratio):
    """OLMo-core `HalfCosWithWarmup.get_lr`: warm up to the cosine's midpoint over `warmup`
    steps, then the second half of a cosine over the remaining `total - warmup` steps."""
    eta_min = peak * final_ratio
    mid = eta_min + (peak - eta_min) / 2.0
    warm = mid * jnp.minimum(n, warmup) / max(warmup, 1)
    span = total - warmup
    frac = (n - warmup + span) / (2.0 * span)
    cos = eta_min + (peak - eta_min) * (1.0 + jnp.cos(math.pi * frac)) / 2.0
    return jnp.where(n < warmup, warm, jnp.where(n >= total, eta_min, cos))


def stage1_schedule(peak: float = STAGE1_PEAK, warmup: int = STAGE1_WARMUP,
                    total: int = STAGE1_TOTAL, final_ratio: float = 0.1,
                    joined_at: Optional[int] = None,
                    first_total: int = STAGE1_FIRST_TOTAL) -> Schedule:
    """Linear warmup to `peak`, then cosine to `final_ratio * peak` at step `total`.

    With `joined_at=None` this is one cosine over `total` steps (the accepted simplification).

    With `joined_at` set, it is AI2's joined schedule: OLMo-core `OLMo-3-1025-7B-pretrain-1.py`
    ran CosWithWarmup(2000) over a 5T-token horizon (`first_total` steps) and was stopped; its
    checkpoint after `joined_at` steps was resumed by `OLMo-3-1025-7B-pretrain-2.py` with a 7T
    horizon (`total` steps) and HalfCosWithWarmup(warmup = 5e12 // batch // 2 + 2000 // 2), a
    half cosine that starts at the midpoint lr (peak + eta_min) / 2, i.e. where the first cosine
    stood. Faithful values: total=1_668_931, joined_at=596_047 (the run then stops at 1,413,814
    steps, the end of the data epoch, at lr ~3.9e-5). The half cosine's own "warmup" branch
    covers steps 596,048..597,045, a <0.4% lr dip that AI2's run had too; we reproduce it.
    """
    if joined_at is None:
        return lambda step: _cosine(_n(step), peak, warmup, total, final_ratio)
    if not 0 < joined_at < first_total <= total:
        raise ValueError(f"joined schedule needs 0 < joined_at ({joined_at}) < first_total "
                         f"({first_total}) <= total ({total})")
    second_warmup = first_total // 2 + warmup // 2   # pretrain-2.py: original_max_steps // 2 + 2000 // 2

    def schedule(step):
        n = _n(step)
        first = _cosine(n, peak, warmup, first_total, final_ratio)
        second = _half_cosine(n, peak, second_warmup, total, final_ratio)
        return jnp.where(n <= joined_at, first, second)
    return schedule


def linear_schedule(peak: float = STAGE2_PEAK, warmup: int = 0, total: int = STAGE2_TOTAL,
                    final_ratio: float = 0.0) -> Schedule:
    """Linear warmup over `warmup` steps, then linear decay to `final_ratio * peak` at `total`.

    OLMo-core `LinearWithWarmup` (alpha_f=0.0 in the midtrain and long-context scripts).
    Stage 2: linear_schedule(2.0712e-4, 0, 47_684); stage 3: warmup=200.
    """
    eta_min = peak * final_ratio

    def schedule(step):
        n = _n(step)
        warm = peak * jnp.minimum(n, warmup) / max(warmup, 1)
        # From the end, (total - n) exact in fp32: no cancellation near lr 0.
        lin = eta_min + (peak - eta_min) * (total - n) / max(total - warmup, 1)
        return jnp.where(n < warmup, warm, jnp.where(n >= total, eta_min, lin))
    return schedule


def constant_schedule(peak: float, warmup: int = 0) -> Schedule:
    """Linear warmup over `warmup` steps (as `linear_schedule`'s), then a constant lr: OLMo-core
    `ConstantWithWarmup` (debugging, ablations)."""
    return lambda step: peak * jnp.minimum(_n(step), warmup) / max(warmup, 1) if warmup else (
        jnp.full((), peak, jnp.float32) + 0.0 * _n(step))


_SCHEDULES = {"cosine": stage1_schedule, "linear": linear_schedule, "constant": constant_schedule}


def make_schedule(name: str, **kw) -> Schedule:
    """Schedule by flag name: 'cosine' (stage 1, `joined_at` for AI2's joined version),
    'linear' (stages 2 and 3) or 'constant'."""
    if name not in _SCHEDULES:
        raise ValueError(f"--schedule={name!r}: choose one of {sorted(_SCHEDULES)}")
    try:
        return _SCHEDULES[name](**kw)
    except TypeError as e:
        raise ValueError(f"schedule {name!r} got bad arguments {sorted(kw)}: {e}") from None
