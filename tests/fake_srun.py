"""A stand-in for SLURM's `srun` and for the environment of `mpirun` (a test helper, not shipped).

    python tests/fake_srun.py [--ntasks-per-node=K] [--nodes=N] [--ntasks=T] [other options] CMD ...

starts T (default: nodes x K, nodes from the batch environment's SLURM_JOB_NUM_NODES) local
processes of CMD, each with the variables a real srun step sets (SLURM_JOB_ID,
SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID, SLURM_STEP_NUM_NODES, ...). Every
"node" is this host, named `localhost` in the node list, so the coordinator JAX derives (the first
node, port 61440 + SLURM_JOB_ID % 4096) is reachable. Like `srun --kill-on-bad-exit=1`, the first
task to fail stops the others; the exit status is that task's. Options it does not model are
accepted and ignored.

`mpirun_env` gives the variables Open MPI 4's mpirun sets for one rank (OMPI_MCA_orte_hnp_uri and
OMPI_COMM_WORLD_*), which is all JAX's Open MPI detection reads: no MPI library is involved.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

SLURM_PORT_BASE = 65535 - 2 ** 12 + 1   # JAX: port = base + SLURM_JOB_ID % 4096 (jax/_src/clusters)


def free_derived_port() -> int:
    """A free port in the range JAX derives SLURM / Open MPI coordinator ports from. It is outside
    Linux's ephemeral range, so a port-0 bind elsewhere in the test session (another test's server,
    Gloo's listeners) cannot take it between this check and a coordinator's bind."""
    for _ in range(200):
        port = SLURM_PORT_BASE + int.from_bytes(os.urandom(2), "little") % 2 ** 12
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port in 61440..65535")


def job_id_for_free_port() -> int:
    """A SLURM_JOB_ID whose derived coordinator port is free on this host now."""
    return 4096 * 1000 + free_derived_port() - SLURM_PORT_BASE


LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "TPU_WORKER", "TPU_PROCESS", "MEGASCALE_",
                     "JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS")


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without any launcher's variables (a test may itself run under srun), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    env.update(extra)
    return env


def srun_env(job_id: int, rank: int, ntasks: int, nodes: int) -> dict[str, str]:
    """The SLURM variables of task `rank` of an srun step over `nodes` nodes (tasks in blocks)."""
    per_node = ntasks // nodes
    return {"SLURM_JOB_ID": str(job_id), "SLURM_JOBID": str(job_id), "SLURM_STEP_ID": "0",
            "SLURM_STEPID": "0", "SLURM_STEP_NODELIST": "localhost", "SLURM_NODELIST": "localhost",
            "SLURM_JOB_NODELIST": "localhost", "SLURM_NTASKS": str(ntasks), "SLURM_NPROCS": str(ntasks),
            "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_STEP_NUM_NODES": str(nodes),
            "SLURM_NNODES": str(nodes), "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})",
            "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})", "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank % per_node), "SLURM_NODEID": str(rank // per_node)}


def mpirun_env(rank: int, size: int, port: int) -> dict[str, str]:
    """Open MPI 4's variables for one rank of `mpirun -np size` on this host. JAX derives its
    coordinator port (a `free_derived_port()`) from the URI's job id, 61440 + (jobid // 4096) %
    4096, and its host from the URI's first tcp address."""
    jobid = 4096 * (port - SLURM_PORT_BASE)
    return {"OMPI_MCA_orte_hnp_uri": f"{jobid}.0;tcp://127.0.0.1:{port}",
            "OMPI_COMM_WORLD_SIZE": str(size), "OMPI_COMM_WORLD_RANK": str(rank),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(size)}


def run_tasks(cmd: list[str], envs: list[dict[str, str]], timeout: float = 900.0) -> int:
    """Run one process of `cmd` per environment; the first failure stops the others."""
    procs = [subprocess.Popen(cmd, env={**os.environ, **env}) for env in envs]
    deadline = time.monotonic() + timeout
    rc = 0
    try:
        while any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                rc = failed[0] if failed else 124
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return rc or next((p.returncode for p in procs if p.returncode), 0)


def main(argv: list[str]) -> int:
    opts, i = {}, 0
    while i < len(argv) and argv[i].startswith("-"):
        name, _, value = argv[i].lstrip("-").partition("=")
        if not value and name in ("n", "N") and i + 1 < len(argv):
            value, i = argv[i + 1], i + 1
        opts[{"n": "ntasks", "N": "nodes"}.get(name, name)] = value
        i += 1
    cmd = argv[i:]
    if not cmd:
        print("fake srun: no command", file=sys.stderr)
        return 2
    nodes = int(opts.get("nodes") or os.environ.get("SLURM_JOB_NUM_NODES", "1"))
    ntasks = int(opts.get("ntasks") or nodes * int(opts.get("ntasks-per-node", "1")))
    job_id = int(os.environ.get("SLURM_JOB_ID") or job_id_for_free_port())
    return run_tasks(cmd, [srun_env(job_id, r, ntasks, nodes) for r in range(ntasks)])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
