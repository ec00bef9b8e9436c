"""Bad input never costs a run: every CLI (train.py, eval.py, convert.py) against the inputs a new
user gets wrong, as subprocesses, the way a user meets them.

Each case asserts the contract of olmo3/cli.py: the exit status (2 for a user's error, 3 for a
non-finite state; both never retried by --resume_until_done), a last line
`<script>: error: ...` naming the culprit, no traceback, and every file that existed before
(checkpoints, prepared data, HF directories) byte-for-byte unchanged. The oracle for "unchanged"
is a sha256 of every file under the test's directory, taken before each case.
"""
import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
TINY = ["--model=tiny", "--d_model=32", "--n_layers=4", "--n_heads=2", "--n_kv_heads=2", "--head_dim=16",
        "--mlp_hidden=64", "--window=16", "--seq_len=32", "--global_batch=4", "--total_steps=4",
        "--warmup_steps=1", "--save_interval=2", "--eval_interval=2", "--loader_workers=0", "--notune_cpu"]


def script(name, *args, cwd=None):
    return subprocess.run([sys.executable, os.path.join(ROOT, name), *map(str, args)], capture_output=True,
                          text=True, env=ENV, cwd=cwd or ROOT, timeout=300)


def snapshot(root) -> dict:
    out = {}
    for dp, _, fs in os.walk(root):
        for f in fs:
            p = os.path.join(dp, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def truncate(path, keep=0.5):
    with open(path, "r+b") as f:
        f.truncate(int(os.path.getsize(path) * keep))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A corpus, a trained run (checkpoints 2 and 4), an HF model and damaged copies of each."""
    w = tmp_path_factory.mktemp("bad")
    for name, files in (("docs", ("model.py", "rope.py", "loss.py", "optim.py", "step.py", "schedules.py")),
                        ("other", ("config.py", "hf.py", "sharding.py", "splash.py", "attention.py", "cli.py"))):
        os.makedirs(w / name)
        for f in files:
            shutil.copy(os.path.join(ROOT, "olmo3", f), w / name / f"{f}.txt")
    os.makedirs(w / "nan")
    (w / "nan" / "a.jsonl").write_text('{"text": "fine"}\n{"text": NaN}\n')
    os.makedirs(w / "blank")
    (w / "blank" / "a.txt").write_text(" \n\t\n")
    p = script("train.py", *TINY, f"--data={w / 'docs'}", f"--run_dir={w / 'run'}")
    assert p.returncode == 0, p.stderr[-3000:]
    shutil.copytree(w / "run", w / "damaged")
    truncate(w / "damaged" / "checkpoints" / "4" / "state" / "_sharding")
    shutil.copytree(w / "run", w / "nometa")
    os.remove(w / "nometa" / "checkpoints" / "4" / "state" / "_METADATA")
    # Checkpoint 4 with one bit of a tensor flipped (the read succeeds; the checksum differs), with
    # its largest data file cut short, and checkpoint 2 copied under the label 6.
    import tensorstore as ts
    shutil.copytree(w / "run", w / "flipped")
    t = ts.open({"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{w / 'flipped/checkpoints/4/state'}",
                                               "path": "model.norm"}}, open=True, read=True, write=True).result()
    flipped = t.read().result()
    flipped.view(np.uint32)[0] ^= 1 << 3
    t.write(flipped).result()
    shutil.copytree(w / "run", w / "cut")
    data = w / "cut" / "checkpoints" / "4" / "state" / "ocdbt.process_0" / "d"
    truncate(max((data / f for f in os.listdir(data)), key=os.path.getsize), 0.1)
    shutil.copytree(w / "run", w / "relabeled")
    shutil.copytree(w / "run" / "checkpoints" / "2", w / "relabeled" / "checkpoints" / "6")
    shutil.copytree(w / "run", w / "badmetrics")
    # The corpus the run prepared (<run_dir>/../data/<name>), as a --data_dir.
    shutil.copytree(next(d for d in (w / "data").iterdir() if (d / "manifest.json").exists()), w / "prepared_docs")
    with open(w / "badmetrics" / "metrics.jsonl", "a") as f:
        f.write("{not json\n")
    # An HF directory (ours, written by olmo3.hf.to_hf) and broken copies of it.
    p = script("convert.py", f"--from=orbax:{w / 'run'}", f"--to=hf:{w / 'hf'}")
    assert p.returncode == 0, p.stderr[-3000:]
    cfg = json.loads((w / "hf" / "config.json").read_text())
    for name, text in (("hf_badjson", json.dumps(cfg)[:40]), ("hf_llama", json.dumps({**cfg, "model_type": "llama"}))):
        shutil.copytree(w / "hf", w / name)
        (w / name / "config.json").write_text(text)
    # A consistent HF model of another tokenizer (1000 rows of vocabulary), and one with a NaN weight.
    from safetensors.numpy import load_file, save_file
    shutil.copytree(w / "hf", w / "hf_small_vocab")
    shutil.copytree(w / "hf", w / "hf_nan")
    for f in os.listdir(w / "hf"):
        if f.endswith(".safetensors"):
            t = load_file(w / "hf" / f)
            save_file({k: v[:1000] if k.endswith(("embed_tokens.weight", "lm_head.weight")) else v for k, v in t.items()},
                      w / "hf_small_vocab" / f)
            q = "model.layers.0.self_attn.q_proj.weight"
            if q in t:
                t[q] = t[q].copy()
                t[q][0, 0] = np.nan
                save_file(t, w / "hf_nan" / f)
    (w / "hf_small_vocab" / "config.json").write_text(json.dumps({**cfg, "vocab_size": 1000}))
    os.makedirs(w / "olmo_core_step" / "model_and_optim")   # the layout of an OLMo-core trainer checkpoint
    os.makedirs(w / "nonempty")
    (w / "nonempty" / "keep.txt").write_text("mine")
    (w / "bad.flags").write_text("--lr=nan\n")
    (w / "binary.flags").write_bytes(bytes(range(128, 256)))   # a file that is no text (a checkpoint's, say)
    (w / "nested.flags").write_text(f"--max_steps=2\n--flagfile={w / 'binary.flags'}\n")
    (w / "dashless.flags").write_text("# a setting written as in a config file\nlr=3e-4\n")
    (w / "loop_a.flags").write_text(f"--max_steps=2\n--flagfile={w / 'loop_b.flags'}\n")
    (w / "loop_b.flags").write_text(f"# back to the first\n--flagfile={w}/./loop_a.flags\n")   # another spelling
    (w / "bom.flags").write_bytes("\ufeff--max_steps=2\n".encode())   # saved by an editor as "UTF-8 with BOM"
    os.makedirs(w / "ckfile")
    (w / "ckfile" / "checkpoints").write_text("")
    (w / "empty.jsonl").write_text("")
    np.arange(10, dtype=np.uint32).tofile(w / "short.npy")   # ten tokens: no window of 32
    for d in ("ta", "tb"):   # two tasks of one file name
        os.makedirs(w / d)
        (w / d / "mc.jsonl").write_text('{"context": "a", "choices": ["x", "y"], "gold": 0}\n')
    return w


def _cases(w):
    """(id, script, args, status, culprit: text the error line must contain). `new` is a run
    directory no case may leave a checkpoint in."""
    T = [*TINY, f"--data={w / 'docs'}"]
    new = w / "new_run"
    prepared = w / "prepared_docs"
    return [
        # Replaced by the other corpus (a warning only): the build was lost, and the run trained on what was not meant.
        ("data_dir_of_another_corpus", "train.py", [*TINY, f"--data={w / 'other'}", f"--data_dir={prepared}",
                                                    f"--run_dir={new}"], 2,
         f"{prepared} holds the prepared corpus of {str(w / 'docs')!r}, not of {str(w / 'other')!r}; nothing was "
         "changed"),
        ("eval_data_dir_of_another_corpus", "eval.py", [f"--model={w / 'run'}", f"--heldout={w / 'other'}",
                                                        f"--eval_data_dir={prepared}"], 2,
         f"{prepared} holds the prepared corpus of {str(w / 'docs')!r}, not of {str(w / 'other')!r}"),
        # Ignored: the mix was read from its default root.
        ("data_dir_with_a_mix", "train.py", [*TINY, "--data=mix:OLMo-mix-0625-official", f"--data_dir={prepared}",
                                             f"--run_dir={new}"], 2,
         "--data=mix:OLMo-mix-0625-official is read as it is: drop --data_dir, or give the mirror as --data_root"),
        # A directory named '~' in the working directory, exit 0.
        ("run_dir_under_an_unexpanded_tilde", "train.py", [*T, "--run_dir=~/olmo3-run"], 2,
         "--run_dir='~/olmo3-run': '~' is not expanded after --flag= or in a flagfile; write the whole path"),
        ("mesh_malformed", "train.py", [*T, f"--run_dir={new}", "--mesh=fsdp:x"], 2, "--mesh='fsdp:x'"),
        ("mesh_impossible", "train.py", [*T, f"--run_dir={new}", "--mesh=fsdp:3"], 2, "--mesh='fsdp:3'"),
        ("context_impossible", "train.py", [*T, f"--run_dir={new}", "--mesh=context:3"], 2,
         "--mesh='context:3': 3 does not divide the 2 global devices"),
        ("context_seq_indivisible", "train.py", [*T, f"--run_dir={new}", "--mesh=context:2", "--seq_len=30"], 2,
         "--seq_len=30 is not divisible by 2 x context = 4"),
        ("run_dir_remote", "train.py", [*T, "--run_dir=gs://bucket/run"], 2,
         "--run_dir='gs://bucket/run': the run directory is written through the local filesystem"),
        ("run_dir_under_a_file", "train.py", [*T, f"--run_dir={w / 'bad.flags' / 'run'}"], 2,
         f"--run_dir='{w / 'bad.flags' / 'run'}': {w / 'bad.flags'} is a file, not a directory"),
        ("global_batch_indivisible", "train.py", [*T, f"--run_dir={new}", "--global_batch=3"], 2,
         "--global_batch=3: the global batch 3 is not divisible by the 2 global devices"),
        ("corpus_missing", "train.py", [*TINY, f"--data={w / 'nowhere'}", f"--run_dir={new}"], 2,
         f"corpus directory '{w / 'nowhere'}' does not exist"),
        ("nan_in_data", "train.py", [*TINY, f"--data={w / 'nan'}", f"--run_dir={new}"], 2,
         "a.jsonl:2: 'text' must be a string"),
        ("corpus_all_blank", "train.py", [*TINY, f"--data={w / 'blank'}", f"--run_dir={new}"], 2,
         f"corpus '{w / 'blank'}' gives no training document: every document is blank"),
        # A warm start into another --param_dtype skipped the checksums and trained on the flipped bit.
        ("init_from_changed_bits_into_bf16", "train.py", [*T, "--stage=2", f"--run_dir={new}",
                                                           f"--init_from={w / 'flipped'}", "--param_dtype=bfloat16"],
         2, "1 tensor(s) read back with other bits than were saved, e.g. ['model.norm']"),
        # A fresh run inside the committed checkpoint 4, exit 0.
        ("run_dir_a_checkpoint", "train.py", [*T, f"--run_dir={w / 'run' / 'checkpoints' / '4'}", "--resume"], 2,
         f"--run_dir={w / 'run' / 'checkpoints' / '4'} lies in the checkpoints of the run {w / 'run'}: pass "
         f"--run_dir={w / 'run'}"),
        # A traceback, exit 1: retried by --resume_until_done.
        ("resume_checkpoint_under_another_label", "train.py", [*T, f"--run_dir={w / 'relabeled'}", "--resume",
                                                               "--total_steps=8"], 2,
         f"--resume: checkpoint {w / 'relabeled' / 'checkpoints' / '6'} holds the state after step 2, not 6: a copy "
         "under another label? Move it out of checkpoints/, then resume"),   # checkpoints/2 is there
        ("init_from_an_hf_directory", "train.py", [*T, "--stage=2", f"--run_dir={new}", f"--init_from={w / 'hf'}"], 2,
         f"{w / 'hf'}: a Hugging Face directory, not a run directory; convert it first: python convert.py "
         f"--from=hf:{w / 'hf'} --to=orbax:<new run dir>"),
        ("init_from_missing", "train.py", [*T, "--stage=2", f"--run_dir={new}", f"--init_from={w / 'nowhere'}"],
         2, f"{w / 'nowhere'}: not a run directory"),
        # absl's own line was "error: ERROR:: Unable to open flagfile: [Errno 2] ..." with no fix.
        ("flagfile_missing", "train.py", [f"--flagfile={w / 'none.flags'}"], 2,
         f"--flagfile='{w / 'none.flags'}': No such file or directory; give an existing flagfile"),
        # A UnicodeDecodeError traceback from absl (exit 1), naming no file.
        ("flagfile_binary_inside_a_flagfile", "train.py", [f"--flagfile={w / 'nested.flags'}"], 2,
         f"--flagfile='{w / 'binary.flags'}' is not UTF-8 text (invalid start byte at byte 0); give a text file"),
        # absl skipped the file with a warning, and the 7B defaults ran (45 s of compiling, then out of memory).
        ("flagfile_including_itself", "train.py", [f"--flagfile={w / 'loop_a.flags'}"], 2,
         f"--flagfile='{w}/./loop_a.flags' includes itself ({w / 'loop_a.flags'} -> {w / 'loop_b.flags'} -> "
         f"{w}/./loop_a.flags); absl skips such a file"),
        # "Unknown arguments [...]; every setting is a --flag": no file named, no fix for the line.
        ("flagfile_line_without_dashes", "train.py", [f"--flagfile={w / 'dashless.flags'}", *T, f"--run_dir={new}"],
         2, f"Unknown arguments ['lr=3e-4'], a line of --flagfile='{w / 'dashless.flags'}'; write each setting as "
            "--name=value"),
        ("flagfile_with_a_bom", "eval.py", [f"--flagfile={w / 'bom.flags'}"], 2,
         f", a line of --flagfile='{w / 'bom.flags'}'; it begins with a byte-order mark: save the file as UTF-8 "
         "without BOM"),
        ("flagfile_binary_convert", "convert.py", [f"--flagfile={w / 'binary.flags'}"], 2,
         f"--flagfile='{w / 'binary.flags'}' is not UTF-8 text"),
        # Past int32: an OverflowError traceback at the first step, a run directory left behind.
        ("total_steps_past_int32", "train.py", [*T, f"--run_dir={new}", "--total_steps=3000000000"], 2,
         "--total_steps must be > 0 and < 2,147,483,648"),
        ("model_seed_past_32_bits", "train.py", [*T, f"--run_dir={new}", "--model_seed=4294967296"], 2,
         "--model_seed must be >= 0 and < 4,294,967,296 (a 32-bit PRNG seed)"),   # was seed 0's model
        ("data_empty", "train.py", [*TINY, "--data=", f"--run_dir={new}"], 2,
         "--data must be 'stdlib', a directory of documents or 'mix:NAME'"),
        # Another stage's flags were ignored without a word.
        ("sft_heldout_in_stage_1", "train.py", [*T, f"--run_dir={new}", f"--sft_heldout={w / 'docs'}"], 2,
         "--sft_heldout applies to --stage=sft only, and this run is --stage=1: drop --sft_heldout"),
        ("num_processes_zero", "train.py", [*T, f"--run_dir={new}", "--num_processes=0"], 2,
         "--num_processes / JAX_NUM_PROCESSES = 0 must be >= 1"),
        ("lr_nan_flag", "train.py", [*T, f"--run_dir={new}", "--lr=nan"], 2, "--lr must be finite and > 0"),
        ("lr_nan_flagfile", "train.py", [*T, f"--run_dir={new}", f"--flagfile={w / 'bad.flags'}"], 2,
         "--lr must be finite and > 0"),
        ("beta_out_of_range", "train.py", [*T, f"--run_dir={new}", "--b2=1.0"], 2, "--b2 must be in [0, 1)"),
        ("max_restarts_zero", "train.py", [*T, f"--run_dir={new}", "--resume_until_done", "--max_restarts=0"], 2,
         "--max_restarts must be >= 1"),
        ("keep_no_checkpoint", "train.py", [*T, f"--run_dir={new}", "--keep_checkpoints=0"], 2,
         "--keep_checkpoints must be >= 1"),
        ("loss_chunk_zero", "train.py", [*T, f"--run_dir={new}", "--loss_chunk=0"], 2, "--loss_chunk must be > 0"),
        ("seq_len_one", "train.py", [*T, f"--run_dir={new}", "--seq_len=1"], 2, "--seq_len must be >= 2"),
        ("flagfile_missing_eval", "eval.py", ["--flagfile=nowhere.flags"], 2,
         "--flagfile='nowhere.flags': No such file or directory; give an existing flagfile (a relative path is read "
         f"from the current directory, {ROOT})"),
        ("seq_len_past_positions", "train.py", [*T, f"--run_dir={new}", "--seq_len=8192"], 2,
         "--seq_len=8192 exceeds the model's max_position_embeddings=4096"),
        ("unknown_downstream_task", "train.py", [*T, f"--run_dir={new}", "--downstream_tasks=bogus"], 2,
         "--downstream_tasks: unknown task 'bogus'"),
        ("downstream_never_scored", "train.py", [*T, f"--run_dir={new}", "--downstream_tasks=arc_easy_rc_5shot"], 2,
         "--downstream_eval_interval=10000 is past the schedule horizon --total_steps=4, so --downstream_tasks would "
         "never be scored"),
        ("data_dir_unwritable", "train.py", [*T, f"--run_dir={new}", "--data_dir=/proc/nonexistent/d"], 2,
         "--data_dir='/proc/nonexistent/d': cannot write a file in /proc"),   # a bare errno, after the tokenizer
        ("eval_data_dir_unwritable", "eval.py", [f"--model={w / 'run'}", f"--heldout={w / 'docs'}",
                                                 "--eval_data_dir=/proc/nonexistent/d"], 2,
         "--eval_data_dir='/proc/nonexistent/d': cannot write a file in /proc"),
        ("yarn_factor_at_stage_1", "train.py", [*T, f"--run_dir={new}", "--yarn_factor=4"], 2,   # it was ignored
         "--yarn_factor configures YaRN, which --stage=1 leaves off by default: add --yarn, or drop --yarn_factor"),
        ("data_root_without_a_mix", "train.py", [*T, f"--run_dir={new}", "--data_root=http://mirror"], 2,
         "--data_root=http://mirror is the root URL of a data mix (--data=mix:NAME)"),
        ("warmup_past_horizon", "train.py", [*T, f"--run_dir={new}", "--warmup_steps=9"], 2, "--warmup_steps=9"),
        ("dpo_beta_zero", "train.py", [*T, "--stage=dpo", f"--run_dir={new}", "--dpo_beta=0"], 2,
         "--dpo_beta=0.0 must be finite and > 0"),
        # Each refused only after the corpus was prepared (and packed: minutes at scale).
        ("epochs_zero", "train.py", [*T, f"--run_dir={new}", "--epochs=0"], 2, "--epochs must be >= 1 passes"),
        # Every other recipe number a flag validator guards (olmo3/cli.py require): each value passed
        # into the run would divide by zero, never save or evaluate, or build an invalid kernel or seed.
        *[(f"{flag}_{value}", "train.py", [*T, f"--run_dir={new}", *extra, f"--{flag}={value}"], 2,
           f"--{flag} must be {says}") for flag, value, extra, says in [
            ("eps", "0", [], "finite and > 0"), ("b1", "1", [], "in [0, 1)"),
            ("max_grad_norm", "0", [], "finite and > 0"), ("weight_decay", "inf", [], "finite and >= 0"),
            ("global_batch", "0", [], "> 0"), ("save_interval", "0", [], "> 0"), ("eval_interval", "0", [], "> 0"),
            ("downstream_eval_interval", "0", [], "> 0"), ("eval_batches", "-1", [], ">= 0"),
            ("yarn_factor", "0.5", ["--yarn"], ">= 1"), ("yarn_original_max_position", "0", ["--yarn"], ">= 1"),
            ("peak_tflops", "0", [], "finite and > 0"), ("micro_batch", "0", [], ">= 1 instances per device"),
            ("seed", "-1", [], ">= 0"), ("joined_at", "0", ["--max_steps=2"], ">= 1 and < 2,147,483,648"),
            ("splash_block_q", "12", [], "a positive multiple of 8"),
            ("splash_block_kv", "0", [], "a positive multiple of 8"),
            ("total_steps", "0", [], "> 0 and < 2,147,483,648"), ("warmup_steps", "-1", [], ">= 0 and < 2,147,483,648"),
            ("downstream_limit", "0", [], "> 0"), ("downstream_batch", "0", [], "> 0"),
            ("source_group_size", "0", [], ">= 1"), ("epochs", "3000000000", [], ">= 1 passes"),
            ("warmup_fraction", "1.5", [], "in [0, 1]")]],
        ("run_dir_empty", "train.py", [*T, "--run_dir="], 2, "--run_dir must be a directory (it is empty)"),
        ("data_only_commas", "train.py", [*TINY, "--data=,", f"--run_dir={new}"], 2,
         "--data must be 'stdlib', a directory of documents or 'mix:NAME' (it names no corpus)"),
        # What --stage=dpo / --stage=sft cannot train on, refused before the model is built.
        ("dpo_packed", "train.py", [*T, "--stage=dpo", f"--run_dir={new}", "--packed"], 2,
         f"--stage=dpo trains on preference pairs: --data must be a directory written by python -m data.prepare_dpo "
         f"(got --data={w / 'docs'} --packed)"),
        ("dpo_on_a_mix", "train.py", [*TINY, "--stage=dpo", "--data=mix:OLMo-mix-0625-official", f"--run_dir={new}"],
         2, "python -m data.prepare_dpo (got --data=mix:OLMo-mix-0625-official)"),
        ("dpo_beta_inf", "train.py", [*T, "--stage=dpo", f"--run_dir={new}", "--dpo_beta=inf"], 2,
         "--dpo_beta=inf must be finite and > 0"),   # non-finite losses after the whole reference pass
        ("reference_cache_a_directory", "train.py", [*T, "--stage=dpo", f"--run_dir={new}",
                                                     f"--reference_cache={w / 'docs'}"], 2,
         f"--reference_cache={str(w / 'docs')!r} is a directory; give a file path"),
        ("reference_cache_under_a_file", "train.py", [*T, "--stage=dpo", f"--run_dir={new}",
                                                      f"--reference_cache={w / 'bad.flags' / 'r.npz'}"], 2,
         f"--reference_cache='{w / 'bad.flags' / 'r.npz'}': {w / 'bad.flags'} is a file, not a directory"),
        ("sft_without_label_masks", "train.py", [*T, "--stage=sft", "--packed", f"--run_dir={new}"], 2,
         "--stage=sft trains on packed conversations with label masks: add --packed --label_masks"),
        # Each would have been ignored without a word.
        ("tokenizer_without_a_mix", "train.py", [*T, f"--run_dir={new}", "--tokenizer=llama2"], 2,
         "--tokenizer=llama2 picks a data mix's token files (--data=mix:NAME)"),
        ("eval_padded_dpo", "train.py", [*T, "--stage=dpo", f"--run_dir={new}", "--eval_padded"], 2,
         "--stage=dpo scores its held-out preference pairs: drop --eval_padded"),
        *[(f"{flag}_in_stage_1", "train.py", [*T, f"--run_dir={new}", f"--{flag}={value}"], 2,
           f"--{flag} applies to --stage=dpo only, and this run is --stage=1: drop --{flag}")
          for flag, value in (("reference_cache", w / "r.npz"), ("dpo_loss", "dpo"), ("dpo_heldout", w / "docs"))],
        *[(f"{flag}_unpacked", "train.py", [*T, f"--run_dir={new}", f"--{flag}{value}"], 2,
           "--source_group_size, --source_permutation_seed, --label_masks and --packing_cache only apply with --packed")
          for flag, value in (("source_group_size", "=2"), ("source_permutation_seed", "=3"), ("label_masks", ""))],
        *[(f"{flag}_without_tasks", "train.py", [*T, f"--run_dir={new}", f"--{flag}=3"], 2,
           f"--{flag} applies only with --downstream_tasks; add it, or drop --{flag}")
          for flag in ("downstream_limit", "downstream_batch")],
        ("yarn_original_max_position_at_stage_1", "train.py", [*T, f"--run_dir={new}",
                                                               "--yarn_original_max_position=16"], 2,
         "--yarn_original_max_position configures YaRN, which --stage=1 leaves off by default"),
        ("warmup_fraction_nan", "train.py", [*T, f"--run_dir={new}", "--warmup_fraction=nan"], 2,
         "--warmup_fraction must be in [0, 1]"),
        ("vocab_smaller_than_the_tokenizer", "train.py", [*T, f"--run_dir={new}", "--vocab_size=100"], 2,
         "--vocab_size=100 is smaller than the tokenizer's 100278: give at least 100278"),
        # Ran on the linear schedule, exit 0.
        ("joined_at_on_a_linear_schedule", "train.py", [*T, "--stage=2", f"--run_dir={new}", "--joined_at=5",
                                                        "--max_steps=2"], 2,
         "--joined_at=5 joins two cosine schedules (AI2's stage 1); this run's schedule is linear (--stage=2's "
         "default): add --schedule=cosine, or drop --joined_at"),
        # Each ran, exit 0, doing nothing (the checkpoint even recorded doc_lengths: true).
        ("z_loss_in_dpo", "train.py", [*T, "--stage=dpo", f"--run_dir={new}", "--z_loss=1e-3"], 2,
         "--z_loss=0.001 has no effect with --stage=dpo: the DPO loss is the whole objective"),
        ("doc_lengths_in_dpo", "train.py", [*T, "--stage=dpo", f"--run_dir={new}", "--doc_lengths"], 2,
         "--doc_lengths=True has no effect with --stage=dpo: each side of a pair is one sequence, padded; drop it"),
        ("repetition_filter_in_dpo", "train.py", [*T, "--stage=dpo", f"--run_dir={new}", "--repetition_filter"], 2,
         "--repetition_filter=True has no effect with --stage=dpo"),
        ("eval_padded_sft", "train.py", [*T, "--stage=sft", "--packed", "--label_masks", f"--run_dir={new}",
                                         "--eval_padded"], 2,
         "--eval_padded pads held-out pretraining documents one per row (OLMo-core's validation sets); --stage=sft"),
        ("joined_schedule_without_stop", "train.py", [*T, f"--run_dir={new}", "--joined_at=2"], 2,
         "--joined_at=2: the joined schedule's second cosine runs to --total_steps"),
        ("checkpoint_of_another_model", "train.py", [*T, f"--run_dir={w / 'run'}", "--resume", "--d_model=64",
                                                     "--head_dim=32"], 2, "model config differs"),
        ("checkpoint_of_another_stage", "train.py", [*T, f"--run_dir={w / 'run'}", "--resume", "--stage=2"], 2,
         "checkpoint is stage 1, flags say --stage=2"),
        ("fingerprint_mismatch", "train.py", [*TINY, f"--data={w / 'other'}", f"--run_dir={w / 'run'}", "--resume",
                                              "--total_steps=6"], 2,
         "fingerprint"),
        ("packed_on_resume", "train.py", [*T, f"--run_dir={w / 'run'}", "--resume", "--packed", "--total_steps=6"], 2,
         "this run packs documents (--packed) and the checkpoint's did not, so the data order would differ. Drop "
         "--packed, or pass allow_fingerprint_mismatch=True (train.py --allow_data_change)"),
        ("seed_changed_on_resume", "train.py", [*T, f"--run_dir={w / 'run'}", "--resume", "--seed=7"], 2,
         "--resume: the checkpoint was trained with --seed="),
        ("rerun_without_resume", "train.py", [*T, f"--run_dir={w / 'run'}"], 2,
         f"--run_dir={w / 'run'} already holds a run (checkpoints up to step 4); add --resume"),
        ("model_size_zero", "train.py", [*T, f"--run_dir={new}", "--d_model=0"], 2, "d_model=0 must be >= 1"),
        ("cudnn_on_a_cpu", "train.py", [*T, f"--run_dir={new}", "--attention=cudnn"], 2,
         "--attention=cudnn is cuDNN's fused attention, for NVIDIA GPUs; this run's devices are cpu"),
        ("max_steps_zero", "train.py", [*T, f"--run_dir={new}", "--max_steps=0"], 2, "--max_steps must be >= 1"),
        ("data_dir_a_file", "train.py", [*T, f"--run_dir={new}", f"--data_dir={w / 'bad.flags'}"], 2,
         f"--data_dir='{w / 'bad.flags'}': {w / 'bad.flags'} is a file, not a directory"),
        ("checkpoints_a_file", "train.py", [*T, f"--run_dir={w / 'ckfile'}"], 2,
         f"--run_dir='{w / 'ckfile'}': {w / 'ckfile' / 'checkpoints'} is a file, not a directory"),
        ("packing_cache_under_a_file", "train.py", [*T, f"--run_dir={new}", "--packed",
                                                    f"--packing_cache={w / 'bad.flags' / 'cache'}"], 2,
         f"--packing_cache='{w / 'bad.flags' / 'cache'}': {w / 'bad.flags'} is a file, not a directory"),
        ("packing_cache_unwritable", "train.py", [*T, f"--run_dir={new}", "--packed", "--packing_cache=/proc/cache"],
         2, "--packing_cache='/proc/cache': cannot write a file in /proc"),
        ("coordinator_without_port", "train.py", [*T, f"--run_dir={new}", "--coordinator=myhost", "--num_processes=2",
                                                  "--process_id=0"], 2,
         "--coordinator / JAX_COORDINATOR_ADDRESS = 'myhost': give host:port"),
        ("head_dim_odd", "train.py", [*T, f"--run_dir={new}", "--head_dim=15"], 2,
         "head_dim=15 must be even: RoPE rotates pairs of dimensions"),
        ("hang_timeout_nan", "train.py", [*T, f"--run_dir={new}", "--hang_timeout_s=nan"], 2,
         "--hang_timeout_s must be >= 1 second, or 0 (never)"),
        ("hang_timeout_too_short", "train.py", [*T, f"--run_dir={new}", "--hang_timeout_s=0.5"], 2,
         "--hang_timeout_s must be >= 1 second, or 0 (never)"),   # ended every attempt at its first step
        ("diverges", "train.py", [*T, f"--run_dir={new}", "--lr=1e30", "--max_grad_norm=1e30"], 3,
         "No checkpoint was written yet"),
        ("eval_no_model", "eval.py", [], 2, "give --model"),
        ("eval_model_missing", "eval.py", [f"--model={w / 'nowhere'}"], 2, f"{w / 'nowhere'}: not a run directory"),
        ("eval_negative_temperature", "eval.py", [f"--model={w / 'run'}", "--chat=hi", "--temperature=-1"], 2,
         "--temperature=-1.0 must be >= 0"),
        ("eval_batch_size_zero", "eval.py", [f"--model={w / 'run'}", "--eval_batch_size=0"], 2,
         "--eval_batch_size must be >= 1"),
        ("eval_yarn_factor_zero", "eval.py", [f"--model={w / 'run'}", "--yarn", "--yarn_factor=0",
                                              "--yarn_original_max_position=16"], 2, "--yarn_factor must be >= 1"),
        ("eval_steps_empty", "eval.py", [f"--compare={w / 'run'},{w / 'run'}", "--steps="], 2,
         "--steps must be checkpoint step numbers"),   # an IndexError traceback, exit 1
        ("eval_model_step_with_model_b_run", "eval.py", [f"--model={w / 'run'}", "--model_step=2",
                                                         f"--model_b={w / 'run'}"], 2,
         "--model_step=2 picks --model's checkpoint only; give --model_b as the checkpoint to compare with"),
        ("eval_heldout_file_twice", "eval.py", [f"--model={w / 'run'}", f"--heldout=code={w / 'x.npy'},code={w / 'x.npy'}"],
         2, f"is listed twice for domain 'code'"),   # its instances counted twice
        ("eval_heldout_corpus_and_file", "eval.py", [f"--model={w / 'run'}", f"--heldout=stdlib,code={w / 'x.npy'}"], 2,
         "'stdlib' is not domain=file (a domain name without '/', then a token file)"),
        ("eval_max_length_past_positions", "eval.py", [f"--model={w / 'run'}", "--chat=hi", "--max_length=70000"], 2,
         "--max_length=70000 exceeds the model's max_position_embeddings=65536"),   # answered, exit 0
        # Refused only once the model had loaded (here: the missing model was named instead).
        ("eval_max_length_zero", "eval.py", [f"--model={w / 'nowhere'}", "--chat=hi", "--max_length=0"], 2,
         "--max_length must be >= 1 tokens"),
        # Named train.py's --seq_len.
        ("eval_heldout_shorter_than_a_window", "eval.py", [f"--model={w / 'run'}", f"--heldout=h={w / 'short.npy'}",
                                                           "--eval_seq_len=32"], 2,
         "give a shorter --eval_seq_len or more text"),
        ("eval_kl_with_position_buckets", "eval.py", [f"--model={w / 'run'}", f"--model_b={w / 'run'}",
                                                      "--position_buckets=0.5,1", "--kl_instances=4"], 2,
         "--kl_instances applies only with --model_b or --compare (the KL between two models; with "
         "--position_buckets none is computed)"),   # ignored
        ("eval_doc_lengths_with_position_buckets", "eval.py", [f"--model={w / 'run'}", "--position_buckets=0.5,1",
                                                               "--nodoc_lengths"], 2,
         "--doc_lengths does not apply with --position_buckets"),   # ignored
        ("eval_yarn_factor_with_noyarn", "eval.py", [f"--model={w / 'run'}", "--noyarn", "--yarn_factor=4"], 2,
         "--yarn_factor configures YaRN, which --noyarn turns off: drop --yarn_factor"),   # ignored
        ("eval_tasks_of_one_name", "eval.py", [f"--model={w / 'run'}", f"--tasks={w / 'ta' / 'mc.jsonl'},"
                                                                         f"{w / 'tb' / 'mc.jsonl'}"], 2,
         f"--tasks: {w / 'ta' / 'mc.jsonl'} and {w / 'tb' / 'mc.jsonl'} are both named 'mc', and results are keyed "
         "by file name"),   # the second's numbers replaced the first's, exit 0
        ("eval_position_buckets_not_numbers", "eval.py", [f"--model={w / 'run'}", "--position_buckets=a,1"], 2,
         "--position_buckets: position buckets ['a', '1']: give fractions"),
        ("eval_unknown_olmo_task", "eval.py", [f"--model={w / 'run'}", "--olmo_tasks=bogus"], 2,
         "--olmo_tasks: unknown task 'bogus'"),
        # With --compare the check came after both runs' checkpoints of the first step were scored.
        ("eval_compare_unknown_olmo_task", "eval.py", [f"--compare={w / 'run'},{w / 'run'}", "--olmo_tasks=bogus"], 2,
         "--olmo_tasks: unknown task 'bogus'"),
        ("eval_model_url", "eval.py", ["--model=gs://bucket/run"], 2,
         "gs://bucket/run: a URL; checkpoints are read through the local filesystem"),
        ("eval_damaged_checkpoint", "eval.py", [f"--model={w / 'damaged'}", f"--heldout={w / 'docs'}"], 2,
         f"{w / 'damaged' / 'checkpoints' / '4' / 'state' / '_sharding'} does not read back"),
        # Dozens of tracebacks (TensorStore's abandoned reads) buried the line, which named no tensor.
        ("eval_checkpoint_data_cut_short", "eval.py", [f"--model={w / 'cut'}", f"--heldout={w / 'docs'}"], 2,
         f"checkpoint {w / 'cut' / 'checkpoints' / '4'} is damaged: tensor '"),
        # Ignored: step 2 was scored.
        ("eval_model_step_of_another_checkpoint", "eval.py", [f"--model={w / 'run' / 'checkpoints' / '4'}",
                                                              "--model_step=2", f"--heldout={w / 'docs'}"], 2,
         f"{w / 'run' / 'checkpoints' / '4'} is checkpoint 4, and a step (eval.py --model_step=2) names another"),
        ("eval_out_a_file", "eval.py", [f"--model={w / 'run'}", f"--out={w / 'bad.flags'}"], 2,
         f"--out='{w / 'bad.flags'}' is a file; give a directory"),
        ("eval_out_under_a_file", "eval.py", [f"--model={w / 'run'}", f"--heldout={w / 'docs'}",
                                              f"--out={w / 'bad.flags' / 'results'}"], 2,
         f"--out='{w / 'bad.flags' / 'results'}': {w / 'bad.flags'} is a file, not a directory"),
        ("eval_out_unwritable", "eval.py", [f"--model={w / 'run'}", f"--heldout={w / 'docs'}", "--out=/proc/results"],
         2, "--out='/proc/results': cannot write a file in /proc"),
        ("eval_model_of_another_tokenizer", "eval.py", [f"--model={w / 'hf_small_vocab'}", f"--heldout={w / 'docs'}"],
         2, f"--model={w / 'hf_small_vocab'}: its vocabulary has 1000 rows, fewer than the 100278 tokens of dolma2"),
        ("eval_olmo_core_checkpoint", "eval.py", [f"--model={w / 'olmo_core_step'}"], 2,
         f"{w / 'olmo_core_step'} is an OLMo-core checkpoint; convert it first: python convert.py --from=olmo-core:"),
        # A KeyError traceback from lm-eval, exit 1 (retried), after the model had loaded.
        ("eval_unknown_lm_eval_task", "eval.py", [f"--model={w / 'run'}", "--lm_eval_tasks=hellaswag,bogus_task"], 2,
         "--lm_eval_tasks: unknown task 'bogus_task'"),
        ("eval_tasks_missing", "eval.py", [f"--model={w / 'run'}", f"--tasks={w / 'none.jsonl'}"], 2,
         f"--tasks: '{w / 'none.jsonl'}' is not a file"),
        ("eval_tasks_empty", "eval.py", [f"--model={w / 'run'}", f"--heldout={w / 'docs'}", f"--tasks={w / 'empty.jsonl'}"],
         2, f"{w / 'empty.jsonl'}: no documents"),
        ("eval_limit_zero", "eval.py", [f"--model={w / 'run'}", "--limit=0"], 2, "--limit must be >= 1"),
        ("eval_steps_not_numbers", "eval.py", [f"--compare={w / 'run'},{w / 'run'}", "--steps=abc"], 2,
         "--steps must be checkpoint step numbers"),
        ("eval_checkpoint_without_metadata", "eval.py", [f"--model={w / 'nometa'}", f"--heldout={w / 'docs'}"], 2,
         f"No such file: '{w / 'nometa' / 'checkpoints' / '4' / 'state' / '_METADATA'}'"),
        ("eval_hf_config_not_json", "eval.py", [f"--model={w / 'hf_badjson'}"], 2,
         f"{w / 'hf_badjson' / 'config.json'}' is not valid JSON"),
        ("eval_chat_empty", "eval.py", [f"--model={w / 'run'}", "--chat="], 2, "--chat takes one non-empty user message"),
        ("eval_top_p_out_of_range", "eval.py", [f"--model={w / 'run'}", "--chat=hi", "--temperature=0.5", "--top_p=0"],
         2, "--top_p=0.0 must be in (0, 1]"),
        ("eval_top_p_greedy", "eval.py", [f"--model={w / 'run'}", "--chat=hi", "--top_p=0.95"], 2,
         "--top_p=0.95 applies to sampling; give --temperature > 0"),
        ("eval_negative_sample_seed", "eval.py", [f"--model={w / 'run'}", "--chat=hi", "--temperature=0.5",
                                                  "--sample_seed=-1"], 2, "--sample_seed=-1 must be >= 0"),
        ("eval_chat_with_model_b", "eval.py", [f"--model={w / 'run'}", "--chat=hi", f"--model_b={w / 'run'}"], 2,
         "--model_b does not apply with --chat"),
        ("eval_chat_file_with_olmo_tasks", "eval.py", [f"--model={w / 'run'}", f"--chat_file={w / 'bad.flags'}",
                                                       "--olmo_tasks=arc_easy_rc_5shot"], 2,
         "--olmo_tasks does not apply with --chat_file"),
        ("eval_compare_with_chat", "eval.py", [f"--compare={w / 'run'},{w / 'run'}", "--chat=hi"], 2,
         "--chat does not apply with --compare"),
        ("eval_chat_and_chat_file", "eval.py", [f"--model={w / 'run'}", "--chat=hi", f"--chat_file={w / 'bad.flags'}"], 2,
         "and not with --chat_file"),
        ("eval_compare_with_position_buckets", "eval.py", [f"--compare={w / 'run'},{w / 'run'}",
                                                           "--position_buckets=0.5,1"], 2,
         "--position_buckets does not apply with --compare"),
        ("eval_train_loss_window_two", "eval.py", [f"--compare={w / 'run'},{w / 'run'}", "--train_loss_window=2"], 2,
         "--train_loss_window must be >= 10"),
        ("eval_metrics_not_json", "eval.py", [f"--compare={w / 'run'},{w / 'badmetrics'}", f"--out={w / 'report'}",
                                              f"--heldout={w / 'docs'}"], 2, "metrics.jsonl:"),
        ("convert_bad_spec", "convert.py", ["--from=foo", f"--to=hf:{w / 'out'}"], 2, "--from='foo'"),
        ("convert_verify_seq_zero", "convert.py", [f"--from=orbax:{w / 'run'}", f"--to=hf:{w / 'out'}", "--verify",
                                                   "--verify_seq=0"], 2, "--verify_seq must be >= 1"),
        # Ignored before: the conversion ran as if it were not given.
        ("convert_max_kl_without_verify", "convert.py", [f"--from=orbax:{w / 'run'}", f"--to=hf:{w / 'out'}",
                                                         "--max_kl=0.5"], 2,
         "--max_kl applies only with --verify; add --verify, or drop --max_kl"),
        # errno's "Not a directory: <file>/config.json", a path the user never typed.
        ("convert_from_hf_a_file", "convert.py", [f"--from=hf:{w / 'bad.flags'}", f"--to=orbax:{w / 'out'}"], 2,
         f"'{w / 'bad.flags'}' is a file: expected an HF model directory"),
        # Written as a checkpoint label that no run could resume.
        ("convert_step_past_int32", "convert.py", [f"--from=hf:{w / 'hf'}", f"--to=orbax:{w / 'out'}",
                                                   "--step=10000000000000000000000000"], 2,
         "--step must be >= 0 and < 2,147,483,648"),
        # Both ignored before.
        ("eval_yarn_with_compare", "eval.py", [f"--compare={w / 'run'},{w / 'run'}", "--yarn"], 2,
         "--yarn does not apply with --compare"),
        ("eval_held_out_flag_with_chat", "eval.py", [f"--model={w / 'run'}", "--chat=hi", "--max_eval_batches=3"], 2,
         "--max_eval_batches does not apply with --chat"),
        # Each ran an evaluation without the part the flag shapes, and said nothing.
        ("eval_tol_without_compare", "eval.py", [f"--model={w / 'run'}", "--tol=0.1"], 2,
         "--tol applies only with --compare=A,B (two runs, step by step); add it, or drop --tol"),
        ("eval_num_fewshot_with_olmo_tasks", "eval.py", [f"--model={w / 'run'}", "--olmo_tasks=arc_easy_rc_5shot",
                                                         "--num_fewshot=5"], 2,
         "--num_fewshot applies only with --tasks or --lm_eval_tasks (an --olmo_tasks label names its own shots"),
        ("eval_kl_instances_without_model_b", "eval.py", [f"--model={w / 'run'}", "--kl_instances=16"], 2,
         "--kl_instances applies only with --model_b or --compare"),
        ("eval_max_length_without_tasks", "eval.py", [f"--model={w / 'run'}", "--max_length=64"], 2,
         "--max_length applies only to what the scorer feeds the model"),
        ("eval_data_root_without_data_mix", "eval.py", [f"--model={w / 'run'}", "--data_root=http://mirror"], 2,
         "--data_root applies only with --data_mix"),
        ("eval_yarn_factor_with_compare", "eval.py", [f"--compare={w / 'run'},{w / 'run'}", "--yarn_factor=4"], 2,
         "--yarn_factor does not apply with --compare"),
        ("eval_model_step_of_hf", "eval.py", [f"--model={w / 'hf'}", "--model_step=2"], 2,
         f"{w / 'hf'} is a Hugging Face directory, which holds one model; a step (eval.py --model_step=2)"),
        # An evaluation of no task, without a word.
        ("eval_olmo_tasks_only_commas", "eval.py", [f"--model={w / 'run'}", "--olmo_tasks=,"], 2,
         "--olmo_tasks=, names no task"),
        ("dpo_beta_in_stage_1", "train.py", [*T, f"--run_dir={new}", "--dpo_beta=3"], 2,
         "--dpo_beta applies to --stage=dpo only, and this run is --stage=1: drop --dpo_beta"),
        ("init_weights_only_without_init_from", "train.py", [*T, "--stage=2", f"--run_dir={new}", "--init_weights_only"],
         2, "--init_weights_only applies only with --init_from; add it, or drop --init_weights_only"),
        ("allow_data_change_without_resume", "train.py", [*T, f"--run_dir={new}", "--allow_data_change"], 2,
         "--allow_data_change applies only with --resume; add it, or drop --allow_data_change"),
        ("packing_cache_without_packed", "train.py", [*T, f"--run_dir={new}", f"--packing_cache={w / 'cache'}"], 2,
         "--packing_cache only apply with --packed"),
        ("convert_step_negative", "convert.py", [f"--from=hf:{w / 'hf'}", f"--to=orbax:{w / 'out'}", "--step=-1"], 2,
         "--step must be >= 0"),
        ("convert_hf_vocab_below_the_tokenizer", "convert.py", [f"--from=orbax:{w / 'run'}", f"--to=hf:{w / 'out'}",
                                                                "--hf_vocab_size=10"], 2,
         "--hf_vocab_size=10: keep between the 100278 rows of real tokens"),
        # Read as unset: the checkpoint's vocabulary was written, exit 0.
        ("convert_hf_vocab_zero", "convert.py", [f"--from=orbax:{w / 'run'}", f"--to=hf:{w / 'out'}",
                                                 "--hf_vocab_size=0"], 2, "--hf_vocab_size must be >= 1 rows"),
        ("convert_to_url", "convert.py", [f"--from=orbax:{w / 'run'}", "--to=hf:gs://bucket/hf"], 2,
         "--to='hf:gs://bucket/hf': hf: takes a local or mounted directory, not a URL"),
        ("convert_wrong_model_type", "convert.py", [f"--from=hf:{w / 'hf_llama'}", f"--to=orbax:{w / 'out'}"], 2,
         "model_type 'llama'"),
        ("convert_config_not_json", "convert.py", [f"--from=hf:{w / 'hf_badjson'}", f"--to=orbax:{w / 'out'}"], 2,
         f"{w / 'hf_badjson' / 'config.json'}' is not valid JSON"),
        ("convert_onto_nonempty", "convert.py", [f"--from=orbax:{w / 'run'}", f"--to=hf:{w / 'nonempty'}"], 2,
         "exists and is not empty"),
        ("convert_orbax_onto_nonempty", "convert.py", [f"--from=hf:{w / 'hf'}", f"--to=orbax:{w / 'nonempty'}"], 2,
         "exists and is not empty"),
        ("convert_orbax_onto_existing", "convert.py", [f"--from=hf:{w / 'hf'}", f"--to=orbax:{w / 'run'}"], 2,
         "already holds checkpoints"),
        # Before, Orbax's writer thread logged the error with two tracebacks above this line.
        ("convert_hf_nan", "convert.py", [f"--from=hf:{w / 'hf_nan'}", f"--to=orbax:{w / 'out'}"], 2,
         f"{w / 'hf_nan'}: tensor 'model.layers.0.self_attn.q_proj.weight' holds NaN or infinite values"),
        # Ignored: --step=2 of a run converted its newest step, exit 0.
        ("convert_step_from_orbax", "convert.py", [f"--from=orbax:{w / 'run'}", f"--to=hf:{w / 'out'}", "--step=2"], 2,
         "--step applies to the checkpoint written on the Orbax side (--to=orbax:), not to --from=orbax:; to convert "
         "step N of a run, give --from=orbax:<run>/checkpoints/N"),
        ("convert_shard_gb_to_orbax", "convert.py", [f"--from=hf:{w / 'hf'}", f"--to=orbax:{w / 'out'}",
                                                    "--shard_gb=1"], 2, "--shard_gb only applies to --to=hf:"),
        ("convert_with_optimizer_state_from_orbax", "convert.py", [f"--from=orbax:{w / 'run'}", f"--to=hf:{w / 'out'}",
                                                                   "--nowith_optimizer_state"], 2,
         "--with_optimizer_state applies to the checkpoint written on the Orbax side (--to=orbax:)"),
        ("convert_hf_dtype_to_orbax", "convert.py", [f"--from=hf:{w / 'hf'}", f"--to=orbax:{w / 'out'}",
                                                     "--hf_dtype=bfloat16"], 2, "--hf_dtype only applies to --to=hf:"),
        # Both wrote the flipped bit into their output, exit 0 (convert.py reads TensorStore itself).
        ("convert_changed_bits_to_hf", "convert.py", [f"--from=orbax:{w / 'flipped'}", f"--to=hf:{w / 'out'}"], 2,
         f"checkpoint {w / 'flipped' / 'checkpoints' / '4'} is damaged: 1 tensor(s) read back with other bits than "
         "were saved, e.g. ['model.norm']"),
        ("convert_changed_bits_to_olmo_core", "convert.py", [f"--from=orbax:{w / 'flipped'}",
                                                             f"--to=olmo-core:{w / 'out'}"], 2,
         "1 tensor(s) read back with other bits than were saved, e.g. ['model.norm']"),
        ("convert_damaged_checkpoint", "convert.py", [f"--from=orbax:{w / 'damaged'}", f"--to=hf:{w / 'out'}"], 2,
         f"{w / 'damaged' / 'checkpoints' / '4' / 'state' / '_sharding'} does not read back"),
    ]


CASE_IDS = [c[0] for c in _cases(__import__("pathlib").Path("/w"))]


@pytest.fixture(scope="module")
def outcomes(world):
    """Every case run once, three at a time (each is mostly interpreter start-up), each in its own
    copy of the paths it may create; the tree is snapshot before and after all of them."""
    from concurrent.futures import ThreadPoolExecutor
    before = snapshot(world)

    def one(case):
        _, name, args, _, _ = case
        args = [a.replace(str(world / "new_run"), str(world / f"new_{case[0]}"))
                 .replace(str(world / "out"), str(world / f"out_{case[0]}")) for a in map(str, args)]
        return case[0], script(name, *args)

    with ThreadPoolExecutor(3) as pool:
        done = dict(pool.map(one, _cases(world)))
    after = snapshot(world)
    changed = sorted(k for k, v in before.items() if after.get(k) != v)
    return done, changed


@pytest.mark.parametrize("case", CASE_IDS)
def test_bad_input(world, outcomes, case):
    _, name, args, status, culprit = next(c for c in _cases(world) if c[0] == case)
    done, changed = outcomes
    p = done[case]
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert p.returncode == status, (p.returncode, p.stderr[-3000:])
    assert lines and lines[-1].startswith(f"{name}: error: "), p.stderr[-3000:]
    assert culprit.replace("new_run", f"new_{case}") in lines[-1], lines[-1]
    assert "Traceback" not in p.stderr + p.stdout, p.stderr[-3000:]
    assert not changed, f"pre-existing files changed: {changed}"
    ckpts = world / f"new_{case}" / "checkpoints"
    assert not (os.path.isdir(ckpts) and os.listdir(ckpts)) and not os.path.exists(world / f"out_{case}")


def test_warm_start_into_another_model_and_resume_without_a_checkpoint_say_so(world):
    """Both went on without a word: --init_from a checkpoint whose window differs from the flags'
    (its tensors fit, so nothing stopped it), and --resume on a run directory with no checkpoint
    (a mistyped --run_dir of a preempted run trained again from step 0)."""
    run_dir = world / "new_warm_window"
    p = script("train.py", *TINY, f"--data={world / 'docs'}", "--stage=2", f"--init_from={world / 'run'}",
               "--window=8", "--resume", f"--run_dir={run_dir}", "--max_steps=1")
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"--resume: {run_dir / 'checkpoints'} holds no checkpoint yet; a new run from step 0" in p.stderr
    assert (f"--init_from={world / 'run'}: this run's model differs from the checkpoint's (window 16 -> 8); its "
            "tensors fit, so the warm start goes on with the flags' model") in p.stderr, p.stderr[-3000:]


@pytest.mark.parametrize("name,args", [
    ("eval.py", ["--model=/nowhere/run", "--attention=cudnn"]),
    ("benchmarks/bench.py", ["--model=tiny", "--seq_len=64", "--steps=1", "--attention=cudnn"]),
])
def test_cudnn_on_a_cpu_is_refused_by_name(name, args):
    # As train.py's case above. Before, eval.py and bench.py ran on and died at the first attention
    # (after the model loaded) in jax.nn.dot_product_attention: "cuDNN is not detected.", a
    # traceback and exit status 1, naming no flag.
    p = script(name, *args)
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr[-3000:]
    assert lines[-1] == (f"{os.path.basename(name)}: error: --attention=cudnn is cuDNN's fused attention, for NVIDIA "
                         "GPUs; this run's devices are cpu: use --attention=xla (or splash)"), lines[-1]
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("name,args", [
    ("train.py", [*TINY, "--data=/nowhere", "--run_dir=/nowhere/run", "--attention=splash", "--splash_block_q=64"]),
    ("benchmarks/bench.py", ["--model=tiny", "--seq_len=64", "--steps=1", "--attention=splash",
                             "--splash_block_kv=64"]),
])
def test_splash_blocks_off_a_tpu_are_refused_by_name(name, args):
    # Config.splash_block_* are the Mosaic (TPU) kernel's tiles; on a CPU or GPU the Splash kernel
    # picks its own, and the flags were accepted and silently did nothing.
    p = script(name, *args)
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    flag = "--splash_block_q" if name == "train.py" else "--splash_block_kv"
    assert p.returncode == 2, p.stderr[-3000:]
    assert lines[-1] == (f"{os.path.basename(name)}: error: {flag} sets the tiles of the TPU (Mosaic) Splash kernel, "
                         "which this run does not use (devices: cpu, --attention=splash); the GPU Splash kernel "
                         f"picks its own (olmo3/splash_gpu.py block_sizes): drop {flag}"), lines[-1]
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("name,args,says", [
    ("benchmarks/downstream_cost.py", ["--tasks=bogus"], "--tasks: unknown task 'bogus'"),   # named --olmo_tasks
    ("benchmarks/bench_checkpoint.py", ["--repeats=0"], "--repeats must be >= 1"),   # StatisticsError after saving
    ("benchmarks/gpu_check.py", ["--smoke", "--only="], "--only must be one or more parts"),   # an empty table, exit 0
    ("benchmarks/gpu_check.py", ["--smoke", "--only=bogus"], "--only=bogus: unknown part(s) ['bogus']"),   # + usage
    ("benchmarks/bench.py", ["--model=tiny", "--torch_threads=1"],   # ignored without the comparison
     "--torch_threads sets up --compare_torch's torch model: add --compare_torch, or drop --torch_threads"),
])
def test_benchmarks_refuse_bad_flags_by_name(name, args, says):
    """The benchmarks end as the scripts do (olmo3/cli.py): before, app.run printed tracebacks or
    its whole usage text with exit 1."""
    p = script(name, *args)
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr[-3000:]
    assert lines[-1].startswith(f"{os.path.basename(name)}: error: ") and says in lines[-1], lines[-1]
    assert "Traceback" not in p.stderr and len(lines) <= 2, p.stderr[-3000:]


def test_exit_status_before_and_after_the_first_step(monkeypatch):
    """Before the first step a missing file is the user's (2); after it, a file vanishing on a
    flaky mount is retried (1). Bad values (2) and a non-finite state (3) stay final."""
    from olmo3 import cli
    monkeypatch.setattr(cli, "_running", False)
    # Out of device memory as XLA's CPU / GPU allocators and the TPU compiler say it; a storage
    # quota (RESOURCE_EXHAUSTED too) is not memory.
    oom = [RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 3411055920 bytes."),
           RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB.\nBufferAssignment"),
           RuntimeError("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
                        "hbm. Used 20.5G of 15.48G hbm."),
           RuntimeError("INTERNAL: Buffer Definition Event: Error preparing computation: Out of memory allocating "
                        "26810197040 bytes.")]   # jaxlib 0.8's CPU client
    cases = [FileNotFoundError("x"), ValueError("x"), cli.UserError("x"), cli.NonFiniteError("x"),
             OSError("x"), RuntimeError("x"), RuntimeError("RESOURCE_EXHAUSTED: quota exceeded"), *oom]
    assert [cli.exit_status(e) for e in cases] == [2, 2, 2, 3, 1, 1, 1, 2, 2, 2, 2]
    assert cli.one_line(oom[1]) == "out of device memory (RESOURCE_EXHAUSTED: Out of memory while trying to " \
                                   "allocate 2.00GiB)"
    # A storage hiccup is retried whenever it happens: TensorStore raises ValueError("<STATUS>: ...")
    # from an async checkpoint write (it was final, 2); an INTERNAL one once the run is going.
    flaky = [ValueError("UNAVAILABLE: Error writing local file \"/ckpt/3000/d/x\""),
             ValueError("DEADLINE_EXCEEDED: gcsfuse read"), OSError(errno.ESTALE, "Stale file handle"),
             ValueError("INTERNAL: tensorstore write"), ValueError("ABORTED: write"), ValueError("CANCELLED: read")]
    assert [cli.exit_status(e) for e in flaky] == [1, 1, 1, 2, 1, 1]
    # A full disk or spent quota said by errno alone; a permission a rerun cannot get; an
    # out-of-memory text in a ValueError (no XLA error) is not device memory.
    final = [OSError(errno.EDQUOT, ""), PermissionError(errno.EACCES, "Permission denied"),
             ValueError("RESOURCE_EXHAUSTED: Out of memory allocating 8 bytes")]
    assert [cli.exit_status(e) for e in final] == [2, 2, 1] and not cli.is_out_of_memory(final[2])
    cli.mark_running()
    assert [cli.exit_status(e) for e in cases] == [1, 2, 2, 3, 1, 1, 1, 1, 1, 1, 1]
    assert [cli.exit_status(e) for e in flaky] == [1, 1, 1, 1, 1, 1]


FINITE = """
import json, math
import train
from olmo3 import cli
class Ckpt:
    def what_to_resume(self):
        return "Resume from checkpoint 4."
out = []
for m in ({"train/loss": 2.5, "eval/docs/loss": 3.0, "optim/grad_norm": 1.0},
          {"train/loss": 2.5, "eval/docs/loss": math.nan}, {"train/loss": math.inf},
          {"eval/code/loss": 3.0, "eval/docs/olmo_core_ce": 1.0, "eval/docs/loss": -math.inf}):
    try:
        train.check_finite(m, 6, Ckpt())
        out.append(None)
    except Exception as e:
        out.append([cli.exit_status(e), cli.one_line(e)])
print(json.dumps(out))
"""


def test_a_non_finite_held_out_loss_ends_the_run_as_non_finite():
    """train.py's check after each step and evaluation: a NaN / inf loss of any name, the training
    loss or a held-out domain's, ends the run with exit 3 before anything is saved, naming it and
    the checkpoint to resume from. A diverging run's training loss goes non-finite first, so a check
    of the training loss alone passed (the loop's check of an evaluation: tests/test_train.py
    test_a_nan_held_out_loss_in_the_run_stops_it_before_its_save)."""
    p = subprocess.run([sys.executable, "-c", FINITE], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**ENV, "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == [
        None,
        [3, "step 6: NaN or inf in eval/docs/loss=nan; nothing was saved. Resume from checkpoint 4."],
        [3, "step 6: NaN or inf in train/loss=inf; nothing was saved. Resume from checkpoint 4."],
        [3, "step 6: NaN or inf in eval/docs/loss=-inf; nothing was saved. Resume from checkpoint 4."]]


def test_out_of_memory_in_a_programs_first_run_is_final_with_its_advice(monkeypatch):
    """After the first step, out of memory in an evaluation that never completed is final (2) with
    that evaluation's advice: every rerun would train up to it. Once it has completed, a later
    one is retried (1). Other errors pass through unchanged."""
    from olmo3 import cli
    monkeypatch.setattr(cli, "_running", True)
    monkeypatch.setattr(cli, "_ran_once", set())
    monkeypatch.setattr(cli, "_oom_final", False)
    monkeypatch.setattr(cli, "_advice", {"memory": "the step's advice", "disk": ""})
    oom = RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 3411055920 bytes.")

    def attempt(name, error):
        try:
            with cli.first_run(name, "lower --x (now 8)"):
                if error is not None:
                    raise error
        except RuntimeError as e:
            return cli.exit_status(e), cli.one_line(e)
        return None

    assert attempt("evaluation", RuntimeError("a lost host")) == (1, "a lost host")
    assert attempt("evaluation", None) is None           # completes: from now on retried
    assert attempt("evaluation", oom) == (1, "out of device memory (RESOURCE_EXHAUSTED: Out of memory allocating "
                                             "3411055920 bytes): the step's advice")
    assert attempt("downstream", oom) == (2, "out of device memory (RESOURCE_EXHAUSTED: Out of memory allocating "
                                             "3411055920 bytes): downstream: lower --x (now 8)")


def test_a_run_that_does_not_fit_in_memory_ends_as_a_users_error(tmp_path):
    """The first step needs more memory than the device has (here the CPU backend's: host memory,
    capped with RLIMIT_AS; the step's logits alone are ~13 GB, the cap 8 GB, an ordinary run of
    this model peaks at ~2.4 GB of address space): exit 2, so --resume_until_done does not
    rerun it, and one line with XLA's first line and the flags to change, at their values."""
    import resource
    os.makedirs(tmp_path / "code")
    for f in os.listdir(os.path.join(ROOT, "olmo3")):
        if f.endswith(".py"):
            shutil.copy(os.path.join(ROOT, "olmo3", f), tmp_path / "code" / f"{f}.txt")
    cap = lambda: resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))  # noqa: E731
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *TINY, f"--data={tmp_path / 'code'}",
                        f"--run_dir={tmp_path / 'run'}", "--seq_len=128", "--global_batch=512",
                        "--loss_chunk=32768"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**ENV, "MALLOC_ARENA_MAX": "2"}, preexec_fn=cap)
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert lines[-1].startswith("train.py: error: out of device memory (") and "Out of memory " in lines[-1], \
        lines[-1]   # XLA's status: RESOURCE_EXHAUSTED (jaxlib 0.10), INTERNAL (0.8)
    assert lines[-1].endswith("the run does not fit at 256 instance(s) of 128 tokens per device per "
                              "microbatch; lower --micro_batch, use --remat=full (now save_proj), a smaller "
                              "--loss_chunk (now 32768 tokens of fp32 logits), or more devices (--mesh, now "
                              "data:1,fsdp:2; a context axis cuts every sequence)"), lines[-1]
    assert "Traceback" not in p.stderr and not os.listdir(tmp_path / "run" / "checkpoints")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_ends_the_run_as_a_users_error(world, tmp_path):
    """metrics.jsonl on a full disk (a link to /dev/full: every write fails with ENOSPC), first
    written after step 1: exit 2, not 1, since each rerun would train up to a write it cannot
    make; the line says so and what to do. Orbax's own write error (TensorStore's ValueError) is
    recognised too."""
    from olmo3 import cli
    os.makedirs(tmp_path / "run")
    os.symlink("/dev/full", tmp_path / "run" / "metrics.jsonl")
    p = script("train.py", *TINY, f"--data={world / 'docs'}", f"--data_dir={world / 'data' / 'docs'}",
               f"--run_dir={tmp_path / 'run'}", "--keep_checkpoints=2")
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert lines[-1] == (f"train.py: error: disk full: [Errno 28] No space left on device: free space under "
                         f"--run_dir={tmp_path / 'run'} or keep fewer checkpoints (--keep_checkpoints, now 2), then "
                         "run again with --resume"), lines[-1]
    assert "Traceback" not in p.stderr
    orbax = ValueError('RESOURCE_EXHAUSTED: Error writing "model.embed/0.0.0" in OCDBT database at local file '
                       '"/r/checkpoints/2.orbax-checkpoint-tmp/": Failed to write 3612672 bytes to file 11: No space '
                       "left on device [os_error_code='28']")
    assert cli.is_disk_full(orbax) and not cli.is_disk_full(ValueError("RESOURCE_EXHAUSTED: rate limit"))


