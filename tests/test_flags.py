"""The stage flagfiles encode the OLMo 3 7B recipe of DESIGN §3 (OLMo-core's official scripts)."""
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def parse():
    import train  # defines the flags
    F = train.F

    def _parse(*args):
        F.unparse_flags()
        F(["train.py", *args])
        return F
    yield _parse
    F.unparse_flags()


def test_stage1_flags(parse):
    F = parse(f"--flagfile={ROOT}/stage1.flags")
    assert (F.stage, F.model, F.seq_len, F.global_batch, F.seed) == (1, "olmo3_7b", 8192, 512, 34521)
    assert F.global_batch * F.seq_len == 4_194_304
    assert (F.lr, F.warmup_steps, F.total_steps, F.final_lr_ratio) == (3e-4, 2000, 1_413_814, 0.1)
    assert (F.b1, F.b2, F.eps, F.weight_decay, F.max_grad_norm, F.z_loss) == (0.9, 0.95, 1e-8, 0.1, 1.0, 1e-5)
    assert F.schedule == "cosine" and F.skip_steps and not F.repetition_filter
    assert F.vocab_size == 100352 and F.data == "mix:OLMo-mix-0625-official"


def test_stage2_flags(parse):
    F = parse(f"--flagfile={ROOT}/stage2.flags")
    assert (F.stage, F.seq_len, F.global_batch, F.seed) == (2, 8192, 256, 1337)
    assert F.global_batch * F.seq_len == 2 ** 21
    assert (F.lr, F.warmup_steps, F.total_steps, F.schedule) == (2.0712352850360292e-4, 0, 47_684, "linear")
    assert F.data == "mix:OLMo-midtraining-mix-0625-100B"


def test_stage3_flags(parse):
    import olmo3
    F = parse(f"--flagfile={ROOT}/stage3.flags")
    assert (F.stage, F.model, F.seq_len, F.global_batch) == (3, "olmo3_7b_long", 65536, 64)
    assert (F.warmup_steps, F.schedule) == (200, "linear")
    assert F.lr == pytest.approx(2.0712e-4, rel=1e-4)
    assert olmo3.Config.preset(F.model).yarn.factor == 8.0
    assert F.data == "mix:OLMo-longmino-mix-0625"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage_data_mix_resolves(parse, stage):
    """--data=mix:NAME resolves to AI2's files plus the per-domain validation sets."""
    from data import mixes
    import train
    if not mixes.available_mixes():
        pytest.skip("OLMo-core mix lists not installed (pip install --no-deps ai2-olmo-core==3.0.0)")
    parse(f"--flagfile={ROOT}/stage{stage}.flags")
    splits = train.resolve_data()
    assert len(splits["train"]) > 900
    assert all(u.startswith("https://olmo-data.org/") and u.endswith(".npy") for u in splits["train"])
    assert "heldout/c4_en-validation" in splits and len(splits) == 12
