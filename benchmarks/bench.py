"""Training throughput and MFU of the real step, optionally side by side with transformers+torch.

    python benchmarks/bench.py --flagfile=benchmarks/bench_cpu.flags --compare_torch     # the CPU comparison (issue 8)
    python benchmarks/bench.py --model=tiny --d_model=2048 --n_layers=16 ... --param_dtype=bfloat16 \
        --compute_dtype=bfloat16 --attention=cudnn --seq_len=8192     # a ~1B config on a GPU

What is timed is exactly what train.py runs per step: the model under `jax.lax.scan`, the
chunked cross entropy + z-loss, skip-step AdamW, the shard_map FSDP gradient over every local
device (`olmo3.sharding.make_train_step`), donated state. FLOPs are counted two ways
(`Config.train_flops_per_token`): the MaxText write-up's convention (6 x non-embedding params +
full causal attention in every layer) and the sliding-window-aware count. MFU is reported
against (a) the best square-matmul rate measured in this same run, same device and dtype --
the honest ceiling on a CPU -- and (b) the vendor's nominal dense peak where one is known
(olmo3/metrics.py). Per device on a GPU / TPU; on a CPU per host, since its host devices share
the cores the one-device matmul already uses. The torch reference gets the same parameter and
compute dtypes (autocast), document masks (--doc_len) and untimed steps, on the device ours uses.
On a shared machine the two frameworks' steps are interleaved one by one,
so background load hits both alike; compare the ratio, not the absolute numbers.

The LAST line printed is machine-readable:
    tokens_per_s=<ours> torch_tokens_per_s=<torch or nan> ratio=<x> mfu_measured=<f> mfu_nominal=<f or nan>
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time

from absl import app, flags

from olmo3 import cli   # absl only: the tuning below still comes before JAX is imported

F = flags.FLAGS
flags.DEFINE_enum("model", "tiny", ["olmo3_7b", "olmo3_7b_16x256", "olmo3_7b_long", "tiny"], "Config preset.")
for _name, _help in [("vocab_size", ""), ("d_model", ""), ("n_layers", ""), ("n_heads", ""),
                     ("n_kv_heads", ""), ("head_dim", ""), ("mlp_hidden", ""),
                     ("window", "Sliding window (tokens a query sees, itself included)."),
                     ("max_position_embeddings", ""), ("splash_block_q", "TPU (Mosaic) Splash tile."),
                     ("splash_block_kv", "TPU (Mosaic) Splash tile.")]:
    flags.DEFINE_integer(_name, None, f"Override the preset's {_name}. {_help}")
flags.DEFINE_list("layer_pattern", None, "Override the repeating layer types, e.g. 'sliding,full' "
                  "(n_layers must be a multiple of its length; default: the preset's 3 sliding + 1 full).")
flags.DEFINE_enum("attention", None, ["xla", "splash", "cudnn"], "Attention kernel (default: preset's).")
flags.DEFINE_enum("remat", None, ["none", "full", "save_proj", "save_dots"], "Rematerialization policy.")
flags.DEFINE_bool("scan_layers", None, "Scan the layer groups (default, compile time flat in depth); "
                  "--noscan_layers unrolls them, faster for small models on a CPU (olmo3/config.py).")
flags.DEFINE_bool("float8", None, "The layers' projections through float8 (the stage-3 recipe, olmo3/float8.py); "
                  "--compare_torch's model gets torchao's Float8Linear the same way (emulated without CUDA).")
flags.DEFINE_enum("param_dtype", None, ["float32", "bfloat16"], "Parameter dtype.")
flags.DEFINE_enum("compute_dtype", None, ["float32", "bfloat16"], "Activation/matmul dtype.")
flags.DEFINE_integer("batch", 4, "Global batch (instances per step).")
flags.DEFINE_integer("seq_len", 512, "Tokens per instance.")
flags.DEFINE_integer("micro_batch", None, "Instances per device per microbatch (default: all).")
flags.DEFINE_integer("doc_len", None, "Documents of this many tokens per instance, masked from each other "
                     "(segment ids, stage 3's intra-document masking); default: one document per instance.")
flags.DEFINE_integer("loss_chunk", 1024, "Tokens per chunk of the lm_head + cross entropy.")
flags.DEFINE_string("mesh", None, "Device mesh, e.g. 'fsdp:8' (default: every device on fsdp).")
flags.DEFINE_integer("warmup", 2, "Untimed steps per framework (the first compiles).")
flags.DEFINE_integer("steps", 5, "Timed steps (per framework).")
flags.DEFINE_integer("matmul_n", 2048, "Side of the square matmul whose rate is the measured peak.")
flags.DEFINE_float("peak_tflops", None, "Nominal per-device peak TFLOP/s, on a CPU the host's "
                   "(default: olmo3/metrics.py table).")
flags.DEFINE_bool("compare_torch", False, "Also time transformers' Olmo3ForCausalLM + torch AdamW: same "
                  "shapes, dtypes, document masks and device as ours (cuda when JAX computes on a GPU).")
flags.DEFINE_enum("torch_attention", "auto", ["auto", "eager", "sdpa"],
                  "transformers attention; auto times one step of each and keeps the faster.")
flags.DEFINE_integer("torch_threads", None, "torch.set_num_threads (default: the cores we may use).")
flags.DEFINE_bool("independent_runs", False, "Under a multi-process launch (srun, mpirun, a TPU slice), "
                  "benchmark each process on its own devices. Without it such a launch stops (olmo3/cluster.py).")
flags.DEFINE_bool("tune_cpu", True, "On a CPU backend: YNNPACK for dots only (float32 compute: its bf16 "
                  "dots differ between programs), keep freed memory in the process (olmo3/runtime.py; torch in this process shares the allocator).")
flags.DEFINE_bool("tune_gpu", True, "On an NVIDIA GPU backend: MaxText's / JAX-Toolbox's XLA flags "
                  "(olmo3/runtime.py); your own XLA_FLAGS entries win one by one.")
cli.require([
    ("batch", lambda v: v >= 1, ">= 1"),
    ("seq_len", lambda v: v >= 2, ">= 2 (an input token and its target)"),
    ("micro_batch", lambda v: v is None or v >= 1, ">= 1"),
    ("doc_len", lambda v: v is None or v >= 1, ">= 1"),
    ("torch_threads", lambda v: v is None or v >= 1, ">= 1"),
    ("loss_chunk", lambda v: v >= 1, ">= 1"),
    ("matmul_n", lambda v: v >= 1, ">= 1"),
    ("steps", lambda v: v >= 1, ">= 1"),
    ("peak_tflops", lambda v: v is None or (cli.finite(v) and v > 0), "finite and > 0"),
    ("warmup", lambda v: v >= 1, ">= 1 (the first step compiles: a timed one would time the compile)")])


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def config_from_flags():
    """The olmo3.Config the flags describe: --model's preset with every override given."""
    import olmo3
    overrides = {k: getattr(F, k) for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                                            "head_dim", "mlp_hidden", "window", "attention", "remat",
                                            "scan_layers", "float8", "param_dtype", "compute_dtype", "max_position_embeddings",
                                            "splash_block_q", "splash_block_kv") if getattr(F, k) is not None}
    if F.layer_pattern:
        overrides["layer_pattern"] = tuple(F.layer_pattern)
    return olmo3.Config.preset(F.model, **overrides)


