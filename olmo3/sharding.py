"""Explicit FSDP x data-parallel partitioning under `jax.shard_map` (DESIGN §6; the JAX shard_map
guide's FSDP section).

The mesh has two axes, ('data', 'fsdp'):

    params, mu, nu   every weight sharded on ONE axis over 'fsdp', replicated over 'data'
    batch rows       split over ('data', 'fsdp'): every device holds global_batch / n_devices rows
    one step         for each microbatch, for each layer in the scan: all_gather that layer's
                     weights over 'fsdp', run it, drop it; the backward pass recomputes the gather
                     and its transpose hands back the gradient already reduce-scattered over
                     'fsdp'. After the last microbatch the shard gradients are psummed over
                     'data' (replicas) once. The loss denominator is the psum of counted tokens over
                     every device, so the math is that of one device holding the whole batch.
    optimizer        plain jit on the sharded arrays, OUTSIDE the shard_map: skip-step AdamW needs
                     a global grad norm, which jit gets right on global arrays; its elementwise
                     update keeps the params' sharding (the step pins it, see `make_train_step`).

The model math never relies on XLA's automatic sharding: every collective of the forward and
backward pass is written here. Pure FSDP (data=1) was as fast as FSDP x DP at 128 devices in the
write-up (DESIGN §6), hence the default: every device on 'fsdp'.

Topology independence (DESIGN §4, bug 4): the global batch is a recipe constant; the per-device
batch and the number of microbatches are derived from it and the GLOBAL device count
(`microbatches`), and a checkpoint is restored onto any mesh from `abstract_state`.

Run `python -m olmo3.sharding` for the per-device memory of the 7B at 128 and 512 devices.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import PyTree

from olmo3 import step as step_lib
from olmo3.config import Config
from olmo3.loss import labels_and_weights
from olmo3.model import Layer, OLMo3
from olmo3.step import Z_LOSS, loss_sums

DATA, FSDP = "data", "fsdp"
ROWS = P((DATA, FSDP))  # leading (batch) axis split over every device of the mesh


# --------------------------------------------------------------------------------------------
# Mesh
# --------------------------------------------------------------------------------------------
def make_mesh(spec: Optional[str] = None, devices: Optional[list] = None) -> Mesh:
    """A ('data', 'fsdp') mesh over all global devices (every process's), from a flag value.

    `spec` is "fsdp:N,data:M" in any order; one axis may be left out and takes the rest of the
    devices; None or "" puts every device on fsdp (pure FSDP)."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    sizes: dict[str, int] = {}
    for part in (spec or "").replace(" ", "").split(","):
        if not part:
            continue
        name, sep, value = part.partition(":")
        if not sep or name not in (DATA, FSDP) or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--mesh={spec!r}: each entry must be 'fsdp:N' or 'data:M' with a "
                             f"positive integer, e.g. --mesh=fsdp:{n},data:1")
        if name in sizes:
            raise ValueError(f"--mesh={spec!r}: axis {name!r} given twice")
        sizes[name] = int(value)
    given = int(np.prod(list(sizes.values()))) if sizes else 1
    if n % given:
        raise ValueError(f"--mesh={spec!r}: {given} does not divide the {n} global devices "
                         f"({jax.process_count()} process(es)); choose sizes whose product is {n}")
    # An axis left out takes the remaining devices (fsdp first: pure FSDP by default).
    if FSDP not in sizes:
        sizes[FSDP] = n // sizes.get(DATA, 1)
    if DATA not in sizes:
        sizes[DATA] = n // sizes[FSDP]
    if sizes[DATA] * sizes[FSDP] != n:
        raise ValueError(f"--mesh={spec!r}: data:{sizes[DATA]} x fsdp:{sizes[FSDP]} = "
                         f"{sizes[DATA] * sizes[FSDP]} devices, but there are {n} global devices "
                         f"({jax.process_count()} process(es)); make the product {n}")
    # Auto axes: outside shard_map (the optimizer) shardings simply follow the inputs.
    return jax.make_mesh((sizes[DATA], sizes[FSDP]), (DATA, FSDP),
                         axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)


def _fsdp_size(mesh_or_size: Union[Mesh, int]) -> int:
    return mesh_or_size.shape[FSDP] if isinstance(mesh_or_size, Mesh) else int(mesh_or_size)