def test_verbosity_brings_the_traceback_back(world):
    p = script("eval.py", f"--model={world / 'nowhere'}", "--verbosity=1")   # library logs may follow it
    assert p.returncode == 2 and "Traceback" in p.stderr
    assert any(line.startswith("eval.py: error: ") for line in p.stderr.splitlines())


def test_a_horizon_below_the_checkpoint_says_nothing_is_trained(world, tmp_path):
    """--resume with --max_steps below the checkpoint's step trains nothing (exit 0: a finished
    run submitted again is not an error) and says so; its header read "steps 5..2" and no more."""
    shutil.copytree(world / "run", tmp_path / "run")
    p = script("train.py", *TINY, f"--data={world / 'docs'}", f"--run_dir={tmp_path / 'run'}", "--resume",
               "--max_steps=2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Nothing to train: the checkpoint is at step 4, and this run stops at step 2 (--max_steps)" in p.stderr


def test_truncated_token_file_is_rebuilt_and_said(world, tmp_path):
    """A prepared token file cut short is rebuilt (as always), and a warning names it."""
    from data import prepare
    shutil.copytree(world / "run", tmp_path / "run")
    data_dir = world / "data" / prepare.default_dir_name(str(world / "docs"))
    token_file = data_dir / "train" / "train-00000.npy"
    saved = token_file.read_bytes()
    try:
        truncate(token_file)
        p = script("train.py", *TINY, f"--data={world / 'docs'}", f"--data_dir={data_dir}",
                   f"--run_dir={tmp_path / 'run'}", "--resume", "--total_steps=6", "--max_steps=6")
        assert p.returncode == 0, p.stderr[-3000:]
        assert "rebuilding the prepared corpus" in p.stderr and "train-00000.npy" in p.stderr
        assert token_file.read_bytes() == saved  # the same corpus, rebuilt exactly
    finally:
        token_file.write_bytes(saved)


def test_a_corpus_edited_to_the_same_sizes_is_not_resumed_on(world, tmp_path):
    """A document of the corpus edited to another text of the same token count: the rebuilt token
    files have the same names and sizes (the fingerprint), other tokens. --resume stops (exit 2)
    instead of continuing on other data; --allow_data_change continues deliberately."""
    import data
    shutil.copytree(world / "run", tmp_path / "run")
    shutil.copytree(world / "docs", tmp_path / "docs")
    doc = tmp_path / "docs" / "loss.py.txt"
    text = doc.read_text()
    enc = data.dolma2()
    edited = next(e for e in (text.replace(a, b, 1) for a, b in (("0", "1"), ("1", "2"), ("x", "y")))
                  if e != text and len(enc.encode_ordinary(e.strip())) == len(enc.encode_ordinary(text.strip())))
    doc.write_text(edited)
    args = [*TINY, f"--data={tmp_path / 'docs'}", f"--data_dir={tmp_path / 'prepared'}", f"--run_dir={tmp_path / 'run'}",
            "--resume", "--total_steps=6"]
    p = script("train.py", *args)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "the token files' contents differ from the checkpoint's" in p.stderr.strip().splitlines()[-1]
    p = script("train.py", *args, "--allow_data_change")
    assert p.returncode == 0, p.stderr[-3000:]


def _logged(run_dir) -> int:
    path = os.path.join(run_dir, "metrics.jsonl")
    return sum(1 for _ in open(path)) if os.path.exists(path) else 0


def _losses(run_dir) -> dict:
    """step -> train/loss from metrics.jsonl; a step logged again after a resume: last line wins."""
    from test_train import losses
    return losses(run_dir)


RESUME = [*TINY[:-6], "--total_steps=6", "--warmup_steps=1", "--save_interval=2", "--eval_interval=2",
          "--loader_workers=0", "--notune_cpu"]


def test_damaged_newest_checkpoint_falls_back_exactly(world, tmp_path):
    """The newest checkpoint loses half its _sharding file: --resume warns naming it, moves step 4
    aside (never deletes it), resumes from step 2, and every logged loss equals an uninterrupted
    run's (the oracle), so exactly-once data and the step convention survive the fallback."""
    data = [f"--data={world / 'docs'}", f"--data_dir={world / 'data' / 'docs'}"]
    p = script("train.py", *RESUME, *data, f"--run_dir={tmp_path / 'a'}")
    assert p.returncode == 0, p.stderr[-3000:]
    p = script("train.py", *RESUME, *data, f"--run_dir={tmp_path / 'b'}", "--max_steps=4")
    assert p.returncode == 0, p.stderr[-3000:]
    sharding_file = tmp_path / "b" / "checkpoints" / "4" / "state" / "_sharding"
    truncate(sharding_file)
    p = script("train.py", *RESUME, *data, f"--run_dir={tmp_path / 'b'}", "--resume")
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"{sharding_file} does not read back" in p.stderr
    assert (tmp_path / "b" / "damaged" / "4" / "state" / "_sharding").stat().st_size == \
        (tmp_path / "a" / "checkpoints" / "4" / "state" / "_sharding").stat().st_size // 2
    assert sorted(os.listdir(tmp_path / "b" / "checkpoints")) == ["2", "4", "6"]
    want = _losses(tmp_path / "a")
    assert sorted(want) == [1, 2, 3, 4, 5, 6] and _losses(tmp_path / "b") == want


def test_every_checkpoint_damaged_is_not_a_fresh_start(world, tmp_path):
    """--resume on a run whose checkpoints all fail to read back: it used to move them aside and
    train from step 1 in the same run directory, exit 0, which a resubmission loop counts as
    progress. Now exit 2, one line naming the damaged steps and where they went."""
    shutil.copytree(world / "run", tmp_path / "run")
    for step in ("2", "4"):
        truncate(tmp_path / "run" / "checkpoints" / step / "state" / "_sharding")
    p = script("train.py", *TINY, f"--data={world / 'docs'}", f"--run_dir={tmp_path / 'run'}", "--resume")
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and f"no checkpoint of {tmp_path / 'run' / 'checkpoints'} reads back: [2, 4] are " \
        f"damaged, now in {tmp_path / 'run' / 'damaged'}" in last, p.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "run" / "damaged")) == ["2", "4"]
    assert not os.listdir(tmp_path / "run" / "checkpoints")


