"""Cluster launches (olmo3/cluster.py, launch/slurm.sbatch): which engine the environment names,
joining through JAX's own detection, and the guard against silent replicas.

The launchers are stood in for by tests/fake_srun.py: the variables a real `srun` (or Open MPI 4's
`mpirun`) sets, nothing else; JAX reads only those. The end-to-end reference is train.py as ONE
process on 4 devices: two "nodes" x 2 devices launched through the sbatch script's own srun line
must give the same per-step losses (rtol 2e-6, float32 reduction order as in test_multiprocess),
one checkpoint directory, and a single process must resume it to the uninterrupted run's losses.
"""
import errno
import json
import os
import re
import socket
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import fake_srun
from olmo3 import cluster
from olmo3.cluster import ClusterError, Launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = os.path.join(ROOT, "launch", "slurm.sbatch")

SLURM_STEP = fake_srun.srun_env(job_id=4096001, rank=3, ntasks=64, nodes=64)


# ---------------------------------------------------------------------------------------------
# Detection: what each environment says (no processes started)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("env, engine, processes, auto, words", [
    (SLURM_STEP, "slurm", 64, True, []),
    # sbatch's own shell, no srun: SLURM_NTASKS says 64, but no step variables.
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "64", "SLURM_JOB_NUM_NODES": "64"}, "slurm", 64, False,
     ["not started by srun", "SLURM_STEP_NODELIST", "srun python train.py"]),
    ({"SLURM_NTASKS": "2"}, "slurm", 2, False, ["SLURM_JOB_ID"]),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}, "none", 1, False, []),   # salloc, one task
    (fake_srun.mpirun_env(1, 4, 61500), "open-mpi", 4, True, []),
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1"}, "open-mpi", 4, False,   # Open MPI 5
     ["OMPI_MCA_orte_hnp_uri", "--num_processes=$OMPI_COMM_WORLD_SIZE"]),
    ({"PMI_SIZE": "8", "PMI_RANK": "0"}, "mpi", 8, False, ["--process_id=$PMI_RANK"]),
    ({"TPU_WORKER_HOSTNAMES": "h0,h1,h2,h3", "TPU_WORKER_ID": "2"}, "cloud-tpu", 4, True, []),
    ({"TPU_WORKER_HOSTNAMES": "h0,h1", "TPU_WORKER_ID": "0", "MEGASCALE_NUM_SLICES": "4"},
     "cloud-tpu", 8, True, []),
    ({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "0"}, "kubernetes", None, True, []),
    ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "none", None, False, []),   # any pod: not a launch
    ({}, "none", None, False, []),
])
def test_detect(env, engine, processes, auto, words):
    launch = cluster.detect(env)
    assert (launch.engine, launch.processes, launch.auto) == (engine, processes, auto), launch
    for w in words:
        assert w in launch.fix
    if processes and processes > 1:   # the line names the variable that says so
        assert launch.source.split("=")[0].split(" ")[0] in env



def _without(env, *names):
    return {k: v for k, v in env.items() if k not in names}


@pytest.mark.parametrize("env", [
    SLURM_STEP,
    _without(SLURM_STEP, "SLURM_NTASKS"),            # SLURM_NPROCS alone: JAX reads SLURM_NTASKS
    _without(SLURM_STEP, "SLURM_LOCALID"),
    _without(SLURM_STEP, "SLURM_STEP_NODELIST"),
    {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "64"},     # the batch shell
    fake_srun.mpirun_env(1, 4, 61500),
    {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1"},   # Open MPI 5: no URI
    {**SLURM_STEP, "OMPI_COMM_WORLD_SIZE": "64", "OMPI_COMM_WORLD_RANK": "3"},
    {**SLURM_STEP, **fake_srun.mpirun_env(1, 4, 61500)},   # both joinable: JAX takes Open MPI first
], ids=["srun", "nprocs_only", "no_localid", "no_step_nodelist", "batch_shell", "mpirun4", "ompi5",
        "srun_ompi5", "srun_mpirun4"])
def test_detect_agrees_with_jax_s_own_detection(env, monkeypatch):
    """The reference: JAX's Open MPI and SLURM detection itself (jax._src.clusters, what
    jax.distributed.initialize() with no arguments runs), given the same variables. `detect` calls
    a launch joinable exactly when JAX finds it, names the engine JAX picks (Open MPI before SLURM)
    and the process count JAX would wait for."""
    clusters = pytest.importorskip("jax._src.clusters")
    for var in list(os.environ):
        if var.startswith(fake_srun.LAUNCHER_PREFIXES):
            monkeypatch.delenv(var)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    names = {clusters.OmpiCluster: "open-mpi", clusters.SlurmCluster: "slurm"}
    found = next((c for c in clusters.ClusterEnv._cluster_types if c in names and c.is_env_present()), None)
    jax_sees = None if found is None else (names[found], found.get_process_count())
    launch = cluster.detect(env)
    assert ((launch.engine, launch.processes) if launch.auto else None) == jax_sees, launch

@pytest.mark.parametrize("env", [
    {"TPU_WORKER_HOSTNAMES": "h0,h1,h2,h3"},
    {"TPU_WORKER_HOSTNAMES": "h0,h1", "MEGASCALE_NUM_SLICES": "4", "MEGASCALE_SLICE_ID": "3"},
    {"TPU_PROCESS_ADDRESSES": "10.0.0.1:8476,10.0.0.2:8476", "TPU_WORKER_HOSTNAMES": "h0,h1,h2,h3"},
    {"TPU_WORKER_HOSTNAMES": "h0,h1,"},                                    # a trailing comma
    {"TPU_PROCESS_ADDRESSES": "", "TPU_WORKER_HOSTNAMES": "h0,h1,h2,h3"},   # empty, but set
], ids=["gke4", "multislice", "addresses_first", "trailing_comma", "empty_addresses"])
def test_cloud_tpu_count_agrees_with_jax_s_own_detection(env, monkeypatch):
    """The reference: JAX's GKE TPU detection (what jax.distributed.initialize() runs on a Cloud
    TPU pod), told it runs on a TPU VM. `detect` counts the processes JAX would wait for; where
    JAX would count a host that is not there, `initialize` refuses the variables, naming them."""
    tpu = pytest.importorskip("jax._src.clusters.cloud_tpu_cluster")
    for var in list(os.environ):
        if var.startswith(fake_srun.LAUNCHER_PREFIXES):
            monkeypatch.delenv(var)
    env = {"TPU_WORKER_ID": "1", "MEGASCALE_NUM_SLICES": "1", **env}   # slices set: no metadata server
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(tpu, "running_in_cloud_tpu_vm", True)
    assert tpu.GkeTpuCluster.is_env_present()
    launch = cluster.detect(env)
    assert (launch.engine, launch.processes) == ("cloud-tpu", tpu.GkeTpuCluster.get_process_count()), launch
    hosts = tpu.GkeTpuCluster._get_worker_list_in_slice()
    import jax
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: None)   # joined: nothing to start
    if all(h.strip() for h in hosts):
        assert cluster.initialize(env=env).processes == launch.processes
    else:
        var = "TPU_PROCESS_ADDRESSES" if "TPU_PROCESS_ADDRESSES" in env else "TPU_WORKER_HOSTNAMES"
        with pytest.raises(ClusterError, match=rf"^{var}=.* has an empty entry.*counts it as a host "
                                               rf"\({len(hosts)} in all\).*no empty entries"):
            cluster.initialize(env=env)
        # all three values given: JAX detects nothing, so the variables do not matter
        monkeypatch.setattr(cluster, "local_gpu_ids", lambda *a: None)
        assert cluster.initialize("10.0.0.1:1234", launch.processes, 0, env=env).engine.startswith("flags")
    for bad in ("0", "two"):
        with pytest.raises(ClusterError, match=rf"MEGASCALE_NUM_SLICES='{bad}' is not a slice count"):
            cluster.initialize(env={**env, "TPU_WORKER_HOSTNAMES": "h0,h1", "MEGASCALE_NUM_SLICES": bad,
                                    "TPU_PROCESS_ADDRESSES": "a,b"})


