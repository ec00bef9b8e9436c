"""convert.py: HF <-> Orbax round trip, parity against transformers, the train.py restore path,
bad inputs; and (slow) train.py --init_from end to end and peak memory on a 1B-shaped checkpoint."""
import importlib.util
import json
import os
import re
import struct
import subprocess
import sys

import equinox as eqx
import jax
import ml_dtypes
import numpy as np
import pytest

import olmo3
from olmo3 import checkpoint, heldout, hf, load, optim, schedules
from olmo3.config import config_diff, config_to_dict
from test_model import hf_config, random_hf_model
from test_train import source_corpus

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("convert", os.path.join(ROOT, "convert.py"))
convert = importlib.util.module_from_spec(spec)
spec.loader.exec_module(convert)


def random_hf_dir(path, dtype=torch.float32, seed=0, **over):
    """A random Olmo3ForCausalLM (test_model's, norms randomized too) saved by transformers
    itself; vocab 512 and GQA 4/2 unless overridden."""
    m = random_hf_model(hf_config(**{"vocab_size": 512, "num_key_value_heads": 2, **over}), seed)
    m.to(dtype).save_pretrained(str(path))
    return m


def raw_tensors(path):
    """name -> (dtype string, shape, raw bytes), read with the safetensors library's torch API."""
    from safetensors import safe_open
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), framework="pt") as h:
                for k in h.keys():
                    t = h.get_tensor(k)
                    out[k] = (str(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hf_orbax_hf_round_trip_is_bit_exact(tmp_path, dtype, monkeypatch):
    random_hf_dir(tmp_path / "hf", dtype)
    assert convert._block((100278, 4096), 0, np.float32) == 11142  # 7B embedding: 9 parts of 183 MB
    assert convert._block((100278, 2048), 0, np.float32) == 16713  # 1B: 6 parts of 137 MB
    monkeypatch.setattr(convert, "PART_BYTES", 4096)  # embed/lm_head in parts of 16 rows/columns (16 x 64 x 4 B)
    assert convert._block((512, 64), 0, np.float32) == 16 and convert._block((64, 512), 1, np.float32) == 16
    convert.hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "orbax"))  # fp32 master weights
    name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    convert.orbax_to_hf(str(tmp_path / "orbax"), str(tmp_path / "hf2"), hf_dtype=name, shard_gb=1e-4)
    a, b = raw_tensors(tmp_path / "hf"), raw_tensors(tmp_path / "hf2")
    assert set(a) == set(b) and len(a) == 3 + 4 * 11
    for k in a:
        assert a[k] == b[k], k
    assert len([f for f in os.listdir(tmp_path / "hf2") if f.endswith(".safetensors")]) > 1  # sharded
    # transformers loads the sharded output and computes what the original computes
    r1 = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    r2 = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2"), dtype=torch.float32)
    x = torch.arange(20)[None] * 7 % 512
    with torch.no_grad():
        assert torch.equal(r1(x).logits, r2(x).logits)


def test_parity_fp32_against_transformers(tmp_path):
    random_hf_dir(tmp_path / "hf", num_attention_heads=4, num_key_value_heads=2)
    convert.hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "orbax"))
    ours, info = load.load_model(str(tmp_path / "orbax"))
    assert info["step"] == 0 and info["kind"] == "orbax"
    r = convert.verify(str(tmp_path / "hf"), ours, seq=48, batch=2)
    assert r["kl_mean"] < 1e-6 and r["kl_max"] < 1e-6, r
    assert r["top1"] == 1.0 and r["top10"] == 1.0 and r["tokens"] == 96


