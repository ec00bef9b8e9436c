"""The stage flagfiles encode the OLMo 3 7B recipe of DESIGN §3 (OLMo-core's official scripts)."""
import json
import math
import os
import subprocess
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_PARSE = """
import json, sys, types
import train
F = train.F
F(["train.py", "--flagfile=" + sys.argv[1]])
out = {k: getattr(F, k) for k in ("stage", "model", "seq_len", "global_batch", "seed", "lr", "warmup_steps",
       "total_steps", "final_lr_ratio", "b1", "b2", "eps", "weight_decay", "max_grad_norm", "z_loss",
       "schedule", "skip_steps", "repetition_filter", "vocab_size", "data", "downstream_tasks",
       "downstream_eval_interval", "packed", "doc_lengths", "source_group_size", "source_permutation_seed",
       "eval_padded", "float8", "micro_batch", "label_masks", "warmup_fraction", "epochs", "yarn")}
from data import mixes
mix = F.data.startswith("mix:") and mixes.available_mixes()
out["splits"] = {k: v for k, v in train.resolve_data().items()} if mix else None
print(json.dumps(out))
"""


def parse(stage):
    """Parse a stage flagfile (stage<N>.flags, or a name such as sft_think) with train.py's own flags,
    in a fresh process (absl flags are global: eval.py defines some of the same names)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    name = f"stage{stage}" if isinstance(stage, int) else stage
    p = subprocess.run([sys.executable, "-c", _PARSE, f"{ROOT}/{name}.flags"], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return types.SimpleNamespace(**json.loads(p.stdout.strip().splitlines()[-1]))


def test_stage1_flags():
    F = parse(1)
    assert (F.stage, F.model, F.seq_len, F.global_batch, F.seed) == ("1", "olmo3_7b", 8192, 512, 34521)
    assert F.global_batch * F.seq_len == 4_194_304
    assert (F.lr, F.warmup_steps, F.total_steps, F.final_lr_ratio) == (3e-4, 2000, 1_413_814, 0.1)
    assert (F.b1, F.b2, F.eps, F.weight_decay, F.max_grad_norm, F.z_loss) == (0.9, 0.95, 1e-8, 0.1, 1.0, 1e-5)
    assert F.schedule == "cosine" and F.skip_steps and not F.repetition_filter
    assert F.vocab_size == 100352 and F.data == "mix:OLMo-mix-0625-official"
    assert (F.downstream_tasks, F.downstream_eval_interval) == (["fast"], 10_000)  # OLMo-core's in-loop set
    assert not F.packed  # NumpyFSLDatasetConfig in pretrain-1
    assert F.eval_padded  # OLMo-core's LM evaluators: NumpyPaddedFSLDataset


def test_stage2_flags():
    F = parse(2)
    assert (F.stage, F.seq_len, F.global_batch, F.seed) == ("2", 8192, 256, 1337)
    assert F.global_batch * F.seq_len == 2 ** 21
    assert (F.lr, F.warmup_steps, F.total_steps, F.schedule) == (2.0712352850360292e-4, 0, 47_684, "linear")
    assert F.data == "mix:OLMo-midtraining-mix-0625-100B"
    # DESIGN §3: stage 2 keeps stage 1's optimizer (OLMo-3-1025-7B-midtrain.py), only lr and horizon change
    assert (F.b1, F.b2, F.eps, F.weight_decay, F.max_grad_norm, F.z_loss) == (0.9, 0.95, 1e-8, 0.1, 1.0, 1e-5)
    assert F.skip_steps and not F.repetition_filter and F.vocab_size == 100352 and not F.packed
    assert F.downstream_tasks == []  # OLMo-3-1025-7B-midtrain.py has no downstream evaluator
    assert F.eval_padded


def test_stage3_flags():
    import olmo3
    F = parse(3)
    assert (F.stage, F.model, F.seq_len, F.global_batch) == ("3", "olmo3_7b_long", 65536, 64)
    assert (F.warmup_steps, F.schedule) == (200, "linear")
    assert F.lr == pytest.approx(2.0712e-4, rel=1e-4)
    # DESIGN §3: ~50B tokens at 64 x 65,536 per step; OLMo-core L66 NumpyDataLoaderConfig(seed=34521)
    assert F.total_steps == math.ceil(50e9 / (64 * 65536)) and F.seed == 34521
    assert (F.b1, F.b2, F.eps, F.weight_decay, F.max_grad_norm, F.z_loss) == (0.9, 0.95, 1e-8, 0.1, 1.0, 1e-5)
    assert F.skip_steps and not F.repetition_filter and F.vocab_size == 100352
    assert olmo3.Config.preset(F.model).yarn.factor == 8.0
    assert F.data == "mix:OLMo-longmino-mix-0625"
    # NumpyPackedFSLDatasetConfig(generate_doc_lengths=True, source_group_size=8, source_permutation_seed=123)
    assert (F.packed, F.doc_lengths, F.source_group_size, F.source_permutation_seed) == (True, True, 8, 123)
    assert F.eval_padded
    assert F.downstream_tasks == []  # OLMo-3-1025-7B-long-context.py has no downstream evaluator
    assert F.float8  # Float8Config(enabled=True, ao=AOFloat8LinearConfig.recommended())
    # rank_microbatch_size=sequence_length: one instance per context group per microbatch, the
    # footprint `python -m olmo3.sharding` prints (8 instances at once would need ~8x the activations)
    assert F.micro_batch == 1


@pytest.mark.parametrize("name,lr", [("sft_think", 5e-5), ("sft_instruct", 8e-5)])
def test_sft_flags(name, lr):
    """DESIGN §8 (OLMo-core Olmo-3-7B-SFT.py with open-instruct's 7b_{think,instruct}_sft.sh): LR 5e-5 Think /
    8e-5 Instruct, 2 epochs, seq 32,768, 1,048,576 tokens per batch, linear with 3% warmup to 0, betas
    (0.9, 0.95), weight decay 0, clip 1.0, no z-loss, YaRN factor 8 over 8192; packed chats on their label
    masks, attention within each conversation."""
    import olmo3
    F = parse(name)
    assert (F.stage, F.model, F.lr, F.epochs) == ("sft", "olmo3_7b_long", lr, 2)
    assert F.seq_len == 32768 and F.global_batch * F.seq_len == 1_048_576
    assert (F.schedule, F.warmup_fraction) == ("linear", 0.03)
    assert (F.b1, F.b2, F.eps, F.weight_decay, F.max_grad_norm, F.z_loss) == (0.9, 0.95, 1e-8, 0.0, 1.0, 0.0)
    assert F.yarn and olmo3.Config.preset(F.model).yarn.factor == 8.0 and F.vocab_size == 100352
    assert F.packed and F.label_masks and F.doc_lengths and F.seed == 34521


_RESOLVED = """
import json, sys
import train
out = []
for args in json.loads(sys.argv[1]):
    train.F.unparse_flags()
    train.F(["train.py", "--model=tiny", *args])
    c = train.model_config()
    out.append({"doc_lengths": train.doc_lengths(), "schedule": train.schedule_kind(),
                "yarn": None if c.yarn is None else [c.yarn.factor, c.yarn.original_max_position],
                "model": [c.remat, c.scan_layers, str(c.param_dtype), str(c.compute_dtype), c.attention, c.float8,
                          c.splash_block_q, c.splash_block_kv],
                "compilation_cache": train.compilation_cache_dir(), "packing_cache": train.packing_cache(),
                "sft_heldout": train.named_sets(train.F.sft_heldout, "--sft_heldout")})
print(json.dumps(out))
"""


def each_flag_list(script: str, cases: list[list[str]]) -> list:
    """`script`'s JSON answer for each flag list of `cases`, parsed in turn by train.py's flags in
    one fresh process (absl flags are global)."""
    p = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def resolved(cases: list[list[str]]) -> list[dict]:
    """What train.py makes of each flag list (over --model=tiny): the model (model_config), the
    stage-dependent choices and the directories the run uses."""
    return each_flag_list(_RESOLVED, cases)


def test_stage_defaults_for_doc_lengths_and_yarn():
    """Without --doc_lengths / --yarn each stage gets its recipe's: attention within documents for stage 3
    (OLMo-core long-context L59 generate_doc_lengths=True) and SFT (Olmo-3-7B-SFT.py's packed chats), not for
    stages 1-2 nor DPO's padded pairs; YaRN (factor 8 over 8192) from stage 3 on: SFT and DPO train stage 3's
    model (DESIGN §8). The schedule: cosine for stage 1 (OLMo-core's CosWithWarmup), linear after it (the
    stage-2 and long-context scripts' LinearWithWarmup, SFT's, open-instruct's DPO's)."""
    stages = ["1", "2", "3", "sft", "dpo"]
    rows = resolved([[f"--stage={s}"] for s in stages])
    got = {s: [r["doc_lengths"], r["yarn"], r["schedule"]] for s, r in zip(stages, rows)}
    yarn = [8.0, 8192]
    assert got == {"1": [False, None, "cosine"], "2": [False, None, "linear"], "3": [True, yarn, "linear"],
                   "sft": [True, yarn, "linear"], "dpo": [False, yarn, "linear"]}, got


def test_every_model_flag_and_explicit_choice_reaches_the_run(tmp_path):
    """Each model flag overrides the preset (model_config), an explicit --yarn / --schedule /
    --doc_lengths wins over the stage's default, and the run's directories follow their flags: the
    compilation cache (in <run_dir>, or off), the packing cache (<--data_dir>/packing, else beside the
    run; none for a remote one) and a held-out set's name (its folder, also given with a trailing /)."""
    run, heldout = tmp_path / "run", tmp_path / "x" / "heldout"
    a, b, c = resolved([
        ["--remat=full", "--noscan_layers", "--param_dtype=bfloat16", "--compute_dtype=bfloat16", "--attention=splash",
         "--splash_block_q=32", "--splash_block_kv=64", "--float8", f"--run_dir={run}"],
        ["--yarn", "--yarn_factor=4", "--yarn_original_max_position=256", "--schedule=constant", "--doc_lengths",
         "--compilation_cache=none", f"--data_dir={tmp_path / 'dd'}", f"--run_dir={run}", f"--sft_heldout={heldout}/"],
        ["--stage=2", "--schedule=cosine", "--packing_cache=gs://bucket/packing", f"--run_dir={run}"]])
    assert a["model"] == ["full", False, "bfloat16", "bfloat16", "splash", True, 32, 64], a
    assert a["compilation_cache"] == str(run / "compilation_cache")
    assert a["packing_cache"] == str(tmp_path / "data" / "packing")
    assert (b["yarn"], b["schedule"], b["doc_lengths"], b["compilation_cache"]) == ([4.0, 256], "constant", True, None)
    assert b["packing_cache"] == str(tmp_path / "dd" / "packing")
    assert b["sft_heldout"] == {"heldout": f"{heldout}/"}, b
    assert (c["schedule"], c["packing_cache"]) == ("cosine", None), c


_CHECKED = """
import json, sys
import train
out = []
for args in json.loads(sys.argv[1]):
    train.F.unparse_flags()
    try:
        train.F(["train.py", "--model=tiny", "--total_steps=4", "--warmup_steps=1", *args])
        train.check_flags()
    except Exception as e:
        out.append(f"{type(e).__name__}: {e}")
    else:
        out.append("accepted")
print(json.dumps(out))
"""


def test_valid_edges_and_flags_that_give_way_pass_the_checks(tmp_path):
    """Values at the edge of what the flags allow, and flags another one replaces (a flagfile's
    --total_steps under --epochs, its --yarn_factor under --noyarn), pass the validators and
    check_flags: a refusal there (exit 2) would stop a valid run. Their neighbours past the edge
    are tests/test_bad_inputs.py cases."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("some text")
    common = [f"--data={tmp_path / 'docs'}", f"--run_dir={tmp_path / 'run'}"]
    cases = {
        "the tokenizer's own vocabulary (HF's 100278)": ["--vocab_size=100278"],
        "warmup over the whole horizon": ["--warmup_steps=4"],
        "downstream scored at the last step": ["--downstream_tasks=arc_easy_rc_5shot", "--downstream_eval_interval=4"],
        "--epochs over --total_steps, for the warmup": ["--epochs=2", "--warmup_steps=9"],
        "--warmup_fraction over --warmup_steps": ["--warmup_fraction=0.1", "--warmup_steps=9"],
        "--epochs over --total_steps, for --max_steps": ["--epochs=2", "--max_steps=10"],
        "--epochs over --total_steps, for downstream": ["--epochs=2", "--downstream_tasks=arc_easy_rc_5shot"],
        "--data_dir as a packed mix's packing cache": ["--data=mix:OLMo-mix-0625-official", "--packed",
                                                      f"--data_dir={tmp_path / 'dd'}"],
        "--noyarn over a flagfile's --yarn_factor": ["--noyarn", "--yarn_factor=4"],
        "b1 = 0": ["--b1=0"], "final_lr_ratio = 1": ["--final_lr_ratio=1"], "no hang timeout": ["--hang_timeout_s=0"]}
    said = dict(zip(cases, each_flag_list(_CHECKED, [common + v for v in cases.values()])))
    assert said == dict.fromkeys(cases, "accepted"), said


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage_data_mix_resolves(stage):
    """--data=mix:NAME resolves to AI2's files plus the per-domain validation sets."""
    splits = parse(stage).splits
    if splits is None:
        pytest.skip("OLMo-core mix lists not installed (pip install --no-deps ai2-olmo-core==3.0.0)")
    assert len(splits["train"]) > 900
    assert all(u.startswith("https://olmo-data.org/") and u.endswith(".npy") for u in splits["train"])
    assert "heldout/c4_en-validation" in splits and len(splits) == 12


_VARIANT = """
import sys
import train
F = train.F
F(["train.py", "--flagfile=" + sys.argv[1], *sys.argv[2:]])
train.model_config()   # Config validates the architecture: raises on an impossible head layout
"""


def test_readme_research_variants_build_a_model():
    """Each model variant the README's recipe section names ("Research variants are flags: ...")
    builds a valid model over stage1.flags, as written. `--n_heads=16 --head_dim=256` alone did
    not: the 7B's 32 KV heads do not divide 16 query heads (exit 2, "not a multiple of n_kv_heads")."""
    import re
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    paragraph = text[text.index("Research variants are flags:"):].split("\n\n", 1)[0]
    variants = []
    for item in re.findall(r"`(--[^`]+)`", paragraph):
        if "=" not in item or item.startswith("--mesh"):   # bare names, and meshes that need 128 devices
            continue
        name, _, values = item.partition("=")
        if " " in item:   # a group of flags given together
            variants.append(item.split())
        else:
            variants += [[f"{name}={v}"] for v in values.split("|")]
    assert ["--attention=cudnn"] in variants and any("256" in " ".join(v) for v in variants), variants
    env = {**os.environ, "PYTHONPATH": ROOT}
    for variant in variants:
        p = subprocess.run([sys.executable, "-c", _VARIANT, f"{ROOT}/stage1.flags", *variant], capture_output=True,
                           text=True, env=env, cwd=ROOT, timeout=120)
        assert p.returncode == 0, (variant, p.stderr[-2000:])


_CONFIG = """
import json, sys
import train
from olmo3.config import config_to_dict
train.F(["train.py", "--flagfile=" + sys.argv[1], *sys.argv[2:]])
print(json.dumps(config_to_dict(train.model_config())))
"""


def model_of(flagfile, *flags):
    p = subprocess.run([sys.executable, "-c", _CONFIG, f"{ROOT}/{flagfile}", *flags], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


_WARM = """
import json, sys
import train
from olmo3.config import config_from_dict
said = []
train.logging.warning = lambda msg, *args: said.append(msg % args)
for saved, now in json.loads(sys.stdin.read()):
    train.warn_model_change(saved, config_from_dict(now), "<previous stage>")
print(json.dumps(said))
"""


def warm_start_warnings(pairs):
    """train.warn_model_change's warnings for each (checkpoint's model, flags' model), in a fresh
    process (train.py's absl flags collide with eval.py's in one)."""
    p = subprocess.run([sys.executable, "-c", _WARM], input=json.dumps(pairs), capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_recipe_chain_warm_starts_without_a_model_change_warning():
    """Each stage's --init_from is the stage before it: train.warn_model_change stays quiet along
    the 7B chain (stage 3 adding YaRN is the recipe), and speaks when a flag changes the window
    or drops YaRN from a model that has it."""
    chain = [model_of(f) for f in ("stage1.flags", "stage2.flags", "stage3.flags", "sft_think.flags",
                                   "dpo_think.flags")]
    changed = model_of("sft_think.flags", "--window=2048", "--noyarn")
    # A conversion from Hugging Face writes YaRN's attention factor out (its default, by value): the
    # same model as the flags' None (olmo3.config.config_diff).
    from olmo3.config import YaRN
    written_out = {**chain[2], "yarn": {**chain[2]["yarn"], "attention_factor": YaRN(**chain[2]["yarn"]).mscale}}
    said = warm_start_warnings([*zip(chain, chain[1:]), (written_out, chain[3]), (chain[2], changed)])
    assert len(said) == 1, said
    assert said[0].startswith("--init_from=<previous stage>: this run's model differs from the checkpoint's (window "
                              "4096 -> 2048, yarn {") and "} -> None); its tensors fit" in said[0], said


def test_a_flagfile_loop_is_found_where_absl_would_skip_a_file(tmp_path, capsys):
    """absl's own reading is the reference: where it says "Hit circular flagfile dependency" (and
    skips the file, so a run took the defaults) a loop is found; a diamond (two files including a
    third) and a --flagfile in a comment are none."""
    from absl import flags
    from olmo3 import cli

    for case, includes in {"diamond": dict(a="bc", b="d", c="d", d=""), "comment": dict(a="#"),
                           "self": dict(a="a"), "two": dict(a="b", b="a")}.items():
        d = tmp_path / case
        d.mkdir()
        for name, inner in includes.items():
            lines = ["--x=1"] + [f"--flagfile={d / i}.flags" for i in inner if i != "#"]
            if inner == "#":
                lines += [f"# --flagfile={d / name}.flags", f"// --flagfile={d / name}.flags"]
            (d / f"{name}.flags").write_text("".join(f"{ln}\n" for ln in lines))
        args = [f"--flagfile={d / 'a.flags'}"]
        flags.FlagValues().read_flags_from_files(args)
        absl_skipped = "Hit circular flagfile dependency" in capsys.readouterr().err
        loop = cli._flagfile_loop(args)
        assert (loop is not None) == absl_skipped == (case in ("self", "two")), case
        if loop:
            assert loop[0] == loop[-1] == str(d / "a.flags"), loop


def test_a_flagfile_given_with_a_tilde_is_named(tmp_path, monkeypatch):
    """absl expands '~' in a flagfile's name; the messages that name a flagfile (not UTF-8 text, a
    line without dashes, a loop) read it the same way: it was named as '' or not at all."""
    from olmo3 import cli
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "bin.flags").write_bytes(b"\x80\x81")
    (tmp_path / "self.flags").write_text("--flagfile=~/self.flags\n")
    assert cli._undecodable_flagfile(["--flagfile=~/bin.flags"]) == "~/bin.flags"
    assert cli._flagfile_loop(["-flagfile", "~/self.flags"]) == [str(tmp_path / "self.flags")] * 2


def test_seq_len_may_be_the_models_positions_not_more():
    """Stage 3 trains at exactly the model's max_position_embeddings (65,536 with YaRN): allowed;
    one token more is refused by name."""
    from absl import app
    from olmo3 import cli
    cli.check_model("xla", 65536, 65536, "cpu")
    with pytest.raises(app.UsageError, match=r"^--seq_len=65537 exceeds the model's max_position_embeddings=65536$"):
        cli.check_model("xla", 65536, 65537, "cpu")
