"""Which cluster engine started this process, joining its other processes, and the guard
against silent replicas.

    launch = detect(os.environ)        # what the environment says: engine, process count, the variable
    initialize(...)                    # explicit flags / JAX_* win; else jax.distributed.initialize()
                                       #   with no arguments, which fills in coordinator, count and id
    check(launch)                      # the environment says N > 1 but JAX sees 1 process, or the
                                       #   devices do not add up: stop before the first step
    start("train.py", ...)             # all three + the first log line; exit status 2, one line,
                                       #   on a misconfigured cluster (the crash loop never retries 2);
                                       #   then INFO lines from process 0 only

Why a guard: under `srun`, `mpirun` or on a multi-host TPU slice nobody sets `--coordinator`. If
nothing joins the processes, each sees only its own devices, reports `process_count() == 1`,
reads rank 0 of 1 of the data order and trains its own replica on the same batches, with nothing
in the logs: the same class of silent bug as double sharding (DESIGN §4).

What JAX's own detection (`jax.distributed.initialize()` with no arguments, jax/_src/clusters/,
read for jax 0.10.2) needs, per engine; we read only the process count and the variables' names,
never JAX's private classes, and let JAX do the bootstrapping:

    Open MPI <= 4  OMPI_MCA_orte_hnp_uri (set by mpirun; the coordinator is the launcher's IP),
                   OMPI_COMM_WORLD_SIZE / _RANK / _LOCAL_RANK. Open MPI 5 (PRRTE) no longer sets
                   the URI: there the flags are needed.
    SLURM          SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID:
                   all set inside an `srun` step, not in the batch script itself. The coordinator
                   is the step's first node, port 61440 + SLURM_JOB_ID % 4096.
    Cloud TPU      on GKE (XPK, JobSet): TPU_WORKER_HOSTNAMES (or TPU_PROCESS_ADDRESSES) and
                   TPU_WORKER_ID, x MEGASCALE_NUM_SLICES slices; on a GCE TPU VM the worker list
                   is in the metadata server, which JAX reads itself.
    Kubernetes     KUBERNETES_SERVICE_HOST plus the `kubernetes` package (`pip install jax[k8s]`)
                   and pod-read permission; the count comes from the API, not the environment.

On SLURM and Open MPI, JAX on GPUs restricts each process to ONE GPU (number = its local rank),
made for one task per GPU. With one task per node (launch/slurm.sbatch) that would silently
train on one GPU of eight (two tasks per node: two of eight); `initialize` then hands JAX all
the GPUs the task was given, or its share of those its node's tasks share (`local_gpu_ids`).
A Kubernetes pod whose JAX cannot read the API is refused, not run alone.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import glob
import importlib.util
import ipaddress
import os
import random
import re
import signal
import socket
import sys
import threading
import time
from typing import Iterator, Mapping, Optional

from absl import logging

# The flag a user passes to run the processes of one launch as independent single-process runs.
INDEPENDENT_FLAG = "--independent_runs"


class ClusterError(ValueError):
    """A launch this process cannot run as configured; the message is one line naming the
    variable (or flag) and the fix."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """What the environment says about this launch.

    engine: "slurm", "open-mpi", "mpi" (MPICH / Intel MPI), "cloud-tpu", "kubernetes",
        "flags", "JAX_* variables" or "none".
    processes: the process count the environment announces (None: it does not say).
    source: the variable that says it, e.g. "SLURM_NTASKS=64" ("" if none).
    auto: jax.distributed.initialize() with no arguments can join these processes.
    fix: when not `auto`, what is missing and how to launch instead."""
    engine: str
    processes: Optional[int] = None
    source: str = ""
    auto: bool = False
    fix: str = ""


def _int(value: Optional[str]) -> Optional[int]:
    return int(value) if value is not None and value.strip().isdigit() else None


def _flags_fix(size_var: str, rank_var: str) -> str:
    return (f"pass --coordinator=<host of process 0>:<free port> --num_processes=${size_var} "
            f"--process_id=${rank_var}")


def _candidates(env: Mapping[str, str]) -> list[Launch]:
    """Every engine whose variables are present, in JAX's detection order (Open MPI, SLURM,
    Cloud TPU, Kubernetes), plus MPICH-style PMI launchers, which JAX does not detect."""
    found = []
    if "OMPI_COMM_WORLD_SIZE" in env or "OMPI_MCA_orte_hnp_uri" in env:
        n = _int(env.get("OMPI_COMM_WORLD_SIZE"))
        found.append(Launch("open-mpi", n, f"OMPI_COMM_WORLD_SIZE={n}", "OMPI_MCA_orte_hnp_uri" in env,
                            "OMPI_MCA_orte_hnp_uri, which JAX's detection reads, is unset (Open MPI 5 no "
                            "longer sets it). Fix: " + _flags_fix("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")))
    if "SLURM_NTASKS" in env or "SLURM_NPROCS" in env:
        var = "SLURM_NTASKS" if "SLURM_NTASKS" in env else "SLURM_NPROCS"
        n = _int(env[var])
        in_step = [v for v in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")
                   if v not in env]
        fix = (f"this process was not started by srun ({', '.join(in_step) or 'SLURM_NTASKS'} unset). Fix: "
               "start every task with `srun python train.py ...`, as launch/slurm.sbatch does")
        step = _int(env.get("SLURM_STEP_NUM_TASKS"))
        if step is not None and step != n and not in_step:
            # `srun -E` (--preserve-env) passes the allocation's SLURM_NTASKS into the step; the
            # step's own count is SLURM_STEP_NUM_TASKS. JAX's detection reads SLURM_NTASKS.
            fix = (f"{var}={n} is the allocation's (srun -E / --preserve-env) and JAX's detection reads it, "
                   f"but this step runs SLURM_STEP_NUM_TASKS={step} tasks. Fix: drop -E, or "
                   + _flags_fix("SLURM_STEP_NUM_TASKS", "SLURM_PROCID"))
            found.append(Launch("slurm", step, f"SLURM_STEP_NUM_TASKS={step}", False, fix))
        else:
            found.append(Launch("slurm", n, f"{var}={n}", var == "SLURM_NTASKS" and not in_step, fix))
    if "PMI_SIZE" in env and "PMI_RANK" in env:   # MPICH / Intel MPI (Hydra)
        n = _int(env["PMI_SIZE"])
        found.append(Launch("mpi", n, f"PMI_SIZE={n}", False, "JAX does not detect MPICH / Intel MPI "
                            "launches. Fix: " + _flags_fix("PMI_SIZE", "PMI_RANK")))
    hosts_var = _tpu_hosts_variable(env)
    if hosts_var:
        hosts = len(env[hosts_var].split(","))   # as JAX counts them: every entry, empty ones too
        slices = _int(env.get("MEGASCALE_NUM_SLICES")) or 1
        n = hosts * slices
        source = f"{hosts_var} ({hosts} hosts)" + (f" x MEGASCALE_NUM_SLICES={slices}" if slices > 1 else "")
        found.append(Launch("cloud-tpu", n, source, True,
                            "JAX found no Cloud TPU VM here (libtpu missing?). Fix: install jax[tpu] on every host"))
    if "KUBERNETES_SERVICE_HOST" in env and ("JOB_COMPLETION_INDEX" in env or "JOBSET_NAME" in env):
        found.append(Launch("kubernetes", None, "JOB_COMPLETION_INDEX/JOBSET_NAME", True,
                            "JAX's Kubernetes detection needs the kubernetes package and pod-read "
                            "permission. Fix: pip install 'jax[k8s]', or "
                            + _flags_fix("NUM_PROCESSES", "JOB_COMPLETION_INDEX")))
    if not hosts_var and _on_cloud_tpu_vm():   # GCE TPU VM: the worker list is in the metadata server
        found.append(Launch("cloud-tpu", None, "Cloud TPU VM (worker list in the GCE metadata)", True))
    return found


def _tpu_hosts_variable(env: Mapping[str, str]) -> Optional[str]:
    """The variable JAX's GKE TPU detection reads the worker list from: TPU_PROCESS_ADDRESSES
    whenever it is set (even empty), else TPU_WORKER_HOSTNAMES; None if neither is set."""
    return next((v for v in ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES") if v in env), None)


def _tpu_variables_problem(env: Mapping[str, str]) -> Optional[str]:
    """Why JAX's Cloud TPU detection would count these variables wrong, or None. JAX splits the
    worker list on commas and counts every entry, so an empty one (a trailing comma, an empty
    TPU_PROCESS_ADDRESSES beside a good TPU_WORKER_HOSTNAMES) is a host that never starts and
    whose place every process waits for."""
    var = _tpu_hosts_variable(env)
    if var is None:
        return None
    value = env[var]
    if any(not h.strip() for h in value.split(",")):
        shadows = (" (JAX reads it instead of TPU_WORKER_HOSTNAMES whenever it is set)"
                   if var == "TPU_PROCESS_ADDRESSES" and "TPU_WORKER_HOSTNAMES" in env else "")
        return (f"{var}={value!r} has an empty entry{shadows}: JAX's detection counts it as a host "
                f"({len(value.split(','))} in all) and every process would wait for it. Fix: list each "
                f"host once, comma-separated, with no empty entries" + (", or unset it" if shadows else ""))
    # JAX's process id is TPU_WORKER_ID + MEGASCALE_SLICE_ID x hosts, each read with int(): one
    # that is no number was "could not join"; one out of range a process id JAX refused, or
    # another host's (worker 2 of 2 in slice 0 is worker 0 of slice 1), whose place both waited for.
    if env.get("MEGASCALE_NUM_SLICES") is not None and not (_int(env["MEGASCALE_NUM_SLICES"]) or 0) >= 1:
        return None   # _count_problem names it
    hosts, slices = len(value.split(",")), _int(env.get("MEGASCALE_NUM_SLICES")) or 1
    for name, count, what in (("TPU_WORKER_ID", hosts, f"{var}'s {hosts} hosts"),
                              ("MEGASCALE_SLICE_ID", slices, f"MEGASCALE_NUM_SLICES={slices} slices")):
        got = env.get(name)
        if name == "MEGASCALE_SLICE_ID" and not got:   # JAX reads unset or empty as slice 0
            continue
        index = _int(got)
        if index is None or not 0 <= index < count:
            said = f"{name}={got!r}" if got is not None else f"{name} (unset)"
            return (f"{said} is not this host's index among {what}: it must be a whole number from 0 "
                    f"to {count - 1}. Fix: leave it to the TPU launcher (GKE's TPU webhook, a JobSet) that sets "
                    f"{var}, or set it on each host to that host's index")
    return None


# The counts the engines announce (read by `detect`, and by JAX for Open MPI, SLURM and Cloud TPU).
# JAX's int() of 'abc', '' or 0 fails inside jax.distributed.initialize(), which then reads as
# "nothing to join": every process trained alone, exit 0.
_LAUNCHER_SETS_IT = "leave it to the launcher that sets it (srun, mpirun, mpiexec); do not set or export it yourself"
_COUNT_VARIABLES = {"OMPI_COMM_WORLD_SIZE": ("process count", _LAUNCHER_SETS_IT),
                    "SLURM_NTASKS": ("process count", _LAUNCHER_SETS_IT),
                    "SLURM_NPROCS": ("process count", _LAUNCHER_SETS_IT),
                    "SLURM_STEP_NUM_TASKS": ("process count", _LAUNCHER_SETS_IT),
                    "PMI_SIZE": ("process count", _LAUNCHER_SETS_IT),
                    "MEGASCALE_NUM_SLICES": ("slice count", "set it to the number of slices, or unset it for one")}


def _count_problem(env: Mapping[str, str]) -> Optional[str]:
    """The first count variable that is set but not a whole number >= 1, said with its fix, or None;
    then the first rank or id variable JAX converts with int() that is not a whole number (its
    ValueError read as the SLURM variables disagreeing, or named nothing), and JAX_LOCAL_DEVICE_IDS."""
    for var, (what, fix) in _COUNT_VARIABLES.items():
        value = env.get(var)
        if value is not None and not (_int(value) or 0) >= 1:
            return f"{var}={value!r} is not a {what}: it must be a whole number >= 1. Fix: {fix}"
    for var in _ID_VARIABLES:
        value = env.get(var)
        if value is not None and _int(value) is None:
            return f"{var}={value!r} is not a whole number >= 0. Fix: {_LAUNCHER_SETS_IT}"
    return _local_ids_problem(env)


def _local_ids_problem(env: Mapping[str, str]) -> Optional[str]:
    """JAX_LOCAL_DEVICE_IDS, which jax.distributed.initialize reads with int() when it is not given
    local_device_ids: 'invalid literal for int()' named no variable."""
    ids = env.get("JAX_LOCAL_DEVICE_IDS")
    if ids is not None and not all(_int(i) is not None for i in ids.split(",")):
        return (f"JAX_LOCAL_DEVICE_IDS={ids!r} is not a comma-separated list of device numbers (e.g. 0,1,2,3). "
                "Fix: correct it, or unset it for the launcher's binding")
    return None


# The ranks, local ranks and ids JAX's Open MPI and SLURM detection read with int().
_ID_VARIABLES = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "OMPI_COMM_WORLD_RANK",
                 "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK")
# This task's rank and the task count of the launcher that started it, in the order a task sees
# them: mpirun / mpiexec inside an sbatch allocation keeps the batch step's SLURM_PROCID (0).
_LAUNCHER_RANKS = (("OMPI_COMM_WORLD_RANK", ("OMPI_COMM_WORLD_SIZE",)), ("PMI_RANK", ("PMI_SIZE",)),
                   ("SLURM_PROCID", ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")))


def _rank_problem(process_id: int, env: Mapping[str, str]) -> Optional[str]:
    """An explicit process id that is not this task's rank in a launch of several tasks: written as
    --process_id=$SLURM_PROCID in an sbatch script (expanded once, by the batch shell) or a stale
    exported JAX_PROCESS_ID, every task claimed one id, and JAX aborted in C++ (exit 134, retried)
    or waited 5 minutes."""
    for rank_var, size_vars in _LAUNCHER_RANKS:
        rank = _int(env.get(rank_var))
        size = next((_int(env.get(v)) for v in size_vars if env.get(v) is not None), None)
        if rank is not None:
            if (size or 1) > 1 and rank != process_id:
                return (f"--process_id / JAX_PROCESS_ID = {process_id}, but {rank_var}={rank} is this task's rank "
                        f"among {size}: each task must pass its own (a ${rank_var} in a batch script is expanded "
                        f"once, for every task). Fix: drop --process_id and JAX_PROCESS_ID (the launcher's ranks "
                        f"are joined), or expand ${rank_var} in each task, e.g. srun bash -c 'python train.py ... "
                        f"--process_id=${rank_var}'")
            return None
    return None


@contextlib.contextmanager
def _signals_end_the_join() -> Iterator[None]:
    """SIGTERM and SIGINT take their default action, ending the process, while
    jax.distributed.initialize waits for every process (up to 5 minutes, inside C++, where the
    Python handler cli.run installs never runs: scancel, a preemption and Ctrl-C waited for JAX's
    timeout). Nothing is written before the join; a signal the process ignores stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        handler = signal.getsignal(sig)
        if handler not in (signal.SIG_IGN, signal.SIG_DFL, None):
            saved[sig] = handler
            signal.signal(sig, signal.SIG_DFL)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _join(env: Mapping[str, str], given: Optional[str], **kwargs) -> None:
    """jax.distributed.initialize(**kwargs), ended by SIGTERM / SIGINT while it waits. Process 0
    serves the coordinator; a port another process holds on this host was a traceback and exit 1
    ("Failed to start RPC server") or, in 5 tries of 8 with jaxlib 0.10.2, a segmentation fault
    (exit 139), both retried into the same clash. Where this process is known to be process 0
    and its port is known, the port is tried first. `given`: the flag or variable that chose the
    coordinator, None where JAX derives it from the launcher (its port from the job id)."""
    import jax
    coordinator = kwargs.get("coordinator_address")
    if coordinator and given and _unknown_host(coordinator):   # dialled for 5 minutes, then exit 134
        raise ClusterError(f"{given}: no host is called {coordinator.rpartition(':')[0]!r} (the name does not "
                           "resolve here); give the host name or IP address of process 0")
    bind = env.get("JAX_COORDINATOR_BIND_ADDRESS") or (coordinator and "[::]:" + coordinator.rsplit(":", 1)[1])
    if kwargs.get("process_id") == 0 and bind and _port_taken(bind):
        raise ClusterError(_port_taken_message(coordinator, given, env))
    with _signals_end_the_join():
        try:
            jax.distributed.initialize(**kwargs)
        except Exception as e:   # jax.errors.JaxRuntimeError; its class moved between releases
            if "Failed to start RPC server" not in str(e):
                raise
            raise ClusterError(_port_taken_message(coordinator, given, env)) from e