def segment_ids(batch: int, seq_len: int, doc_len):
    """[batch, seq_len] document ids 0, 1, 2, ... of doc_len tokens (the last one shorter if need
    be); all zeros without --doc_len. Both frameworks mask attention across them."""
    import numpy as np
    docs = np.arange(seq_len, dtype=np.int32) // (doc_len or seq_len)
    return np.ascontiguousarray(np.broadcast_to(docs, (batch, seq_len)))


# ---------------------------------------------------------------------------------------------
# Ours: the same step train.py runs.
# ---------------------------------------------------------------------------------------------
def build_ours(config, tokens_np):
    import jax
    import numpy as np

    import olmo3
    from olmo3 import optim, schedules, sharding
    from olmo3.model import decay_mask

    mesh = sharding.make_mesh(F.mesh)
    microbatches = sharding.microbatches(F.batch, F.micro_batch, mesh, flags=("--batch", "--micro_batch"))
    # Recipe optimizer (stage 1 hyperparameters); a constant lr keeps the step's math the same.
    optimizer = optim.SkipStepAdamW(schedules.constant_schedule(3e-4), decay_mask=decay_mask)
    abstract = sharding.abstract_state(
        jax.eval_shape(lambda: (lambda m: (m, optimizer.init(m)))(olmo3.OLMo3(config, jax.random.key(0)))),
        mesh)
    state = sharding.place((lambda m: (m, optimizer.init(m)))(olmo3.OLMo3(config, jax.random.key(0))), abstract)
    specs = sharding.param_specs(state[0], mesh)
    step_fn = sharding.make_train_step(optimizer, mesh, specs, microbatches=microbatches,
                                       chunk=F.loss_chunk, use_segments=F.doc_len is not None)
    batch = sharding.global_batch({"tokens": tokens_np, "instance_mask": np.ones(F.batch, bool),
                                   "segment_ids": segment_ids(*tokens_np.shape, F.doc_len)}, mesh)
    holder = {"state": state}

    def run_step():
        model, opt_state = holder["state"]
        model, opt_state, metrics = step_fn(model, opt_state, batch)
        loss = float(metrics["train/loss"])   # waits for the step (as train.py's logging does)
        holder["state"] = (model, opt_state)
        return loss

    # The optimized HLO of this step (benchmarks/profile_step.py names its ops with it).
    run_step.hlo_text = lambda: step_fn.lower(*holder["state"], batch).compile().compiled.as_text()
    return run_step, mesh.size