def test_checkpoint_restores_the_way_train_py_warm_starts(tmp_path, monkeypatch):
    """train.py --init_from restores {"model", "opt"} into the abstract of a fresh state and calls
    optimizer.warm_start: the weights must be HF's (numpy oracle: transposes of the torch tensors)
    and the optimizer state must equal a fresh init (zero fp32 moments, Adam count 0)."""
    ref = random_hf_dir(tmp_path / "hf")
    monkeypatch.setattr(convert, "PART_BYTES", 4096)  # every tensor written in several parts
    convert.hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "init"), with_optimizer_state=True)
    config = hf.read_hf_config(str(tmp_path / "hf"))
    opt = optim.SkipStepAdamW(schedules.constant_schedule(1e-3))
    abstract = eqx.filter_eval_shape(lambda: (lambda m: {"model": m, "opt": opt.init(m)})(
        olmo3.OLMo3(config, jax.random.key(1))))
    run, step = checkpoint.locate(str(tmp_path / "init"))
    state, extra = checkpoint.CheckpointManager(run, read_only=True).restore(step, abstract)
    sd = {k: v.numpy() for k, v in ref.state_dict().items()}
    m = state["model"]
    np.testing.assert_array_equal(m.embed, sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(m.lm_head, sd["lm_head.weight"].T)
    for i in range(config.n_layers):
        np.testing.assert_array_equal(m.layers.gate_proj[i], sd[f"model.layers.{i}.mlp.gate_proj.weight"].T)
        np.testing.assert_array_equal(m.layers.q_norm[i], sd[f"model.layers.{i}.self_attn.q_norm.weight"])
    warm = opt.warm_start(state["opt"])
    fresh = opt.init(m)
    assert jax.tree.structure(warm) == jax.tree.structure(fresh)
    for a, b in zip(jax.tree.leaves(warm), jax.tree.leaves(fresh)):
        assert a.dtype == b.dtype and a.shape == b.shape and not np.any(np.asarray(a))
    assert extra["model_config"] == config_to_dict(config) and extra["stage"] == 0



def test_pad_vocab_as_olmo_core_and_back(tmp_path, monkeypatch):
    """--pad_vocab: HF's 500 rows exactly, then rows drawn as OLMo-core's InitMethod.normal draws
    the embedding and output projection (truncated normal, std 0.02, cut at +-3 std); logits on the
    real rows equal transformers' once the softmax over the padding is undone; the way back to HF
    drops the padding (bit-exact round trip). Parts of 16 rows, so one part straddles row 500."""
    ref = random_hf_dir(tmp_path / "hf", vocab_size=500)
    monkeypatch.setattr(convert, "PART_BYTES", 4096)
    convert.hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "o"), pad_vocab=640, with_optimizer_state=True)
    ours, info = load.load_model(str(tmp_path / "o"))
    assert info["config"].vocab_size == 640 and ours.embed.shape == (640, 64) and ours.lm_head.shape == (64, 640)
    sd = {k: v.numpy() for k, v in ref.state_dict().items()}
    np.testing.assert_array_equal(ours.embed[:500], sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(ours.lm_head[:, :500], sd["lm_head.weight"].T)
    for pad in (np.asarray(ours.embed[500:]), np.asarray(ours.lm_head[:, 500:])):
        assert np.abs(pad).max() <= 3 * 0.02 and abs(pad.mean()) < 2e-3
        assert 0.0185 < pad.std() < 0.0210  # trunc. normal at +-3 sd: 0.02 x 0.9866 = 0.0197
    assert not np.array_equal(np.asarray(ours.embed[500:]), np.asarray(ours.lm_head[:, 500:]).T)
    r = convert.verify(str(tmp_path / "hf"), ours, seq=32, batch=2)
    assert r["kl_mean"] < 1e-6 and r["top1"] == 1.0, r
    convert.orbax_to_hf(str(tmp_path / "o"), str(tmp_path / "hf2"))   # the checkpoint knows its HF vocab
    a, b = raw_tensors(tmp_path / "hf"), raw_tensors(tmp_path / "hf2")
    assert set(a) == set(b) and all(a[k] == b[k] for k in a)
    with open(tmp_path / "hf2" / "config.json") as f:
        assert json.load(f)["vocab_size"] == 500
    convert.orbax_to_hf(str(tmp_path / "o"), str(tmp_path / "hf3"), hf_vocab_size=640)  # or keep them all
    assert raw_tensors(tmp_path / "hf3")["model.embed_tokens.weight"][1] == (640, 64)
    with pytest.raises(ValueError, match="--pad_vocab=400 is smaller than .* 500 rows"):
        convert.hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "o2"), pad_vocab=400)
    with pytest.raises(ValueError, match="--pad_vocab=1001 is more than twice .* 500 rows"):   # 10**25 never ended
        convert.hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "o2"), pad_vocab=1001)


def test_unpadded_vocab_is_dolma2():
    """A train.py checkpoint carries no HF vocab: rows past dolma2's 100,278 tokens are padding."""
    assert convert.unpadded_vocab(100352) == 100278 and convert.unpadded_vocab(100278) == 100278
    assert convert.unpadded_vocab(512) == 512