def test_srun_preserve_env_counts_the_step():
    """`srun -E -n1` inside a 16-task allocation keeps SLURM_NTASKS=16: one process, not a refused
    replica; a step of 2 under -E cannot be joined by JAX (it would wait for 16) and says so."""
    one = {**fake_srun.srun_env(job_id=5, rank=0, ntasks=1, nodes=1), "SLURM_NTASKS": "16"}
    assert (cluster.detect(one).engine, cluster.detect(one).processes) == ("none", 1)
    two = {**fake_srun.srun_env(job_id=5, rank=1, ntasks=2, nodes=2), "SLURM_NTASKS": "16"}
    launch = cluster.detect(two)
    assert (launch.engine, launch.processes, launch.auto) == ("slurm", 2, False)
    assert "SLURM_STEP_NUM_TASKS=2" in launch.fix and "drop -E" in launch.fix


def test_kubernetes_without_the_package_is_refused(monkeypatch):
    """An indexed Job's pod whose JAX cannot read the Kubernetes API (no `kubernetes` package)
    would train alone as process 0 of 1; it stops with the fix instead."""
    import jax
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: (_ for _ in ()).throw(
        ValueError("coordinator_address should be defined.")))
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "3"}
    with pytest.raises(ClusterError, match=r"indexed Job.*jax\[k8s\].*--independent_runs"):
        cluster.initialize(env=env)
    assert "independent runs" in cluster.initialize(independent_runs=True, env=env).engine
    # Cloud TPU variables on a host JAX finds no TPU VM on: the count they announce is refused here,
    # naming what JAX said and the fix (not left for the guard after a backend has started).
    tpu = {"TPU_WORKER_HOSTNAMES": "h0,h1", "TPU_WORKER_ID": "1"}
    with pytest.raises(ClusterError, match=r"TPU_WORKER_HOSTNAMES \(2 hosts\) says 2 processes, but "
                                           r"jax.distributed.initialize\(\) could not join them.*install jax\[tpu\]"):
        cluster.initialize(env=tpu)


def test_bad_addresses_and_counts_are_named_before_jax_sees_them(monkeypatch):
    """A coordinator without host:port failed inside JAX (IndexError, exit 1: retried by
    --resume_until_done); a JAX_NUM_PROCESSES of 'abc' named no variable; SLURM variables that
    are all there but disagree were called unset."""
    import jax
    for bad in ("myhost", "myhost:", "myhost:abc", ":1234", "myhost:70000"):
        with pytest.raises(ClusterError, match=f"--coordinator / JAX_COORDINATOR_ADDRESS = '{bad}': give host:port"):
            cluster.initialize(bad, 2, 0, env={})
        with pytest.raises(ClusterError, match="give host:port"):
            cluster.initialize(env={"JAX_COORDINATOR_ADDRESS": bad, "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"})
    for name in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        with pytest.raises(ClusterError, match=f"^{name}='abc' is not an integer"):
            cluster.initialize(env={"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0",
                                    name: "abc"})
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: (_ for _ in ()).throw(
        ValueError("Got process_id=5, num_processes=2.")))
    env = {**fake_srun.srun_env(job_id=5, rank=1, ntasks=2, nodes=2), "SLURM_PROCID": "5"}
    with pytest.raises(ClusterError) as e:
        cluster.initialize(env=env)
    assert "(Got process_id=5, num_processes=2.): the task's SLURM variables disagree" in str(e.value)
    assert "unset" not in str(e.value)


@pytest.mark.parametrize("bad", ["http://localhost:12345", "grpc://10.0.0.1:1234", "localhost:12:34", "::1:1234",
                                 "[myhost]:1234", "[fd00::1]", "node 1:1234"])
def test_coordinator_jax_would_dial_for_5_minutes_is_refused(bad, monkeypatch):
    """A scheme or an unbracketed ':' in the host passed the host:port check; every process then
    dialled it for 5 minutes and JAX aborted (exit 134, which --resume_until_done retries)."""
    import jax
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: pytest.fail(f"joined {kw}"))
    message = rf"^--coordinator / JAX_COORDINATOR_ADDRESS = {re.escape(repr(bad))}: give host:port or \[IPv6\]:port"
    with pytest.raises(ClusterError, match=message):
        cluster.initialize(bad, 1, 0, env={})
    with pytest.raises(ClusterError, match=message):
        cluster.initialize(env={"JAX_COORDINATOR_ADDRESS": bad, "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"})


def test_coordinator_forms_jax_can_dial_are_joined(monkeypatch):
    import jax
    joined = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: joined.append(kw["coordinator_address"]))
    monkeypatch.setattr(jax.config, "update", lambda *a: None)   # no gloo for this test process
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, port: [])   # every name resolves
    good = ["node001:12345", "10.0.0.1:1234", "my-host.example.com:80", "[::1]:1234", "[fd00::1]:12345",
            "[fe80::1%eth0]:1234"]
    for address in good:
        cluster.initialize(address, 2, 0, env={})
    assert joined == good


@pytest.mark.parametrize("nodes", ["", ",node002", "node[001]"])
def test_slurm_node_list_jax_cannot_make_a_coordinator_of_is_refused(nodes, monkeypatch):
    """The reference: JAX's SLURM detection, given the same variables. An empty SLURM_STEP_NODELIST
    gave the coordinator ':61440', dialled for 5 minutes before JAX aborted; it is refused, naming
    the host JAX would dial. A --coordinator of the user's, or Open MPI's (which JAX tries first),
    is used instead of the node list, which then does not matter."""
    import jax
    slurm = pytest.importorskip("jax._src.clusters.slurm_cluster")
    env = {**fake_srun.srun_env(job_id=5, rank=1, ntasks=2, nodes=2), "SLURM_STEP_NODELIST": nodes}
    for var in list(os.environ):
        if var.startswith(fake_srun.LAUNCHER_PREFIXES):
            monkeypatch.delenv(var)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    jax_host = slurm.SlurmCluster.get_coordinator_address(None, None).rsplit(":", 1)[0]
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: pytest.fail(f"joined {kw}"))
    with pytest.raises(ClusterError, match=rf"^SLURM_STEP_NODELIST={re.escape(repr(nodes))}: its first host "
                                           rf"{re.escape(repr(jax_host))}.*--coordinator="):
        cluster.initialize(env=env)
    joined = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: joined.append(kw))
    monkeypatch.setattr(jax.config, "update", lambda *a: None)
    cluster.initialize("10.0.0.1:1234", env=env)
    cluster.initialize(env={**env, **fake_srun.mpirun_env(1, 2, 61500)})
    assert len(joined) == 2


@pytest.mark.parametrize("nodes, host", [("localhost", "localhost"), ("node001,host2", "node001"),
                                         ("node[001-015],host2", "node001"), ("node[007,001-005]", "node007")])
