"""CheckpointManager: round trip of an Equinox model + optimizer state across device counts,
keep-N, async-save safety, clear errors, and a process SIGKILLed mid-save."""
import json
import os
import signal
import subprocess
import sys
import textwrap
from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import fake_srun
from olmo3 import checkpoint
from olmo3.checkpoint import CheckpointManager, MissingTensorsError, locate, tensor_names
from olmo3.optim import SkipStepAdamW

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Net(eqx.Module):
    embed: jax.Array
    layers: list
    act: Callable = jax.nn.gelu
    d: int = eqx.field(static=True, default=8)


def make_net(key, d=8, vocab=16):
    k1, k2, k3 = jax.random.split(key, 3)
    return Net(embed=jax.random.normal(k1, (vocab, d)),
               layers=[jax.random.normal(k2, (d, d)), jax.random.normal(k3, (d, d))], d=d)


def mesh(n):
    return Mesh(np.array(jax.devices()[:n]), ("fsdp",))


def shard(tree, m):
    """Row-shard every array over the mesh (scalars and small vectors replicated)."""
    def put(x):
        spec = P("fsdp") if x.ndim >= 1 and x.shape[0] % m.size == 0 else P()
        return jax.device_put(x, NamedSharding(m, spec))
    return jax.tree.map(lambda x: put(x) if eqx.is_array(x) else x, tree)


def abstract_on(tree_fn, m, spec_fn=lambda s: P(None, "fsdp") if len(s.shape) == 2 else P()):
    shapes = eqx.filter_eval_shape(tree_fn)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                       sharding=NamedSharding(m, spec_fn(s)))
                        if isinstance(s, jax.ShapeDtypeStruct) else s, shapes)


def make_state():
    net = make_net(jax.random.key(0))
    opt = SkipStepAdamW(lambda s: jnp.float32(1e-2))
    st = opt.init(net)
    g = jax.tree.map(lambda x: jnp.ones_like(x) if eqx.is_inexact_array(x) else x, net)
    net, st, _ = opt.update(g, st, net, jnp.float32(2.0))
    return {"model": net, "opt": st}


def leaves_equal(a, b):
    la, lb = jax.tree.leaves(eqx.filter(a, eqx.is_array)), jax.tree.leaves(eqx.filter(b, eqx.is_array))
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("n_restore", [1, 2])
def test_roundtrip_8_devices_to_fewer(tmp_path, n_restore):
    state = shard(make_state(), mesh(8))
    assert len(state["model"].embed.sharding.device_set) == 8
    mgr = CheckpointManager(str(tmp_path), keep=2)
    extra = {"loader": {"step": 1, "epoch": 0}, "fingerprint": "abc", "stage": 1}
    mgr.save(1, state, extra)
    mgr.wait()
    assert mgr.latest_step() == 1 and os.path.isdir(tmp_path / "checkpoints" / "1")

    m = mesh(n_restore)
    abstract = abstract_on(make_state, m)
    got, got_extra = CheckpointManager(str(tmp_path), read_only=True).restore(None, abstract)
    leaves_equal(got, state)                       # values AND dtypes, bit for bit
    assert got_extra == extra
    assert got["model"].act is jax.nn.gelu and got["model"].d == 8
    assert got["model"].embed.sharding == NamedSharding(m, P(None, "fsdp"))
    assert len(got["opt"].mu.embed.sharding.device_set) == n_restore
    assert isinstance(got["opt"], type(state["opt"]))