# ---------------------------------------------------------------------------------------------
# The reference: transformers' Olmo3ForCausalLM + torch.optim.AdamW, same shapes and hyperparameters,
# same parameter and compute dtypes, same document masks, on the device ours computes on.
# ---------------------------------------------------------------------------------------------
def torch_device() -> str:
    """Where the reference computes: "cuda" when JAX computes on a GPU and torch can reach it
    (NVIDIA or ROCm), else "cpu". The matmul peak both MFUs divide by is measured on JAX's device."""
    import jax
    import torch
    return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


def torch_document_masks(config, segment_ids_np, attn_impl: str, device: str, dtype) -> dict:
    """Our attention masks as transformers' Olmo3Model takes them ready-made (a dict of 4-D masks
    [batch, 1, q, kv] by layer type, used as given): causal, transformers' sliding window
    (`kv > q - sliding_window`) and same document. sdpa takes them boolean (True: attend), eager
    added to the scores (0 or the dtype's min)."""
    import torch
    seg = torch.from_numpy(segment_ids_np).to(device)
    q = torch.arange(seg.shape[1], device=device)[:, None]           # (T, 1)
    kv = q.T                                                         # (1, T)
    full = (kv <= q) & (seg[:, None, :, None] == seg[:, None, None, :])   # (B, 1, T, T)
    masks = {"full_attention": full, "sliding_attention": full & (kv > q - config.window)}
    if attn_impl == "eager":
        masks = {k: torch.zeros(m.shape, dtype=dtype, device=device).masked_fill(~m, torch.finfo(dtype).min)
                 for k, m in masks.items()}
    return masks