def test_slurm_node_lists_jax_can_read_are_joined(nodes, host, monkeypatch):
    """SLURM's node-list forms: JAX's first host (the reference) is a host, and nothing is refused."""
    import jax
    slurm = pytest.importorskip("jax._src.clusters.slurm_cluster")
    env = {**fake_srun.srun_env(job_id=5, rank=1, ntasks=2, nodes=2), "SLURM_STEP_NODELIST": nodes}
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert slurm.SlurmCluster.get_coordinator_address(None, None).rsplit(":", 1)[0] == host
    joined = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: joined.append(kw))
    monkeypatch.setattr(jax.config, "update", lambda *a: None)
    assert cluster.initialize(env=env).engine == "slurm" and len(joined) == 1


_MPIRUN_RANK_1 = fake_srun.mpirun_env(1, 2, 61500)


@pytest.mark.parametrize("change, named", [
    ({"OMPI_COMM_WORLD_LOCAL_RANK": None}, r"but OMPI_COMM_WORLD_LOCAL_RANK is not: "),
    ({"OMPI_COMM_WORLD_SIZE": None, "OMPI_COMM_WORLD_RANK": None},
     r"but OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_RANK are not: "),
    ({"OMPI_MCA_orte_hnp_uri": "garbage"}, r"='garbage' is not mpirun's"),
    ({"OMPI_MCA_orte_hnp_uri": "4096.0;udp://10.0.0.1:5"}, r"='4096\.0;udp://10\.0\.0\.1:5' is not mpirun's"),
], ids=["local-rank-unset", "size-and-rank-unset", "uri-without-job-id", "uri-without-tcp-address"])
def test_open_mpi_variables_jax_cannot_read_are_named(change, named, monkeypatch):
    """The reference: JAX's Open MPI detection, given the same variables, fails (a KeyError or a
    RuntimeError was a traceback, exit 1, that the crash loop retried; a ValueError was read as
    the variables disagreeing). Each is named before the join; `mpirun -np 1`, never joined, and a
    --coordinator of the user's, which spares the URI, are not refused."""
    import jax
    ompi = pytest.importorskip("jax._src.clusters.ompi_cluster")
    env = {k: v for k, v in {**_MPIRUN_RANK_1, **change}.items() if v is not None}
    for var in list(os.environ):
        if var.startswith(fake_srun.LAUNCHER_PREFIXES) or var.startswith("JAX_"):
            monkeypatch.delenv(var)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises((KeyError, ValueError, RuntimeError)):
        ompi.OmpiCluster.get_coordinator_address(None, None)
        ompi.OmpiCluster.get_process_count(), ompi.OmpiCluster.get_process_id()
        ompi.OmpiCluster.get_local_process_id()
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: pytest.fail(f"joined {kw}"))
    with pytest.raises(ClusterError, match=rf"^OMPI_MCA_orte_hnp_uri.*{named}.*Fix: start every process with mpirun"):
        cluster.initialize(env=env)
    joined = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: joined.append(kw))
    monkeypatch.setattr(jax.config, "update", lambda *a: None)
    assert cluster.initialize(env={**env, "OMPI_COMM_WORLD_SIZE": "1"}).processes == 1 and not joined
    if "OMPI_MCA_orte_hnp_uri" in change:   # the URI is read only for the coordinator
        cluster.initialize("10.0.0.1:1234", env=env)
        assert len(joined) == 1
    cluster.initialize(env=_MPIRUN_RANK_1)
    assert joined[-1] == {"local_device_ids": None}


_SLURM_TASK = {"SLURM_JOB_ID": "4096123", "SLURM_STEP_NODELIST": "localhost", "SLURM_PROCID": "1",
               "SLURM_LOCALID": "0"}


@pytest.mark.parametrize("env, var", [
    *[pytest.param({**_SLURM_TASK, "SLURM_NTASKS": v}, "SLURM_NTASKS", id=f"SLURM_NTASKS={v}")
      for v in ("abc", "", "0", "-2")],
    pytest.param({**fake_srun.srun_env(job_id=5, rank=1, ntasks=2, nodes=2), "SLURM_STEP_NUM_TASKS": "two"},
                 "SLURM_STEP_NUM_TASKS", id="SLURM_STEP_NUM_TASKS=two"),
    *[pytest.param({**fake_srun.mpirun_env(1, 4, 61500), "OMPI_COMM_WORLD_SIZE": v}, "OMPI_COMM_WORLD_SIZE",
                   id=f"OMPI_COMM_WORLD_SIZE={v}") for v in ("abc", "0")],
    pytest.param({"PMI_SIZE": "abc", "PMI_RANK": "1"}, "PMI_SIZE", id="PMI_SIZE=abc"),
])
def test_unparseable_process_count_is_refused(env, var, monkeypatch):
    """JAX's int() of SLURM_NTASKS='abc' (or a count of 0) failed inside jax.distributed.initialize(),
    which read as "nothing to join": every process trained alone, exit 0, the silent replica the
    guard exists for. It is refused before JAX is called, naming the variable and its value."""
    import jax
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: pytest.fail(f"joined {kw}"))
    with pytest.raises(ClusterError, match=rf"^{var}={re.escape(repr(env[var]))} is not a process count: "
                                           "it must be a whole number >= 1"):
        cluster.initialize(env=env)
    # eval.py and bench.py (one process by design) read the count to find copies: unreadable, they ran.
    for name in list(os.environ):
        if name.startswith(fake_srun.LAUNCHER_PREFIXES):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as e:
        cluster.start("eval.py", multi_process=False)
    assert e.value.code == 2


@pytest.mark.parametrize("var, value", [("SLURM_PROCID", "abc"), ("SLURM_PROCID", ""), ("SLURM_LOCALID", "x"),
                                        ("SLURM_JOB_ID", "abc"), ("SLURM_JOB_ID", "")])
def test_unparseable_rank_or_job_id_is_named(var, value, monkeypatch):
    """JAX's int() of a malformed rank, local rank or job id failed inside jax.distributed.initialize,
    said as "the task's SLURM variables disagree" (naming none of them); now the variable and its
    value, before JAX is called."""
    import jax
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: pytest.fail(f"joined {kw}"))
    env = {**_SLURM_TASK, "SLURM_NTASKS": "2", var: value}
    with pytest.raises(ClusterError, match=rf"^{var}={re.escape(repr(value))} is not a whole number >= 0"):
        cluster.initialize(env=env)


def test_local_device_ids_jax_cannot_read_are_named(monkeypatch):
    """JAX_LOCAL_DEVICE_IDS=a: "invalid literal for int() with base 10: 'a'" (explicit flags) or
    the SLURM variables blamed (a launcher's); the variable is named either way."""
    import jax
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: pytest.fail(f"joined {kw}"))
    for args, env in ((("10.0.0.1:1234", 2, 0), {}), ((), {**_SLURM_TASK, "SLURM_NTASKS": "2"})):
        with pytest.raises(ClusterError, match=r"^JAX_LOCAL_DEVICE_IDS='0,a' is not a comma-separated list"):
            cluster.initialize(*args, env={**env, "JAX_LOCAL_DEVICE_IDS": "0,a"})