# --------------------------------------------------------------------------------------------
# Partition specs
# --------------------------------------------------------------------------------------------
def param_specs(model: OLMo3, mesh_or_fsdp: Union[Mesh, int]) -> PyTree:
    """PartitionSpec of every float array of `model` (None elsewhere), structure of
    `eqx.filter(model, eqx.is_inexact_array)`.

    Rule: each weight is sharded over 'fsdp' on its LARGEST axis that the fsdp size divides
    (the earlier axis on a tie), never on the stacked [n_layers] axis of `model.layers` (the scan
    walks it; one layer at a time is gathered). A weight with no such axis is refused: name the
    weight, its shape and the fsdp size. Works on abstract models (eqx.filter_eval_shape)."""
    fsdp = _fsdp_size(mesh_or_fsdp)

    def spec(path, x):
        name = jax.tree_util.keystr(path)
        first = 1 if name.startswith(".layers.") else 0   # skip the stacked layer axis
        axes = [a for a in range(first, x.ndim) if x.shape[a] % fsdp == 0]
        if not axes:
            raise ValueError(
                f"weight model{name} of shape {tuple(x.shape)} has no axis divisible by the fsdp "
                f"size {fsdp} (the layer axis is never sharded); choose --mesh with an fsdp size "
                f"that divides one of {tuple(x.shape[first:])}, or pad that dimension (e.g. "
                "vocab_size to a multiple of 128, as OLMo-core pads 100278 to 100352)")
        best = max(axes, key=lambda a: (x.shape[a], -a))
        return P(*[FSDP if a == best else None for a in range(x.ndim)])

    return jax.tree_util.tree_map_with_path(spec, eqx.filter(model, _is_float))


def _is_float(x) -> bool:
    """A float array, concrete or abstract (ShapeDtypeStruct from eqx.filter_eval_shape)."""
    return ((isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))
             and jnp.issubdtype(x.dtype, jnp.inexact)))


def _fsdp_axis(spec: P) -> int:
    return list(spec).index(FSDP)


def opt_specs(opt_state: PyTree, specs: PyTree) -> PyTree:
    """Specs of the optimizer state: mu/nu exactly like the params, everything else (step
    counters, skip-step windows) replicated."""
    out = jax.tree.map(lambda _: P(), opt_state)
    return eqx.tree_at(lambda s: (s.mu, s.nu), out, (specs, specs))


# --------------------------------------------------------------------------------------------
# Placing the training state (model, opt_state)
# --------------------------------------------------------------------------------------------
def _named(specs: PyTree, mesh: Mesh) -> PyTree:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


def state_shardings(state: tuple[OLMo3, PyTree], mesh: Mesh) -> tuple[PyTree, PyTree]:
    """NamedShardings of (model, opt_state), trees of their array leaves (None elsewhere)."""
    model, opt_state = state
    specs = param_specs(model, mesh)
    return _named(specs, mesh), _named(opt_specs(opt_state, specs), mesh)


def abstract_state(state: tuple[OLMo3, PyTree], mesh: Mesh) -> tuple[OLMo3, PyTree]:
    """(model, opt_state) with every array replaced by a ShapeDtypeStruct carrying its
    NamedSharding on `mesh`: the target of a checkpoint restore (olmo3/checkpoint.py reads each
    shard straight onto its device, so a run saved on 8 devices resumes on 2 by restoring onto
    a 2-device mesh). `state` may be concrete or abstract (eqx.filter_eval_shape)."""
    arrays, static = eqx.partition(state, lambda x: isinstance(x, jax.Array) or _is_abstract(x))
    shapes = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          arrays, state_shardings(arrays, mesh))
    return eqx.combine(shapes, static)


def place(state: PyTree, abstract: PyTree) -> PyTree:
    """Copy every array of `state` onto the sharding of the matching leaf of `abstract`.

    Every process must pass the same values (each keeps only its own devices' shards). Use
    `init_sharded` for a fresh 7B: this path holds the whole state on the host first."""
    def put(x, a):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, a.sharding, lambda idx: host[idx])

    arrays, static = eqx.partition(state, eqx.is_array)
    targets = eqx.filter(abstract, _is_abstract)
    return eqx.combine(jax.tree.map(put, arrays, targets), static)