def build_torch(config, tokens_np, attn_impl: str, device: str | None = None):
    import contextlib

    import torch
    import transformers

    device = device or torch_device()
    param_dtype, compute_dtype = getattr(torch, config.param_dtype), getattr(torch, config.compute_dtype)
    torch.manual_seed(0)
    hf_cfg = transformers.Olmo3Config(
        vocab_size=config.vocab_size, hidden_size=config.d_model, intermediate_size=config.mlp_hidden,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads, head_dim=config.head_dim,
        max_position_embeddings=max(F.seq_len, config.max_position_embeddings),
        rms_norm_eps=config.norm_eps, sliding_window=config.window,
        layer_types=[t + "_attention" for t in config.layer_types()],
        pad_token_id=None, eos_token_id=None, tie_word_embeddings=False,
        attn_implementation=attn_impl)
    model = transformers.Olmo3ForCausalLM(hf_cfg).to(device=device, dtype=param_dtype).train()
    if config.float8:   # as OLMo-core's stage 3 converts it: torchao on every linear but the LM head
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        emulate = device != "cuda"   # float8 GEMMs need a GPU; emulated (upcast) elsewhere
        convert_to_float8_training(
            model, config=Float8LinearConfig(round_scales_to_power_of_2=True, emulate=emulate),
            module_filter_fn=lambda m, fqn: fqn != "lm_head" and all(d % 16 == 0 for d in m.weight.shape))
        n = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
        print(f"torch: torchao Float8Linear on {n} linears{' (emulated)' if emulate else ''}")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    tokens = torch.from_numpy(tokens_np).long().to(device)
    inputs = {"input_ids": tokens, "labels": tokens}
    if F.doc_len:
        inputs["attention_mask"] = torch_document_masks(
            config, segment_ids(*tokens_np.shape, F.doc_len), attn_impl, device, compute_dtype)
    # Parameters in the parameter dtype; the forward in the compute dtype where it is lower (the
    # backward follows the forward's dtypes), as ours casts the weights per layer.

    def autocast():
        return (torch.autocast(device_type=device, dtype=compute_dtype) if compute_dtype != param_dtype
                else contextlib.nullcontext())

    def run_step():
        with autocast():
            loss = model(**inputs).loss   # shifted CE, mean over tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()   # waits for the step (on cuda too)

    return run_step


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one step. CPU seconds barely move when
    other jobs share the cores, so their ratio is the steadier comparison on a busy machine."""
    t, c = time.perf_counter(), time.process_time()
    loss = fn()
    dt, dc = time.perf_counter() - t, time.process_time() - c
    check_loss(loss)
    return dt, dc


def check_loss(loss: float) -> None:
    """Every step's loss, the untimed ones' too: a step that diverged times something else."""
    if not math.isfinite(loss):
        raise cli.NonFiniteError(f"non-finite loss {loss} in the benchmark step: these flags do not train "
                                 "(try --param_dtype=float32, or a smaller model)")


def tune() -> list[str]:
    """The process settings train.py runs with (--tune_cpu, --tune_gpu), before JAX starts."""
    from olmo3 import runtime
    return ((runtime.tune_cpu(dots=F.compute_dtype != "bfloat16") if F.tune_cpu else [])
            + (runtime.tune_gpu() if F.tune_gpu else []))


def check(config, platform: str) -> None:
    """The flags' model on `platform`: the attention kernel runs there and --seq_len fits (exit 2)."""
    cli.check_model(config.attention, config.max_position_embeddings, F.seq_len, platform)


