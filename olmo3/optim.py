"""Skip-step AdamW with fp32 moments: OLMo-core's `SkipStepAdamW`, as a pure function of PyTrees.

What it does, per call of `SkipStepAdamW.update(grads, opt_state, model, loss)`:

1. Global grad norm over every float gradient, in fp32, BEFORE clipping (logged, and fed to the
   skip-step window); clip to `max_grad_norm` the way torch's `clip_grad_norm_` does
   (factor min(1, max_norm / (norm + 1e-6))), as OLMo-core's train module does.
2. Skip-step decision (OLMo-core `optim/skip_step_optimizer.py::get_step_factor`): the windows
   hold the CE loss and the pre-clip grad norm of the last `window` (128) steps. With k the number
   of values seen so far INCLUDING this step's, once k >= window // 2 (64) the step is skipped
   unless  loss - mean <= sigma * std  AND  gnorm - mean <= sigma * std  (sigma 6), with mean and
   Bessel std over the PREVIOUS values only (at most 128 of them). Written as "not <=", so a NaN
   loss or norm is skipped too, exactly like OLMo-core. Addition: a non-finite loss or grad norm
   is also skipped during the first 63 steps, and a skipped step never touches the weights or
   moments (OLMo-core, at any step, writes NaN into both from a NaN/inf gradient: its clip
   factor is NaN or 0 * inf, and 0 * NaN is NaN in `adamw_step`).
3. AdamW (optax `scale_by_adam`, moments in fp32 ALWAYS: gradients are cast to fp32 before they
   reach the moments and both mu AND nu are created fp32 — optax's `mu_dtype` covers mu only, and
   bf16 moments once cost +0.93 loss in 1000 steps, DESIGN §3), decoupled weight decay
   `update += wd * param` on masked leaves, then `param -= lr * update`, i.e. torch AdamW /
   OLMo-core `adamw_step`: p *= 1 - lr*wd; p -= lr * mhat / (sqrt(vhat) + eps).
4. A skipped step leaves params, mu, nu and the Adam count unchanged (OLMo-core multiplies every
   change by step_factor = 0, including `step += step_factor`); its loss and norm still enter the
   windows, and the schedule step still advances (OLMo-core's lr follows trainer.global_step).

Two counters live in the state: `step` = training steps run (skipped ones included); the lr of
the next step is `schedule(step)` (see schedules.py for the 0-based convention). `count` = Adam
updates applied, for bias correction (OLMo-core's per-parameter `state["step"]`).

Everything in `OptState` is an array, so it is checkpointed and sharded like the params
(mu/nu have the params' structure, shapes and shardings). `update` works on global (jit-level)
arrays: under a shard_map, pass it the gathered view or psum the squared norm yourself.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PyTree

from olmo3.schedules import Schedule

# OLMo-core `OLMo-3-1025-7B-pretrain-1.py` (SkipStepAdamWConfig) and train module defaults.
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
MAX_GRAD_NORM = 1.0
WINDOW = 128        # SkipStepOptimizer.rolling_interval_length
SIGMA = 6.0         # SkipStepOptimizer.sigma_factor

DecayMask = Union[None, PyTree, Callable[[PyTree], PyTree]]


class OptState(eqx.Module):
    """Optimizer state: all arrays. mu/nu have the structure of `eqx.filter(model,
    eqx.is_inexact_array)` (None where the model holds no float array), always fp32."""

    step: Int[Array, ""]                 # training steps run, skipped included (drives the lr)
    count: Int[Array, ""]                # Adam updates applied (bias correction)
    mu: PyTree
    nu: PyTree
    loss_window: Float[Array, " window"]   # ring buffer, slot (n % window) is the oldest
    gnorm_window: Float[Array, " window"]
    n_seen: Int[Array, ""]               # values ever written to the windows


def no_decay_on(where: Callable[[PyTree], Any]) -> Callable[[PyTree], PyTree]:
    """Decay mask: every float array decayed except the leaves `where(model)` selects.

    OLMo-3 recipe: `no_decay_on(lambda m: m.embed)`, i.e. olmo3.model.decay_mask (OLMo-core's
    `OptimGroupOverride(params=["embeddings.weight"], opts=dict(weight_decay=0.0))`; norm weights
    ARE decayed)."""
    def mask(model):
        m = jax.tree.map(lambda _: True, model)
        return eqx.tree_at(where, m, replace_fn=lambda _: False)
    return mask


def global_norm(tree: PyTree) -> Float[Array, ""]:
    """L2 norm over every array leaf, accumulated in fp32: each leaf squared and summed over all
    of its axes, in place. Under FSDP each device sums its own shard and one scalar per leaf is
    all-reduced. Anything that flattens a leaf first (jnp.vdot ravels) all-gathers every leaf
    sharded on an axis other than its first: at 7B on fsdp:8, 27.5 of the 29.2 GB of fp32
    gradient, every step, a stacked MLP weight (5.8 GB) at a time. Summed this way it is also
    exact to ~1e-7 on every jaxlib from 0.8.1 on; jnp.vdot on jaxlib 0.8.1-0.10.1 runs long fp32
    running sums on the CPU and came out 1.7-7% low on trees with a [512, 100278] leaf, enough
    to change the clipping factor and the skip-step test. CPU benchmark step (2-core AMD EPYC,
    runs alternating with the vdot version): equal within the machine's noise."""
    leaves = [x for x in jax.tree.leaves(tree) if eqx.is_inexact_array(x)]
    if not leaves:
        return jnp.zeros((), jnp.float32)
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def _should_skip(value, window, n_seen, min_values, sigma):
    """OLMo-core get_step_factor for one series: True when the step must be skipped."""
    size = window.shape[0]
    prev = jnp.minimum(n_seen, size)                      # previous values stored
    valid = jnp.arange(size) < prev
    nf = jnp.maximum(prev, 1).astype(jnp.float32)
    mean = jnp.sum(jnp.where(valid, window, 0.0)) / nf
    # Bessel's divisor, unclamped: one previous value gives 0/0 = NaN, and the step is skipped,
    # as OLMo-core's torch.std_mean of one value is NaN (windows 2 and 3 decide from 2 values on).
    var = jnp.sum(jnp.where(valid, jnp.square(window - mean), 0.0)) / (nf - 1.0)
    ok = (value - mean) <= sigma * jnp.sqrt(var)          # "not <=": NaN is skipped
    active = n_seen + 1 >= min_values                     # len(_losses) incl. this one >= 64
    return active & ~ok