def _unknown_host(address: str) -> bool:
    """Whether the host of `address` (host:port) is a name that the resolver says does not exist
    (EAI_NONAME; a resolver that is down, EAI_AGAIN, may answer on the next try). Addresses pass."""
    host = address.rpartition(":")[0]
    if host.startswith("["):
        return False
    try:
        ipaddress.ip_address(host)
        return False
    except ValueError:
        pass
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror as e:
        return e.errno == socket.EAI_NONAME
    return False


def _port_taken(bind: str) -> bool:
    """Whether another socket listens on the port of the `host:port` that process 0's coordinator
    service binds (JAX's default: [::]:PORT, every address), tried as gRPC binds: SO_REUSEADDR, so
    the connections an earlier attempt's coordinator left in TIME_WAIT do not count (Linux lets a
    bind pass them when both sockets set it, and gRPC's listener does)."""
    port = bind.rsplit(":", 1)[-1]
    if not _is_port(port):
        return False   # JAX's own error names it
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):   # dual-stack first
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, int(port)))
                return False
        except OSError as e:   # no IPv6 on this host: the IPv4 wildcard
            if e.errno == errno.EADDRINUSE:
                return True
    return False


def _port_taken_message(address: Optional[str], given: Optional[str], env: Mapping[str, str]) -> str:
    bind = env.get("JAX_COORDINATOR_BIND_ADDRESS")
    if bind:
        fix = f"JAX_COORDINATOR_BIND_ADDRESS={bind} must be a free host:port of this host: fix or unset it"
    elif given:
        fix = f"give a free port in {given}"
    else:
        fix = ("JAX derives the port from the job id: set JAX_COORDINATOR_PORT to a free port for every process "
               "(or --coordinator=HOST:PORT)")
    return (f"process 0 could not serve the coordinator at {address or 'the address JAX derived'}: the port is "
            f"taken on this host (another job, or a process of an earlier attempt still running); {fix}")