def _is_abstract(x) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def shard_state(model: OLMo3, opt_state: PyTree, mesh: Mesh) -> tuple[OLMo3, PyTree]:
    """Params and optimizer state placed on the mesh (params/mu/nu sharded over fsdp, the
    optimizer's scalars and windows replicated)."""
    return place((model, opt_state), abstract_state((model, opt_state), mesh))


def init_sharded(init: Callable[[], tuple[OLMo3, PyTree]], mesh: Mesh) -> tuple[OLMo3, PyTree]:
    """Run `init() -> (model, opt_state)` under jit with sharded outputs: XLA partitions the
    initializer (threefry random bits are partitionable), so each device computes and keeps its
    own shards and the 7B never sits whole on one device or host; every process of a
    multi-process run gets the values of the same key."""
    abstract = eqx.filter_eval_shape(init)
    static = eqx.partition(abstract, _is_abstract)[1]
    values = jax.jit(lambda: eqx.partition(init(), eqx.is_array)[0],
                     out_shardings=state_shardings(abstract, mesh))()
    return eqx.combine(values, static)


# --------------------------------------------------------------------------------------------
# The gradient under shard_map
# --------------------------------------------------------------------------------------------
def _gather(x: jax.Array, spec: P, axis_offset: int = 0) -> jax.Array:
    """This device's shard -> the full weight. Its transpose (in the backward pass) is a
    reduce-scatter: each device receives the fsdp-summed gradient of its own shard only."""
    if jax.lax.axis_size(FSDP) == 1:   # nothing to gather: XLA would still copy the weight
        return x
    return jax.lax.all_gather(x, FSDP, axis=_fsdp_axis(spec) - axis_offset, tiled=True)


def _gather_layer(layer: Layer, layer_specs: Layer) -> Layer:
    """ONE layer's weights (the stacked layer axis already indexed away by the scan), called by
    model.hidden inside the scanned body: only one layer is ever whole on a device."""
    return jax.tree.map(lambda x, s: _gather(x, s, axis_offset=1), layer, layer_specs)


def _gather_top(model: OLMo3, specs: PyTree) -> OLMo3:
    """The weights used outside the layer scan: embedding, final norm, lm_head."""
    return eqx.tree_at(lambda m: (m.embed, m.norm, m.lm_head), model,
                       (_gather(model.embed, specs.embed), _gather(model.norm, specs.norm),
                        _gather(model.lm_head, specs.lm_head)))


def gathered(model: OLMo3, specs: PyTree) -> tuple[OLMo3, Callable[[Layer], Layer]]:
    """Inside a shard_map: the model with its top-level weights whole, and the per-layer gather
    to pass as `model.hidden(gather=...)`. For losses written outside this module (olmo3/dpo.py)."""
    return _gather_top(model, specs), lambda layer: _gather_layer(layer, specs.layers)