@pytest.mark.parametrize("preset", ["olmo3_7b", "olmo3_7b_long"])
def test_exported_config_carries_the_transformers_4_rope_keys(tmp_path, preset):
    """config.json holds rope_parameters (transformers 5) and the flat rope_theta + rope_scaling that
    transformers 4.x reads (4.57.1, OLMo 3's release, reads only those). The flat keys alone give
    transformers 5 the same per-layer rope, and us the same Config."""
    from transformers import AutoConfig
    c = getattr(olmo3.Config, preset)()
    full = hf.config_to_hf(c)
    assert full["rope_theta"] == 500_000.0
    assert (full["rope_scaling"] is None) == (c.yarn is None)
    flat = {k: v for k, v in full.items() if k != "rope_parameters"}
    loaded = []
    for name, d in (("full", full), ("flat", flat)):
        os.makedirs(tmp_path / name)
        with open(tmp_path / name / "config.json", "w") as f:
            json.dump(d, f)
        loaded.append(AutoConfig.from_pretrained(str(tmp_path / name)).rope_parameters)
    assert loaded[0] == loaded[1]
    assert hf.config_from_hf(flat) == hf.config_from_hf(full)


def test_exported_config_of_a_model_unlike_the_7b_reads_back_through_transformers(tmp_path):
    """Every architecture field away from the 7B's (GQA, head_dim, window, pattern, theta, eps,
    YaRN) survives config.json as transformers reads it; dolma2's eos / pad ids are written only
    where the vocabulary holds them (transformers warns about ids outside it)."""
    from transformers import AutoConfig

    from olmo3.config import YaRN
    c = olmo3.Config.tiny(vocab_size=300, d_model=48, n_layers=6, n_heads=3, n_kv_heads=1, head_dim=20, mlp_hidden=80,
                          window=9, layer_pattern=("sliding", "full"), rope_theta=1e4, norm_eps=1e-5,
                          yarn=YaRN(factor=2.0, original_max_position=64, beta_fast=8.0, beta_slow=2.0))
    os.makedirs(tmp_path / "c")
    with open(tmp_path / "c" / "config.json", "w") as f:
        json.dump(hf.config_to_hf(c), f)
    theirs = AutoConfig.from_pretrained(str(tmp_path / "c"))
    assert theirs.rms_norm_eps == 1e-5 and theirs.num_key_value_heads == 1 and theirs.sliding_window == 9
    assert theirs.layer_types == ["sliding_attention", "full_attention"] * 3
    assert theirs.eos_token_id is None and theirs.pad_token_id is None
    assert config_diff(c, hf.config_from_hf(theirs.to_dict())) == {}
    seven = hf.config_to_hf(olmo3.Config.olmo3_7b())
    assert (seven["eos_token_id"], seven["pad_token_id"]) == (100257, 100277)   # dolma2 (DESIGN §2)


