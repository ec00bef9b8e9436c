"""The stage flagfiles encode the OLMo 3 7B recipe of DESIGN §3 (OLMo-core's official scripts)."""
import json
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
       "eval_padded", "float8", "micro_batch")}
from data import mixes
out["splits"] = {k: v for k, v in train.resolve_data().items()} if mixes.available_mixes() else None
print(json.dumps(out))
"""


def parse(stage: int):
    """Parse a stage flagfile with train.py's own flags, in a fresh process (absl flags are global:
    eval.py defines some of the same names)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-c", _PARSE, f"{ROOT}/stage{stage}.flags"], capture_output=True,
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
    assert F.downstream_tasks == []  # OLMo-3-1025-7B-midtrain.py has no downstream evaluator
    assert F.eval_padded


def test_stage3_flags():
    import olmo3
    F = parse(3)
    assert (F.stage, F.model, F.seq_len, F.global_batch) == ("3", "olmo3_7b_long", 65536, 64)
    assert (F.warmup_steps, F.schedule) == (200, "linear")
    assert F.lr == pytest.approx(2.0712e-4, rel=1e-4)
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