def main(argv):
    del argv
    if F.compare_torch:   # torch may share the GPU: JAX takes memory as it needs it, not 90% up front
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from olmo3 import logs, runtime
    logs.quiet_library_logs()   # our lines only, unless --verbosity asks for the libraries' logs
    tuned = tune()
    from olmo3 import cluster   # one process: under srun / mpirun with N > 1 tasks, stop (or --independent_runs)
    cluster.start("bench.py", multi_process=False, independent_runs=F.independent_runs)

    import jax
    import numpy as np

    from olmo3 import metrics as metrics_lib

    config = config_from_flags()
    check(config, jax.devices()[0].platform)
    if F.compare_torch and (config.param_dtype, config.compute_dtype) == ("bfloat16", "float32"):
        raise app.UsageError("--compare_torch with --param_dtype=bfloat16 --compute_dtype=float32: torch's "
                             "autocast only lowers precision, so its reference cannot compute wider than its "
                             "parameters; give --compute_dtype=bfloat16 or --param_dtype=float32")
    if not F.compare_torch:   # it was ignored (--torch_attention is not: bench_cpu.flags sets it for the comparison)
        cli.refuse_given(("torch_threads",), "sets up --compare_torch's torch model: add --compare_torch, or drop {flag}")
    tokens_np = np.random.default_rng(0).integers(0, config.vocab_size, (F.batch, F.seq_len), dtype=np.int32)
    tokens_per_step = F.batch * F.seq_len
    flops = {c: config.train_flops_per_token(F.seq_len, c) * tokens_per_step for c in ("writeup", "sliding")}
    device = jax.devices()[0]
    cpu_host = device.platform == "cpu"
    unit = "TFLOP/s (the host's cores)" if cpu_host else "TFLOP/s/device"   # what one peak stands for
    cpu = f" ({metrics_lib.cpu_model()})" if cpu_host else ""   # CPUs differ: name it
    print(f"device: {device.platform} {device.device_kind}{cpu} x{jax.device_count()} | cores {cores()} | "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r} | tuning: {', '.join(tuned) or 'none'}")
    print(f"config: {F.model} d_model={config.d_model} layers={config.n_layers} heads={config.n_heads}/"
          f"{config.n_kv_heads}x{config.head_dim} mlp={config.mlp_hidden} window={config.window} "
          f"vocab={config.vocab_size} | batch {F.batch} x seq {F.seq_len} | {config.param_dtype} params, "
          f"{config.compute_dtype} compute | attention={config.attention} remat={config.remat} "
          f"scan_layers={config.scan_layers} float8={config.float8} "
          f"loss_chunk={F.loss_chunk}" + (f" | documents of {F.doc_len} tokens" if F.doc_len else ""))
    print(f"params: {config.num_params():,} ({config.num_params(False):,} without the input embedding); "
          f"train FLOPs/token: {flops['writeup'] / tokens_per_step / 1e6:.1f} M (write-up), "
          f"{flops['sliding'] / tokens_per_step / 1e6:.1f} M (sliding)")

    # (a) the same-run matmul peak, same device and compute dtype.
    peak_measured = metrics_lib.measure_matmul_peak(F.matmul_n, config.dtype)
    nominal = F.peak_tflops or metrics_lib.nominal_peak_tflops()
    print(f"peak: measured {F.matmul_n}^2 {config.compute_dtype} matmul {peak_measured / 1e12:.3f} "
          f"{unit}; nominal dense bf16 {f'{nominal} {unit}' if nominal else 'unknown'}")

    t0 = time.perf_counter()
    ours, n_devices = build_ours(config, tokens_np)
    for _ in range(F.warmup):
        check_loss(ours())
    print(f"ours: built + {F.warmup} warmup step(s) in {time.perf_counter() - t0:.1f} s")
    mem = metrics_lib.memory_bytes()   # before torch allocates anything in this process
    print("memory: " + ", ".join(f"{k.split('/')[1]} {v:.2f} GB" for k, v in mem.items()))

    theirs = None
    if F.compare_torch:
        import torch
        torch.set_num_threads(F.torch_threads or cores())
        torch_on = torch_device()
        print(f"torch: on {torch_on}, {config.param_dtype} params, {config.compute_dtype} compute"
              + (" (autocast)" if config.compute_dtype != config.param_dtype else "")
              + (f", documents of {F.doc_len} tokens masked" if F.doc_len else ""))
        if torch_on == "cpu" and device.platform != "cpu":
            print(f"torch: this torch cannot reach the {device.platform} ours computes on: the ratio "
                  "compares devices, not frameworks")
        impls = ["eager", "sdpa"] if F.torch_attention == "auto" else [F.torch_attention]
        best = None
        for impl in impls:
            fn = build_torch(config, tokens_np, impl, torch_on)
            for _ in range(F.warmup):   # as many untimed steps as ours
                check_loss(fn())
            dt = timed(fn)[0] if len(impls) > 1 else 0.0
            print(f"torch: attn_implementation={impl}" + (f" one step {dt:.2f} s" if dt else "") +
                  f", {torch.get_num_threads()} threads")
            if best is None or dt < best[0]:
                best = (dt, impl, fn)
        theirs = best[2]
        print(f"torch: timing attn_implementation={best[1]}")

    # Interleave step by step, the matmul peak too: a burst of background load hits all alike.
    ours_t, theirs_t, peaks = [], [], [peak_measured]
    for _ in range(F.steps):
        ours_t.append(timed(ours))
        if theirs is not None:
            theirs_t.append(timed(theirs))
        peaks.append(metrics_lib.measure_matmul_peak(F.matmul_n, config.dtype, repeats=2))
    peak_measured = statistics.median(peaks)
    print(f"peak: median of {len(peaks)} interleaved measurements {peak_measured / 1e12:.4g} {unit} "
          f"(min {min(peaks) / 1e12:.4g}, max {max(peaks) / 1e12:.4g})")

    def report(name, ts):
        wall, cpu = [t[0] for t in ts], [t[1] for t in ts]
        med, best = statistics.median(wall), min(wall)
        tps, tpc = tokens_per_step / med, tokens_per_step / statistics.median(cpu)
        print(f"{name}: step min {best:.3f} s, median {med:.3f} s over {len(ts)} | {tps:,.1f} tokens/s | "
              f"{tpc:,.1f} tokens/CPU-second")
        return tps, tpc, med

    tps, tpc, med = report("ours ", ours_t)
    trims = runtime.trims()
    if trims is not None:   # each trim faults the next steps' temporaries back in
        print(f"malloc: the heap's free memory was returned to the kernel {trims} time(s) since start")
    ttps, ttpc, tmed = report("torch", theirs_t) if theirs_t else (float("nan"),) * 3
    # FLOP/s per what one peak stands for. A GPU / TPU has a peak per device: divide by the devices.
    # A CPU's host devices (--xla_force_host_platform_device_count) share its cores, and the
    # matmul on one of them already uses every core: that peak is the host's, as torch's FLOP/s is.
    per_peak = lambda f: f / med / (1 if cpu_host else n_devices)  # noqa: E731
    for c in ("writeup", "sliding"):
        line = (f"ours  {c:>7s} FLOPs: {per_peak(flops[c]) / 1e12:.4g} {unit}, "
                f"MFU {per_peak(flops[c]) / peak_measured:.1%} of measured")
        if nominal:
            line += f", {per_peak(flops[c]) / (nominal * 1e12):.1%} of nominal"
        print(line)
    if theirs_t:
        print(f"torch writeup FLOPs: {flops['writeup'] / tmed / 1e12:.4g} TFLOP/s, MFU "
              f"{flops['writeup'] / tmed / peak_measured:.1%} of measured | ours/torch: {tps / ttps:.2f}x "
              f"tokens/s, {tpc / ttpc:.2f}x tokens/CPU-second")
    mfu_measured = per_peak(flops["writeup"]) / peak_measured
    mfu_nominal = per_peak(flops["writeup"]) / (nominal * 1e12) if nominal else float("nan")
    print(f"tokens_per_s={tps:.2f} torch_tokens_per_s={ttps:.2f} ratio={tps / ttps:.4f} "
          f"mfu_measured={mfu_measured:.4f} mfu_nominal={mfu_nominal:.4f}")
    sys.stdout.flush()


if __name__ == "__main__":
    cli.run(main)   # a bad flag or config: one line, exit 2