def test_cli_verify_fails_above_max_kl(tmp_path):
    random_hf_dir(tmp_path / "hf")
    cmd = [sys.executable, os.path.join(ROOT, "convert.py"), f"--from=hf:{tmp_path / 'hf'}",
           f"--to=orbax:{tmp_path / 'o'}", "--verify", "--verify_seq=16", "--verify_batch=1"]
    bad = subprocess.run(cmd + ["--max_kl=-1"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2, bad.stderr[-2000:]   # a rerun converts to the same numbers: never retried
    last = bad.stderr.strip().splitlines()[-1]
    assert "top-1 agreement 100.00%" in bad.stdout and "--verify failed: mean KL" in last and str(tmp_path / "o") in last
    positions = subprocess.run([*cmd[:3], f"--to=orbax:{tmp_path / 'o2'}", "--verify", "--verify_seq=100000"],
                               capture_output=True, text=True, cwd=ROOT)
    assert positions.returncode == 2 and "--verify_seq=100000 is past the model's" in positions.stderr
    assert not os.path.exists(tmp_path / "o2")   # refused before converting


def test_train_py_checkpoint_to_hf(tmp_path):
    """A checkpoint as train.py writes it (jax arrays, one storage chunk per tensor, model + opt)
    converts to the HF tensors of olmo3/hf.py's state_dict, and transformers loads it."""
    config = olmo3.Config(vocab_size=512, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                          mlp_hidden=96, window=7, max_position_embeddings=256)
    model = olmo3.OLMo3(config, jax.random.key(3))
    opt = optim.SkipStepAdamW(schedules.constant_schedule(1e-3))
    mgr = checkpoint.CheckpointManager(str(tmp_path / "run"), async_save=False)
    mgr.save(5, {"model": model, "opt": opt.init(model)}, {"model_config": config_to_dict(config), "stage": 1})
    mgr.close()
    convert.orbax_to_hf(str(tmp_path / "run"), str(tmp_path / "hf"))
    got, want = hf.SafetensorsReader(str(tmp_path / "hf")), hf.state_dict(model)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    x = np.arange(24)[None] * 5 % 512
    with torch.no_grad():
        ref_logits = ref(torch.tensor(x)).logits.numpy()
    r = heldout.logit_agreement(ref_logits[0], np.asarray(model(jax.numpy.asarray(x[0], jax.numpy.int32))))
    assert r["kl_max"] < 1e-6 and r["top1"] == 1.0


def test_stage3_checkpoint_to_hf_states_the_yarn_context(tmp_path):
    """A train.py stage-3 checkpoint (YaRN 4 x 16 on the full layers) converts to a config.json
    whose max_position_embeddings is the context YaRN extends to (transformers' reading: factor =
    max_position_embeddings / original_max_position_embeddings), though the checkpoint's
    model_config does not hold it; transformers and from_hf give our logits past position 16."""
    config = olmo3.Config(vocab_size=512, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                          mlp_hidden=96, window=7, yarn=olmo3.YaRN(factor=4.0, original_max_position=16),
                          max_position_embeddings=64)
    model = olmo3.OLMo3(config, jax.random.key(4))
    mgr = checkpoint.CheckpointManager(str(tmp_path / "run"), async_save=False)
    mgr.save(5, {"model": model}, {"model_config": config_to_dict(config), "stage": 3})
    mgr.close()
    convert.orbax_to_hf(str(tmp_path / "run"), str(tmp_path / "hf"))
    with open(tmp_path / "hf" / "config.json") as f:
        written = json.load(f)
    assert written["max_position_embeddings"] == 64 == 4 * written["rope_scaling"]["original_max_position_embeddings"]
    x = np.arange(64)[None] * 7 % 512
    ours = np.asarray(model(jax.numpy.asarray(x[0], jax.numpy.int32)))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    with torch.no_grad():
        r = heldout.logit_agreement(ref(torch.tensor(x)).logits.numpy()[0], ours)
    assert r["kl_max"] < 1e-6 and r["top1"] == 1.0
    back = hf.from_hf(str(tmp_path / "hf"))
    assert back.config.yarn.factor == 4.0 and back.config.max_position_embeddings == 64
    # The round trip writes YaRN's default attention factor out (0.1 ln 4 + 1 = 1.1386); it is the same model
    # (eval.py --compare's architecture check used to refuse the pair).
    assert back.config.yarn.attention_factor is not None and config_diff(config, back.config) == {}
    np.testing.assert_array_equal(np.asarray(back(jax.numpy.asarray(x[0], jax.numpy.int32))), ours)


def test_bad_inputs(tmp_path):
    random_hf_dir(tmp_path / "hf")
    f = tmp_path / "hf" / "model.safetensors"
    data = f.read_bytes()
    # truncated tensor data
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "cut" / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match=r"(?s)model.safetensors.*(corrupt|truncated)"):
        convert.hf_to_orbax(str(tmp_path / "cut"), str(tmp_path / "o1"))
    # garbage header
    (tmp_path / "cut" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}" + data[100:])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        convert.hf_to_orbax(str(tmp_path / "cut"), str(tmp_path / "o1"))
    assert not os.path.exists(tmp_path / "o1" / "checkpoints" / "0")
    # config.json that does not describe the weights
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "wrong").mkdir()
    (tmp_path / "wrong" / "model.safetensors").write_bytes(data)
    (tmp_path / "wrong" / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 8, "layer_types": None}))
    with pytest.raises(ValueError, match="do not match config.json"):
        convert.hf_to_orbax(str(tmp_path / "wrong"), str(tmp_path / "o2"))
    (tmp_path / "wrong" / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))
    with pytest.raises(ValueError, match=r"mlp.gate_proj.weight.*config.json implies"):
        convert.hf_to_orbax(str(tmp_path / "wrong"), str(tmp_path / "o3"))
    # config.json that is not an object, misses or garbles a field, or names another activation
    for name, text, culprit in (("list", "[1, 2]", "holds a JSON list, not an object"),
                                ("nohidden", json.dumps({k: v for k, v in cfg.items() if k != "hidden_size"}),
                                 "has no 'hidden_size'"),
                                ("nulllayers", json.dumps({**cfg, "num_hidden_layers": None}), "no 'num_hidden_layers'"),
                                ("abc", json.dumps({**cfg, "intermediate_size": "abc"}),
                                 "field 'intermediate_size' is 'abc'; expected an integer"),
                                ("gelu", json.dumps({**cfg, "hidden_act": "gelu"}), "hidden_act 'gelu'"),
                                # an AssertionError traceback, exit 1
                                ("nolayers", json.dumps({**cfg, "num_hidden_layers": 0, "layer_types": []}),
                                 "num_hidden_layers=0: a model has at least one layer"),
                                # read as 4096 (transformers' Olmo3 cannot run it; --verify crashed, exit 1)
                                ("nowindow", json.dumps({**cfg, "sliding_window": None}), "sliding_window null"),
                                # NaN losses with exit 0
                                ("theta0", json.dumps({**{k: v for k, v in cfg.items() if k != "rope_parameters"},
                                                       "rope_theta": 0}), "rope_theta=0.0 must be a finite number > 0"),
                                ("epsneg", json.dumps({**cfg, "rms_norm_eps": -1}), "norm_eps=-1.0 must be"),
                                ("yarnx", json.dumps({**{k: v for k, v in cfg.items() if k != "rope_parameters"},
                                                      "rope_scaling": {"rope_type": "yarn", "factor": 4,
                                                                       "original_max_position_embeddings": 64,
                                                                       "attention_factor": "x"}}),
                                 "field 'attention_factor' is 'x'; expected a number"),
                                ("yarnhalf", json.dumps({**{k: v for k, v in cfg.items() if k != "rope_parameters"},
                                                         "rope_scaling": {"rope_type": "yarn", "factor": 0.5,
                                                                          "original_max_position_embeddings": 64}}),
                                 "factor must be a finite number >= 1")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(data)
        (tmp_path / name / "config.json").write_text(text)
        with pytest.raises(ValueError, match=re.escape(str(tmp_path / name / "config.json")) + ".*" + culprit):
            convert.hf_to_orbax(str(tmp_path / name), str(tmp_path / f"o_{name}"))
    # integer or non-finite weights: named, and nothing written
    from safetensors.torch import save_file
    weights = {k: v for k, v in random_hf_model(hf_config(vocab_size=512, num_key_value_heads=2), 0).state_dict().items()
               if "rotary_emb" not in k}
    for name, change, culprit in (("ints", lambda t: t.to(torch.int32), "has dtype int32"),
                                  ("nan", lambda t: t.index_fill(0, torch.tensor([1]), float("nan")), "NaN")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        target = "model.layers.1.mlp.up_proj.weight"
        save_file({k: (change(v) if k == target else v).contiguous() for k, v in weights.items()},
                  str(tmp_path / name / "model.safetensors"))
        with pytest.raises(ValueError, match=re.escape(target) + ".*" + culprit):
            convert.hf_to_orbax(str(tmp_path / name), str(tmp_path / f"o_{name}"))
        assert not os.path.exists(tmp_path / f"o_{name}")
    # never overwrite
    convert.hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "o4"))
    with pytest.raises(FileExistsError):
        convert.hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "o4"))
    with pytest.raises(FileExistsError):
        convert.orbax_to_hf(str(tmp_path / "o4"), str(tmp_path / "hf"))
    # a sharded checkpoint missing a shard its index names: the shard is named, not a tensor
    convert.orbax_to_hf(str(tmp_path / "o4"), str(tmp_path / "sharded"), shard_gb=1e-4)
    shards = sorted(f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors"))
    os.remove(tmp_path / "sharded" / shards[1])
    with pytest.raises(FileNotFoundError, match=rf"{shards[1]}; download them again"):
        hf.SafetensorsReader(str(tmp_path / "sharded"))
    with pytest.raises(FileNotFoundError, match="1 missing"):
        convert.hf_to_orbax(str(tmp_path / "sharded"), str(tmp_path / "o5"))
    # The shards the index names are read, as transformers reads them: a leftover shard of an older
    # download (here: every tensor of shard 1, zeroed) replaced tensors without a word before.
    convert.orbax_to_hf(str(tmp_path / "o4"), str(tmp_path / "stale"), shard_gb=1e-4)
    from safetensors.numpy import load_file, save_file as save_numpy
    first = load_file(str(tmp_path / "stale" / shards[0]))
    save_numpy({k: np.zeros_like(v) for k, v in first.items()}, str(tmp_path / "stale" / "model-99999-of-00002.safetensors"))
    reader = hf.SafetensorsReader(str(tmp_path / "stale"))
    for name, value in first.items():
        np.testing.assert_array_equal(reader[name], value)
    index = tmp_path / "stale" / "model.safetensors.index.json"
    kept = index.read_text()
    os.remove(index)   # without an index every file is read: a name in two of them is refused
    with pytest.raises(ValueError, match=rf"tensor '{re.escape(next(iter(first)))}' is in .*model-99999-of-00002"
                                         rf".safetensors' and .*{shards[0]}': which is meant is unclear"):
        hf.SafetensorsReader(str(tmp_path / "stale"))
    index.write_text(kept)
    second, third = (load_file(str(tmp_path / "stale" / shards[k])) for k in (1, 2))
    moved = next(iter(third))   # also in a shard read before its own, which the index does not name for it
    save_numpy({**second, moved: third[moved]}, str(tmp_path / "stale" / shards[1]))
    with pytest.raises(ValueError, match=rf"tensor '{re.escape(moved)}' is in .*{shards[1]}', but .*index.json puts "
                                         rf"it in '{shards[2]}'"):
        hf.SafetensorsReader(str(tmp_path / "stale"))
    save_numpy(second, str(tmp_path / "stale" / shards[1]))
    for text in ("[1, 2]", '{"weight_map": {"lm_head.weight": ["x"]}}', "{not json"):   # AttributeError, TypeError
        index.write_text(text)
        with pytest.raises(ValueError, match=r"index.json is not a safetensors index .*download it again"):
            hf.SafetensorsReader(str(tmp_path / "stale"))


def test_hf_directories_read_as_transformers_reads_them_or_refused(tmp_path):
    """from_hf(directory) (eval.py's and load's reader) and hf_to_orbax against the same damaged
    or extended directories: a tensor the config has no place for (a q_proj bias: transformers'
    attention_bias=True) and a NaN weight are refused by both; model.safetensors beside a stale
    index and its shards is read alone, as transformers' from_pretrained reads it."""
    from safetensors.torch import load_file, save_file
    ref = random_hf_dir(tmp_path / "hf")
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    bias = "model.layers.0.self_attn.q_proj.bias"
    for name, tensors, culprit in (
            ("bias", {**weights, bias: torch.zeros(weights[bias.replace("bias", "weight")].shape[0])},
             re.escape(bias)),
            ("nan", {**weights, "model.norm.weight": torch.full_like(weights["model.norm.weight"], float("nan"))},
             r"'model.norm.weight' holds NaN")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
        with pytest.raises(ValueError, match=culprit):
            hf.from_hf(str(tmp_path / name))
        with pytest.raises(ValueError, match=culprit):
            convert.hf_to_orbax(str(tmp_path / name), str(tmp_path / f"o_{name}"))
        assert not os.path.exists(tmp_path / f"o_{name}")
    # A sharded copy of another model left beside model.safetensors (a re-download in the same directory)
    random_hf_dir(tmp_path / "other", seed=1).save_pretrained(str(tmp_path / "other"), max_shard_size="200KB")
    for f in os.listdir(tmp_path / "other"):
        if f.startswith("model-") or f.endswith(".index.json"):
            os.replace(tmp_path / "other" / f, tmp_path / "hf" / f)
    assert os.path.exists(tmp_path / "hf" / "model.safetensors.index.json")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    ours = hf.from_hf(str(tmp_path / "hf"))
    for theirs in (loaded, ref):
        np.testing.assert_array_equal(np.asarray(ours.embed), theirs.model.embed_tokens.weight.detach().numpy())
        np.testing.assert_array_equal(np.asarray(ours.layers.q_proj[0]),
                                      theirs.model.layers[0].self_attn.q_proj.weight.detach().numpy().T)


# ---- slow -----------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("pad_vocab", [None, 100352], ids=["hf_vocab", "pad_vocab"])
def test_train_py_init_from_converted_checkpoint(tmp_path, pad_vocab):
    """train.py --init_from=<converted dir> starts from the HF weights: its step-1 loss equals the
    HF model's own (torch) loss on the same first batch. With --pad_vocab=100352 (stage1.flags'
    vocabulary) the torch logits get the padded columns appended (lm_head's input, captured by a
    hook, times the converted checkpoint's padding columns)."""
    import data
    random_hf_dir(tmp_path / "hf", vocab_size=100278, hidden_size=32, intermediate_size=64,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=16, sliding_window=16)
    convert.hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "init"), with_optimizer_state=True,
                        pad_vocab=pad_vocab)
    docs = source_corpus(tmp_path / "docs")
    run = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--model=tiny", "--d_model=32", "--n_layers=4",
           "--n_heads=2", "--n_kv_heads=2", "--head_dim=16", "--mlp_hidden=64", "--window=16",
           f"--data={docs}", "--seq_len=32", "--global_batch=8", "--max_steps=1", "--total_steps=10",
           "--warmup_steps=1", f"--run_dir={run}", f"--init_from={tmp_path / 'init'}", "--save_interval=1",
           "--eval_interval=1", "--loader_workers=0", "--seed=7", "--z_loss=0",
           *([f"--vocab_size={pad_vocab}"] if pad_vocab else [])]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=str(tmp_path), env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    loss = json.loads(open(run / "metrics.jsonl").readline())["train/loss"]
    splits = data.ensure_corpus(str(tmp_path / "data" / "docs"), str(docs))
    batch = data.get_batch(data.FSLDataset(splits["train"], 32), 8, 7, 0)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    seen = []
    ref.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(inp[0]))
    with torch.no_grad():
        t = torch.tensor(batch["tokens"], dtype=torch.long)
        logits = ref(t).logits
        if pad_vocab:
            pad = np.asarray(load.load_model(str(tmp_path / "init"))[0].lm_head[:, 100278:])
            logits = torch.cat([logits, seen[0] @ torch.from_numpy(pad)], -1)
        lp = torch.log_softmax(logits[:, :-1], -1)
        want = -lp.gather(-1, t[:, 1:, None]).mean().item()
    assert abs(loss - want) < 1e-4, (loss, want)