def make_grad_fn(mesh: Mesh, specs: PyTree, *, microbatches: int = 1, chunk: int = 1024,
                 z_loss: float = Z_LOSS, use_segments: bool = False) -> Callable:
    """`grad_fn(model, batch) -> (grads, ce_mean, z_mean)` for `olmo3.step.make_train_step`.

    `model` arrays are sharded by `specs` (`param_specs`), the batch rows over ('data', 'fsdp')
    (`global_batch`). Returned grads are fp32, sharded like the params; ce/z are the means over
    the counted tokens of the whole global batch (replicated scalars). `microbatches` splits each
    device's rows (see `microbatches()` to derive it from the recipe's global batch)."""
    def grad_fn(model: OLMo3, batch: dict):
        params, static = eqx.partition(model, eqx.is_inexact_array)
        batch_specs = {k: ROWS for k in batch}

        def local(params, batch):   # one device: its weight shards and its rows of the batch
            rows = batch["tokens"].shape[0]
            if rows % microbatches:
                raise ValueError(f"{rows} rows per device do not split into microbatches="
                                 f"{microbatches}; derive it with olmo3.sharding.microbatches()")
            # Global loss denominator: counted tokens of the WHOLE batch (DESIGN §4, bug 4).
            counted = labels_and_weights(batch["tokens"], batch["instance_mask"], batch.get("label_mask"))[2]
            n = jnp.maximum(jax.lax.psum(jnp.sum(counted), (DATA, FSDP)), 1.0)

            def objective(p, mb):
                m = _gather_top(eqx.combine(p, static), specs)
                ce, z, _ = loss_sums(m, mb, chunk=chunk, use_segments=use_segments,
                                     gather=lambda layer: _gather_layer(layer, specs.layers),
                                     z_loss=z_loss)
                return (ce + z_loss * z) / n, (ce, z)

            def body(carry, mb):   # gradient accumulation over this device's microbatches
                g_acc, ce_acc, z_acc = carry
                g, (ce, z) = jax.grad(objective, has_aux=True)(params, mb)
                g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
                return (g_acc, ce_acc + ce, z_acc + z), None

            if microbatches == 1:  # no accumulator: saves a zero-fill and an add per weight
                grads, (ce, z) = jax.grad(objective, has_aux=True)(params, batch)
                grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
            else:
                split = jax.tree.map(lambda x: x.reshape(microbatches, -1, *x.shape[1:]), batch)
                zeros = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)
                zero = jnp.zeros((), jnp.float32)
                (grads, ce, z), _ = jax.lax.scan(body, (zeros, zero, zero), split)
            # grads are already reduce-scattered over fsdp (transpose of the all_gathers);
            # sum the data replicas' shards (a copy of every gradient even on one replica: skip
            # it there). Loss sums over every device.
            if mesh.shape[DATA] > 1:
                grads = jax.lax.psum(grads, DATA)
            ce, z = jax.lax.psum((ce, z), (DATA, FSDP))
            return grads, ce / n, z / n

        # check_vma=False: every collective of the step is the explicit one written above.
        # With the check on, shard_map would broadcast the data-invariant weights implicitly and
        # transpose that into an all-reduce over 'data' of each FULL gathered weight gradient,
        # per layer and microbatch (and every scan carry in the model would need annotating).
        return jax.shard_map(local, mesh=mesh, in_specs=(specs, batch_specs),
                             out_specs=(specs, P(), P()), check_vma=False)(params, batch)

    return grad_fn


def make_eval_fn(mesh: Mesh, specs: PyTree, *, chunk: int = 1024, use_segments: bool = False):
    """`eval_fn(model, batch) -> (CE sum, counted tokens)` over the whole global batch, jitted;
    same gathers as the gradient, no backward pass (held-out evaluation)."""
    def local(params, batch, static):
        model = _gather_top(eqx.combine(params, static), specs)
        ce, _, n = loss_sums(model, batch, chunk=chunk, use_segments=use_segments,
                             gather=lambda layer: _gather_layer(layer, specs.layers), z_loss=None)
        return jax.lax.psum((ce, n), (DATA, FSDP))

    @eqx.filter_jit
    def eval_fn(model: OLMo3, batch: dict):
        params, static = eqx.partition(model, eqx.is_inexact_array)
        return jax.shard_map(lambda p, b: local(p, b, static), mesh=mesh,
                             in_specs=(specs, {k: ROWS for k in batch}), out_specs=(P(), P()),
                             check_vma=False)(params, batch)

    return eval_fn


def make_score_fn(mesh: Mesh, specs: PyTree):
    """`score_fn(model, batch) -> per-row (continuation log-likelihood, choice log-probs)` of
    olmo3.scoring.continuation_scores, as numpy arrays on every process. `batch` holds the WHOLE
    batch's rows (numpy, identical on every process: OLMo's in-loop requests are read by each);
    process p keeps its slice, rows are split over every device like held-out evaluation (same
    per-layer gathers), and the per-row results are gathered back, nothing summed."""
    from jax.experimental import multihost_utils

    from olmo3.scoring import continuation_scores

    def local(params, batch, static):
        model = _gather_top(eqx.combine(params, static), specs)
        return continuation_scores(model, batch, gather=lambda layer: _gather_layer(layer, specs.layers))

    @eqx.filter_jit
    def sharded(model: OLMo3, batch: dict):
        params, static = eqx.partition(model, eqx.is_inexact_array)
        return jax.shard_map(lambda p, b: local(p, b, static), mesh=mesh,
                             in_specs=(specs, {k: ROWS for k in batch}), out_specs=(ROWS, ROWS),
                             check_vma=False)(params, batch)

    def score_fn(model: OLMo3, batch: dict):
        n, rank = jax.process_count(), jax.process_index()
        rows = len(batch["tokens"]) // n
        mine = {k: v[rank * rows:(rank + 1) * rows] for k, v in batch.items()}
        out = sharded(model, global_batch(mine, mesh))
        if n == 1:
            return tuple(np.asarray(x) for x in out)
        return tuple(np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in out)

    return score_fn


