"""Cost of one in-loop downstream evaluation (train.py --downstream_tasks), on paper and measured.

    python benchmarks/downstream_cost.py                          # OLMo 3's "fast" set at the 7B shape
    python benchmarks/downstream_cost.py --measure_limit=20       # + a measured CPU scoring rate

On paper: the task set's rows are built exactly as oe_tasks.score batches them (AI2's requests,
dolma2, left-truncated to --max_length, sorted longest first, padded to a multiple of 128), and
each row costs forward FLOPs = T x Config.train_flops_per_token(T) / 3 (the write-up's
convention, forward only). Seconds per evaluation = FLOPs / (devices x rate), for two rates:
  - an accelerator at --mfu of --peak_tflops (stated assumptions, not measurements);
  - this CPU's measured scoring rate: the tiny model (tiny.flags shape) scoring --measure_limit
    documents per task through the same jitted scorer, FLOPs over wall seconds (compile excluded).
"""
from __future__ import annotations

import math
import time

from absl import flags

from olmo3 import cli

F = flags.FLAGS
flags.DEFINE_list("tasks", ["fast"], "Task labels or groups (olmo3/oe_tasks.py).")
flags.DEFINE_integer("max_length", 8192, "Longest row (OLMo-core: the train module's max sequence length).")
flags.DEFINE_integer("rows", 8, "Rows per scoring batch.")
flags.DEFINE_list("devices", ["8", "64", "512"], "Device counts to cost.")
flags.DEFINE_float("peak_tflops", 989.0, "Accelerator dense bf16 peak (H100 SXM: 989).")
flags.DEFINE_float("mfu", 0.4, "Assumed model FLOP utilisation of the scoring forward pass on the accelerator.")
flags.DEFINE_integer("measure_limit", 0, "Documents per task for the measured CPU rate (0: skip).")
cli.require([("max_length", lambda v: v >= 1, ">= 1"), ("rows", lambda v: v >= 1, ">= 1"),
             ("tasks", lambda v: len(v) >= 1, "one or more task labels or groups"),
             ("devices", lambda v: len(v) >= 1 and all(d.isdigit() and int(d) >= 1 for d in v),
              "one or more device counts >= 1"),
             ("peak_tflops", lambda v: cli.finite(v) and v > 0, "finite and > 0"), ("mfu", lambda v: 0 < v <= 1, "in (0, 1]"),
             ("measure_limit", lambda v: v >= 0, ">= 0 (0: skip)")])


def padded_shapes(task_rows, rows: int) -> list[tuple[int, int]]:
    """(rows, T) of every batch oe_tasks.score would run."""
    lengths = sorted((len(r.query) for r in task_rows), reverse=True)
    return [(rows, 128 * math.ceil(lengths[a] / 128)) for a in range(0, len(lengths), rows)]


def main(argv):
    del argv
    import data
    import olmo3
    from olmo3 import oe_tasks, scoring
    encode = data.tokenizer.encode
    labels = oe_tasks.resolve(F.tasks, "--tasks")
    big = olmo3.Config.preset("olmo3_7b")
    fwd = lambda c, T: T * c.train_flops_per_token(T, "writeup") / 3  # noqa: E731  forward FLOPs of one row
    total_rows = total_tokens = 0
    flops = 0.0
    for label in labels:
        task_rows = oe_tasks.rows(label, oe_tasks.load_requests(label), encode, F.max_length)
        shapes = padded_shapes(task_rows, F.rows)
        f = sum(r * fwd(big, T) for r, T in shapes)
        total_rows += len(task_rows)
        total_tokens += sum(r * T for r, T in shapes)
        flops += f
        print(f"{label:45s} rows {len(task_rows):6d}  padded tokens {sum(r * T for r, T in shapes):11,d}  "
              f"7B fwd {f / 1e15:8.1f} PFLOP")
    print(f"total: {len(labels)} tasks, {total_rows:,} rows, {total_tokens:,} padded tokens, {flops / 1e15:.1f} PFLOP at 7B")
    for d in map(int, F.devices):
        print(f"  {d:4d} devices at {F.mfu:.0%} of {F.peak_tflops:g} TFLOP/s: {flops / (d * F.mfu * F.peak_tflops * 1e12):8.1f} s")
    if F.measure_limit:
        import jax
        tiny = olmo3.Config.preset("tiny", d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, head_dim=64,
                                   mlp_hidden=768, window=128)  # tiny.flags
        model = olmo3.OLMo3(tiny, jax.random.key(0))
        cache = {}
        kw = dict(score_fn=scoring.continuation_scores_jit, encode=encode, pad_id=data.PAD_ID,
                  limit=F.measure_limit, max_length=256, batch_rows=F.rows, requests_cache=cache)
        oe_tasks.evaluate(model, labels, **kw)  # compile every shape once
        t0 = time.perf_counter()
        oe_tasks.evaluate(model, labels, **kw)
        dt = time.perf_counter() - t0
        f_tiny = sum(r * fwd(tiny, T) for rows in cache.values() for r, T in padded_shapes(rows, F.rows))
        rate = f_tiny / dt
        print(f"measured on this CPU: tiny model, {F.measure_limit} documents per task at max_length 256: "
              f"{dt:.1f} s, {rate / 1e9:.1f} GFLOP/s")
        for d in map(int, F.devices):
            print(f"  7B on {d:4d} devices at this measured rate: {flops / (d * rate) / 3600:10.1f} h")


if __name__ == "__main__":
    cli.run(main)   # a bad flag: one line, exit 2 (olmo3/cli.py)