class SkipStepAdamW:
    """Hyperparameters plus the pure functions `init`, `update`, `warm_start`.

    schedule:   `step -> lr` (olmo3.schedules); called with `opt_state.step`.
    decay_mask: None (decay every float array), a bool pytree shaped like the model, or a
                callable model -> such a pytree (see `no_decay_on`).
    """

    def __init__(self, schedule: Schedule, *, b1: float = BETAS[0], b2: float = BETAS[1],
                 eps: float = EPS, weight_decay: float = WEIGHT_DECAY,
                 decay_mask: DecayMask = None, max_grad_norm: Optional[float] = MAX_GRAD_NORM,
                 window: int = WINDOW, sigma: float = SIGMA, min_values: Optional[int] = None,
                 skip_steps: bool = True):
        if window < 2:
            raise ValueError(f"skip-step window={window} must be >= 2")
        self.schedule = schedule
        self.b1, self.b2, self.eps = b1, b2, eps
        self.weight_decay = weight_decay
        self.decay_mask = decay_mask
        self.max_grad_norm = max_grad_norm
        self.window = window
        self.sigma = sigma
        # OLMo-core: max(2, rolling_interval_length // 2)
        self.min_values = max(2, window // 2) if min_values is None else min_values
        self.skip_steps = skip_steps
        # mu_dtype pins mu; nu is fp32 because init/update only ever see fp32 trees.
        self._adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps, mu_dtype=jnp.float32)

    # -- helpers -------------------------------------------------------------------------
    def _mask(self, params: PyTree) -> PyTree:
        """Bool per float array of `params` (structure of eqx.filter(params, is_inexact_array))."""
        leaves, treedef = jax.tree.flatten(params)
        if self.decay_mask is None:
            mleaves = [True] * len(leaves)
        else:
            m = self.decay_mask(params) if callable(self.decay_mask) else self.decay_mask
            try:
                mleaves = treedef.flatten_up_to(m)
            except (ValueError, TypeError) as e:
                raise ValueError("decay_mask does not have the structure of the model; build it "
                                 "with jax.tree.map(lambda _: True, model) or no_decay_on(...): "
                                 f"{e}") from None
        return jax.tree.unflatten(treedef, [bool(m) if eqx.is_inexact_array(p) else None
                                            for p, m in zip(leaves, mleaves)])

    @staticmethod
    def _f32(tree: PyTree) -> PyTree:
        return jax.tree.map(lambda x: x.astype(jnp.float32),
                            eqx.filter(tree, eqx.is_inexact_array))

    # -- API -----------------------------------------------------------------------------
    def init(self, params: PyTree) -> OptState:
        """Zero fp32 moments shaped like params. Called eagerly, mu/nu take each param's
        sharding; under jit, pass out_shardings (XLA does not tie zeros to an input)."""
        zeros = jax.tree.map(jnp.zeros_like, self._f32(params))
        return OptState(step=jnp.zeros((), jnp.int32), count=jnp.zeros((), jnp.int32),
                        mu=zeros, nu=jax.tree.map(jnp.zeros_like, zeros),
                        loss_window=jnp.zeros((self.window,), jnp.float32),
                        gnorm_window=jnp.zeros((self.window,), jnp.float32),
                        n_seen=jnp.zeros((), jnp.int32))

    def update(self, grads: PyTree, opt_state: OptState, params: PyTree,
               loss: Union[float, Float[Array, ""]]) -> tuple[PyTree, OptState, dict[str, Float[Array, ""]]]:
        """One optimizer step. `loss` is the CE loss without z-loss, averaged over all ranks.

        Returns (new_params, new_opt_state, metrics); params keep their dtypes."""
        s = opt_state
        g32 = self._f32(grads)
        gnorm = global_norm(g32)
        if self.max_grad_norm is not None:
            factor = jnp.minimum(1.0, self.max_grad_norm / (gnorm + 1e-6))  # torch clip_grad_norm_
            g32 = jax.tree.map(lambda g: g * factor, g32)
            clipped = gnorm > self.max_grad_norm
        else:
            clipped = jnp.zeros((), bool)

        loss = jnp.asarray(loss, jnp.float32)
        finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        if self.skip_steps:
            skip = (_should_skip(loss, s.loss_window, s.n_seen, self.min_values, self.sigma)
                    | _should_skip(gnorm, s.gnorm_window, s.n_seen, self.min_values, self.sigma))
            skip = skip | ~finite
        else:
            skip = jnp.zeros((), bool)

        lr = jnp.asarray(self.schedule(s.step), jnp.float32)
        adam_in = optax.ScaleByAdamState(count=s.count, mu=s.mu, nu=s.nu)
        u, adam_out = self._adam.update(g32, adam_in)
        p_arrays, p_static = eqx.partition(params, eqx.is_inexact_array)
        mask = self._mask(params)
        wd = self.weight_decay
        u = jax.tree.map(lambda u, p, m: u + wd * p.astype(jnp.float32) if m else u,
                         u, p_arrays, mask)
        new_p = jax.tree.map(lambda p, u: (p.astype(jnp.float32) - lr * u).astype(p.dtype),
                             p_arrays, u)

        keep = lambda new, old: jnp.where(skip, old, new)  # noqa: E731
        new_params = eqx.combine(jax.tree.map(keep, new_p, p_arrays), p_static)
        slot = s.n_seen % self.window
        new_state = OptState(
            step=s.step + 1,
            count=keep(adam_out.count, s.count),
            mu=jax.tree.map(keep, adam_out.mu, s.mu),
            nu=jax.tree.map(keep, adam_out.nu, s.nu),
            loss_window=s.loss_window.at[slot].set(loss),
            gnorm_window=s.gnorm_window.at[slot].set(gnorm),
            n_seen=s.n_seen + 1)
        metrics = {"optim/lr": lr, "optim/grad_norm": gnorm,
                   "optim/step_skipped": skip.astype(jnp.float32),
                   "optim/clipped": clipped.astype(jnp.float32),
                   "optim/adam_count": new_state.count.astype(jnp.float32)}
        return new_params, new_state, metrics

    def warm_start(self, opt_state: OptState) -> OptState:
        """Stage 2/3 "warm Adam" start from the previous stage's final state.

        Kept: mu, nu and the Adam `count` (OLMo-core midtrain/long-context scripts load the
        optimizer state dict, per-parameter `step` included, with load_optim_state=True;
        resetting `count` with warm moments would inflate the first updates ~2.2x through bias
        correction). Reset: `step` (load_trainer_state=False: global_step and the schedule
        restart) and the skip-step windows (OLMo-core never checkpoints them, so every load
        starts empty; and stage-1 losses do not describe the new data mix)."""
        return OptState(step=jnp.zeros_like(opt_state.step), count=opt_state.count,
                        mu=opt_state.mu, nu=opt_state.nu,
                        loss_window=jnp.zeros_like(opt_state.loss_window),
                        gnorm_window=jnp.zeros_like(opt_state.gnorm_window),
                        n_seen=jnp.zeros_like(opt_state.n_seen))