# What JAX's Open MPI detection reads once OMPI_MCA_orte_hnp_uri is set (jax/_src/clusters/
# ompi_cluster.py): os.environ[...] of each, so one left out (a container that passes only some
# OMPI_* through) was a KeyError traceback, exit 1, that the crash loop retried.
_OMPI_READ = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")


def _ompi_problem(env: Mapping[str, str], coordinator: Optional[str]) -> Optional[str]:
    """Why JAX's Open MPI detection, which OMPI_MCA_orte_hnp_uri turns on, cannot read this launch,
    or None: a rank variable left out, or (with no coordinator given) a URI without the job id and
    tcp:// or tcp6://[...] address JAX makes the coordinator of ('<jobid>.<vpid>;tcp://<ip>,...:<port>')."""
    uri = env.get("OMPI_MCA_orte_hnp_uri")
    if uri is None or _int(env.get("OMPI_COMM_WORLD_SIZE")) == 1:   # `mpirun -np 1`: nothing to join
        return None
    fix = ("start every process with mpirun (a container must pass all of OMPI_* through), or unset "
           "OMPI_MCA_orte_hnp_uri for a process that runs alone")
    missing = [v for v in _OMPI_READ if v not in env]
    if missing:
        return (f"OMPI_MCA_orte_hnp_uri is set (an mpirun launch), but {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not: JAX's Open MPI detection reads all of "
                f"{', '.join(_OMPI_READ)}. Fix: {fix}")
    if coordinator is not None:   # the URI is read only for the coordinator address
        return None
    address = re.search(r"tcp://(.+?)[,:]|tcp6://\[(.+?)[,\]]", uri)
    job = uri.split(".", 1)[0]
    if address and (_int(job) is not None or _is_port(env.get("JAX_COORDINATOR_PORT", ""))):
        return None
    return (f"OMPI_MCA_orte_hnp_uri={uri!r} is not mpirun's '<jobid>.<vpid>;tcp://<ip>:<port>': JAX's Open MPI "
            f"detection makes the coordinator of its job id and first address. Fix: {fix}, or pass "
            "--coordinator=<host of process 0>:<free port>")