def cut_in_half(step_dir):
    """Every file of a checkpoint's tensors cut to half its size: a torn copy."""
    for f in (step_dir / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _checksum_oracle(x: np.ndarray) -> list[int]:
    """numpy: the bits of each element as an unsigned integer (8-byte ones as two 4-byte words,
    bools as 0 / 1), summed, and summed times 2654435761 * (flat position) + 1, both mod 2**32."""
    x = np.ascontiguousarray(x)
    bits = x.astype(np.uint64) if x.dtype == bool else x.view({1: np.uint8, 2: np.uint16, 4: np.uint32,
                                                             8: np.uint32}[x.dtype.itemsize]).astype(np.uint64)
    weights = (2654435761 * np.arange(bits.size, dtype=np.uint64) + 1) % 2**32
    return [int(bits.sum() % 2**32), int(np.sum((bits.ravel() * weights) % 2**32) % 2**32)]


def test_tensor_checksums_match_a_numpy_oracle_on_any_sharding():
    rng = np.random.default_rng(0)
    host = {"f32": rng.normal(size=(16, 24)).astype(np.float32), "i32": rng.integers(-9, 9, (8, 3), dtype=np.int32),
            "bf16": rng.normal(size=(32,)).astype(jnp.bfloat16), "u8": rng.integers(0, 255, (40,), dtype=np.uint8),
            "bool": rng.random((8, 8)) < 0.5, "scalar": np.float32(3.5)}
    want = {k: _checksum_oracle(np.asarray(v)) for k, v in host.items()}
    assert checkpoint.tensor_checksums({k: jnp.asarray(v) for k, v in host.items()}) == want
    assert checkpoint.tensor_checksums(shard({k: jnp.asarray(v) for k, v in host.items()}, mesh(8))) == want
    flipped = host["f32"].copy()
    flipped.view(np.uint32)[5, 7] ^= 1 << 30
    assert checkpoint.tensor_checksums({"f32": jnp.asarray(flipped)})["f32"] != want["f32"]


def test_a_flipped_bit_is_damage_and_the_resume_falls_back(tmp_path):
    """Orbax's OCDBT data files carry no checksum: a flipped bit in one read back without an error
    and with other numbers. The checksums saved with every checkpoint find it; the resume falls back."""
    mgr = CheckpointManager(str(tmp_path), keep=3, async_save=False)
    state = {"w": jnp.arange(4096, dtype=jnp.float32) / 7, "n": jnp.arange(64, dtype=jnp.int32)}
    mgr.save(1, state, {"step": 1})
    later = {"w": state["w"] * 2, "n": state["n"] + 1}
    mgr.save(2, later, {"step": 2})
    where = tmp_path / "checkpoints" / "2" / "state"
    data_files = [os.path.join(dp, f) for dp, _, fs in os.walk(where) for f in fs if os.path.basename(dp) == "d"]
    big = max(data_files, key=os.path.getsize)
    saved = open(big, "rb").read()
    outcomes = []
    for at in range(len(saved) // 8, len(saved), len(saved) // 8):   # any bit: damage or the same numbers
        b = bytearray(saved)
        b[at] ^= 0x08
        open(big, "wb").write(bytes(b))
        try:
            got, _ = CheckpointManager(str(tmp_path), read_only=True).restore(2, state)
            leaves_equal(got, later)
            outcomes.append("same")
        except checkpoint.ChangedBitsError:
            outcomes.append("checksum")
        except checkpoint.DamagedCheckpointError:
            outcomes.append("unreadable")
    assert "checksum" in outcomes, outcomes   # these flips were restored silently, as other numbers
    b = bytearray(saved)
    b[(outcomes.index("checksum") + 1) * (len(saved) // 8)] ^= 0x08
    open(big, "wb").write(bytes(b))
    step, got, extra = CheckpointManager(str(tmp_path)).restore_intact(state)
    assert step == 1 and extra == {"step": 1} and os.path.isdir(tmp_path / "damaged" / "2")
    leaves_equal(got, state)


def test_moved_elements_are_damage_too(tmp_path):
    """A block of elements read back at another place (the same bits, so the same plain sum) is
    damage: the position-weighted sum is compared as well. Simulated by recording, as the saved
    checksum, that of the tensor with its elements moved."""
    w = jnp.arange(64, dtype=jnp.float32)
    CheckpointManager(str(tmp_path), async_save=False).save(1, {"w": w})
    saved = checkpoint.tensor_checksums({"w": w})["w"]
    moved = checkpoint.tensor_checksums({"w": jnp.roll(w, 8)})["w"]
    assert moved[0] == saved[0] and moved[1] != saved[1]
    meta = tmp_path / "checkpoints" / "1" / "extra" / "metadata"
    extra = json.loads(meta.read_text())
    assert extra[checkpoint.CHECKSUMS]["w"] == saved
    extra[checkpoint.CHECKSUMS]["w"] = moved
    meta.write_text(json.dumps(extra))
    with pytest.raises(checkpoint.ChangedBitsError, match="other bits"):
        CheckpointManager(str(tmp_path), read_only=True).restore(1, {"w": w})


def test_non_finite_state_is_refused_but_skipped_losses_are_kept(tmp_path):
    """A NaN or inf in any float tensor: NonFiniteError naming it, and no checkpoint written. The
    skip-step windows are exempt: a skipped step's NaN loss is their record, not damage; every
    other tensor is checked, not only the first, float32 or the model's: a bf16 parameter and an
    Adam moment beside the windows too."""
    from olmo3.cli import NonFiniteError
    mgr = CheckpointManager(str(tmp_path), async_save=False)
    good = {"w": jnp.ones((8,)), "n": jnp.arange(3)}
    for bad in (np.nan, np.inf, -np.inf):
        with pytest.raises(NonFiniteError, match=r"step 1: 1 tensor.*'w'.*not written"):
            mgr.save(1, {**good, "w": good["w"].at[5].set(bad)})
    for name, bad in (("z", {"z": good["w"].at[1].set(np.nan)}),
                      ("h", {"h": jnp.ones((8,), jnp.bfloat16).at[2].set(np.inf)}),
                      ("opt.nu", {"opt": {"loss_window": good["w"], "nu": good["w"].at[0].set(np.nan)}})):
        with pytest.raises(NonFiniteError, match=rf"step 1: 1 tensor.*\['{name}'\].*not written"):
            mgr.save(1, {**good, **bad})
    assert mgr.all_steps() == []
    skipped = {"loss_window": jnp.full((4,), jnp.nan), "gnorm_window": jnp.array([1.0, jnp.inf, 0.0, 0.0])}
    mgr.save(1, {**good, "opt": skipped})
    got, _ = mgr.restore(1, {**good, "opt": skipped})
    assert np.isnan(np.asarray(got["opt"]["loss_window"])).all() and mgr.all_steps() == [1]


def test_restoring_into_another_dtype_casts_and_still_checks_the_bits(tmp_path):
    """Dtypes follow the abstract state: an fp32 checkpoint read as bf16 (a warm start with another
    --param_dtype) is cast as numpy casts, onto the sharding asked for. Its bits are compared as
    stored first: before, a tensor restored into another dtype skipped its checksum, and a warm
    start trained on from a damaged checkpoint."""
    w = jnp.arange(16, dtype=jnp.float32) / 3
    CheckpointManager(str(tmp_path), async_save=False).save(1, {"w": w, "v": w})
    mgr = CheckpointManager(str(tmp_path), read_only=True)
    on_two = NamedSharding(mesh(2), P("fsdp"))
    got, _ = mgr.restore(1, {"w": jax.ShapeDtypeStruct((16,), jnp.bfloat16, sharding=on_two),
                             "v": jax.device_put(w, on_two)})
    assert got["w"].dtype == jnp.bfloat16 and got["w"].sharding == on_two
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(w).astype(jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(got["v"]), np.asarray(w))
    meta = tmp_path / "checkpoints" / "1" / "extra" / "metadata"
    extra = json.loads(meta.read_text())
    extra[checkpoint.CHECKSUMS]["w"] = checkpoint.tensor_checksums({"w": w.at[3].add(1)})["w"]   # as if damaged
    meta.write_text(json.dumps(extra))
    with pytest.raises(checkpoint.ChangedBitsError, match=r"\['w'\]"):
        CheckpointManager(str(tmp_path), read_only=True).restore(1, {"w": jax.ShapeDtypeStruct((16,), jnp.bfloat16)})


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int32])
def test_checksums_of_blocks_add_up_to_the_saved_one(tmp_path, dtype):
    """convert.py reads a tensor a layer or a block of rows at a time: BlockChecksums adds the
    blocks' position-weighted sums and compares the total, once the blocks cover the tensor, with
    the checksum saved (tensor_checksums, held to a numpy oracle above). Any split, in any order;
    a changed element in any block is damage."""
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(3, 5, 7)) * 100).astype(dtype)
    CheckpointManager(str(tmp_path), async_save=False).save(1, {"x": jnp.asarray(x)})
    mgr = CheckpointManager(str(tmp_path), read_only=True)
    layers = checkpoint.BlockChecksums(mgr, 1)
    for i in (2, 0, 1):
        layers.add("x", x[i], (i, 0, 0), x.shape)   # layer i, indexed out of the stacked axis
    rows = checkpoint.BlockChecksums(mgr, 1)
    for i in range(3):
        for a in range(0, 5, 2):                    # blocks of rows, the last one short
            rows.add("x", x[i:i + 1, a:a + 2], (i, a, 0), x.shape)
    checkpoint.BlockChecksums(mgr, 1).add("x", x, (0, 0, 0), x.shape)
    for where in ((0, 0, 0), (1, 4, 6), (2, 3, 1)):
        y = x.copy()
        y[where] += 1
        changed = checkpoint.BlockChecksums(mgr, 1)
        with pytest.raises(checkpoint.ChangedBitsError, match=r"\['x'\]"):
            for i in range(3):
                changed.add("x", y[i], (i, 0, 0), x.shape)
    moved = checkpoint.BlockChecksums(mgr, 1)   # the right layers at the wrong places
    with pytest.raises(checkpoint.ChangedBitsError):
        for i in range(3):
            moved.add("x", x[(i + 1) % 3], (i, 0, 0), x.shape)