@pytest.mark.slow
def test_sigkill_anywhere(world, tmp_path):
    """SIGKILL at random moments (mid-step, mid-save, mid-resume and mid-fallback included), at
    least 20 times, rerunning with --resume after each, one checkpoint per step; before every
    third rerun the newest checkpoint is damaged, so that resumes fall back (and some kills land
    mid-fallback). After every kill each complete checkpoint reads back whole; each killed
    sequence, run to its end, logs exactly the uninterrupted run's losses."""
    import random
    import signal
    import time
    sys.path.insert(0, ROOT)
    from olmo3 import checkpoint
    args = [*TINY[:-6], "--total_steps=8", "--warmup_steps=1", "--save_interval=1", "--eval_interval=4",
            "--keep_checkpoints=2", "--loader_workers=0", "--notune_cpu", f"--data={world / 'docs'}",
            f"--data_dir={world / 'data' / 'docs'}"]
    p = script("train.py", *args, f"--run_dir={tmp_path / 'ref'}")
    assert p.returncode == 0, p.stderr[-3000:]
    want = _losses(tmp_path / "ref")
    rng, kills, finished, at, damaged = random.Random(0), 0, 0, [], 0
    run = tmp_path / "run"
    while kills < 20 or finished == 0:   # at least 20 kills, and every killed sequence run to its end
        steps = sorted(int(s) for s in os.listdir(run / "checkpoints") if s.isdigit()) \
            if os.path.isdir(run / "checkpoints") else []
        if len(steps) > 1 and kills % 3 == 2 and kills < 20:   # one to fall back to (all damaged: exit 2)
            truncate(run / "checkpoints" / str(steps[-1]) / "state" / "_sharding")
            damaged += 1
        # The kill is placed by progress, not wall time, so a loaded machine moves it too: after 0-3
        # more logged steps (0: during start-up or resume), plus a random fraction of a step.
        logged = _logged(run)
        target, extra = logged + rng.randint(0, 3), rng.uniform(0.0, 1.5)
        with open(tmp_path / "stderr.txt", "w+") as err:   # a file: a full pipe would stall the run
            proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args, f"--run_dir={run}",
                                     "--resume"], env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
            deadline = time.time() + 600
            while kills < 20 and proc.poll() is None and _logged(run) < target and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(rng.uniform(1.0, 8.0) if target == logged else extra)
            if kills < 20 and proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
            proc.wait(timeout=600)
            err.seek(0)
            assert proc.returncode in (0, -signal.SIGKILL), err.read()[-3000:]
        steps = []
        if os.path.isdir(run / "checkpoints"):   # every complete checkpoint reads back
            mgr = checkpoint.CheckpointManager(str(run), read_only=True)
            steps = mgr.all_steps()
            for step in steps:
                mgr.verify(step)
            mgr.close()
        if proc.returncode == 0:   # a sequence finished: its losses are the uninterrupted run's
            assert _losses(run) == want, (kills, finished)
            finished += 1
            shutil.rmtree(run)
        else:
            at.append(steps[-1] if steps else None)
    print(f"\n{kills} SIGKILLs, {damaged} damaged newest checkpoints, {finished} killed sequences run to "
          f"the end with the uninterrupted losses; newest checkpoint at each kill: {at}")