def test_a_process_id_that_is_not_the_launchers_rank_is_refused(monkeypatch):
    """--process_id=$SLURM_PROCID in an sbatch script is expanded once, by the batch shell: every
    task claimed process 0 and JAX aborted in C++ (exit 134, retried by --resume_until_done) or
    waited 5 minutes. An id that is the task's rank is joined; so are ids where the launcher says
    nothing of it: two one-task srun steps, and mpirun inside an allocation (the batch step's
    SLURM_PROCID=0 is inherited; Open MPI's rank is the task's)."""
    import jax
    joined = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: joined.append(kw["process_id"]))
    monkeypatch.setattr(jax.config, "update", lambda *a: None)   # no gloo for this test process
    task_1 = fake_srun.srun_env(job_id=7, rank=1, ntasks=2, nodes=2)
    for pid, env in ((0, task_1), (None, {**task_1, "JAX_PROCESS_ID": "0"})):   # the flag, a stale export
        with pytest.raises(ClusterError, match=r"^--process_id / JAX_PROCESS_ID = 0, but SLURM_PROCID=1 is this "
                                               r"task's rank among 2: each task must pass its own"):
            cluster.initialize("10.0.0.1:1234", 2, pid, env=env)
    with pytest.raises(ClusterError, match=r"= 2, but OMPI_COMM_WORLD_RANK=3 is this task's rank among 4"):
        cluster.initialize("10.0.0.1:1234", 4, 2, env=fake_srun.mpirun_env(3, 4, 61500))
    cluster.initialize("10.0.0.1:1234", 2, 1, env=task_1)
    cluster.initialize("10.0.0.1:1234", 2, 1, env=fake_srun.srun_env(job_id=8, rank=0, ntasks=1, nodes=1))
    batch = {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}
    cluster.initialize("10.0.0.1:1234", 4, 3, env={**batch, "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3"})
    assert joined == [1, 1, 3]


def test_sigterm_ends_a_process_waiting_for_its_peers(tmp_path):
    """jax.distributed.initialize waits in C++ for every process (5 minutes): the SIGTERM handler
    cli.run installs never ran there, so scancel, a preemption or a dead launcher's PDEATHSIG were
    ignored until JAX gave up. Now the signal's default action ends it at once."""
    import signal
    import time
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), "--flagfile=tiny.flags",
                             f"--run_dir={tmp_path / 'run'}", f"--coordinator=127.0.0.1:{port}", "--num_processes=2",
                             "--process_id=0"], cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:   # the line logged just before the join
            if "waiting for all of them" in line:
                break
        time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_detect_prefers_what_jax_can_join():
    """srun of an Open MPI 5 program: the SLURM step is joinable, the MPI variables are not."""
    env = {**SLURM_STEP, "OMPI_COMM_WORLD_SIZE": "64", "OMPI_COMM_WORLD_RANK": "3"}
    assert cluster.detect(env).engine == "slurm"


def test_job_id_is_shared_by_the_tasks_of_a_job():
    """--resume_until_done seeds its backoff with it: the tasks of one job restart together."""
    ids = {cluster.job_id(fake_srun.srun_env(job_id=42, rank=r, ntasks=4, nodes=2)) for r in range(4)}
    assert ids == {"slurm:42"}
    assert len({cluster.job_id(fake_srun.mpirun_env(r, 2, 61500)) for r in range(2)}) == 1
    assert cluster.job_id({}) is None


