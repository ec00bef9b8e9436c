"""One process of the 2-process run in tests/test_multiprocess.py (not a test itself).

    python tests/multiprocess_worker.py PORT PROCESS_ID OUT_DIR    # explicit coordinator 127.0.0.1:PORT
    python tests/multiprocess_worker.py auto PROCESS_ID OUT_DIR    # a launcher's variables only
    python tests/multiprocess_worker.py PORT PROCESS_ID OUT_DIR scores   # whole-batch scoring only

Each process owns 2 CPU devices (4 global), joins jax.distributed (through explicit values, or
through JAX's own detection of the SLURM / Open MPI variables tests/fake_srun.py sets), builds the
sharded state with `init_sharded`, feeds ITS rows of each global batch (data rank = process
index), runs STEPS steps, and all processes save one Orbax checkpoint into OUT_DIR/run. Process 0
writes the losses and the final params (gathered from every process) to OUT_DIR/result.npz.
"""
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from olmo3 import sharding as sh  # noqa: E402


def whole_batch_scores(out_dir: str) -> None:
    """Functions given the WHOLE batch on every process (DPO reference log-probs, downstream
    scoring) return its rows' results in the batch's order, on a mesh that puts process 1's
    devices first and interleaves the two processes, as a TPU slice's physical order may."""
    import numpy as np

    import test_multiprocess as spec
    from olmo3 import dpo

    mine = {d.process_index: [] for d in jax.devices()}
    for d in jax.devices():
        mine[d.process_index].append(d)
    mesh = sh.make_mesh(spec.MESH, devices=[d for pair in zip(mine[1], mine[0]) for d in pair])
    model, _ = sh.init_sharded(spec.fresh, mesh)
    specs = sh.param_specs(model, mesh)
    batch = spec.scored_batch()
    sums, counts = dpo.make_logps_fn(mesh, specs, chunk=64)(model, batch)
    ll, choice = sh.make_score_fn(mesh, specs)(model, batch)
    if jax.process_index() == 0:
        np.savez(os.path.join(out_dir, "scores.npz"), sums=sums, counts=counts, ll=ll, choice=choice)


def main(port: str, process_id: int, out_dir: str, mode: str = "train") -> None:
    if port == "auto":   # no flags: olmo3.cluster detects the engine, JAX fills in the rest
        from olmo3 import cluster
        launch = cluster.initialize()
        cluster.check(launch)
        assert launch.engine in ("slurm", "open-mpi") and launch.processes == 2, launch
        rank, num_ranks = jax.process_index(), jax.process_count()
    else:
        rank, num_ranks = sh.initialize_distributed(f"127.0.0.1:{port}", 2, process_id)
    assert (rank, num_ranks) == (process_id, 2) and jax.device_count() == 4, jax.devices()
    jax.config.update("jax_default_matmul_precision", "highest")
    if mode == "scores":
        return whole_batch_scores(out_dir)

    import numpy as np
    from jax.experimental import multihost_utils

    import test_multiprocess as spec   # the shared recipe: config, optimizer, batches
    from olmo3.checkpoint import CheckpointManager

    mesh = sh.make_mesh(spec.MESH)
    model, opt = sh.init_sharded(spec.fresh, mesh)
    step = sh.make_train_step(spec.optimizer(), mesh, sh.param_specs(model, mesh),
                              microbatches=spec.MICROBATCHES, chunk=64)
    losses = []
    for batch in spec.batches():
        rows = len(batch["tokens"]) // num_ranks                  # this rank's rows only
        local = {k: v[rank * rows:(rank + 1) * rows] for k, v in batch.items()}
        model, opt, m = step(model, opt, sh.global_batch(local, mesh))
        losses.append(float(m["train/loss"]))

    ckpt = CheckpointManager(os.path.join(out_dir, "run"), async_save=False)
    ckpt.save(spec.STEPS, {"model": model, "opt": opt}, {"losses": losses})
    ckpt.wait()
    ckpt.close()

    flat = {jax.tree_util.keystr(p): np.asarray(multihost_utils.process_allgather(x, tiled=True))
            for p, x in jax.tree_util.tree_flatten_with_path(model)[0]}
    if rank == 0:
        np.savez(os.path.join(out_dir, "result.npz"), losses=np.array(losses), **flat)
    multihost_utils.sync_global_devices("done")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
