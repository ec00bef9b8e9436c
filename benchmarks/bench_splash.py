"""What block sparsity saves in olmo3/splash.py, and what can be timed without an accelerator.

    python benchmarks/bench_splash.py                      # 7B FLOP report + a small CPU interpret timing
    python benchmarks/bench_splash.py --time_seq=0         # FLOP report only
    python benchmarks/bench_splash.py --block=512 --block=2048

Part 1 (exact, no hardware): at the 7B shapes (32 heads x head_dim 128, seq 8192, window 4096 in
the 24 sliding layers, 8 full layers; DESIGN.md §2) count the score tiles the kernel visits and
turn them into attention FLOPs, against a dense kernel (every tile) and a causal-only block
kernel (no window skipping); then the same at compute-chunk level (inside a partial tile the
kernel skips empty 512 x 512 chunks, so compute tracks the mask more closely than the DMA).
"model" FLOPs are 12 per (query, key, head_dim) for forward + backward (QK^T, PV; dQ, dK, dV,
dP) as in Config.train_flops_per_token; "executed" FLOPs (at chunk level) add the two score
recomputations of this kernel's backward (dq and dk/dv kernels each redo QK^T):
4 forward + 6 dq + 8 dk/dv = 18.

Part 2 (CPU, Pallas INTERPRET mode): wall time of splash vs the XLA reference on a small
shape. Interpret mode emulates the kernel grid step by step in XLA on the host; the ratio says
nothing about TPU speed and is printed only to show the kernel runs end to end. Timing against
the best library kernel (cuDNN) needs a GPU and is not done here.
"""
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from olmo3 import cli, splash

flags.DEFINE_integer("seq", 8192, "sequence length for the FLOP report (stage 1/2: 8192)")
flags.DEFINE_integer("window", 4096, "sliding window of the sliding layers (OLMo 3: 4096)")
flags.DEFINE_multi_integer("block", [512, 1024, 2048], "block sizes (block_q = block_kv) to report")
flags.DEFINE_integer("time_seq", 1024, "sequence length for the CPU interpret timing (0: skip)")
flags.DEFINE_integer("time_window", 256, "window for the CPU interpret timing")
flags.DEFINE_integer("time_block", 128, "block size for the CPU interpret timing")
flags.DEFINE_integer("repeats", 3, "timed repetitions (best is reported)")
cli.require([*[(name, lambda v: v >= 1, ">= 1") for name in ("seq", "window", "time_window", "time_block",
                                                             "repeats")],
             ("block", lambda v: all(b >= 1 for b in v), "block sizes >= 1"), ("time_seq", lambda v: v >= 0, ">= 0 (0: skip)")])
FLAGS = flags.FLAGS

HEADS, HEAD_DIM, SLIDING_LAYERS, FULL_LAYERS = 32, 128, 24, 8   # OLMo 3 7B (DESIGN.md §2)


def exact_pairs(seq: int, window) -> int:
    """(query, key) pairs the mask allows: sum over q of min(q + 1, window)."""
    w = seq if window is None else min(window, seq)
    return w * (w + 1) // 2 + (seq - w) * w