# All five make JAX's SLURM detection join the step (jax/_src/clusters/slurm_cluster.py); it is
# tried after Open MPI's, which OMPI_MCA_orte_hnp_uri alone turns on.
_SLURM_DETECTED_BY = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


def _slurm_coordinator_problem(env: Mapping[str, str]) -> Optional[str]:
    """Why the coordinator JAX's SLURM detection derives from the step's first node is no host,
    or None. An empty SLURM_STEP_NODELIST made it ':61440', which every process dialled for 5
    minutes before JAX aborted (exit 134, retried)."""
    if "OMPI_MCA_orte_hnp_uri" in env or not all(v in env for v in _SLURM_DETECTED_BY):
        return None
    nodes = env["SLURM_STEP_NODELIST"]
    # JAX's parse: up to the first ',' or '['; after a '[', its first index up to ',' or '-'
    # ('node[001-004],gpu7' -> 'node001'). 'node[001]' gives 'node001]', as JAX would dial it.
    prefix, index = re.match(r"([^,\[]*)(?:\[([^,-]*))?", nodes).groups()
    host = prefix + (index or "")
    if _is_host(host):
        return None
    return (f"SLURM_STEP_NODELIST={nodes!r}: its first host {host!r}, which JAX's SLURM detection makes the "
            "coordinator address from, is not a host name. Fix: start every task with `srun python train.py "
            "...` (srun sets it), or pass --coordinator=<host of process 0>:<free port>")


