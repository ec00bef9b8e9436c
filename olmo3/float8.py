"""Float8 linears: the stage-3 recipe's `Float8Config(enabled=True, ao=AOFloat8LinearConfig.recommended())`.

OLMo-core's long-context script (OLMo-3-1025-7B-long-context.py, `float8_config=...`) swaps every
`nn.Linear` except the LM head (`Transformer.apply_fp8` ignores "lm_head.w_out") for torchao's
`Float8Linear` with its default "tensorwise dynamic" recipe, scales rounded down to powers of 2
(`round_scales_to_power_of_2=True`) and the weights cast to float8 from the fp32 master copy
before FSDP gathers them (`enable_fsdp_float8_all_gather=True`: one byte per element on the wire,
the scale from the whole weight's maximum; olmo3/sharding.py `_wire`). In this model that is the seven
projections of every layer (q, k, v, o, gate, up, down), where both dimensions are multiples of
16 as OLMo-core's filter asks (olmo3/model.py). One linear y = x @ w, as torchao does it:

    forward     x8 = cast(x, e4m3)   w8 = cast(w, e4m3)     y  = x8 @ w8        (in x's dtype)
    backward    g8 = cast(dy, e5m2)                         dx = g8 @ w8^T      (in dy's dtype)
                                                            dw = x8^T @ g8      (in dy's dtype)
    cast(t, f8) = saturate(t * s) -> f8, dequantized as / s;  s = max_f8 / amax|t|

Each tensor gets one scale from its own absolute maximum ("tensorwise"; e4m3 max 448 for
activations and weights, e5m2 max 57344 for gradients, whose range matters more than precision).
Activations and gradients have it rounded down to a power of 2; the weights do not. Under FSDP,
which is how OLMo-core always trains, torchao casts a weight in its all-gather hook
(`WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather`) with the scale that
`precompute_float8_dynamic_scale_for_fsdp` computes after each optimizer step (OLMo-core's
`Transformer.post_optim_step`), max_f8 / amax in fp64 then fp32, never rounded: the rounding flag
reaches only the casts inside `Float8Linear`, which a gathered weight, already float8, skips
(torchao 0.18.0 float8/fsdp_utils.py). A weight of amax 0.078 gets 448 / 0.078 = 5743.6 where a rounded
scale is 4096: every dequantized value moves, by up to 6% of the amax, and the layer's output by
as much as float8 itself moves it (tests/test_float8.py).

A power-of-2 scale makes the dequantized values exact in bf16 and fp32, so a dot of `qdq`'d
(quantized, then dequantized) operands computes the float8 products exactly. The weight's scale
is applied to the dot's fp32 result instead, as a float8 GEMM applies its operands' scales to
the accumulator (torch `_scaled_mm`, cuBLASLt): y = (x8 / sx) @ w8, times 1 / sw. Where the chip
has no float8 GEMM the products are the float8 ones at the compute dtype's speed; torchao's CPU
emulation, `mm(x8.float() / sx, w8.float() / sw)`, rounds each w8 / sw to fp32 first, so it can
differ from this in the last fp32 bit. Float8 operands converted (one multiplied by a scalar)
into a dot is the pattern XLA's GPU GEMM rewriter turns into cuBLASLt float8 GEMMs on Hopper and
later, which JAX's and Flax's fp8 examples rely on; not yet seen on a GPU here
(benchmarks/gpu_check.sh's stage-3 row).

**Whose maximum.** torchao's is over the tensor a rank multiplies: its whole microbatch. Here the
model runs one sequence at a time under `jax.vmap`, so the activation and gradient maxima are per
sequence. That is torchao's exactly when a device's microbatch is one instance, which is how the
stage-3 recipe runs (`rank_microbatch_size=sequence_length`, "for CP we want only 1 instance per
rank"); with more
instances per microbatch the scales are finer-grained than torchao's. Weights are whole inside the
layer (the FSDP gather), so their maximum is the full tensor's, as torchao's precomputed one is.
Under context parallelism a rank's activation maximum is over its own tokens, as in OLMo-core;
but its ranks hold one contiguous slice each and ours the chunks r and 2C-1-r, so the scales, and
with them the losses, differ slightly from OLMo-core's and from a run without the context axis
(without --float8 they are equal, tests/test_context.py).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

E4M3 = jnp.float8_e4m3fn      # activations and weights (torchao e4m3_dtype)
E5M2 = jnp.float8_e5m2        # gradients of the outputs (torchao e5m2_dtype)
EPS = 1e-12                   # torchao float8_utils.EPS: the smallest amax a scale is taken from


def scale(amax: Float[Array, ""], dtype, pow2: bool = True) -> Float[Array, ""]:
    """torchao `amax_to_scale(..., round_scales_to_power_of_2=pow2)`: max_f8 / max(amax, EPS),
    rounded down to a power of 2 when `pow2`. The rounding is exact here (frexp's exponent; XLA's
    exp2 and log2 are approximations); torchao's exp2(floor(log2(s))) in fp32 can round a quotient
    a few fp32 ulps below a power of 2 up to it, a scale twice ours for such a tensor. Unrounded,
    the fp32 quotient equals torchao's fp64 one rounded to fp32 (a quotient rounded twice, to 53
    bits then 24, is rounded once), where the backend divides exactly (CPU and GPU do)."""
    s = jnp.float32(jnp.finfo(dtype).max) / jnp.maximum(amax.astype(jnp.float32), EPS)
    if not pow2:
        # As computed: XLA's algebraic simplifier turns 1 / (max_f8 / amax), the reciprocal a
        # float8 GEMM is given, into amax x (1 / max_f8), an fp32 ulp off, in some programs and
        # not in others (a linear's gradient differed in the last bit between one jit and two).
        return jax.lax.optimization_barrier(s)
    _, e = jnp.frexp(s)                            # s = m * 2^e, m in [0.5, 1): floor(log2 s) = e - 1
    # An inf amax gives s = 0 and a NaN one s = NaN, kept as torchao keeps them, so that a
    # non-finite activation makes the output NaN instead of being saturated into range.
    return jnp.where(s > 0, jnp.ldexp(jnp.float32(1.0), e - 1), s)


def quantize(t: Float[Array, "..."], dtype, amax: Optional[Float[Array, ""]] = None, pow2: bool = True
             ) -> tuple[Array, Float[Array, ""]]:
    """(t in float8 `dtype`, its scale): torchao's `hp_tensor_to_float8_dynamic`, tensorwise:
    the fp32 product t * s saturated to the format's range (torch's cast does not saturate).
    `amax`: the whole tensor's absolute maximum when `t` is one shard of it (the FSDP gather);
    `pow2=False`: the scale of a weight (not rounded, see above)."""
    s = scale(jnp.max(jnp.abs(t)) if amax is None else amax, dtype, pow2)
    top = float(jnp.finfo(dtype).max)
    return jnp.clip(t.astype(jnp.float32) * s, -top, top).astype(dtype), s


def dequantize(q: Array, s: Float[Array, ""], out_dtype) -> Float[Array, "..."]:
    """q / s in `out_dtype`: the value a float8 GEMM multiplies, exact in bf16 and fp32 when the
    scale is a power of 2 (else rounded once). Written as convert-then-multiply-by-a-scalar, the
    operand pattern XLA's GPU GEMM rewriter replaces with a float8 GEMM."""
    return q.astype(out_dtype) * (1.0 / s).astype(out_dtype)