def test_init_from_missing_stops_before_the_data_are_prepared_or_packed(tmp_path):
    """A mistyped --init_from (the README's stage-2/3 commands name a step directory) stops before
    the data section prepares the corpus, lists a remote mix or packs it: stage 3 packs by scanning
    every token for eos, hours for the 7B's mix, and the error only came after it."""
    os.makedirs(tmp_path / "docs")
    for f in ("model.py", "rope.py", "loss.py"):
        shutil.copy(os.path.join(ROOT, "olmo3", f), tmp_path / "docs" / f"{f}.txt")
    p = script("train.py", *TINY, f"--data={tmp_path / 'docs'}", "--stage=3", "--packed", "--doc_lengths",
               f"--run_dir={tmp_path / 'run'}", f"--init_from={tmp_path / 'run2' / 'checkpoints' / '40'}")
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert f"checkpoint {tmp_path / 'run2' / 'checkpoints' / '40'} does not exist" in last, last
    assert not (tmp_path / "data").exists()   # <run_dir>/../data: nothing prepared, nothing packed


def test_init_from_another_model_stops_before_the_data_are_prepared(world, tmp_path):
    """A warm start whose checkpoint the flags' model does not fit (here --d_model) was refused only
    once §5 read it: after the corpus was prepared (at scale: a mix listed, stage 3's packing), with
    the new run's checkpoints/ made. Its tensors' shapes are read before the data section now."""
    os.makedirs(tmp_path / "docs")
    shutil.copy(os.path.join(ROOT, "olmo3", "model.py"), tmp_path / "docs" / "model.py.txt")
    p = script("train.py", *TINY, f"--data={tmp_path / 'docs'}", "--stage=2", "--d_model=64",
               f"--run_dir={tmp_path / 'run'}", f"--init_from={world / 'run'}")
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert (f"checkpoint {world / 'run' / 'checkpoints' / '4'}: tensor 'model.embed' has shape (100278, 32) "
            "but the model expects (100278, 64)") in last, last
    assert not (tmp_path / "data").exists() and not (tmp_path / "run" / "checkpoints").exists()