def _write_random_hf(path, cfg: olmo3.Config, seed=0):
    """A random HF checkpoint written tensor by tensor (bf16), never all in memory."""
    os.makedirs(path)
    rng = np.random.default_rng(seed)
    d, L, V = cfg.d_model, cfg.n_layers, cfg.vocab_size
    specs = [("model.embed_tokens.weight", (V, d))]
    for i in range(L):
        for field, suffix, t in hf.LAYER_MAP:
            shape = {"q_proj": (cfg.q_dim, d), "k_proj": (cfg.kv_dim, d), "v_proj": (cfg.kv_dim, d),
                     "o_proj": (d, cfg.q_dim), "q_norm": (cfg.q_dim,), "k_norm": (cfg.kv_dim,),
                     "gate_proj": (cfg.mlp_hidden, d), "up_proj": (cfg.mlp_hidden, d),
                     "down_proj": (d, cfg.mlp_hidden)}.get(field, (d,))
            specs.append((f"model.layers.{i}.{suffix}", shape))
    specs += [("model.norm.weight", (d,)), ("lm_head.weight", (V, d))]
    bf16 = np.dtype(ml_dtypes.bfloat16)
    w = hf.SafetensorsWriter(os.path.join(path, "model.safetensors"), [(n, s, bf16) for n, s in specs])
    for n, s in specs:
        w.write(n, (0.02 * rng.standard_normal(s, np.float32)).astype(bf16))
    w.close()
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf.config_to_hf(cfg), f)