def test_keep_last_n_and_async_save_is_safe_to_donate(tmp_path):
    mgr = CheckpointManager(str(tmp_path), keep=2)
    for step in range(1, 6):
        x = jnp.full((64, 64), float(step))
        mgr.save(step, {"x": x}, {"step": step})
        x.delete()       # train.py donates buffers right after save(): save must have copied them
    mgr.wait()
    assert mgr.all_steps() == [4, 5]
    abstract = {"x": jax.ShapeDtypeStruct((64, 64), jnp.float32)}
    for step in (4, 5):
        got, extra = mgr.restore(step, abstract)
        assert np.all(np.asarray(got["x"]) == step) and extra == {"step": step}
    assert mgr.read_extra(4) == {"step": 4}


def test_steps_are_numbers_not_names(tmp_path):
    """Step 10 is newer than step 9 (as a name it sorts first): keep-N drops 8, and the latest
    step and the resume are 10."""
    mgr = CheckpointManager(str(tmp_path), keep=2, async_save=False)
    for step in (8, 9, 10):
        mgr.save(step, {"x": jnp.full((4,), float(step))}, {"step": step})
    assert mgr.all_steps() == [9, 10] and mgr.latest_step() == 10
    assert mgr.verify() == 10 and mgr.read_extra() == {"step": 10}   # step None: the latest
    assert np.all(np.asarray(mgr.restore(None, {"x": jax.ShapeDtypeStruct((4,), jnp.float32)})[0]["x"]) == 10)
    mgr.close()
    step, got, extra = CheckpointManager(str(tmp_path)).restore_intact({"x": jax.ShapeDtypeStruct((4,), jnp.float32)})
    assert step == 10 and extra == {"step": 10} and np.all(np.asarray(got["x"]) == 10)