def test_one_task_per_node_gets_all_its_gpus():
    """JAX pins a SLURM / Open MPI process to GPU <local rank>; with one task per node that would
    be one GPU of eight, so the task's GPUs are handed over explicitly."""
    one_per_node = cluster.detect(SLURM_STEP)
    assert cluster.local_gpu_ids(one_per_node, {**SLURM_STEP, "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}) \
        == list(range(8))
    assert cluster.local_gpu_ids(one_per_node, {**SLURM_STEP, "SLURM_GPUS_ON_NODE": "4"}) == [0, 1, 2, 3]
    # Nothing names the GPUs (SLURM without gres, mpirun -npernode 1): every GPU the process sees;
    # JAX's default would pin the task to GPU <local rank> = 0. On CPU nodes [] changes nothing.
    assert cluster.local_gpu_ids(one_per_node, SLURM_STEP) == []
    mpi_1pernode = {**fake_srun.mpirun_env(1, 2, 61500), "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    assert cluster.local_gpu_ids(cluster.detect(mpi_1pernode), mpi_1pernode) == []
    assert cluster.local_gpu_ids(one_per_node, {**SLURM_STEP, "CUDA_VISIBLE_DEVICES": "0,1",
                                                "JAX_LOCAL_DEVICE_IDS": "0"}) is None   # the user's choice
    per_gpu = fake_srun.srun_env(job_id=1, rank=3, ntasks=16, nodes=2)           # 8 tasks per node
    mpi_2pernode = {**fake_srun.mpirun_env(1, 2, 61500), "CUDA_VISIBLE_DEVICES": "0,1"}   # JAX's default
    assert cluster.local_gpu_ids(cluster.detect(mpi_2pernode), mpi_2pernode) is None
    # srun --gpus-per-task=1 binds each task to its GPU: the only one it sees is 0, not <local rank>
    assert cluster.local_gpu_ids(cluster.detect(per_gpu), {**per_gpu, "CUDA_VISIBLE_DEVICES": "5"}) == [0]
    # a node with 2 tasks among nodes with one: not one task per node
    uneven = {**per_gpu, "SLURM_STEP_TASKS_PER_NODE": "1,2", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert cluster.local_gpu_ids(cluster.detect(uneven), uneven) is None
    mpi = {**fake_srun.mpirun_env(0, 1, 61500), "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert cluster.local_gpu_ids(cluster.detect(mpi), mpi) == [0, 1, 2, 3]
    tpu = {"TPU_WORKER_HOSTNAMES": "a,b", "CUDA_VISIBLE_DEVICES": "0"}
    assert cluster.local_gpu_ids(cluster.detect(tpu), tpu) is None



def test_tasks_sharing_a_nodes_gpus_split_them():
    """srun --ntasks-per-node=K on nodes whose N GPUs every task sees (no per-task GPUs): JAX's
    default pinned task i to GPU i, so 2 tasks used 2 of 8 GPUs and passed every check. Each task
    gets its block of N // K; tasks given GPUs of their own keep them all; more tasks than GPUs
    stop before JAX starts."""
    def ids(k, rank, **extra):
        env = {**fake_srun.srun_env(job_id=1, rank=rank, ntasks=2 * k, nodes=2), **extra}
        return cluster.local_gpu_ids(cluster.detect(env), env)
    eight = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert [ids(2, r, **eight) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [ids(4, r, **eight) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert ids(8, 5, **eight) == [5]                          # one task per GPU: JAX's own choice
    assert [ids(3, r, **eight) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]   # 2 idle, said in the log
    # srun --gpus-per-task=4: each task sees its own four (masked to 0-3)
    assert ids(2, 1, CUDA_VISIBLE_DEVICES="4,5,6,7", SLURM_GPUS_PER_TASK="4") == [0, 1, 2, 3]
    assert ids(2, 1, SLURM_GPU_BIND="closest", **eight) is None   # may overlap: JAX default
    with pytest.raises(ClusterError, match=r"16 tasks on this node share its 8 GPUs.*task 9 has none"):
        ids(16, 9, **eight)
    with pytest.raises(ClusterError, match=r"16 tasks on this node share its 8 GPUs"):   # every task: [] is all GPUs
        ids(16, 3, **eight)
    assert ids(16, 9, JAX_PLATFORMS="cpu", **eight) is None   # no GPU computing: nothing to share out
    assert ids(2, 1, JAX_PLATFORMS="cuda", **eight) == [4, 5, 6, 7]
    # CUDA stops at the first empty entry: "0,1," is two GPUs
    assert ids(1, 0, CUDA_VISIBLE_DEVICES="0,1,") == [0, 1]
    assert ids(1, 0, CUDA_VISIBLE_DEVICES=" 0, 1 ") == [0, 1]


def test_guard():
    slurm = Launch("slurm", 2, "SLURM_NTASKS=2", True)
    with pytest.raises(ClusterError, match=r"SLURM_NTASKS=2 says this is one of 2 processes.*--independent_runs"):
        cluster.check(slurm, process_count=1, device_count=8, local_device_count=8)
    with pytest.raises(ClusterError, match=r"15 global devices, but 2 processes x 8 local devices"):
        cluster.check(slurm, process_count=2, device_count=15, local_device_count=8)
    cluster.check(slurm, process_count=2, device_count=16, local_device_count=8)
    cluster.check(Launch("none"), process_count=1, device_count=8, local_device_count=8)
    independent = cluster.initialize(independent_runs=True, env={"SLURM_NTASKS": "2", "SLURM_JOB_ID": "1"})
    cluster.check(independent, process_count=1, device_count=8, local_device_count=8)
    assert "independent runs" in independent.engine


def test_initialize_refuses_before_touching_jax(monkeypatch):
    import jax
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: pytest.fail(f"joined {kw}"))
    with pytest.raises(ClusterError, match="not started by srun"):
        cluster.initialize(env={"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2"})
    with pytest.raises(ClusterError, match="contradicts"):
        cluster.initialize(num_processes=2, independent_runs=True, env={})
    # a count the launcher contradicts: --num_processes=1 was ignored (all 64 joined), 8 of 64 fail
    for n in (1, 8):
        with pytest.raises(ClusterError, match=f"--num_processes / JAX_NUM_PROCESSES = {n}, but SLURM_NTASKS=64 says "
                                               "this launch started 64 processes: drop it.*--independent_runs"):
            cluster.initialize(num_processes=n, env=SLURM_STEP)
        with pytest.raises(ClusterError, match=f"= {n}, but OMPI_COMM_WORLD_SIZE=4"):
            cluster.initialize(env={**fake_srun.mpirun_env(1, 4, 61500), "JAX_NUM_PROCESSES": str(n)})
    # Explicit values with no engine to fill in the rest: all three, or the missing ones named.
    with pytest.raises(ClusterError, match=r"needs all of: --process_id / JAX_PROCESS_ID missing"):
        cluster.initialize("10.0.0.1:1234", 2, env={})
    # A count of 0 ran as one process, without a word.
    with pytest.raises(ClusterError, match=r"--num_processes / JAX_NUM_PROCESSES = 0 must be >= 1"):
        cluster.initialize(env={"JAX_NUM_PROCESSES": "0"})
    # A process id outside [0, count): the coordinator would wait for a process that never comes.
    for pid in (2, -1):
        with pytest.raises(ClusterError, match=rf"--process_id / JAX_PROCESS_ID = {pid} must be in \[0, "
                                               r"--num_processes / JAX_NUM_PROCESSES = 2\)"):
            cluster.initialize("10.0.0.1:1234", 2, pid, env={})
    # `srun -n1` (no -E): a one-task step that JAX could "join" is one process; nothing is joined.
    one = cluster.initialize(env=fake_srun.srun_env(job_id=5, rank=0, ntasks=1, nodes=1))
    assert (one.engine, one.processes) == ("slurm", 1)
    assert not jax.distributed.is_initialized()


def test_explicit_count_of_an_mpi_launch_inside_a_slurm_step_is_joined(monkeypatch):
    """Open MPI 5's mpirun inside an allocation starts its daemons with srun, one per node, and
    its ranks inherit that step: SLURM_NTASKS counts the nodes, OMPI_COMM_WORLD_SIZE the ranks,
    and detect() reports the SLURM step (test_detect_prefers_what_jax_can_join). The flags the
    open-mpi fix asks for (--num_processes=$OMPI_COMM_WORLD_SIZE) are joined, as before the
    launcher-count check; a count no launcher announces is still refused."""
    import jax
    joined = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: joined.append(kw))
    monkeypatch.setattr(jax.config, "update", lambda *a: None)   # no gloo for this test process
    env = {**fake_srun.srun_env(job_id=7, rank=1, ntasks=2, nodes=2), "OMPI_COMM_WORLD_SIZE": "16",
           "OMPI_COMM_WORLD_RANK": "9"}
    assert cluster.detect(env).processes == 2
    cluster.initialize("10.0.0.1:1234", 16, 9, env=env)
    assert [(kw["num_processes"], kw["process_id"]) for kw in joined] == [(16, 9)]
    with pytest.raises(ClusterError, match="= 8, but SLURM_NTASKS=2 says"):
        cluster.initialize("10.0.0.1:1234", 8, 5, env=env)


# ---------------------------------------------------------------------------------------------
# The guard in every script: one line, exit status 2, nothing written
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", ["train.py", "eval.py", "bench.py"])
def test_scripts_stop_on_silent_replicas(tmp_path, script):
    args = {"train.py": [f"--flagfile={ROOT}/tiny.flags", f"--run_dir={tmp_path / 'run'}",
                         f"--data_dir={tmp_path / 'data'}", "--resume_until_done"],
            "eval.py": [f"--model={tmp_path / 'run'}", f"--out={tmp_path / 'out'}"],
            "bench.py": ["--model=tiny"]}[script]
    if script == "train.py":   # the case: SLURM_NTASKS=2, one process, no srun step
        slurm = {"SLURM_JOB_ID": "123", "SLURM_NTASKS": "2"}
    else:   # one-process tools: `srun -N2 python eval.py` starts two copies (a bare batch shell, one)
        slurm = fake_srun.srun_env(job_id=123, rank=0, ntasks=2, nodes=2)
    env = fake_srun.clean_env(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, **slurm)
    path = os.path.join(ROOT, "benchmarks", script) if script == "bench.py" else os.path.join(ROOT, script)
    p = subprocess.run([sys.executable, path, *args], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith(f"{script}: error:")]
    assert len(errors) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "SLURM_NTASKS=2" in errors[0] and "srun" in errors[0] and "--independent_runs" in errors[0]
    assert os.listdir(tmp_path) == []   # no run dir, no data, no output


def test_one_process_tools(monkeypatch):
    """eval.py / bench.py in SLURM's batch shell (no srun) are one copy and run; started by srun
    as N copies they stop, unless the copies are asked for."""
    for var in list(os.environ):
        if var.startswith(fake_srun.LAUNCHER_PREFIXES):
            monkeypatch.delenv(var)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "64")
    assert cluster.start("eval.py", multi_process=False).engine == "slurm, one process"
    for var, value in fake_srun.srun_env(job_id=7, rank=1, ntasks=2, nodes=2).items():
        monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as e:
        cluster.start("eval.py", multi_process=False)
    assert e.value.code == 2
    launch = cluster.start("eval.py", multi_process=False, independent_runs=True)
    assert launch.engine == "slurm, independent runs (--independent_runs)"
    # `mpiexec -n 2 python eval.py` (MPICH / Intel MPI: nothing JAX joins) starts two copies as well
    for var in list(os.environ):
        if var.startswith(fake_srun.LAUNCHER_PREFIXES):
            monkeypatch.delenv(var)
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv("PMI_RANK", "1")
    with pytest.raises(SystemExit) as e:
        cluster.start("eval.py", multi_process=False)
    assert e.value.code == 2


# ---------------------------------------------------------------------------------------------
# Joining through the launcher's variables alone: two real processes, and the data order they
# read (every instance exactly once per epoch, DESIGN §4 bug 1) through the auto-detected ranks
# ---------------------------------------------------------------------------------------------
PROBE = textwrap.dedent("""
    import sys
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    import data
    from olmo3 import cluster
    launch = cluster.start("probe")
    rank, ranks = jax.process_index(), jax.process_count()
    ids = multihost_utils.process_allgather(np.array([rank]))
    # One epoch of the data order as train.py reads it (data rank = process index): all ranks' rows
    n, gb, steps = 1003, 8, 1003 // 8
    mine = np.concatenate([data.batch_indices(n, gb, 34521, 0, s, rank, ranks) for s in range(steps)])
    seen = np.bincount(multihost_utils.process_allgather(mine).ravel(), minlength=n)
    open(sys.argv[1] + f"/{rank}.txt", "w").write(
        cluster.summary(launch) + " | " + ",".join(map(str, ids.ravel().tolist()))
        + f" | seen once: {(seen == 1).sum()}, never: {(seen == 0).sum()}, more: {(seen > 1).sum()}")
""")


@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_processes_join_through_launcher_variables(tmp_path, launcher):
    env = fake_srun.clean_env(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
                              XLA_FLAGS="--xla_force_host_platform_device_count=2")
    if launcher == "srun":
        job_id = fake_srun.job_id_for_free_port()
        envs = [fake_srun.srun_env(job_id, i, 2, 2) for i in range(2)]
        engine = "slurm (SLURM_NTASKS=2)"
    else:
        port = fake_srun.free_derived_port()
        envs = [fake_srun.mpirun_env(i, 2, port) for i in range(2)]
        engine = "open-mpi (OMPI_COMM_WORLD_SIZE=2)"
    procs = [subprocess.Popen([sys.executable, "-c", PROBE, str(tmp_path)], env={**env, **e},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for e in envs]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    for i in range(2):   # exactly once: 125 global batches of 8, the 3-instance tail never
        assert (tmp_path / f"{i}.txt").read_text() == (
            f"cluster: {engine}: process {i} of 2, 2 local / 4 global cpu devices | 0,1 | "
            "seen once: 1000, never: 3, more: 0")


def test_sbatch_srun_line(tmp_path):
    """The sbatch script under a stand-in srun whose 'python' records what each task was given:
    one task per node, the flagfile unchanged, the run dir, the crash loop, the user's flags."""
    record = tmp_path / "record.py"
    record.write_text("import json, os, sys\n"
                      "rank = os.environ['SLURM_PROCID']\n"
                      "json.dump({'argv': sys.argv[1:], 'env': {k: v for k, v in os.environ.items() "
                      "if k.startswith('SLURM_')}}, open(sys.argv[0] + '.' + rank, 'w'))\n")
    python = _executable(tmp_path / "python", f'exec "{sys.executable}" "{record}" "$@"')
    env = _sbatch_env(tmp_path, nodes=3, PYTHON=str(python))
    p = subprocess.run(["bash", SBATCH, "stage1.flags", "/shared/runs/s1", "--max_steps=5"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for args in ([], ["stage1.flags"], ["stage1.flags", ""]):   # bash's ${1:?} exited 1
        bad = subprocess.run(["bash", SBATCH, *args], env=env, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and bad.stderr.startswith("slurm.sbatch: error: usage: sbatch launch/slurm.sbatch "
                                                              "FLAGFILE RUN_DIR"), (args, bad.stderr)
    tasks = [json.load(open(f"{record}.{r}")) for r in range(3)]
    for r, t in enumerate(tasks):
        assert t["argv"] == ["train.py", "--flagfile=stage1.flags", "--run_dir=/shared/runs/s1",
                             "--attention=cudnn", "--resume_until_done", "--max_steps=5"]
        assert t["env"]["SLURM_PROCID"] == str(r) and t["env"]["SLURM_LOCALID"] == "0"
        assert t["env"]["SLURM_NTASKS"] == "3" and t["env"]["SLURM_STEP_NUM_NODES"] == "3"



def test_sbatch_leaves_the_gpu_tuning_to_train_py(tmp_path):
    """train.py sets the XLA GPU flags itself (olmo3/runtime.py tune_gpu), and an XLA_FLAGS entry
    of the environment replaces its flag of the same name. The script exported MaxText's 128 MiB
    all-gather / all-reduce and 64 MiB reduce-scatter thresholds, so every task ran with those
    instead of tune_gpu's (at least one 7B layer's 0.81 GB of fp32 weights). A user's own
    XLA_FLAGS still reach the tasks unchanged."""
    from olmo3 import runtime
    record = tmp_path / "record.py"
    record.write_text("import json, os, sys\n"
                      "json.dump({k: os.environ.get(k) for k in ('XLA_FLAGS', 'CUDA_DEVICE_MAX_CONNECTIONS')}, "
                      "open(sys.argv[0] + '.' + os.environ['SLURM_PROCID'], 'w'))\n")
    python = _executable(tmp_path / "python", f'exec "{sys.executable}" "{record}" "$@"')
    for user in (None, "--xla_dump_to=/tmp/hlo"):
        env = _sbatch_env(tmp_path, nodes=1, PYTHON=str(python))
        env.pop("XLA_FLAGS", None)
        if user:
            env["XLA_FLAGS"] = user
        p = subprocess.run(["bash", SBATCH, "stage1.flags", "/shared/runs/s1"], env=env,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        task = json.load(open(f"{record}.0"))
        assert task["XLA_FLAGS"] == user, task
        ours = {runtime.flag_name(f) for f in runtime.GPU_XLA_FLAGS}
        assert not ours & {runtime.flag_name(f) for f in (task["XLA_FLAGS"] or "").split()}


def test_sbatch_srun_gets_the_cpus_per_task(tmp_path):
    """srun of Slurm >= 22.05 does not inherit --cpus-per-task from the batch job (sbatch(1)):
    without it on the srun line each task ran confined to one core of the node's 96. The
    stand-in srun records its options; the job's value must reach srun, and none when unset."""
    log = tmp_path / "srun.args"
    for cpus in ("96", None):
        env = _sbatch_env(tmp_path, nodes=1, PYTHON=str(_executable(tmp_path / "python", "exit 0")))
        _executable(tmp_path / "bin" / "srun", f'echo "$@" > "{log}"')   # records, runs nothing
        if cpus:
            env["SLURM_CPUS_PER_TASK"] = cpus
        p = subprocess.run(["bash", SBATCH, "stage1.flags", "/shared/runs/s1"], env=env,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        options = log.read_text().split(" train.py")[0].split()
        assert [o for o in options if o.startswith("--cpus-per-task")] == (
            [f"--cpus-per-task={cpus}"] if cpus else []), options

def _executable(path, body):
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _sbatch_env(tmp_path, nodes, **extra):
    """What sbatch gives its script (job id, node count, submit dir), with `srun` on PATH being
    tests/fake_srun.py."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    _executable(bin_dir / "srun", f'exec "{sys.executable}" "{os.path.join(ROOT, "tests", "fake_srun.py")}" "$@"')
    return fake_srun.clean_env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID=str(fake_srun.job_id_for_free_port()),
        SLURM_JOB_NUM_NODES=str(nodes), SLURM_NNODES=str(nodes), SLURM_NTASKS=str(nodes),
        SLURM_SUBMIT_DIR=ROOT, SLURM_JOB_NODELIST="localhost", **extra)


# ---------------------------------------------------------------------------------------------
# End to end: train.py through the sbatch script (and through mpirun's variables)
# ---------------------------------------------------------------------------------------------
def _losses(run_dir):
    out = {}
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        m = json.loads(line)
        out[m["step"]] = m["train/loss"]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """train.py as one process x 4 devices, 6 steps, uninterrupted: the reference."""
    from test_train import SMALL, word_corpus
    base = tmp_path_factory.mktemp("cluster_ref")
    corpus = base / "docs"
    corpus.mkdir()
    word_corpus(corpus)
    flags = [*SMALL[1:], f"--data={corpus}", f"--data_dir={base / 'data'}", "--mesh=fsdp:4",
             "--save_interval=3", "--attention=xla"]
    _train_one(base / "one", flags + ["--max_steps=6"])
    return {"base": base, "flags": flags, "losses": _losses(base / "one")}


def _train_one(run_dir, flags):
    env = fake_srun.clean_env(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
                              XLA_FLAGS="--xla_force_host_platform_device_count=4")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), f"--flagfile={ROOT}/tiny.flags",
                        f"--run_dir={run_dir}", *flags], env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["sbatch", "mpirun"])
def test_two_nodes_match_one_process_and_resume(reference, tmp_path, launcher):
    ref, run_dir = reference["losses"], tmp_path / "two"
    two_devices = "--xla_force_host_platform_device_count=2"
    if launcher == "sbatch":   # the script itself: its srun line, --resume_until_done and all
        env = _sbatch_env(tmp_path, nodes=2, PYTHON=sys.executable, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
                          XLA_FLAGS=two_devices)
        p = subprocess.run(["bash", SBATCH, f"{ROOT}/tiny.flags", str(run_dir), *reference["flags"],
                            "--max_steps=3"], env=env, capture_output=True, text=True, timeout=900)
        rc, log = p.returncode, p.stderr
    else:
        env = fake_srun.clean_env(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS=two_devices)
        log_path = tmp_path / "log"
        with open(log_path, "w") as log_file:
            port = fake_srun.free_derived_port()
            procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), f"--flagfile={ROOT}/tiny.flags",
                                       f"--run_dir={run_dir}", *reference["flags"], "--max_steps=3"],
                                      env={**env, **fake_srun.mpirun_env(i, 2, port)}, stdout=log_file,
                                      stderr=subprocess.STDOUT) for i in range(2)]
            rc = max(p.wait(timeout=900) for p in procs)
        log = log_path.read_text()
    assert rc == 0, log[-4000:]
    engine = "slurm (SLURM_NTASKS=2)" if launcher == "sbatch" else "open-mpi (OMPI_COMM_WORLD_SIZE=2)"
    for i in range(2):
        assert f"cluster: {engine}: process {i} of 2, 2 local / 4 global cpu devices" in log
    two = _losses(run_dir)
    assert sorted(two) == [1, 2, 3]   # one writer: process 0
    np.testing.assert_allclose([two[s] for s in (1, 2, 3)], [ref[s] for s in (1, 2, 3)], rtol=2e-6)
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["3"]   # one checkpoint, written by both
    # One process x 4 devices resumes the two-process checkpoint: steps 4..6 as if uninterrupted.
    _train_one(run_dir, reference["flags"] + ["--max_steps=6", "--resume"])
    resumed = _losses(run_dir)
    np.testing.assert_allclose([resumed[s] for s in (4, 5, 6)], [ref[s] for s in (4, 5, 6)], rtol=2e-6)


def test_independent_copies_of_one_launch_may_not_share_a_run_dir(tmp_path):
    """--independent_runs copies given one --run_dir (launch/slurm.sbatch passes one to every task)
    wrote each other's checkpoints: interleaved metrics, then an OCDBT 'Configuration mismatch' and
    a half-written save, after the whole training. A rank that finds another rank's mark of its
    job stops; the same rank rerun (a restart) and another job's copies do not."""
    run = str(tmp_path / "run")
    job = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "2"}
    cluster.claim_run_dir(run, env={**job, "SLURM_PROCID": "0"})
    cluster.claim_run_dir(run, env={**job, "SLURM_PROCID": "0"})   # its restart
    with pytest.raises(ClusterError, match=r"--run_dir=.* is shared by the --independent_runs copies of one launch "
                                           r"\(ranks 1, 0 of slurm:77\).*its own --run_dir, e\.g\. srun bash -c"):
        cluster.claim_run_dir(run, env={**job, "SLURM_PROCID": "1"})
    cluster.claim_run_dir(run, env={"SLURM_JOB_ID": "78", "SLURM_PROCID": "1"})   # a later job resuming it
    cluster.claim_run_dir(str(tmp_path / "alone"), env={})   # no launcher: nothing to tell apart
    assert not os.path.exists(tmp_path / "alone")


@pytest.mark.parametrize("port", ["abc", "0", "70000", "12:34", ""])
def test_a_coordinator_port_that_is_no_port_is_refused(port, monkeypatch):
    """JAX appends JAX_COORDINATOR_PORT to the host it derives from the launcher: one that is no
    port was dialled until JAX aborted (exit 134, retried). An explicit --coordinator names its own."""
    import jax
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: pytest.fail(f"joined {kw}"))
    env = {**_SLURM_TASK, "SLURM_NTASKS": "2", "JAX_COORDINATOR_PORT": port}
    with pytest.raises(ClusterError, match=rf"^JAX_COORDINATOR_PORT={re.escape(repr(port))} is not a port"):
        cluster.initialize(env=env)


def test_a_coordinator_port_in_use_is_named_before_the_join(monkeypatch):
    """Process 0 serves the coordinator: a port another process listens on was JAX's traceback
    ("Failed to start RPC server", exit 1) or a segmentation fault (exit 139, 5 tries of 8), both retried into
    the same clash. Now it is tried first, as gRPC binds it (every address, SO_REUSEADDR)."""
    import jax
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: pytest.fail(f"joined {kw}"))
    monkeypatch.setattr(jax.config, "update", lambda *a: None)   # no gloo for this test process
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ClusterError, match=rf"^process 0 could not serve the coordinator at 127.0.0.1:{port}: "
                                               rf"the port is taken on this host .*; give a free port in "
                                               rf"--coordinator / JAX_COORDINATOR_ADDRESS=127.0.0.1:{port}$"):
            cluster.initialize(f"127.0.0.1:{port}", 2, 0, env={})
        bind = f"[::]:{port}"   # JAX_COORDINATOR_BIND_ADDRESS decides the port process 0 listens on
        with pytest.raises(ClusterError, match=rf"JAX_COORDINATOR_BIND_ADDRESS={re.escape(bind)} must be a free"):
            cluster.initialize("127.0.0.1:1", 2, 0, env={"JAX_COORDINATOR_BIND_ADDRESS": bind})
    joined = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: joined.append(kw["process_id"]))
    cluster.initialize(f"127.0.0.1:{port}", 2, 0, env={})   # released: joined
    with socket.socket() as held:   # process 1 serves nothing: not tried
        held.bind(("127.0.0.1", port))
        held.listen()
        cluster.initialize(f"127.0.0.1:{port}", 2, 1, env={})
    assert joined == [0, 1]


def test_a_port_an_earlier_attempt_left_in_time_wait_is_free():
    """A coordinator that crashed leaves its port's connections in TIME_WAIT for a minute; gRPC
    binds with SO_REUSEADDR, so the port is free to it, and the probe must say so too: a false
    'taken' is exit 2, which --resume_until_done never retries (the run would stop for good)."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as gRPC's listener (Linux: both need it)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()   # the server's side closes first: its end of the connection waits in TIME_WAIT
        client.close()
    assert not cluster._port_taken(f"[::]:{port}")
    with socket.socket() as s:   # what the probe without SO_REUSEADDR saw: the port in use
        with pytest.raises(OSError):
            s.bind(("127.0.0.1", port))


def test_a_host_without_ipv6_probes_the_port_on_ipv4(monkeypatch):
    """Where the kernel has no IPv6 (socket(AF_INET6) fails), the probe binds the IPv4 wildcard,
    as gRPC then listens: a port held there is taken, a free one is not."""
    real = socket.socket

    def no_ipv6(family=socket.AF_INET, *args):
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real(family, *args)
    monkeypatch.setattr(cluster.socket, "socket", no_ipv6)
    with real() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        assert cluster._port_taken(f"[::]:{port}")
    assert not cluster._port_taken(f"[::]:{port}")


def test_a_coordinator_port_jax_derived_and_found_taken_is_named(monkeypatch):
    """Under srun JAX derives process 0's port from the job id; two jobs whose ids agree modulo
    4096 on one node clash. JAX's error becomes a line that says how to choose the port."""
    import jax

    def clash(**kw):
        raise jax.errors.JaxRuntimeError("UNKNOWN: Failed to start RPC server")
    monkeypatch.setattr(jax.distributed, "initialize", clash)
    monkeypatch.setattr(jax.config, "update", lambda *a: None)
    with pytest.raises(ClusterError, match=r"^process 0 could not serve the coordinator at .*: the port is taken "
                                           r"on this host .*set JAX_COORDINATOR_PORT to a free port for every process"):
        cluster.initialize(env=fake_srun.srun_env(job_id=5, rank=0, ntasks=2, nodes=1))


def test_a_coordinator_host_that_does_not_exist_is_named(monkeypatch):
    """A misspelt coordinator host was dialled for 5 minutes, then JAX aborted (exit 134, retried).
    A resolver that does not answer (EAI_AGAIN) is left to JAX: it may answer on the next try."""
    import jax
    joined = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: joined.append(kw["coordinator_address"]))
    monkeypatch.setattr(jax.config, "update", lambda *a: None)

    def resolver(host, port):
        if host == "node0001":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        if host == "node0002":
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return []
    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    with pytest.raises(ClusterError, match=r"^--coordinator / JAX_COORDINATOR_ADDRESS=node0001:1234: no host is "
                                           r"called 'node0001' \(the name does not resolve here\); give"):
        cluster.initialize("node0001:1234", 2, 1, env={})
    with pytest.raises(ClusterError, match=r"^--coordinator / JAX_COORDINATOR_ADDRESS=node0001:1234: no host"):
        cluster.initialize(env={"JAX_COORDINATOR_ADDRESS": "node0001:1234", "JAX_NUM_PROCESSES": "2",
                                "JAX_PROCESS_ID": "1"})
    for address in ("node0002:1234", "10.0.0.1:1234", "[::1]:1234"):
        cluster.initialize(address, 2, 1, env={})
    assert joined == ["node0002:1234", "10.0.0.1:1234", "[::1]:1234"]


@pytest.mark.parametrize("ids, name", [
    ({"TPU_WORKER_ID": "2"}, "TPU_WORKER_ID"),              # 2 hosts: 0 or 1
    ({"TPU_WORKER_ID": "one"}, "TPU_WORKER_ID"),
    ({}, "TPU_WORKER_ID"),                                  # JAX read int('None')
    ({"TPU_WORKER_ID": "1", "MEGASCALE_SLICE_ID": "3"}, "MEGASCALE_SLICE_ID"),   # 3 slices: 0 to 2
    ({"TPU_WORKER_ID": "1", "MEGASCALE_SLICE_ID": "-1"}, "MEGASCALE_SLICE_ID"),
    ({"TPU_WORKER_ID": "1", "MEGASCALE_SLICE_ID": "2"}, None),
    ({"TPU_WORKER_ID": "0", "MEGASCALE_SLICE_ID": ""}, None),   # JAX: slice 0
], ids=["worker_2_of_2", "worker_one", "worker_unset", "slice_3_of_3", "slice_minus_1", "slice_2", "slice_empty"])
def test_tpu_worker_and_slice_ids_jax_cannot_place_are_named(ids, name, monkeypatch):
    """JAX's GKE TPU detection makes the process id TPU_WORKER_ID + MEGASCALE_SLICE_ID x hosts,
    each with int(): where that is no process id in [0, hosts x slices) (the reference: JAX's own
    get_process_id), the variable is named before the join."""
    tpu = pytest.importorskip("jax._src.clusters.cloud_tpu_cluster")
    for var in list(os.environ):
        if var.startswith(fake_srun.LAUNCHER_PREFIXES):
            monkeypatch.delenv(var)
    env = {"TPU_WORKER_HOSTNAMES": "h0,h1", "MEGASCALE_NUM_SLICES": "3", "MEGASCALE_SLICE_ID": "0", **ids}
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(tpu, "running_in_cloud_tpu_vm", True)
    try:
        jax_id = tpu.GkeTpuCluster.get_process_id()
    except ValueError:
        jax_id = None
    # A place for this host: an id in range that no other (worker, slice) pair also gets.
    placed = (jax_id is not None and 0 <= jax_id < tpu.GkeTpuCluster.get_process_count()
              and divmod(jax_id, 2) == (int(env["MEGASCALE_SLICE_ID"] or 0), int(env["TPU_WORKER_ID"])))
    assert (name is None) == placed
    import jax
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: None)
    if name is None:
        assert cluster.initialize(env=env).processes == 6
    else:
        said = f"{name}={ids[name]!r}" if name in ids else f"{name} (unset)"
        with pytest.raises(ClusterError, match=rf"^{re.escape(said)} is not this host's index "
                                               rf"among .*: it must be a whole number from 0 to [12]\. Fix: leave it"):
            cluster.initialize(env=env)


def test_gpu_block_is_chosen_by_the_local_rank_not_the_global_one():
    """srun --ntasks-per-node=2 on 2 nodes of 8 GPUs: global rank 3 is local rank 1 of node 1."""
    eight = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    envs = [{**fake_srun.srun_env(job_id=1, rank=r, ntasks=4, nodes=2), **eight} for r in range(4)]
    assert [cluster.local_gpu_ids(cluster.detect(e), e) for e in envs] == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2


def test_one_task_per_node_counts_the_gpus_cuda_enumerates():
    """CUDA_VISIBLE_DEVICES (what CUDA enumerates for the task) wins over SLURM_GPUS_ON_NODE."""
    env = {**fake_srun.srun_env(job_id=1, rank=0, ntasks=2, nodes=2), "CUDA_VISIBLE_DEVICES": "0,1",
           "SLURM_GPUS_ON_NODE": "8"}
    assert cluster.local_gpu_ids(cluster.detect(env), env) == [0, 1]


def test_copies_on_different_nodes_with_the_same_local_rank_are_told_apart(tmp_path):
    """One task per node (launch/slurm.sbatch): every --independent_runs copy has SLURM_LOCALID=0;
    the global rank (SLURM_PROCID) tells them apart."""
    run = str(tmp_path / "run")
    base = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}
    cluster.claim_run_dir(run, env={**base, "SLURM_PROCID": "0"})
    with pytest.raises(ClusterError, match="is shared by the --independent_runs copies"):
        cluster.claim_run_dir(run, env={**base, "SLURM_PROCID": "1"})


def test_a_single_task_step_under_srun_e_is_not_a_launch_of_several():
    """`srun -E -n1` in a 16-task allocation: SLURM_NTASKS=16 is the allocation's, the step runs
    SLURM_STEP_NUM_TASKS=1 task, so an explicit --process_id is not checked against SLURM_PROCID."""
    env = {"SLURM_JOB_ID": "5", "SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "1"}
    assert cluster._rank_problem(1, env) is None
    assert cluster._rank_problem(1, {**env, "SLURM_STEP_NUM_TASKS": "2"}) is not None


def test_an_ipv6_open_mpi_uri_is_read():
    """mpirun's coordinator URI on an IPv6-only network (tcp6://[address]:port) is read, not refused."""
    env = {"OMPI_MCA_orte_hnp_uri": "123.0;tcp6://[fd00::1]:5000", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    assert cluster._ompi_problem(env, None) is None
