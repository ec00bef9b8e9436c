"""What the finiteness check costs a checkpoint save (olmo3/checkpoint.py `nonfinite_tensors`).

    python benchmarks/bench_checkpoint.py                 # 8 x 256 MiB fp32 tensors (2.15 GB)
    python benchmarks/bench_checkpoint.py --tensors=4 --mib=512

Every save first checks every float tensor of the state for NaN / inf, so that no checkpoint of a
poisoned state is ever written. The check reads the state once on the devices that hold it; this
script times it (median of --repeats) next to synchronous saves of the same state with and without
the check, interleaved, and scales the check's rate to the 7B state (fp32 parameters + two Adam
moments, 87.6 GB) per device for a device count.
"""
import shutil
import statistics
import tempfile
import time

from absl import app, flags

flags.DEFINE_integer("tensors", 8, "tensors in the state")
flags.DEFINE_integer("mib", 256, "MiB per fp32 tensor")
flags.DEFINE_integer("repeats", 5, "timed checks")
flags.DEFINE_integer("saves", 2, "timed saves with and without the check, interleaved")
flags.DEFINE_integer("devices_7b", 128, "devices the 7B state is sharded over, for the per-device figure")
F = flags.FLAGS

STATE_7B_GB = 7_298_011_136 * 4 * 3 / 1e9   # DESIGN §2 parameter count; fp32 params + mu + nu


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp

    from olmo3 import checkpoint
    n = F.mib * 2**20 // 4
    flat = {f"model.w{i}": jax.random.normal(jax.random.key(i), (n,), jnp.float32) for i in range(F.tensors)}
    gb = F.tensors * n * 4 / 1e9
    assert checkpoint.nonfinite_tensors(flat) == []   # compiles
    times = []
    for _ in range(F.repeats):
        t = time.perf_counter()
        checkpoint.nonfinite_tensors(flat)
        times.append(time.perf_counter() - t)
    check_s = statistics.median(times)
    print(f"check: {gb:.2f} GB in {check_s * 1e3:.0f} ms (median of {F.repeats}, min {min(times) * 1e3:.0f}): "
          f"{gb / check_s:.2f} GB/s")
    d = tempfile.mkdtemp()
    real = checkpoint.nonfinite_tensors
    saves = {"with check": [], "without": []}
    try:
        mgr = checkpoint.CheckpointManager(d, keep=1, async_save=False)
        for k in range(2 * F.saves):
            kind = "with check" if k % 2 == 0 else "without"
            checkpoint.nonfinite_tensors = real if kind == "with check" else (lambda flat: [])
            t = time.perf_counter()
            mgr.save(k + 1, flat, {})
            mgr.wait()
            saves[kind].append(time.perf_counter() - t)
    finally:
        checkpoint.nonfinite_tensors = real
        shutil.rmtree(d)
    for kind, ts in saves.items():
        print(f"save {kind}: median {statistics.median(ts):.2f} s of {[round(x, 2) for x in ts]}")
    per_device = STATE_7B_GB / F.devices_7b
    print(f"7B state {STATE_7B_GB:.1f} GB = {per_device:.2f} GB per device on {F.devices_7b} devices: "
          f"{per_device / (gb / check_s):.2f} s at this device's check rate")


if __name__ == "__main__":
    app.run(main)