def qdq(t: Float[Array, "..."], dtype, out_dtype) -> Float[Array, "..."]:
    """t cast to float8 and back, in `out_dtype`."""
    return dequantize(*quantize(t, dtype), out_dtype)


def _dot(a: jax.Array, b: jax.Array, dtype) -> jax.Array:
    return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dtype)


def _dot_weight(a: jax.Array, qw: jax.Array, sw: Float[Array, ""], dtype) -> jax.Array:
    """a @ (qw / sw) with the weight's scale applied to the fp32 accumulator: the float8 values
    converted exactly to a's dtype, then 1 / sw, as a float8 GEMM scales its result."""
    return (jnp.dot(a, qw.astype(a.dtype), preferred_element_type=jnp.float32) * (1.0 / sw)).astype(dtype)


@jax.custom_vjp
def linear(x: Float[Array, "*batch k"], w: Float[Array, "k n"]) -> Float[Array, "*batch n"]:
    """x @ w through float8 (torchao `Float8Linear`, tensorwise): the output in x's dtype, fp32
    accumulation; `w` may be the fp32 master weight (cast to float8 from it, not from bf16)."""
    return _forward(x, w)[0]   # the residuals are unused outside differentiation: XLA drops them


def _forward(x, w):
    (qx, sx), (qw, sw) = quantize(x, E4M3), quantize(w, E4M3, pow2=False)
    y = _dot_weight(dequantize(qx, sx, x.dtype), qw, sw, x.dtype)
    # Residuals: the float8 tensors and their scales (torchao recasts the same tensors with the
    # same scales in its backward): a byte per element where a layer's residuals are kept, and
    # the backward's dots again read float8 operands. Zeros carry the dtypes of x and w, which
    # the gradients must come back in.
    return y, (qx, sx, qw, sw, jnp.zeros((), x.dtype), jnp.zeros((), w.dtype))


def _backward(res, dy):
    qx, sx, qw, sw, x_zero, w_zero = res
    g8 = qdq(dy, E5M2, dy.dtype)
    dx = _dot_weight(g8, qw.T, sw, dy.dtype)
    x8 = dequantize(qx, sx, dy.dtype)
    k, n = qw.shape
    dw = _dot(x8.reshape(-1, k).T, g8.reshape(-1, n), dy.dtype)   # torchao: dy's dtype, then the reduce
    return dx.astype(x_zero.dtype), dw.astype(w_zero.dtype)


linear.defvjp(_forward, _backward)