def test_transient_read_errors_keep_every_checkpoint(tmp_path, monkeypatch):
    """A storage hiccup while resuming is not damage: Orbax re-raises an array read's failure as a
    plain Exception with the TensorStore status in its cause; a transient one (UNAVAILABLE) ends
    the resume as it is, retried (exit 1, also before the first step), and no checkpoint is moved
    aside (it used to move every one aside and start again from step 0). A truncated file's
    OUT_OF_RANGE still is damage: moved aside, the bytes kept."""
    from olmo3 import cli
    monkeypatch.setattr(cli, "_running", False)
    mgr = CheckpointManager(str(tmp_path), keep=None, async_save=False)
    for step in (1, 2):
        mgr.save(step, {"x": jnp.full((8,), float(step))}, {"step": step})
    abstract = {"x": jax.ShapeDtypeStruct((8,), jnp.float32)}

    def fail_with(status):
        def restore(*args, **kwargs):
            try:
                raise ValueError(f"{status}: Error reading local file \"{tmp_path}/checkpoints/2/state/d/abc\"")
            except ValueError as cause:
                raise Exception("Encountered error while reading array index (0,).") from cause
        monkeypatch.setattr(mgr._mgr, "restore", restore)

    for status in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "INTERNAL"):
        fail_with(status)
        with pytest.raises(Exception, match="Encountered error while reading") as e:
            mgr.restore_intact(abstract)
        assert mgr.all_steps() == [1, 2] and not os.path.exists(tmp_path / "damaged")
        assert cli.exit_status(e.value) == 1
    stale = OSError(116, "Stale file handle")
    assert cli.storage_error_kind(stale) == "transient" and cli.exit_status(stale) == 1
    fail_with("OUT_OF_RANGE")
    with pytest.raises(checkpoint.NoIntactCheckpointError, match="no checkpoint of .* reads back: "
                       r"\[1, 2\] are damaged") as e:   # not a fresh start that passes for a resume
        mgr.restore_intact(abstract)
    assert cli.exit_status(e.value) == 2
    assert sorted(os.listdir(tmp_path / "damaged")) == ["1", "2"]