@pytest.mark.slow
def test_peak_rss_1b_shaped(tmp_path):
    """Measurement, not a default test: convert a random 1B-shaped checkpoint (OLMo 2 1B shape,
    dolma2 vocab) both ways in fresh processes and print peak RSS next to the largest tensor."""
    cfg = olmo3.Config(d_model=2048, n_layers=16, n_heads=16, n_kv_heads=16, head_dim=128, mlp_hidden=8192)
    _write_random_hf(str(tmp_path / "hf"), cfg)
    largest = cfg.n_layers * cfg.d_model * cfg.mlp_hidden * 4  # stacked fp32 gate_proj
    out = {}
    for name, args in [("hf->orbax", [f"--from=hf:{tmp_path / 'hf'}", f"--to=orbax:{tmp_path / 'o'}",
                                      "--with_optimizer_state"]),
                       ("orbax->hf", [f"--from=orbax:{tmp_path / 'o'}", f"--to=hf:{tmp_path / 'hf2'}",
                                      "--hf_dtype=bfloat16"])]:
        p = subprocess.run([sys.executable, os.path.join(ROOT, "convert.py"), *args],
                           capture_output=True, text=True, cwd=ROOT)
        assert p.returncode == 0, p.stderr[-3000:]
        out[name] = float(re.search(r"peak RSS ([\d.]+) GB", p.stdout).group(1))
    print(f"\n1B-shaped ({cfg.num_params():,} params, fp32 checkpoint {cfg.num_params() * 4 / 2**30:.2f} GiB, "
          f"largest stacked tensor {largest / 2**30:.2f} GiB): peak RSS {out}")
    assert max(out.values()) < 2.5, out  # a few parts of <= 256 MB in flight, not the 5.5 GiB model