class _Pinned:
    """The optimizer with its outputs constrained to the state's shardings: the elementwise
    AdamW update keeps the params' sharding anyway, this makes it a guarantee (donated buffers
    are reused, and the next step sees the same input shardings, so no recompile)."""

    def __init__(self, optimizer, mesh: Mesh, specs: PyTree):
        self.optimizer, self.mesh, self.specs = optimizer, mesh, specs

    def update(self, grads, opt_state, params, loss):
        params, opt_state, metrics = self.optimizer.update(grads, opt_state, params, loss)
        pin = lambda tree, specs: jax.lax.with_sharding_constraint(tree, _named(specs, self.mesh))  # noqa: E731
        arrays, static = eqx.partition(params, eqx.is_inexact_array)
        params = eqx.combine(pin(arrays, self.specs), static)
        return params, pin(opt_state, opt_specs(opt_state, self.specs)), metrics


def pinned(optimizer, mesh: Mesh, specs: PyTree):
    """`optimizer` with its outputs pinned to the state's shardings (for train steps built
    outside this module, e.g. olmo3/dpo.py)."""
    return _Pinned(optimizer, mesh, specs)


def make_train_step(optimizer, mesh: Mesh, specs: PyTree, *, microbatches: int = 1,
                    chunk: int = 1024, z_loss: float = Z_LOSS, use_segments: bool = False):
    """`olmo3.step.make_train_step` with the shard_map gradient and the optimizer update pinned
    to the state's shardings (plain jit on the sharded arrays, outside the shard_map)."""
    grad_fn = make_grad_fn(mesh, specs, microbatches=microbatches, chunk=chunk, z_loss=z_loss,
                           use_segments=use_segments)
    return step_lib.make_train_step(_Pinned(optimizer, mesh, specs), z_loss=z_loss,
                                    grad_fn=grad_fn)


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------
def microbatches(global_batch: int, micro_batch_per_device: Optional[int], mesh: Mesh) -> int:
    """Gradient-accumulation steps for a recipe global batch on this mesh.

    The global batch (instances per optimizer step) is the recipe constant; rows per device =
    global_batch / n_devices, split into microbatches of `micro_batch_per_device` rows. Losing
    devices raises the microbatch count, never changes the math (DESIGN §4, bug 4).
    None: the whole per-device batch in one microbatch."""
    n = mesh.size   # GLOBAL device count: every process's devices
    if micro_batch_per_device is None:
        micro_batch_per_device = max(global_batch // n, 1)
    if global_batch < 1 or micro_batch_per_device < 1:
        raise ValueError(f"global_batch={global_batch} and micro_batch_per_device="
                         f"{micro_batch_per_device} must be positive")
    if global_batch % n:
        raise ValueError(f"global batch {global_batch} is not divisible by the {n} global devices "
                         f"of the mesh {dict(mesh.shape)}; the global batch is a recipe constant, "
                         "so run on a device count that divides it")
    per_device = global_batch // n
    if per_device % micro_batch_per_device:
        raise ValueError(f"{per_device} rows per device (global batch {global_batch} / {n} "
                         f"devices) are not divisible by micro_batch_per_device="
                         f"{micro_batch_per_device}; choose a divisor of {per_device}")
    return per_device // micro_batch_per_device


def global_batch(local_batch: dict, mesh: Mesh) -> dict:
    """One global jax.Array per numpy field of this process's rows (other fields, e.g. the
    loader's "step" int, are left out), rows split over ('data', 'fsdp').

    Process p passes rows [p * L, (p + 1) * L) of the global batch (data rank =
    jax.process_index(), num ranks = jax.process_count()); they land on its own devices. With
    jax.make_mesh's device order (grouped by process) the global array is the global batch in
    order; a topology-permuted mesh only permutes rows, which no loss sum can see."""
    sharding = NamedSharding(mesh, ROWS)
    n_local = len(mesh.local_devices)
    out = {}
    for key, value in local_batch.items():
        if not isinstance(value, np.ndarray):
            continue
        if value.ndim == 0 or value.shape[0] % n_local:
            raise ValueError(f"batch field {key!r} has shape {value.shape} on process "
                             f"{jax.process_index()}: its rows must split evenly over the "
                             f"{n_local} local devices; the local batch is global_batch / "
                             f"process_count rows")
        out[key] = jax.make_array_from_process_local_data(sharding, value)
    return out


# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------
def initialize_distributed(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
                           process_id: Optional[int] = None, *,
                           independent_runs: bool = False) -> tuple[int, int]:
    """Start JAX's multi-controller runtime when launched as several processes; returns the data
    rank and rank count (jax.process_index(), jax.process_count()).

    Several processes means: flags (coordinator "host:port", num_processes > 1, process_id), or
    the environment JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (each flag wins
    over its variable), or a cluster engine that `jax.distributed.initialize()` detects by
    itself (SLURM's srun, Open MPI's mpirun, Cloud TPU, Kubernetes; olmo3/cluster.py). An
    environment that announces several processes JAX cannot join raises cluster.ClusterError
    (a ValueError), unless `independent_runs`. Must run before any other JAX call; scripts call
    `cluster.start`, which adds the guard against silent replicas and the first log line."""
    from olmo3 import cluster
    cluster.initialize(coordinator, num_processes, process_id, independent_runs=independent_runs)
    return jax.process_index(), jax.process_count()


# --------------------------------------------------------------------------------------------
# Memory report
# --------------------------------------------------------------------------------------------
def memory_report(config: Config, n_devices: int, data: int = 1) -> dict:
    """Per-device bytes of params and optimizer state (fp32 mu, nu and replicated scalars) on a
    ('data', 'fsdp') = (data, n_devices / data) mesh, from abstract shapes (no allocation)."""
    from olmo3.optim import SkipStepAdamW
    if n_devices % data:
        raise ValueError(f"data={data} does not divide n_devices={n_devices}")
    fsdp = n_devices // data
    model = eqx.filter_eval_shape(OLMo3, config, jax.random.key(0))
    opt = eqx.filter_eval_shape(SkipStepAdamW(lambda s: 0.0).init, model)
    specs = param_specs(model, fsdp)

    def local_bytes(x, spec):
        shape = list(x.shape)
        if spec is not None and FSDP in spec:
            shape[_fsdp_axis(spec)] //= fsdp
        return int(np.prod(shape)) * jnp.dtype(x.dtype).itemsize

    def total(tree, spec_tree):
        return sum(jax.tree.leaves(jax.tree.map(local_bytes, tree, spec_tree,
                                                is_leaf=lambda s: isinstance(s, P))))

    params = total(eqx.filter(model, _is_float), specs)
    ospecs = opt_specs(opt, specs)
    optim = total(opt, ospecs)
    # Transient, not in the totals: the full weights a device holds while it computes, i.e. the
    # top-level ones (gathered once per microbatch) plus one layer (gathered inside the scan).
    itemsize = jnp.dtype(config.pdtype).itemsize
    gathered = (config.params_per_layer() + 2 * config.vocab_size * config.d_model
                + config.d_model) * itemsize
    return {"n_devices": n_devices, "fsdp": fsdp, "data": data,
            "params": config.num_params(), "param_bytes": params, "opt_bytes": optim,
            "total_bytes": params + optim, "gathered_bytes": gathered}


def _main(argv: Optional[list] = None) -> None:
    import argparse
    ap = argparse.ArgumentParser(description="Per-device param + optimizer memory under FSDP.")
    ap.add_argument("--preset", default="olmo3_7b", choices=Config.PRESETS)
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 128, 512])
    args = ap.parse_args(argv)
    cfg = Config.preset(args.preset)
    print(f"{args.preset}: {cfg.num_params():,} params, param_dtype {cfg.param_dtype}, "
          "AdamW mu+nu fp32, pure FSDP")
    print(f"{'devices':>8} {'params/device':>30} {'optimizer/device':>30} {'total/device':>30}")
    for n in args.devices:
        r = memory_report(cfg, n)
        cell = lambda b: f"{b:,} B ({b / 2**30:.3f} GiB)"  # noqa: E731
        print(f"{n:>8} {cell(r['param_bytes']):>30} {cell(r['opt_bytes']):>30} "
              f"{cell(r['total_bytes']):>30}")
    print(f"plus, transient on every device during the step: at least {cell(r['gathered_bytes'])} of "
          "gathered full weights (embedding + lm_head + final norm + one layer)")

if __name__ == "__main__":
    _main()