def test_the_rotated_out_checkpoint_waits_for_the_next_save(tmp_path):
    """keep-N renames the oldest step into checkpoints/.deleted/. Opening the manager no longer
    empties it (a resume that found the kept step damaged destroyed the one intact copy there
    first); the refusal names it, and the next save or close() empties it (train.py closes at
    the end, where it had left N+1 checkpoints on disk)."""
    mgr = CheckpointManager(str(tmp_path), keep=1, async_save=False)
    for step in (1, 2):
        mgr.save(step, {"x": jnp.full((8,), float(step))}, {"step": step})
    abstract = {"x": jax.ShapeDtypeStruct((8,), jnp.float32)}
    deleted = tmp_path / "checkpoints" / ".deleted"
    assert os.listdir(deleted) == ["1"]
    cut_in_half(tmp_path / "checkpoints" / "2")
    resumed = CheckpointManager(str(tmp_path), keep=1, async_save=False)
    with pytest.raises(checkpoint.NoIntactCheckpointError, match=r"\.deleted still holds step\(s\) \['1'\]"):
        resumed.restore_intact(abstract)
    os.rename(deleted / "1", tmp_path / "checkpoints" / "1")   # what the message says to do
    resumed = CheckpointManager(str(tmp_path), keep=1, async_save=False)
    step, got, _ = resumed.restore_intact(abstract)
    assert step == 1 and np.all(np.asarray(got["x"]) == 1.0)
    resumed.save(2, {"x": jnp.full((8,), 2.0)}, {"step": 2})
    resumed.save(3, {"x": jnp.full((8,), 3.0)}, {"step": 3})
    assert os.listdir(deleted) == ["2"]
    resumed.close()
    assert not os.path.exists(deleted) or not os.listdir(deleted)


@pytest.mark.parametrize("async_save", [True, False])
def test_finished_saves_reports_each_save_once(tmp_path, async_save):
    """train.py prints "checkpoint N saved in S s" from this: every save, once, in order."""
    mgr = CheckpointManager(str(tmp_path), keep=2, async_save=async_save)
    net = make_net(jax.random.key(0))
    seen = []
    for step in (1, 2, 3):
        mgr.save(step, {"model": net})
        seen += mgr.finished_saves()
    mgr.wait()
    seen += mgr.finished_saves()
    assert [s for s, _ in seen] == [1, 2, 3] and all(t >= 0 for _, t in seen)
    assert mgr.finished_saves() == []
    mgr.close()