def test_cli_verify_fails_on_a_nan_kl(tmp_path):
    """convert.py --verify with a checkpoint whose logits are NaN (finite weights that overflow fp32:
    a final norm weight of 3e38) fails the check, exit 2: a NaN mean KL is no agreement. Reference:
    transformers' Olmo3ForCausalLM, whose logits on these weights are NaN too."""
    m = random_hf_dir(tmp_path / "src")
    with torch.no_grad():
        m.model.norm.weight.fill_(3e38)   # finite, so the converter takes it
    m.save_pretrained(str(tmp_path / "hf"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    with torch.no_grad():
        assert torch.isnan(ref(torch.arange(16)[None]).logits).any()
    p = subprocess.run([sys.executable, os.path.join(ROOT, "convert.py"), f"--from=hf:{tmp_path / 'hf'}",
                        f"--to=orbax:{tmp_path / 'o'}", "--verify", "--verify_seq=16", "--verify_batch=1"],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2, (p.stdout[-1000:], p.stderr[-2000:])
    assert "--verify failed: mean KL nan" in p.stderr.strip().splitlines()[-1]


def shard_layout(path):
    """[(file, [(name, nbytes) in file order])] for every shard, in the index's file order."""
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    out = []
    for f in files:
        with open(os.path.join(path, f), "rb") as h:
            n = struct.unpack("<Q", h.read(8))[0]
            header = json.loads(h.read(n))
        header.pop("__metadata__", None)
        tensors = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        out.append((f, [(name, v["data_offsets"][1] - v["data_offsets"][0]) for name, v in tensors]))
    return out


def greedy(sizes, limit):
    """HF / convert.py's packing: a new shard when the next tensor would pass `limit` bytes."""
    shards, size = [[]], 0
    for name, nbytes in sizes:
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def test_shards_are_packed_greedily_under_shard_gb_decimal_gigabytes(tmp_path):
    """convert.py --shard_gb: shards are packed as HF packs them (transformers' max_shard_size "5GB" is
    5 x 10**9 bytes, decimal), greedily in write order: no shard holding more than one tensor passes
    shard_gb x 10**9 bytes, and every shard but the last is full (its next tensor would pass that).
    Reference: the file system: each shard's safetensors header (data_offsets, read here by hand) and
    model.safetensors.index.json, against a greedy-packing oracle in numpy-free Python."""
    random_hf_dir(tmp_path / "hf")
    convert.hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "o"))
    shard_gb = 2e-4    # 200,000 bytes (a GiB reading would allow 214,748)
    convert.orbax_to_hf(str(tmp_path / "o"), str(tmp_path / "out"), shard_gb=shard_gb)
    layout = shard_layout(tmp_path / "out")
    assert len(layout) > 2
    in_order = [t for _, tensors in layout for t in tensors]
    limit = shard_gb * 1e9
    assert [[n for n, _ in tensors] for _, tensors in layout] == greedy(in_order, limit)
    for k, (f, tensors) in enumerate(layout):
        total = sum(b for _, b in tensors)
        assert total <= limit or len(tensors) == 1, (f, total)
        if k + 1 < len(layout):   # full: the next shard's first tensor did not fit
            assert total + layout[k + 1][1][0][1] > limit, (f, total)
    with open(tmp_path / "out" / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert index["metadata"]["total_size"] == sum(b for _, b in in_order)
    assert index["weight_map"] == {n: f for f, tensors in layout for n, _ in tensors}


def test_pad_seed_draws_the_padding(tmp_path):
    """convert.py --pad_seed: the padded vocabulary rows (--pad_vocab) are drawn from that seed: two
    seeds give two different draws of the padding, the same seed the same bits, and the HF rows are
    the HF checkpoint's either way. Reference: the HF checkpoint (transformers' Olmo3ForCausalLM
    state_dict) for the real rows; the seeds' draws against each other for the padding."""
    ref = random_hf_dir(tmp_path / "hf", vocab_size=500)
    sd = {k: v.numpy() for k, v in ref.state_dict().items()}
    got = {}
    for name, seed in (("s0", 0), ("s1", 1), ("s1b", 1)):
        convert.hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / name), pad_vocab=640, pad_seed=seed)
        m, _ = load.load_model(str(tmp_path / name))
        got[name] = (np.asarray(m.embed), np.asarray(m.lm_head))
        np.testing.assert_array_equal(got[name][0][:500], sd["model.embed_tokens.weight"])
        np.testing.assert_array_equal(got[name][1][:, :500], sd["lm_head.weight"].T)
    for k in range(2):
        pad = (lambda a: a[500:]) if k == 0 else (lambda a: a[:, 500:])
        assert np.array_equal(pad(got["s1"][k]), pad(got["s1b"][k]))           # the same seed: the same rows
        assert not np.any(pad(got["s0"][k]) == pad(got["s1"][k]))              # another seed: another draw
