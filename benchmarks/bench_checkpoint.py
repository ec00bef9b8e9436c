"""What the finiteness check and the checksums cost a checkpoint save (olmo3/checkpoint.py
`nonfinite_tensors`, `tensor_checksums`).

    python benchmarks/bench_checkpoint.py                 # 8 x 256 MiB fp32 tensors (2.15 GB)
    python benchmarks/bench_checkpoint.py --tensors=4 --mib=512

Every save first checks every float tensor of the state for NaN / inf, so that no checkpoint of a
poisoned state is ever written, then takes a checksum of every tensor's bits, which every restore
compares. Each reads the state once on the devices that hold it; this script times each (median
of --repeats) next to synchronous saves of the same state with and without both, interleaved, and
scales their rate to the 7B state (fp32 parameters + two Adam moments, 87.6 GB) per device for a
device count.
"""
import shutil
import statistics
import tempfile
import time

from absl import flags

from olmo3 import cli

flags.DEFINE_integer("tensors", 8, "tensors in the state")
flags.DEFINE_integer("mib", 256, "MiB per fp32 tensor")
flags.DEFINE_integer("repeats", 5, "timed checks")
flags.DEFINE_integer("saves", 2, "timed saves with and without the check, interleaved")
flags.DEFINE_integer("devices_7b", 128, "devices the 7B state is sharded over, for the per-device figure")
cli.require([(name, lambda v: v >= 1, ">= 1") for name in ("tensors", "mib", "repeats", "saves", "devices_7b")])
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
    checkpoint.tensor_checksums(flat)
    rates = {}
    for name, fn in (("finiteness check", checkpoint.nonfinite_tensors), ("checksums", checkpoint.tensor_checksums)):
        times = []
        for _ in range(F.repeats):
            t = time.perf_counter()
            fn(flat)
            times.append(time.perf_counter() - t)
        rates[name] = gb / statistics.median(times)
        print(f"{name}: {gb:.2f} GB in {statistics.median(times) * 1e3:.0f} ms (median of {F.repeats}, "
              f"min {min(times) * 1e3:.0f}): {rates[name]:.2f} GB/s")
    d = tempfile.mkdtemp()
    real = checkpoint.nonfinite_tensors, checkpoint.tensor_checksums
    saves = {"with both": [], "without": []}
    try:
        mgr = checkpoint.CheckpointManager(d, keep=1, async_save=False)
        for k in range(2 * F.saves):
            kind = "with both" if k % 2 == 0 else "without"
            checkpoint.nonfinite_tensors, checkpoint.tensor_checksums = (
                real if kind == "with both" else (lambda flat: [], lambda flat: {}))
            t = time.perf_counter()
            mgr.save(k + 1, flat, {})
            mgr.wait()
            saves[kind].append(time.perf_counter() - t)
    finally:
        checkpoint.nonfinite_tensors, checkpoint.tensor_checksums = real
        shutil.rmtree(d)
    for kind, ts in saves.items():
        print(f"save {kind}: median {statistics.median(ts):.2f} s of {[round(x, 2) for x in ts]}")
    per_device = STATE_7B_GB / F.devices_7b
    print(f"7B state {STATE_7B_GB:.1f} GB = {per_device:.2f} GB per device on {F.devices_7b} devices: "
          + ", ".join(f"{name} {per_device / rate:.2f} s" for name, rate in rates.items()) + " at this device's rates")


if __name__ == "__main__":
    cli.run(main)   # a bad flag: one line, exit 2 (olmo3/cli.py)