def test_partial_restore_and_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        CheckpointManager(str(tmp_path / "nope"), read_only=True)
    state = make_state()
    mgr = CheckpointManager(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        mgr.restore(None, state)
    mgr.save(3, {"model": state["model"]}, {"stage": 1})      # a model-only checkpoint
    mgr.wait()
    with pytest.raises(FileExistsError, match="already exists"):
        mgr.save(3, state, {})
    os.makedirs(tmp_path / "checkpoints" / "5")   # made since the manager listed its steps: not written over
    (tmp_path / "checkpoints" / "5" / "mine").write_text("x")
    with pytest.raises(FileExistsError, match="already exists"):
        mgr.save(5, state, {})
    assert (tmp_path / "checkpoints" / "5" / "mine").read_text() == "x"
    os.remove(tmp_path / "checkpoints" / "5" / "mine")
    os.rmdir(tmp_path / "checkpoints" / "5")
    with pytest.raises(TypeError, match="JSON"):
        mgr.save(4, state, {"bad": object()})
    with pytest.raises(FileNotFoundError, match=r"available: \[3\]"):
        mgr.restore(7, state)
    # Model only: fine. Model + optimizer from a model-only checkpoint: names the tensors.
    got, _ = mgr.restore(3, {"model": eqx.filter_eval_shape(make_state)["model"]})
    leaves_equal(got["model"], state["model"])
    with pytest.raises(MissingTensorsError, match=r"no tensor\(s\) \['opt\.count'") as e:
        mgr.restore(3, state)
    assert all(n.startswith("opt.") for n in e.value.missing) and "opt.mu.embed" in e.value.missing
    # Shape mismatch names the tensor path.
    wrong = {"model": eqx.filter_eval_shape(lambda: make_net(jax.random.key(0), vocab=32))}
    with pytest.raises(ValueError, match=r"'model\.embed' has shape \(16, 8\) but the model "
                                         r"expects \(32, 8\)"):
        mgr.restore(3, wrong)
    assert sorted(tensor_names(state["model"])) == ["embed", "layers.0", "layers.1"]
    assert locate(str(tmp_path)) == (str(tmp_path), None)
    assert locate(str(tmp_path / "checkpoints" / "3")) == (str(tmp_path), 3)
    assert locate(str(tmp_path / "checkpoints")) == (str(tmp_path), None)
    run42 = tmp_path.parent / f"{tmp_path.name}-runs" / "checkpoints" / "42"   # run 42 in a folder of runs
    os.makedirs(run42 / "checkpoints")
    assert locate(str(run42)) == (str(run42), None)
    with pytest.raises(FileNotFoundError):
        locate(str(tmp_path / "checkpoints" / "9"))


CHILD = textwrap.dedent("""
    import os, signal, sys, time
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from olmo3.checkpoint import CheckpointManager
    m = Mesh(np.array(jax.devices()), ("d",))
    sh = NamedSharding(m, P("d"))
    mgr = CheckpointManager(sys.argv[1], keep=3)
    mgr.save(1, {"w": jax.device_put(jnp.arange(4096.0), sh)}, {"step": 1})
    mgr.wait()
    big = jax.device_put(jnp.ones((8, 8 * 1024 * 1024), jnp.float32), sh)   # 256 MiB
    mgr.save(2, {"w": big}, {"step": 2})
    # The save runs in the background: the kill must land once its tmp dir exists (a kill right
    # after save() returned found only step 1 under a loaded CI box), and before it is renamed;
    # the process kills itself (a kill sent by the test after reading a line here could land after
    # the rename while the test waits for a core).
    ckpts, deadline = os.path.join(sys.argv[1], "checkpoints"), time.time() + 60
    while not any(".orbax-checkpoint-tmp" in n for n in os.listdir(ckpts)) and time.time() < deadline:
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGKILL)
""")

RESTORE_1DEV = textwrap.dedent("""
    import sys, jax, jax.numpy as jnp, numpy as np
    from olmo3.checkpoint import CheckpointManager
    assert jax.device_count() == 1
    mgr = CheckpointManager(sys.argv[1], read_only=True)
    got, extra = mgr.restore(None, {"w": jax.ShapeDtypeStruct((4096,), jnp.float32)})
    print(mgr.latest_step(), float(np.asarray(got["w"]).sum()), extra["step"])
""")


def _env(n_devices):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={n_devices}")
    return env


def test_sigkill_during_async_save_keeps_previous_checkpoint(tmp_path):
    run = str(tmp_path / "run")
    child = subprocess.run([sys.executable, "-c", CHILD, run], capture_output=True, env=_env(8), text=True,
                           timeout=180)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    ckpts = tmp_path / "run" / "checkpoints"
    # The kill landed mid-save: step 2 exists only as an orbax tmp dir.
    assert any(".orbax-checkpoint-tmp" in n for n in os.listdir(ckpts)), os.listdir(ckpts)
    assert not (ckpts / "2").exists()
    ro = CheckpointManager(run, read_only=True)
    assert ro.all_steps() == [1] and ro.latest_step() == 1
    # Restore the 8-device save in a fresh 1-device process.
    out = subprocess.run([sys.executable, "-c", RESTORE_1DEV, run], capture_output=True,
                         text=True, env=_env(1), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", str(float(sum(range(4096)))), "1"]
    # A writable manager clears the stale tmp dir (in the background, done by the next save),
    # and step 2 can be saved again.
    mgr = CheckpointManager(run)
    mgr.save(2, {"w": jnp.zeros(3)}, {"step": 2})
    mgr.wait()
    assert not any(".orbax-checkpoint-tmp" in n for n in os.listdir(ckpts))
    assert mgr.all_steps() == [1, 2]
    assert json.dumps(mgr.read_extra(2)) == '{"step": 2}'


TWO_PROCESSES = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    port, pid, run, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    from olmo3 import sharding
    sharding.initialize_distributed(f"127.0.0.1:{port}", 2, pid)
    import jax, jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from olmo3.checkpoint import CheckpointManager
    shd = NamedSharding(Mesh(np.array(jax.devices()), ("fsdp",)), P("fsdp"))
    ckpt = CheckpointManager(run, keep=5, async_save=False)
    if mode == "save":
        for step in (1, 2):
            w = np.random.default_rng(step).standard_normal(1 << 18).astype(np.float32) + step   # 1 MB: real shard files
            ckpt.save(step, {"w": jax.make_array_from_callback(w.shape, shd, lambda i: w[i])}, {"step": step})
        ckpt.wait()
        print(json.dumps({"pid": pid}))
    else:
        step, state, _ = ckpt.restore_intact({"w": jax.ShapeDtypeStruct((1 << 18,), jnp.float32, sharding=shd)})
        total = float(jnp.sum(state["w"]))   # a collective: both processes must have restored the same step
        print(json.dumps({"pid": pid, "step": step, "total": total}))
""")


def test_damage_seen_by_one_process_is_every_processs_verdict(tmp_path):
    """Two processes (2 devices each): a shard file written by process 1 is truncated, so only
    process 1 cannot read checkpoint 2, while process 0 is past Orbax's restore barrier. Process 1
    marks the step and exits 1 (before, it fell back alone and both hung in the next collective,
    every rerun alike); process 0 is then ended (by JAX's heartbeat on a cluster, here by the
    test). The rerun falls back to checkpoint 1 on both, and the damaged one is moved aside once."""
    run = str(tmp_path / "run")

    def start(mode):
        port = str(fake_srun.free_derived_port())
        return [subprocess.Popen([sys.executable, "-c", TWO_PROCESSES, port, str(pid), run, mode], text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(2)) for pid in (0, 1)]

    def both(mode):
        outs = []
        for p in start(mode):
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
        return outs

    both("save")
    shard_dir = tmp_path / "run" / "checkpoints" / "2" / "state" / "ocdbt.process_1" / "d"
    files = sorted(shard_dir.iterdir(), key=lambda f: f.stat().st_size)
    with open(files[-1], "r+b") as f:   # the data file process 1 wrote
        f.truncate(f.seek(0, 2) // 2)
    import time
    procs = start("restore")
    pending = tmp_path / "run" / "damaged" / "pending-2"
    deadline = time.time() + 240
    while not pending.exists() and time.time() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.2)
    time.sleep(2)   # its error line; then its exit would wait minutes on JAX's shutdown barrier
    for p in procs:   # a cluster's heartbeat (or the launcher) ends them; here the test does
        p.kill()
    err = procs[1].communicate()[1]
    procs[0].communicate()
    assert pending.exists() and "cannot fall back alone" in err, err[-3000:]
    got = both("restore")
    want = float((np.random.default_rng(1).standard_normal(1 << 18).astype(np.float32) + 1).sum())
    assert [r["step"] for r in got] == [1, 1]
    np.testing.assert_allclose([r["total"] for r in got], [want, want], rtol=1e-5)
    assert sorted(os.listdir(tmp_path / "run" / "damaged")) == ["2"]
    assert os.path.exists(tmp_path / "run" / "damaged" / "2" / "damaged_on_another_process.json")


def test_steps_in_flight_are_not_listed_as_checkpoints(tmp_path, monkeypatch):
    """While an async save still writes step 2 under its temporary name, Orbax already counts it:
    the steps listed (the latest, the advice a non-finite state ends with) are those on disk."""
    mgr = CheckpointManager(str(tmp_path), async_save=False)
    mgr.save(1, {"w": jnp.ones((8,))}, {"step": 1})
    monkeypatch.setattr(mgr._mgr, "is_saving_in_progress", lambda: True)
    monkeypatch.setattr(mgr._mgr, "all_steps", lambda: [1, 2])
    assert mgr.all_steps() == [1] and mgr.latest_step() == 1
    assert f"{tmp_path / 'checkpoints'}/1: resume from it" in mgr.what_to_resume()


@pytest.mark.parametrize("name", ["state/_sharding", "_CHECKPOINT_METADATA"])
def test_verify_names_the_metadata_file_that_does_not_parse(tmp_path, name):
    """eval.py and convert.py verify a checkpoint before reading it: a cut JSON metadata file is
    named, also the one Orbax only logs about when it does not parse (a torn copy)."""
    CheckpointManager(str(tmp_path), async_save=False).save(1, {"w": jnp.ones((8,))}, {"step": 1})
    cut = tmp_path / "checkpoints" / "1" / name
    cut.write_bytes(cut.read_bytes()[:5])
    with pytest.raises(checkpoint.DamagedCheckpointError) as e:
        CheckpointManager(str(tmp_path), read_only=True).verify(1)
    assert e.value.file == str(cut)


def test_a_label_damaged_twice_is_moved_aside_twice(tmp_path):
    """A step damaged, moved aside, saved again and damaged again: both copies are kept under
    damaged/ (the second as <N>-<time>), and the resume falls back both times."""
    mgr = CheckpointManager(str(tmp_path), keep=None, async_save=False)
    abstract = {"x": jax.ShapeDtypeStruct((8,), jnp.float32)}
    mgr.save(1, {"x": jnp.full((8,), 1.0)}, {"step": 1})
    for _ in range(2):
        mgr.save(2, {"x": jnp.full((8,), 2.0)}, {"step": 2})
        cut_in_half(tmp_path / "checkpoints" / "2")
        step, got, _ = CheckpointManager(str(tmp_path), keep=None, async_save=False).restore_intact(abstract)
        assert step == 1 and np.all(np.asarray(got["x"]) == 1.0)
        mgr = CheckpointManager(str(tmp_path), keep=None, async_save=False)
    assert len(os.listdir(tmp_path / "damaged")) == 2 and "2" in os.listdir(tmp_path / "damaged")


def test_the_quiet_hook_passes_on_every_other_unraisable(monkeypatch):
    """Abandoned reads' reports are dropped; every other unraisable exception still reaches the
    hook that was there before."""
    import types
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    checkpoint._quiet_abandoned_reads()
    report = lambda e: sys.unraisablehook(types.SimpleNamespace(   # noqa: E731
        exc_type=type(e), exc_value=e, exc_traceback=None, err_msg=None, object=None))
    report(RuntimeError("Event loop is closed"))
    other = ValueError("another module's finaliser failed")
    report(other)
    assert seen == [other]