def flop_report(seq: int, window: int, blocks) -> None:
    print(f"== Part 1: attention FLOPs per sequence, 7B shapes: {HEADS} heads x {HEAD_DIM}, "
          f"seq {seq}, window {window}, {SLIDING_LAYERS} sliding + {FULL_LAYERS} full layers")
    per_pair = HEADS * HEAD_DIM                       # model FLOPs = 12 x pairs x this
    dense = seq * seq
    print(f"   exact mask share of seq^2: causal {exact_pairs(seq, None) / dense:.4f}, "
          f"window {exact_pairs(seq, window) / dense:.4f}")
    print(f"   chunk = compute sub-tile inside a tile ({splash.COMPUTE_CHUNK}); empty chunks of "
          f"partial tiles are skipped")
    print(f"   {'block':>5} {'tiles':>5} | {'tile share':^15} | {'compute share':^15} | "
          f"{'model TFLOP per sequence (32 layers)':^44} | {'executed':>8}")
    print(f"   {'':>5} {'':>5} | {'causal':>7} {'window':>7} | {'causal':>7} {'window':>7} | "
          f"{'dense':>7} {'causal blk':>10} {'splash tiles':>12} {'+chunks':>8} {'skip':>4} | "
          f"{'TFLOP':>8}")
    for b in blocks:
        n = (seq // b) ** 2
        share = {m: splash.computed_block_fraction(seq, w, b, b)
                 for m, w in (("causal", None), ("window", window))}
        chunk = {m: splash.computed_score_fraction(seq, w, b, b)
                 for m, w in (("causal", None), ("window", window))}

        def tflop(sh):  # 12 FLOPs per (pair, head_dim) for fwd + bwd, summed over the layers
            pairs = (SLIDING_LAYERS * sh["window"] + FULL_LAYERS * sh["causal"]) * dense
            return 12 * pairs * per_pair / 1e12

        dense_tf = 12 * (SLIDING_LAYERS + FULL_LAYERS) * dense * per_pair / 1e12
        causal_blk = 12 * (SLIDING_LAYERS + FULL_LAYERS) * share["causal"] * dense * per_pair / 1e12
        tiles_tf, chunks_tf = tflop(share), tflop(chunk)
        executed = chunks_tf * 18 / 12             # + the two score recomputations (see top)
        print(f"   {b:>5} {n:>5} | {share['causal']:>7.4f} {share['window']:>7.4f} | "
              f"{chunk['causal']:>7.4f} {chunk['window']:>7.4f} | {dense_tf:>7.2f} "
              f"{causal_blk:>10.2f} {tiles_tf:>12.2f} {chunks_tf:>8.2f} "
              f"{1 - chunks_tf / dense_tf:>4.0%} | {executed:>8.2f}")
    exact = 12 * (SLIDING_LAYERS * exact_pairs(seq, window)
                  + FULL_LAYERS * exact_pairs(seq, None)) * per_pair / 1e12
    print(f"   exact-mask model FLOPs (no tile waste): {exact:.2f} TFLOP per sequence")
    print("   share = computed / all of the seq x seq scores; 'skip' = saved vs the dense kernel")


def _best_time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))                            # compile + warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def interpret_timing(seq: int, window: int, block: int, repeats: int) -> None:
    from olmo3.attention import reference_attention

    heads, kv_heads, d = 4, 4, 128
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(kq, (heads, seq, d), jnp.float32)
    k = jax.random.normal(kk, (kv_heads, seq, d), jnp.float32)
    v = jax.random.normal(kv, (kv_heads, seq, d), jnp.float32)
    fns = {
        "xla reference": lambda q, k, v: reference_attention(q, k, v, window=window),
        "splash (plain interpret)": lambda q, k, v: splash.splash_attention(
            q, k, v, window=window, block_q=block, block_kv=block, interpret=True),
    }
    print(f"== Part 2: CPU, INTERPRET MODE (not TPU performance): {heads} heads x {d}, "
          f"seq {seq}, window {window}, block {block}, fp32, "
          f"{splash.computed_block_fraction(seq, window, block, block):.3f} of tiles computed")
    times = {}
    for name, fn in fns.items():
        fwd = jax.jit(fn)
        grad = jax.jit(jax.grad(lambda q, k, v, fn=fn: fn(q, k, v).sum(), argnums=(0, 1, 2)))
        times[name] = (_best_time(fwd, q, k, v, repeats=repeats),
                       _best_time(grad, q, k, v, repeats=repeats))
        print(f"   {name:>26}: forward {times[name][0] * 1e3:8.1f} ms, "
              f"forward+backward {times[name][1] * 1e3:8.1f} ms")
    ref, ours = times["xla reference"], times["splash (plain interpret)"]
    print(f"   interpret-mode splash / xla: forward {ours[0] / ref[0]:.1f}x, "
          f"forward+backward {ours[1] / ref[1]:.1f}x (slower = expected: interpret mode)")


def main(argv):
    del argv
    # The kernel tiles the sequence: a block that does not divide it has no tile count (it was a
    # ZeroDivisionError traceback for a block past the sequence).
    for flag, seq, blocks in (("block", FLAGS.seq, FLAGS.block),
                              ("time_block", FLAGS.time_seq, [FLAGS.time_block] if FLAGS.time_seq else [])):
        for b in blocks:
            if seq % b:
                raise app.UsageError(f"--{flag}={b} does not divide the sequence ({seq}); give a block size that does")
    if not FLAGS.time_seq:   # each was ignored
        cli.refuse_given(("time_window", "time_block", "repeats"),
                         "applies to the interpret timing, which --time_seq=0 skips: drop {flag}")
    flop_report(FLAGS.seq, FLAGS.window, FLAGS.block)
    if FLAGS.time_seq:
        interpret_timing(FLAGS.time_seq, FLAGS.time_window, FLAGS.time_block, FLAGS.repeats)
    print(f"backend: {jax.default_backend()}; no accelerator timing (cuDNN comparison needs a GPU)"
          if jax.default_backend() == "cpu" else f"backend: {jax.default_backend()}")


if __name__ == "__main__":
    cli.run(main)   # a bad flag: one line, exit 2 (olmo3/cli.py)