def _port_problem(env: Mapping[str, str]) -> Optional[str]:
    """JAX_COORDINATOR_PORT, which JAX appends to the host it derives (jax/_src/clusters/cluster.py),
    when it is not a port: every process would dial that address until JAX aborts (exit 134)."""
    port = env.get("JAX_COORDINATOR_PORT")
    if port is None or _is_port(port):
        return None
    return (f"JAX_COORDINATOR_PORT={port!r} is not a port: it must be a whole number from 1 to 65535. Fix: "
            "set a free port, or unset it for the launcher's default")


def _on_cloud_tpu_vm() -> bool:
    """libtpu is installed and a TPU device node exists (public signals, no backend started)."""
    return (importlib.util.find_spec("libtpu") is not None
            and bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")))


def detect(env: Mapping[str, str] = os.environ) -> Launch:
    """The launch this environment describes: the first engine JAX can bootstrap, else the first
    that announces more than one process (which `initialize` refuses), else a single process."""
    found = _candidates(env)
    usable = [c for c in found if c.auto]
    if usable:
        return usable[0]
    many = [c for c in found if (c.processes or 1) > 1]
    return many[0] if many else Launch("none", found[0].processes if found else None,
                                       found[0].source if found else "")


def job_id(env: Mapping[str, str] = os.environ) -> Optional[str]:
    """The cluster job this process belongs to (shared by all its tasks), or None."""
    if env.get("SLURM_JOB_ID"):
        return "slurm:" + env["SLURM_JOB_ID"]
    if env.get("OMPI_MCA_orte_hnp_uri"):
        return "ompi:" + env["OMPI_MCA_orte_hnp_uri"].split(";")[0]
    return None


# This copy's index among the copies a launcher started (SLURM, Open MPI, MPICH / Intel MPI).
_RANK_VARIABLES = ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def claim_run_dir(run_dir: str, env: Mapping[str, str] = os.environ) -> None:
    """--independent_runs: each copy trains alone, so each needs its own run directory. Copies of
    one launch given one --run_dir (launch/slurm.sbatch passes the same to every task) wrote each
    other's checkpoints and metrics: interleaved steps, then an OCDBT 'Configuration mismatch',
    a half-written save and exit 2 after the training. Each copy marks the directory with its
    job and rank, then looks for another rank's mark of the same job: of copies that share one,
    at least one stops here (ClusterError), before any step. A rerun of the same rank (a
    restart, --resume_until_done) finds only its own mark; another job's marks are not looked at."""
    job = job_id(env)
    rank = next((env[v] for v in _RANK_VARIABLES if env.get(v)), None)
    if job is None or rank is None:
        return
    key = re.sub(r"[^A-Za-z0-9_.-]", "_", job)
    marks = os.path.join(run_dir, ".independent_runs")
    os.makedirs(marks, exist_ok=True)
    with open(os.path.join(marks, f"{key}.rank-{rank}"), "w") as f:
        f.write(f"{socket.gethostname()} {os.getpid()}\n")
    others = sorted(n.rsplit("-", 1)[1] for n in os.listdir(marks)
                    if n.startswith(f"{key}.rank-") and n != f"{key}.rank-{rank}")
    if others:
        raise ClusterError(f"--run_dir={run_dir} is shared by the {INDEPENDENT_FLAG} copies of one launch (ranks "
                           f"{', '.join([rank] + others)} of {job}): each trains alone and needs its own. Fix: give "
                           "each its own --run_dir, e.g. srun bash -c 'python train.py ... "
                           "--run_dir=runs/r$SLURM_PROCID' (srun starts python without a shell, and a batch script "
                           "expands $SLURM_PROCID once, for every task), or join them (drop the flag)")


def _cuda_device_count(visible: str) -> Optional[int]:
    """How many GPUs a CUDA_VISIBLE_DEVICES value names (None: it names none). CUDA reads the
    list up to its first empty entry: "0,1," is two GPUs, not three."""
    names = [d.strip() for d in visible.split(",")] if visible and visible != "NoDevFiles" else []
    n = names.index("") if "" in names else len(names)
    return n or None


def local_gpu_ids(launch: Launch, env: Mapping[str, str] = os.environ) -> Optional[list[int]]:
    """The GPUs of this SLURM / Open MPI task for jax.distributed.initialize, where JAX's default
    (one GPU per task, number = the task's local rank, right for one task per GPU) is wrong:

    - ONE task on this node: all its GPUs, those CUDA enumerates for the task (CUDA_VISIBLE_DEVICES
      as SLURM's GPU binding sets it, else SLURM_GPUS_ON_NODE), or [] (no restriction: every GPU
      the process sees) where nothing names them (mpirun -npernode 1, SLURM without gres);
    - several tasks, each bound to ONE GPU (a one-entry CUDA_VISIBLE_DEVICES, e.g. srun
      --gpus-per-task=1): [0], its only device (local rank 5 would name a device that is masked);
    - SLURM tasks given GPUs of their own (srun --gpus-per-task=4): all of them;
    - K SLURM tasks on every node sharing the node's N GPUs (srun --ntasks-per-node=2 on 8-GPU
      nodes, no per-task GPUs): N // K each, task i the i-th block. JAX's default gave each task
      one GPU, 6 of 8 idle with nothing in the logs; more tasks than GPUs is a ClusterError.

    jax_cuda_visible_devices counts after CUDA_VISIBLE_DEVICES masking. None: JAX's default."""
    if launch.engine not in ("slurm", "open-mpi") or env.get("JAX_LOCAL_DEVICE_IDS"):
        return None
    platforms = env.get("JAX_PLATFORMS", "").strip()
    if platforms and not {"cuda", "gpu"} & {p.strip() for p in platforms.split(",")}:
        return None   # JAX will not compute on a GPU (JAX_PLATFORMS=cpu): no GPUs to share out
    visible = (env.get("CUDA_VISIBLE_DEVICES") or "").strip()
    n_visible = _cuda_device_count(visible)
    if launch.engine == "slurm":   # e.g. "1(x8)", "2,1": one count on every node, else None
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
        counts = set(re.findall(r"(\d+)(?:\(x\d+\))?", per_node))
        tasks = int(counts.pop()) if len(counts) == 1 else None
    else:
        tasks = _int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE"))
    if tasks == 1:
        if n_visible:
            return list(range(n_visible))
        n = _int(env.get("SLURM_GPUS_ON_NODE"))
        return list(range(n)) if n else []
    if n_visible == 1:
        return [0]
    if launch.engine != "slurm" or not tasks or not n_visible or _int(env.get("SLURM_LOCALID")) is None:
        return None
    if env.get("SLURM_GPUS_PER_TASK"):   # GPUs of its own (implies --gpu-bind=per_task)
        return list(range(n_visible))
    if env.get("SLURM_GPU_BIND"):   # --gpu-bind=closest / map_gpu:...: tasks may overlap; JAX's default
        return None
    rank = _int(env["SLURM_LOCALID"])
    if tasks > n_visible:
        raise ClusterError(f"SLURM_STEP_TASKS_PER_NODE={per_node}: {tasks} tasks on this node share its "
                           f"{n_visible} GPUs (CUDA_VISIBLE_DEVICES={visible}), so task {rank} has none. Fix: at "
                           "most one task per GPU, or one per node as launch/slurm.sbatch does")
    each = n_visible // tasks
    if n_visible % tasks and rank == 0:
        logging.warning("SLURM_STEP_TASKS_PER_NODE=%s: %d tasks on %d GPUs get %d each; %d GPU(s) of every "
                        "node stay idle", per_node, tasks, n_visible, each, n_visible - each * tasks)
    return list(range(rank * each, (rank + 1) * each))


def initialize(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, *, independent_runs: bool = False,
               env: Mapping[str, str] = os.environ) -> Launch:
    """Join this launch's processes (before any other JAX call) and return what was detected.

    Explicit values (flags, then JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID)
    win; values they leave out are filled by JAX's detection where it works. Without any, an
    engine JAX detects (see the module docstring) is joined through jax.distributed.initialize()
    with no arguments. An environment that announces N > 1 processes JAX cannot join is refused
    here with a ClusterError, before JAX starts a backend. Call `check` afterwards."""
    import jax

    detected = detect(env)
    if independent_runs:
        if coordinator or num_processes or process_id is not None:
            raise ClusterError(f"{INDEPENDENT_FLAG} contradicts --coordinator/--num_processes/--process_id; "
                               "pass one or the other")
        return dataclasses.replace(detected, engine=f"{detected.engine}, independent runs ({INDEPENDENT_FLAG})",
                                   auto=False)
    coordinator = coordinator or env.get("JAX_COORDINATOR_ADDRESS") or None
    if coordinator is not None:
        _check_coordinator(coordinator)
    if num_processes is None and env.get("JAX_NUM_PROCESSES"):
        num_processes = _env_int(env, "JAX_NUM_PROCESSES")
    if process_id is None and env.get("JAX_PROCESS_ID"):
        process_id = _env_int(env, "JAX_PROCESS_ID")
    if num_processes is not None and num_processes < 1:   # 0 ran as one process, without a word
        raise ClusterError(f"--num_processes / JAX_NUM_PROCESSES = {num_processes} must be >= 1; give the count of "
                           "processes, or leave it out for the launcher's")
    if not (coordinator and num_processes is not None and process_id is not None):   # JAX detects the rest
        problem = (_tpu_variables_problem(env) or _count_problem(env) or _ompi_problem(env, coordinator)
                   or (None if coordinator else _slurm_coordinator_problem(env) or _port_problem(env)))
        if problem:
            raise ClusterError(problem)
    announced = {c.processes for c in _candidates(env)}   # Open MPI 5 under srun: the ranks, not the step's
    if num_processes is not None and (detected.processes or 1) > 1 and num_processes not in announced:
        # --num_processes=1 was ignored (JAX joined the launcher's processes anyway); another count
        # makes processes the coordinator does not expect, which fail or wait for the rest
        raise ClusterError(f"--num_processes / JAX_NUM_PROCESSES = {num_processes}, but {detected.source} says "
                           f"this launch started {detected.processes} processes: drop it (the launcher's count is "
                           f"joined), give {detected.processes}, or pass {INDEPENDENT_FLAG} for separate runs")
    explicit = coordinator is not None or (num_processes or 1) > 1 or process_id is not None
    if explicit or (detected.auto and detected.processes != 1):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices only (DESIGN §7)
    if explicit:
        given = [v for v in (coordinator, num_processes, process_id) if v is not None]
        if len(given) < 3 and not detected.auto:
            missing = [name for name, v in (("coordinator address (--coordinator / JAX_COORDINATOR_ADDRESS)",
                                             coordinator),
                                            ("--num_processes / JAX_NUM_PROCESSES", num_processes),
                                            ("--process_id / JAX_PROCESS_ID", process_id)) if v is None]
            raise ClusterError(f"multi-process launch needs all of: {', '.join(missing)} missing")
        if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
            raise ClusterError(f"--process_id / JAX_PROCESS_ID = {process_id} must be in [0, --num_processes / "
                               f"JAX_NUM_PROCESSES = {num_processes})")
        problem = (_rank_problem(process_id, env) if process_id is not None else None) or _local_ids_problem(env)
        if problem:
            raise ClusterError(problem)
        if (num_processes or 1) > 1:   # JAX waits for every process (5 minutes), then aborts in C++
            logging.info("cluster: joining %d processes at %s as process %s; waiting for all of them",
                         num_processes, coordinator, process_id)
        _join(env, f"--coordinator / JAX_COORDINATOR_ADDRESS={coordinator}" if coordinator else None,
              coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
              local_device_ids=local_gpu_ids(detected, env))
        engine = "flags" if len(given) == 3 else f"flags + {detected.engine}"
        return dataclasses.replace(detected, engine=engine)
    if detected.auto:
        if detected.processes == 1:   # one task: nothing to join (and JAX would pin it to one GPU)
            return detected
        try:
            _join(env, None, local_device_ids=local_gpu_ids(detected, env))
        except ClusterError:   # a ValueError too: already the line to print
            raise
        except ValueError as e:   # JAX found no engine after all (e.g. TPU variables on a CPU host)
            if (detected.processes or 1) > 1:
                # SLURM's / Open MPI's variables were all there (auto), so they disagree: their fix
                # text is for variables that are missing
                fix = {"slurm": "the task's SLURM variables disagree: start every task with `srun python train.py "
                                "...`, as launch/slurm.sbatch does, or " + _flags_fix("SLURM_NTASKS", "SLURM_PROCID"),
                       "open-mpi": "the task's Open MPI variables disagree: start every process with mpirun, or "
                                   + _flags_fix("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")
                       }.get(detected.engine, detected.fix)
                raise ClusterError(f"{detected.source} says {detected.processes} processes, but "
                                   f"jax.distributed.initialize() could not join them ({e}): {fix}") from e
            if detected.engine == "kubernetes":   # the count is in the API JAX could not read
                raise ClusterError(f"{detected.source} says this pod is one process of an indexed Job / "
                                   f"JobSet, but jax.distributed.initialize() could not join it ({e}): "
                                   f"{detected.fix}; or pass {INDEPENDENT_FLAG} for a pod that runs "
                                   "alone") from e
            logging.warning("%s: jax.distributed.initialize() found nothing to join (%s); one process",
                            detected.engine, e)
            return dataclasses.replace(detected, engine=f"{detected.engine} (not joined)", auto=False)
        return detected
    if (detected.processes or 1) > 1:
        raise ClusterError(_replica_message(detected, detected.fix))
    return detected


def _env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ClusterError(f"{name}={env[name]!r} is not an integer; set it to a count / rank, or unset it") from None


def _is_host(host: str) -> bool:
    """A host name, an IPv4 address, or an IPv6 address in brackets: what gRPC can dial."""
    if host.startswith("[") and host.endswith("]"):
        try:
            return ipaddress.ip_address(host[1:-1]).version == 6
        except ValueError:
            return False
    return re.fullmatch(r"[A-Za-z0-9._-]+", host) is not None


def _is_port(port: str) -> bool:
    """A TCP port number, 1 to 65535, in digits."""
    return re.fullmatch(r"[0-9]+", port) is not None and 0 < int(port) < 65536


def _check_coordinator(address: str) -> None:
    """host:port or [IPv6]:port, as jax.distributed.initialize reads it. A bare host failed in JAX
    with an IndexError (exit 1, retried by --resume_until_done); a scheme ('http://h:1') or a host
    with a ':' ('h:12:34') was dialled as given for 5 minutes, then JAX aborted (exit 134, retried)."""
    host, sep, port = address.rpartition(":")
    if not (sep and _is_host(host) and _is_port(port)):
        raise ClusterError(f"--coordinator / JAX_COORDINATOR_ADDRESS = {address!r}: give host:port or [IPv6]:port, "
                           "with no scheme: the host of process 0 and a free port on it (e.g. node001:12345, "
                           "[fd00::1]:12345)")


def _replica_message(launch: Launch, fix: str) -> str:
    return (f"{launch.source} says this is one of {launch.processes} processes, but JAX sees only this "
            f"one, so each would train its own replica on the same batches: {fix}; or pass "
            f"{INDEPENDENT_FLAG} to run {launch.processes} separate single-process runs on purpose")


def check(launch: Launch, *, process_count: Optional[int] = None, device_count: Optional[int] = None,
          local_device_count: Optional[int] = None) -> None:
    """The guard, after `initialize`: raise ClusterError when the environment announces N > 1
    processes but JAX has one, or when the global device count is not process_count x
    local_device_count (processes own different numbers of devices). The counts default to JAX's."""
    import jax
    if INDEPENDENT_FLAG in launch.engine:
        return
    p = jax.process_count() if process_count is None else process_count
    g = jax.device_count() if device_count is None else device_count
    n_local = jax.local_device_count() if local_device_count is None else local_device_count
    if (launch.processes or 1) > 1 and p == 1:
        raise ClusterError(_replica_message(
            launch, launch.fix or "JAX joined no other process. Fix: drop --num_processes=1 / "
                                  "JAX_NUM_PROCESSES=1 and let the processes join"))
    if g != p * n_local:
        raise ClusterError(f"JAX sees {g} global devices, but {p} processes x {n_local} local devices on "
                           f"this one = {p * n_local}: the processes own different numbers of devices. "
                           "Fix: give every task the same devices (e.g. #SBATCH --gpus-per-node=8 with "
                           "--ntasks-per-node=1), or set JAX_LOCAL_DEVICE_IDS on each")
    if launch.processes and launch.processes > 1 and p != launch.processes:
        logging.warning("%s but JAX joined %d processes; the explicit values won", launch.source, p)


def summary(launch: Launch) -> str:
    """The first log line: engine, process id and count, local and global devices."""
    import jax
    source = f" ({launch.source})" if launch.source else (" (a single process)" if launch.engine == "none" else "")
    return (f"cluster: {launch.engine}{source}: process {jax.process_index()} of {jax.process_count()}, "
            f"{jax.local_device_count()} local / {jax.device_count()} global {jax.default_backend()} devices")


def start(program: str, coordinator: Optional[str] = None, num_processes: Optional[int] = None,
          process_id: Optional[int] = None, *, independent_runs: bool = False,
          multi_process: bool = True) -> Launch:
    """For scripts: initialize + check + the first log line (on every process; after it, processes
    other than 0 print warnings and errors only: olmo3/logs.py). On a ClusterError print one line
    to stderr and exit with status 2 (a user error; olmo3/launch.py never retries it) before
    anything is written. `multi_process=False` (eval.py, bench.py) joins nothing and refuses an
    environment that announces several processes."""
    import jax

    from olmo3 import logs
    try:
        if multi_process:
            launch = initialize(coordinator, num_processes, process_id, independent_runs=independent_runs)
        else:   # eval.py, bench.py: one process by design
            problem = _count_problem(os.environ)   # an unreadable count hid the copies: each ran as one process
            if problem:
                raise ClusterError(problem)
            launch = detect()
            # Copies started by the engine (an srun step, mpirun, TPU pods) would all do the same
            # work; SLURM's batch shell without srun is one copy, which is fine.
            copies = (launch.processes or 1) > 1 and (launch.auto or launch.engine != "slurm")
            if copies and not independent_runs:
                raise ClusterError(f"{launch.source} says this is one of {launch.processes} processes, but "
                                   f"{program} runs as one process: every copy would do the same work. "
                                   f"Fix: run it as a single task (e.g. `srun --ntasks=1 python {program} "
                                   f"...`), or pass {INDEPENDENT_FLAG} to run the copies on purpose")
            if (launch.processes or 1) > 1:
                how = f"independent runs ({INDEPENDENT_FLAG})" if copies else "one process"
                launch = dataclasses.replace(launch, engine=f"{launch.engine}, {how}", processes=None)
        check(launch)
    except ClusterError as e:
        print(f"{program}: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    logging.info(summary(launch))   # every process: its own index and devices, the guard's evidence
    logs.quiet_other_processes(jax.process_index())   # from here on, INFO from process 0 only
    return launch


def check_shared_directory(path: str, flag: str, timeout_s: float = 30.0) -> None:
    """Stop every process (ClusterError, exit status 2) unless all processes of the job see one
    directory at `path`. Checkpoints need it: process 0 writes the metadata, every process its
    shards, and each reads all of them back. A path each host has to itself (a local disk, a
    bucket mounted on none or some of the hosts) otherwise trains up to its first save, which
    never completes, and the watchdog then blames a hang, on every rerun. Process 0 writes a
    file of a fresh name there; each other process looks for it, for up to `timeout_s` (a network
    filesystem may show another host's new file late); then all learn who did not see it."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from olmo3 import atomic
    if jax.process_count() == 1:
        return
    token = int(multihost_utils.broadcast_one_to_all(np.int32(random.getrandbits(31))))
    marker = os.path.join(os.path.abspath(path), f".olmo3-shared-{token:08x}")
    failed = None   # process 0 reports a failed write through the allgather: the others never wait alone
    if jax.process_index() == 0:
        try:
            os.makedirs(path, exist_ok=True)
            atomic.write_text(marker, "olmo3")
        except OSError as e:
            failed = e
    multihost_utils.sync_global_devices("olmo3: shared-directory marker written")
    deadline = time.monotonic() + timeout_s
    while not (seen := os.path.exists(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    everyone = np.asarray(multihost_utils.process_allgather(np.asarray(seen))).reshape(-1)
    if jax.process_index() == 0:
        try:
            os.remove(marker)
        except OSError:
            pass
    blind = [i for i, s in enumerate(everyone) if not s]
    if blind and blind[0] == 0:   # process 0 could not write it: its own line says why
        why = f"({failed})" if failed is not None else "(process 0's log says why)"
        raise ClusterError(f"{flag}={path!r}: process 0 cannot write there {why}; fix the directory or "
                           "its permissions, or give another")
    if blind:
        raise ClusterError(
            f"{flag}={path!r} is not one directory shared by every process: process(es) {blind} of "
            f"{len(everyone)} do not see the file process 0 wrote there ({os.path.basename(marker)}) within "
            f"{timeout_s:.0f} s. Fix: give a path every host sees: a shared filesystem, or a bucket mounted on "
            "every host (launch/tpu_jobset.yaml mounts one at /gcs; XPK: `xpk storage attach` and --storage)")


def check_same_everywhere(values: Mapping[str, str], what: str, fix: str) -> None:
    """Stop every process (ClusterError, exit status 2) unless all processes hold the same
    `values` ({name: value}, e.g. each dataset's fingerprint). Each process builds its data order
    from what it sees itself (token files, a cache of remote sizes); one that sees other files or
    sizes computes another permutation and reads rows the others never skip, with no error
    (DESIGN §4 bug 1). Only digests travel: 32 bytes per name."""
    import hashlib

    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    if jax.process_count() == 1 or not values:   # nothing to compare (the same on every process: flags decide it)
        return
    names = sorted(values)
    mine = np.stack([np.frombuffer(hashlib.sha256(f"{n}={values[n]}".encode()).digest(), np.uint8)
                     for n in names]) if names else np.zeros((0, 32), np.uint8)
    everyone = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, len(names), 32)
    differ = [n for k, n in enumerate(names) if (everyone[:, k] != everyone[0, k]).any()]
    if differ:
        odd = [i for i in range(len(everyone)) if (everyone[i] != everyone[0]).any()]
        raise ClusterError(f"{what} differ between processes: {', '.join(differ)} on process(es) {odd} "
                           f"of {len(everyone)} differ from process 0's. Fix: {fix}")
