"""Explicit FSDP x data-parallel x context-parallel partitioning under `jax.shard_map` (DESIGN §6;
the JAX shard_map guide's FSDP section; Llama 3 paper §3.3.2 for the context axis).

The mesh has two axes, ('data', 'fsdp'), or three with `--mesh=...,context:C`:

    params, mu, nu   every weight sharded on ONE axis over 'fsdp' (x 'context'), replicated over
                     'data'
    batch rows       split over ('data', 'fsdp'): every device holds global_batch / (data x fsdp)
                     rows; with a context axis each row's sequence is split over it as well
    one step         for each microbatch, for each layer in the scan: all_gather that layer's
                     weights over 'fsdp', run it, drop it; the backward pass recomputes the gather
                     and its transpose hands back the gradient already reduce-scattered over
                     'fsdp'. Weights cross the wire as the model computes with them (`_wire`:
                     float8 linears as float8 bytes, every other weight in the compute dtype;
                     OLMo-core's FSDP param_dtype=bf16), gradients are reduce-scattered
                     in fp32 (its reduce_dtype). After the last microbatch the shard gradients
                     are psummed over 'data' (replicas) once. The loss denominator is the psum
                     of counted tokens over every device, so the math is that of one device
                     holding the whole batch.
    optimizer        plain jit on the sharded arrays, OUTSIDE the shard_map: skip-step AdamW needs
                     a global grad norm, which jit gets right on global arrays; its elementwise
                     update keeps the params' sharding (the step pins it, see `make_train_step`).

The model math never relies on XLA's automatic sharding: every collective of the forward and
backward pass is written here. Pure FSDP (data=1) was as fast as FSDP x DP at 128 devices in the
write-up (DESIGN §6), hence the default: every device on 'fsdp'.

Context parallelism (stage 3: 65,536-token instances, OLMo-core `llama3(degree=8,
head_stride=4)`, one instance per context group):

    layout      the sequence is cut into 2C chunks; rank r holds chunks r and 2C-1-r (an early
                and a late one, so every rank does the same causal work), built on the host by
                `global_batch`: tokens, next-token labels (shifted on the whole row first),
                global positions (RoPE) and segment ids all follow their tokens
    attention   in every layer, for each group of head_stride K/V heads: all_gather the group's
                K and V (and, once per row, the segment ids) over 'context', restore position
                order, and attend each local query chunk at its global offset against the whole
                K/V (causal, window and document masks from global positions:
                attention.chunk_attention, or splash with a static offset per rank). The
                gather's transpose reduce-scatters dK, dV back to the ranks that own the tokens
    weights     split over fsdp x context (as OLMo-core's FSDP shards over dp_shard x cp), so
                the per-layer gather's transpose reduces the gradients over both axes
    loss        CE and token counts are psummed over data x fsdp x context

Why all-gather K/V and not ring attention: the Llama 3 paper (§3.3.2) chose it because any mask
(document masks, here also sliding windows) is easy when a rank holds the whole K/V, and because
GQA made its K/V much smaller than Q. The OLMo 3 7B is MHA, so the bound comes from head_stride
instead: only one group of 4 K/V heads is gathered at a time (128 MiB in bf16 at seq 65,536,
against ~23 GiB of saved activations per rank, `python -m olmo3.sharding`), and every attention
kernel runs unchanged on a query chunk at an offset; GQA variants gather proportionally less.
OLMo-core's own llama3 load balancer hands each rank one contiguous slice (ring-flash-attn's
varlen kernel, head_stride K/V heads gathered at a time); our two-chunk layout is the paper's,
and the loss and gradients do not depend on which rank holds which token (with --float8
they do: each rank scales its activations by its own tokens' maximum, olmo3/float8.py).

Topology independence (DESIGN §4, bug 4): the global batch is a recipe constant; the per-device
batch and the number of microbatches are derived from it and the GLOBAL device count
(`microbatches`), and a checkpoint is restored onto any mesh from `abstract_state`.

Run `python -m olmo3.sharding` for the per-device memory of the 7B at 128 and 512 devices, and
of the stage-3 7B with and without context:8.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import PyTree

from olmo3 import step as step_lib
from olmo3.config import Config
from olmo3 import attention, float8
from olmo3 import model as model_lib
from olmo3.loss import IGNORE, chunked_cross_entropy, labels_and_weights, loss_weights
from olmo3.model import Layer, OLMo3
from olmo3.step import Z_LOSS, loss_sums

DATA, FSDP, CONTEXT = "data", "fsdp", "context"
ROWS = P((DATA, FSDP))  # leading (batch) axis split over data x fsdp (and replicated over context)
TOKENS = P((DATA, FSDP), CONTEXT)  # [rows, seq] fields under context parallelism
# K/V heads gathered at a time inside attention (OLMo-core OLMo-3-1025-7B-long-context.py:
# `TransformerContextParallelConfig.llama3(degree=8, head_stride=4)`).
HEAD_STRIDE = 4


def kv_group(head_stride: int, n_kv_heads: int) -> int:
    """K/V heads gathered at a time: the largest divisor of n_kv_heads not above head_stride, so
    that every --n_kv_heads runs under context parallelism (6 heads at stride 4: 3 at a time)."""
    return max(d for d in range(1, min(head_stride, n_kv_heads) + 1) if n_kv_heads % d == 0)


# --------------------------------------------------------------------------------------------
# Mesh
# --------------------------------------------------------------------------------------------
def make_mesh(spec: Optional[str] = None, devices: Optional[list] = None) -> Mesh:
    """A ('data', 'fsdp') mesh over all global devices (every process's), from a flag value;
    ('data', 'fsdp', 'context') when the spec names a context axis.

    `spec` is "fsdp:N,data:M,context:C" in any order; of data and fsdp one may be left out and
    takes the rest of the devices; None or "" puts every device on fsdp (pure FSDP)."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    sizes: dict[str, int] = {}
    for part in (spec or "").replace(" ", "").split(","):
        if not part:
            continue
        name, sep, value = part.partition(":")
        if not sep or name not in (DATA, FSDP, CONTEXT) or not (value.isascii() and value.isdigit()) or int(value) < 1:
            raise ValueError(f"--mesh={spec!r}: each entry must be 'fsdp:N' or 'data:M' (or "
                             f"'context:C') with a positive integer, e.g. --mesh=fsdp:{n},data:1")
        if name in sizes:
            raise ValueError(f"--mesh={spec!r}: axis {name!r} given twice")
        sizes[name] = int(value)
    given = int(np.prod(list(sizes.values()))) if sizes else 1
    if n % given:
        raise ValueError(f"--mesh={spec!r}: {given} does not divide the {n} global devices "
                         f"({jax.process_count()} process(es)); choose sizes whose product is {n}")
    context = sizes.pop(CONTEXT, None)
    rows = n // (context or 1)     # devices that hold different rows: data x fsdp
    # An axis left out takes the remaining devices (fsdp first: pure FSDP by default).
    if FSDP not in sizes:
        sizes[FSDP] = rows // sizes.get(DATA, 1)
    if DATA not in sizes:
        sizes[DATA] = rows // sizes[FSDP]
    if sizes[DATA] * sizes[FSDP] * (context or 1) != n:
        with_context = f" x context:{context}" if context else ""
        raise ValueError(f"--mesh={spec!r}: data:{sizes[DATA]} x fsdp:{sizes[FSDP]}{with_context} = "
                         f"{sizes[DATA] * sizes[FSDP] * (context or 1)} devices, but there are {n} "
                         f"global devices ({jax.process_count()} process(es)); make the product {n}")
    # Auto axes: outside shard_map (the optimizer) shardings simply follow the inputs.
    if context is None:
        return jax.make_mesh((sizes[DATA], sizes[FSDP]), (DATA, FSDP),
                             axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)
    # context last: a context group is neighbouring devices (one node's fast links).
    return jax.make_mesh((sizes[DATA], sizes[FSDP], context), (DATA, FSDP, CONTEXT),
                         axis_types=(AxisType.Auto,) * 3, devices=devices)


def context_size(mesh: Mesh) -> int:
    """C of the mesh's context axis (1 without one)."""
    return mesh.shape.get(CONTEXT, 1)


def check_context(mesh: Mesh, seq_len: int) -> None:
    """The sequence must cut into 2 x C equal chunks (each context rank holds two), and every
    context group must lie within one process: each process loads whole instances (global_batch),
    so one whose devices hold only some of a group's chunks has no rows of its own."""
    C = context_size(mesh)
    if C > 1:
        groups = np.moveaxis(mesh.devices, mesh.axis_names.index(CONTEXT), -1).reshape(-1, C)
        for group in groups:
            procs = sorted({d.process_index for d in group})
            if len(procs) > 1:
                per_process = sum(d.process_index == procs[0] for d in mesh.devices.flat)
                raise ValueError(f"--mesh context:{C}: a context group spans processes {procs}, each with "
                                 f"{per_process} devices; every process loads whole instances, so a context "
                                 f"group must lie within one: choose a context size that divides {per_process}")
    if CONTEXT in mesh.axis_names and seq_len % (2 * C):
        raise ValueError(f"--seq_len={seq_len} is not divisible by 2 x context = {2 * C}: "
                         f"context parallelism cuts every instance into {2 * C} equal chunks; "
                         f"choose a --seq_len that is a multiple of {2 * C} or a smaller context")


def _fsdp_size(mesh_or_size: Union[Mesh, int]) -> int:
    """Devices a weight is split over: fsdp (x context: OLMo-core shards over dp_shard x cp)."""
    if isinstance(mesh_or_size, Mesh):
        return mesh_or_size.shape[FSDP] * context_size(mesh_or_size)
    return int(mesh_or_size)


def _shard_axes(mesh_or_size: Union[Mesh, int]):
    """The mesh axis name(s) a weight's sharded dimension is split over."""
    if isinstance(mesh_or_size, Mesh) and CONTEXT in mesh_or_size.axis_names:
        return (FSDP, CONTEXT)
    return FSDP


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
    fsdp, axes_name = _fsdp_size(mesh_or_fsdp), _shard_axes(mesh_or_fsdp)

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
        return P(*[axes_name if a == best else None for a in range(x.ndim)])

    return jax.tree_util.tree_map_with_path(spec, eqx.filter(model, _is_float))


def _is_float(x) -> bool:
    """A float array, concrete or abstract (ShapeDtypeStruct from eqx.filter_eval_shape)."""
    return ((isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))
             and jnp.issubdtype(x.dtype, jnp.inexact)))


def _fsdp_axis(spec: P) -> int:
    return next(a for a, e in enumerate(spec) if e == FSDP or (isinstance(e, tuple) and FSDP in e))


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
# Context parallelism: each rank holds two chunks of every sequence
# --------------------------------------------------------------------------------------------
def context_order(seq: int, context: int) -> np.ndarray:
    """The global positions in device order: the sequence cut into 2C chunks of seq / 2C, rank r
    holding chunks r and 2C - 1 - r (Llama 3 paper §3.3.2), so every rank's causal work (an
    early chunk + a late one) is the same. Rank r's tokens are order[r * seq/C:(r + 1) * seq/C]."""
    c = seq // (2 * context)
    chunks = np.arange(seq).reshape(2 * context, c)
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * context - 1 - r]])
                           for r in range(context)])


def _natural(x: jax.Array, context: int, axis: int) -> jax.Array:
    """Undo `context_order` along `axis` of an all-gathered (rank-major) array: x[..., order]
    -> x in position order, by slicing (rank r's first chunk is chunk r, its second 2C-1-r)."""
    x = jnp.moveaxis(x, axis, 0)
    pieces = x.reshape(context, 2, x.shape[0] // (2 * context), *x.shape[1:])  # (C, 2, c, ...)
    early, late = pieces[:, 0], pieces[::-1, 1]                     # chunks 0..C-1, C..2C-1
    out = jnp.concatenate([early, late]).reshape(x.shape)
    return jnp.moveaxis(out, 0, axis)


def _context_rows(batch: dict, context: int) -> dict:
    """Host side: this process's rows in context order, with what a chunk cannot compute alone.

    Next-token labels are shifted on the whole row first (a chunk's last target is the next
    chunk's first token) and the label mask folded in, as `olmo3.loss.labels_and_weights` does;
    "positions" carries every token's global position (RoPE, masks)."""
    tokens = batch["tokens"]
    B, T = tokens.shape
    if T % (2 * context):
        raise ValueError(f"--seq_len={T} is not divisible by 2 x context = {2 * context}: context "
                         f"parallelism cuts every instance into {2 * context} equal chunks; "
                         f"choose a --seq_len that is a multiple of {2 * context}")
    labels = np.concatenate([tokens[:, 1:], np.full((B, 1), IGNORE, tokens.dtype)], axis=1)
    if batch.get("label_mask") is not None:
        target_ok = np.concatenate([batch["label_mask"][:, 1:], np.zeros((B, 1), bool)], axis=1)
        labels = np.where(target_ok, labels, IGNORE)
    order = context_order(T, context)
    out = {"labels": labels[:, order].astype(np.int32),
           "positions": np.ascontiguousarray(np.broadcast_to(order.astype(np.int32), (B, T)))}
    for key, value in batch.items():
        if key == "label_mask" or not isinstance(value, np.ndarray):
            continue
        out[key] = value[:, order] if value.ndim == 2 else value
    return out


def _context_attention(cfg: Config, segment_ids: Optional[jax.Array], head_stride: int) -> Callable:
    """`attend(q, k, v, window=)` for one sequence chunk inside shard_map (model.layer_forward).

    q [H, T/C, hd], k, v [KV, T/C, hd] hold this rank's two chunks; `segment_ids` [T] the whole
    row's, in position order. For each group of `head_stride` K/V heads: all-gather the group's
    K/V over 'context' (the backward pass reduce-scatters their gradients), restore position
    order, and attend each of the two query chunks at its global offset."""
    C, rank = jax.lax.axis_size(CONTEXT), jax.lax.axis_index(CONTEXT)

    def chunks(q, k, v, window, offsets):
        c = q.shape[1] // 2
        return jnp.concatenate([
            attention.attention(q[:, i * c:(i + 1) * c], k, v, window=window,
                                segment_ids=segment_ids, impl=cfg.attention, q_offset=offset,
                                block_q=cfg.splash_block_q, block_kv=cfg.splash_block_kv)
            for i, offset in enumerate(offsets)], axis=1)

    def one_group(q, k, v, window):           # q [s*G, T/C, hd], k, v [s, T/C, hd]
        k, v = (_natural(jax.lax.all_gather(x, CONTEXT, axis=1, tiled=True), C, axis=1)
                for x in (k, v))              # (s, T, hd) in position order
        c = q.shape[1] // 2
        if cfg.attention == "xla":            # traced offsets: one program for every rank
            return chunks(q, k, v, window, (rank * c, (2 * C - 1 - rank) * c))
        # splash / cudnn build their block tables on the host: one branch per rank, static offsets
        return jax.lax.switch(rank, [functools.partial(chunks, window=window,
                                                       offsets=(r * c, (2 * C - 1 - r) * c))
                                     for r in range(C)], q, k, v)

    def attend(q, k, v, *, window):
        H, Tc, hd = q.shape
        KV = k.shape[0]
        s = kv_group(head_stride, KV)
        if KV == s:
            return one_group(q, k, v, window)
        groups = lambda x: x.reshape(KV // s, -1, Tc, hd)                   # (KV/s, s[*G], T/C, hd)
        out = jax.lax.map(lambda a: one_group(*a, window), (groups(q), groups(k), groups(v)))
        return out.reshape(H, Tc, hd)

    return attend


def _context_loss_sums(model: OLMo3, batch: dict, *, chunk: int, use_segments: bool,
                       gather: Callable, z_loss: Optional[float], head_stride: int):
    """`olmo3.step.loss_sums` on this rank's chunks of every row: (CE sum, lse^2 sum, counted)."""
    labels = batch["labels"]
    weights, counted = loss_weights(labels, batch["instance_mask"])
    C = jax.lax.axis_size(CONTEXT)
    segs = None
    if use_segments:   # whole rows, in position order: every chunk's keys need them
        segs = _natural(jax.lax.all_gather(batch["segment_ids"], CONTEXT, axis=1, tiled=True), C, 1)

    def one(t, pos, seg):
        return model.hidden(t, positions=pos, gather=gather,
                            attend=_context_attention(model.config, seg, head_stride))

    if use_segments:
        h = jax.vmap(one)(batch["tokens"], batch["positions"], segs)
    else:
        h = jax.vmap(lambda t, pos: one(t, pos, None))(batch["tokens"], batch["positions"])
    B, T, d = h.shape
    ce, z = chunked_cross_entropy(h.reshape(B * T, d), model.lm_head, labels.reshape(-1),
                                  weights.reshape(-1), chunk=chunk, z_loss=z_loss)
    return ce, z, jnp.sum(counted)


# --------------------------------------------------------------------------------------------
# The gradient under shard_map
# --------------------------------------------------------------------------------------------
def _wire(cfg: Config, name: str, shape: tuple[int, ...], dtype) -> Union[str, jnp.dtype, None]:
    """How the weight `name` (whole shape `shape`, stored as `dtype`) crosses the wire in the FSDP
    all-gather, losslessly for the model that uses it:
      "float8"      a float8 linear (model.uses_float8) as the e4m3 bytes and one scale that its
                    torchao cast makes from the whole fp32 weight: what torchao's
                    `enable_fsdp_float8_all_gather` sends, a quarter of an fp32 weight's bytes
      compute dtype every other weight (projections, embedding, lm_head, norms), which the model
                    casts to the compute dtype before any use (model.rms_norm too): OLMo-core's
                    FSDP `param_dtype=bfloat16` gathers these in bf16, half an fp32 weight's bytes
      None          whatever is stored in the compute dtype already: as it is
    XLA's CPU backend widens bf16 collectives back to fp32 (its float normalization); GPUs (NCCL
    bf16) and TPUs gather them as given. Float8 travels as uint8 bytes everywhere.
    """
    if model_lib.uses_float8(cfg, name, shape):
        return "float8"
    if jnp.dtype(cfg.dtype).itemsize < jnp.dtype(dtype).itemsize:
        return jnp.dtype(cfg.dtype)
    return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _all_gather_as(x: jax.Array, names, axis: int, wire) -> jax.Array:
    """all_gather(x over `names`, tiled on `axis`) whose bytes travel as `wire` (see `_wire`) and
    arrive back in x's dtype, holding exactly the values the model then computes with. The
    gradient is reduce-scattered in x's dtype, as OLMo-core's `reduce_dtype=float32` does: the
    cast is straight-through there (torchao's float8 cast is too), the same gradient as
    gathering x itself."""
    if wire == "float8":
        amax = jax.lax.pmax(jnp.max(jnp.abs(x)), names)      # the whole weight's maximum
        q, s = float8.quantize(x, float8.E4M3, amax=amax, pow2=False)
        # As bytes: a collective of a float8 type need not exist on every backend.
        q = jax.lax.bitcast_convert_type(
            jax.lax.all_gather(jax.lax.bitcast_convert_type(q, jnp.uint8), names, axis=axis,
                               tiled=True), float8.E4M3)
        # What arrives is q / s, except that an entry float8 saturated (|q| = 448, the entries
        # that reached the whole weight's maximum) arrives as +-amax: float8.linear, recasting
        # it, then finds this amax, so this scale, and these float8 values (q / s times s is q
        # to an fp32 ulp, far from any float8 rounding boundary). Plain q / s would hand it the
        # amax 448 x (1 / s) rounded, hence a scale a few ulps off, and the outputs would differ
        # from one device's in the last bit. The forward and backward of the layer are those of
        # a weight cast from the whole fp32 tensor on one device, bit for bit.
        top = float(jnp.finfo(float8.E4M3).max)
        d = float8.dequantize(q, s, x.dtype)
        return jnp.where(jnp.abs(q.astype(jnp.float32)) == top, jnp.sign(d) * amax.astype(x.dtype), d)
    return jax.lax.all_gather(x.astype(wire), names, axis=axis, tiled=True).astype(x.dtype)


def _all_gather_as_fwd(x, names, axis, wire):
    return _all_gather_as(x, names, axis, wire), None


def _all_gather_as_bwd(names, axis, wire, _, g):
    return (jax.lax.psum_scatter(g, names, scatter_dimension=axis, tiled=True),)


_all_gather_as.defvjp(_all_gather_as_fwd, _all_gather_as_bwd)


def _gather(x: jax.Array, spec: P, axis_offset: int, cfg: Config, name: str) -> jax.Array:
    """This device's shard of the weight `name` -> the full weight, its bytes sent as `_wire`
    says. Its transpose (in the backward pass) is a reduce-scatter: each device receives the
    fsdp-summed gradient of its own shard only."""
    axis = _fsdp_axis(spec)
    n = jax.lax.axis_size(spec[axis])
    if n == 1:   # nothing to gather: XLA would still copy the weight
        return x
    shape = tuple(d * n if i == axis - axis_offset else d for i, d in enumerate(x.shape))
    wire = _wire(cfg, name, shape, x.dtype)
    if wire is None:
        return jax.lax.all_gather(x, spec[axis], axis=axis - axis_offset, tiled=True)
    return _all_gather_as(x, spec[axis], axis - axis_offset, wire)


def _gather_layer(layer: Layer, layer_specs: Layer, cfg: Config) -> Layer:
    """ONE layer's weights (the stacked layer axis already indexed away by the scan), called by
    model.hidden inside the scanned body: only one layer is ever whole on a device."""
    names = [f.name for f in dataclasses.fields(Layer)]
    return Layer(**{k: _gather(getattr(layer, k), getattr(layer_specs, k), 1, cfg, k) for k in names})


def _gather_top(model: OLMo3, specs: PyTree) -> OLMo3:
    """The weights used outside the layer scan: embedding, final norm, lm_head."""
    names = ("embed", "norm", "lm_head")
    return eqx.tree_at(lambda m: (m.embed, m.norm, m.lm_head), model,
                       tuple(_gather(getattr(model, k), getattr(specs, k), 0, model.config, k) for k in names))


def gathered(model: OLMo3, specs: PyTree) -> tuple[OLMo3, Callable[[Layer], Layer]]:
    """Inside a shard_map: the model with its top-level weights whole, and the per-layer gather
    to pass as `model.hidden(gather=...)`. For every loss (here and olmo3/dpo.py)."""
    cfg = model.config
    return _gather_top(model, specs), lambda layer: _gather_layer(layer, specs.layers, cfg)


def _batch_specs(batch: dict, mesh: Mesh) -> dict:
    """Rows over ('data', 'fsdp'); with a context axis, [rows, seq] fields also seq over it."""
    cp = CONTEXT in mesh.axis_names
    return {k: TOKENS if cp and v.ndim == 2 else ROWS for k, v in batch.items()}


def _loss_fn(mesh: Mesh, *, chunk: int, use_segments: bool, head_stride: int) -> tuple[Callable, Callable, tuple]:
    """(loss_sums(model, batch, gather, z_loss), counted(batch), the axes every sum runs over)
    for this mesh: the whole rows, or this rank's chunks of them under context parallelism."""
    if CONTEXT in mesh.axis_names:
        sums = functools.partial(_context_loss_sums, chunk=chunk, use_segments=use_segments,
                                 head_stride=head_stride)
        return sums, lambda b: loss_weights(b["labels"], b["instance_mask"])[1], (DATA, FSDP, CONTEXT)
    sums = functools.partial(loss_sums, chunk=chunk, use_segments=use_segments)
    counted = lambda b: labels_and_weights(b["tokens"], b["instance_mask"], b.get("label_mask"))[2]  # noqa: E731
    return sums, counted, (DATA, FSDP)


def make_grad_fn(mesh: Mesh, specs: PyTree, *, microbatches: int = 1, chunk: int = 1024,
                 z_loss: float = Z_LOSS, use_segments: bool = False,
                 head_stride: int = HEAD_STRIDE) -> Callable:
    """`grad_fn(model, batch) -> (grads, ce_mean, z_mean)` for `olmo3.step.make_train_step`.

    `model` arrays are sharded by `specs` (`param_specs`), the batch rows over ('data', 'fsdp')
    (`global_batch`). Returned grads are fp32, sharded like the params; ce/z are the means over
    the counted tokens of the whole global batch (replicated scalars). `microbatches` splits each
    device's rows (see `microbatches()` to derive it from the recipe's global batch)."""
    sums, count, every_axis = _loss_fn(mesh, chunk=chunk, use_segments=use_segments,
                                       head_stride=head_stride)

    def grad_fn(model: OLMo3, batch: dict):
        params, static = eqx.partition(model, eqx.is_inexact_array)

        def local(params, batch):   # one device: its weight shards and its rows of the batch
            rows = batch["tokens"].shape[0]
            if rows % microbatches:
                raise ValueError(f"{rows} rows per device do not split into microbatches="
                                 f"{microbatches}; derive it with olmo3.sharding.microbatches()")
            # Global loss denominator: counted tokens of the WHOLE batch (DESIGN §4, bug 4).
            n = jnp.maximum(jax.lax.psum(jnp.sum(count(batch)), every_axis), 1.0)

            def objective(p, mb):
                m, gather = gathered(eqx.combine(p, static), specs)
                ce, z, _ = sums(m, mb, gather=gather, z_loss=z_loss)
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
            # grads are already reduce-scattered over fsdp (x context): the transpose of the
            # all_gathers; sum the data replicas' shards (a copy of every gradient even on one
            # replica: skip it there). Loss sums over every device.
            if mesh.shape[DATA] > 1:
                grads = jax.lax.psum(grads, DATA)
            ce, z = jax.lax.psum((ce, z), every_axis)
            return grads, ce / n, z / n

        # check_vma=False: every collective of the step is the explicit one written above.
        # With the check on, shard_map would broadcast the data-invariant weights implicitly and
        # transpose that into an all-reduce over 'data' of each FULL gathered weight gradient,
        # per layer and microbatch (and every scan carry in the model would need annotating).
        return jax.shard_map(local, mesh=mesh, in_specs=(specs, _batch_specs(batch, mesh)),
                             out_specs=(specs, P(), P()), check_vma=False)(params, batch)

    return grad_fn


def make_eval_fn(mesh: Mesh, specs: PyTree, *, chunk: int = 1024, use_segments: bool = False,
                 head_stride: int = HEAD_STRIDE, micro_rows: Optional[int] = None):
    """`eval_fn(model, batch) -> (CE sum, counted tokens)` over the whole global batch, jitted;
    same gathers as the gradient, no backward pass (held-out evaluation). `micro_rows`: each
    device runs its rows at most this many at a time (the largest divisor of its rows that is
    not above it), so an evaluation never holds more activations than a training microbatch of
    that size; the sums are the same."""
    sums, _, every_axis = _loss_fn(mesh, chunk=chunk, use_segments=use_segments,
                                   head_stride=head_stride)

    def local(params, batch, static):
        model, gather = gathered(eqx.combine(params, static), specs)

        def one(mb):
            ce, _, n = sums(model, mb, gather=gather, z_loss=None)
            return ce, n

        rows = batch["tokens"].shape[0]
        k = max(d for d in range(1, min(rows, micro_rows or rows) + 1) if rows % d == 0)
        if k == rows:
            ce, n = one(batch)
        else:   # rows / k pieces of k rows, summed in order
            split = jax.tree.map(lambda x: x.reshape(rows // k, k, *x.shape[1:]), batch)
            ce, n = jax.lax.map(one, split)
            ce, n = jnp.sum(ce), jnp.sum(n)
        return jax.lax.psum((ce, n), every_axis)

    @eqx.filter_jit
    def eval_fn(model: OLMo3, batch: dict):
        params, static = eqx.partition(model, eqx.is_inexact_array)
        return jax.shard_map(lambda p, b: local(p, b, static), mesh=mesh,
                             in_specs=(specs, _batch_specs(batch, mesh)), out_specs=(P(), P()),
                             check_vma=False)(params, batch)

    return eval_fn


def make_score_fn(mesh: Mesh, specs: PyTree):
    """`score_fn(model, batch) -> per-row (continuation log-likelihood, choice log-probs)` of
    olmo3.scoring.continuation_scores, as numpy arrays on every process. `batch` holds the WHOLE
    batch's rows (numpy, identical on every process: OLMo's in-loop requests are read by each);
    rows are split over every device like held-out evaluation (same per-layer gathers,
    `whole_batch`), and the per-row results are gathered back in row order, nothing summed. With a context
    axis the ranks of a context group score the same whole rows (requests are short)."""
    from jax.experimental import multihost_utils

    from olmo3.scoring import continuation_scores

    def local(params, batch, static):
        model, gather = gathered(eqx.combine(params, static), specs)
        return continuation_scores(model, batch, gather=gather)

    @eqx.filter_jit
    def sharded(model: OLMo3, batch: dict):
        params, static = eqx.partition(model, eqx.is_inexact_array)
        return jax.shard_map(lambda p, b: local(p, b, static), mesh=mesh,
                             in_specs=(specs, {k: ROWS for k in batch}), out_specs=(ROWS, ROWS),
                             check_vma=False)(params, batch)

    def score_fn(model: OLMo3, batch: dict):
        out = sharded(model, whole_batch(batch, mesh))
        if jax.process_count() == 1:
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
                    chunk: int = 1024, z_loss: float = Z_LOSS, use_segments: bool = False,
                    head_stride: int = HEAD_STRIDE):
    """`olmo3.step.make_train_step` with the shard_map gradient and the optimizer update pinned
    to the state's shardings (plain jit on the sharded arrays, outside the shard_map)."""
    grad_fn = make_grad_fn(mesh, specs, microbatches=microbatches, chunk=chunk, z_loss=z_loss,
                           use_segments=use_segments, head_stride=head_stride)
    return step_lib.make_train_step(_Pinned(optimizer, mesh, specs), z_loss=z_loss,
                                    grad_fn=grad_fn)


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------
def microbatches(global_batch: int, micro_batch_per_device: Optional[int], mesh: Mesh, *,
                 flags: tuple[str, str] = ("--global_batch", "--micro_batch")) -> int:
    """Gradient-accumulation steps for a recipe global batch on this mesh.

    The global batch (instances per optimizer step) is the recipe constant; rows per device =
    global_batch / n_devices, split into microbatches of `micro_batch_per_device` rows. Losing
    devices raises the microbatch count, never changes the math (DESIGN §4, bug 4).
    None: the whole per-device batch in one microbatch. `flags`: the two values' flags, as messages
    name them (bench.py: --batch)."""
    n = mesh.size // context_size(mesh)   # GLOBAL row groups: the devices of every process,
    devices = (f"{n} global devices" if CONTEXT not in mesh.axis_names   # a context group as one
               else f"{n} row groups ({mesh.size} global devices / context {context_size(mesh)})")
    if micro_batch_per_device is None:
        micro_batch_per_device = max(global_batch // n, 1)
    batch, micro = flags
    if global_batch < 1 or micro_batch_per_device < 1:
        raise ValueError(f"{batch}={global_batch} and {micro}={micro_batch_per_device} (rows per device) must "
                         "be positive")
    if global_batch % n:
        raise ValueError(f"{batch}={global_batch}: the global batch {global_batch} is not divisible by the {devices} "
                         f"of the mesh {dict(mesh.shape)}; the global batch is a recipe constant, "
                         "so run on a device count that divides it")
    per_device = global_batch // n
    if per_device % micro_batch_per_device:
        raise ValueError(f"{micro}={micro_batch_per_device}: {per_device} rows per device ({batch}={global_batch} / "
                         f"{devices}) are not divisible by it; choose a divisor of {per_device}")
    return per_device // micro_batch_per_device


def global_batch(local_batch: dict, mesh: Mesh) -> dict:
    """One global jax.Array per numpy field of this process's rows (other fields, e.g. the
    loader's "step" int, are left out), rows split over ('data', 'fsdp').

    Process p passes its L rows of the global batch (data rank = jax.process_index(), num
    ranks = jax.process_count(); the loader gives it the strided rows p, p + P, ...: data/order.py);
    they land on its own devices. The global array therefore holds the global batch's rows in
    another order than the loader's, which no loss sum can see (every sum runs over all rows).
    With a context axis, rows are first put in context order (`_context_rows`: labels, positions)
    and their [rows, seq] fields split over 'context' too (a context group within one process).
    A batch every process holds whole goes through `whole_batch` instead."""
    C = context_size(mesh)
    chunked = CONTEXT in mesh.axis_names
    if chunked:
        local_batch = _context_rows({k: v for k, v in local_batch.items() if isinstance(v, np.ndarray)}, C)
    n_local = len(mesh.local_devices) // C
    out = {}
    for key, value in local_batch.items():
        if not isinstance(value, np.ndarray):
            continue
        if value.ndim == 0 or value.shape[0] % n_local:
            raise ValueError(f"batch field {key!r} has shape {value.shape} on process "
                             f"{jax.process_index()}: its rows must split evenly over the "
                             f"{n_local} local devices; the local batch is global_batch / "
                             f"process_count rows")
        spec = TOKENS if chunked and value.ndim == 2 else ROWS
        out[key] = jax.make_array_from_process_local_data(NamedSharding(mesh, spec), value)
    return out


def whole_batch(batch: dict, mesh: Mesh) -> dict:
    """One global jax.Array per numpy field of a batch that EVERY process holds whole (held-out
    pairs, downstream requests), rows split over ('data', 'fsdp'), replicated over 'context'. Row
    i of the global array is batch row i: each device takes the rows its place in the mesh owns,
    wherever the mesh puts it. (A process's own slice of rows would land on its devices' places,
    which are not rows [p * n, (p + 1) * n) when the mesh interleaves processes, as a TPU slice's
    physical order may; results gathered back in global order would then be another row's.)"""
    sharding = NamedSharding(mesh, ROWS)
    return {key: jax.make_array_from_callback(value.shape, sharding, lambda index, v=value: v[index])
            for key, value in batch.items() if isinstance(value, np.ndarray)}


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
def memory_report(config: Config, n_devices: int, data: int = 1, context: int = 1,
                  seq_len: Optional[int] = None, head_stride: int = HEAD_STRIDE) -> dict:
    """Per-device bytes of params and optimizer state (fp32 mu, nu and replicated scalars) on a
    ('data', 'fsdp', 'context') = (data, n_devices / (data * context), context) mesh, from
    abstract shapes (no allocation); weights are split over fsdp x context.

    With `seq_len`: the activations one instance leaves per device, seq_len / context tokens
    each: the layer inputs and projection outputs the "save_proj" remat policy keeps (a lower
    bound: XLA's temporaries are not counted), and the K/V of one head_stride group gathered
    over the context group (transient, inside attention)."""
    from olmo3.optim import SkipStepAdamW
    if n_devices % (data * context):
        raise ValueError(f"data={data} x context={context} does not divide n_devices={n_devices}")
    fsdp = n_devices // (data * context)
    shard = fsdp * context
    model = eqx.filter_eval_shape(OLMo3, config, jax.random.key(0))
    opt = eqx.filter_eval_shape(SkipStepAdamW(lambda s: 0.0).init, model)
    specs = param_specs(model, shard)

    def local_bytes(x, spec):
        shape = list(x.shape)
        if spec is not None and FSDP in spec:
            shape[_fsdp_axis(spec)] //= shard
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
    out = {"n_devices": n_devices, "fsdp": fsdp, "data": data, "context": context,
           "params": config.num_params(), "param_bytes": params, "opt_bytes": optim,
           "total_bytes": params + optim, "gathered_bytes": gathered}
    if seq_len is not None:
        c, act = config, jnp.dtype(config.dtype).itemsize
        saved = c.q_dim + 2 * c.kv_dim + 2 * c.mlp_hidden + 3 * c.d_model   # q k v gate up, o down x
        out["activation_bytes"] = (seq_len // context) * c.n_layers * saved * act
        out["kv_gathered_bytes"] = 2 * kv_group(head_stride, c.n_kv_heads) * seq_len * c.head_dim * act
    return out


def _main(argv: Optional[list] = None) -> None:
    import argparse
    ap = argparse.ArgumentParser(description="Per-device param + optimizer memory under FSDP, and "
                                             "the stage-3 7B under context parallelism.")
    ap.add_argument("--preset", default="olmo3_7b", choices=Config.PRESETS)
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 128, 512])
    args = ap.parse_args(argv)
    cfg = Config.preset(args.preset)
    cell = lambda b: f"{b:,} B ({b / 2**30:.3f} GiB)"  # noqa: E731
    print(f"{args.preset}: {cfg.num_params():,} params, param_dtype {cfg.param_dtype}, "
          "AdamW mu+nu fp32, pure FSDP")
    print(f"{'devices':>8} {'params/device':>30} {'optimizer/device':>30} {'total/device':>30}")
    for n in args.devices:
        r = memory_report(cfg, n)
        print(f"{n:>8} {cell(r['param_bytes']):>30} {cell(r['opt_bytes']):>30} "
              f"{cell(r['total_bytes']):>30}")
    print(f"plus, transient on every device during the step: at least {cell(r['gathered_bytes'])} of "
          "gathered full weights (embedding + lm_head + final norm + one layer)")

    # Stage 3 (OLMo-core OLMo-3-1025-7B-long-context.py): seq 65,536 (L37), one instance per
    # rank (L71 rank_microbatch_size=sequence_length), cp llama3(degree=8, head_stride=4) (L89),
    # hsdp shard_degree=1 (L84): weights split over the 8 ranks of a context group, replicated
    # over the groups. The script leaves the device count to the launcher: 64 = 8 nodes x 8 shown.
    # vocab 100352: dolma2 padded to a multiple of 128 (L47, stage3.flags)
    long, seq = Config.olmo3_7b_long(vocab_size=100352, compute_dtype="bfloat16"), 65536
    print(f"\nstage 3: olmo3_7b_long, seq {seq:,}, one instance per context group per microbatch, "
          "bf16 activations, remat save_proj")
    print(f"{'mesh (64 devices)':>28} {'params+optimizer/device':>30} {'activations/device':>30}")
    for data, context in ((8, 1), (8, 8), (1, 8)):
        r = memory_report(long, 64, data=data, context=context, seq_len=seq)
        mesh = f"data:{data},fsdp:{r['fsdp']},context:{context}" if context > 1 else f"data:{data},fsdp:{r['fsdp']}"
        print(f"{mesh:>28} {cell(r['total_bytes']):>30} {cell(r['activation_bytes']):>30}")
    print(f"activations: layer inputs + the projections save_proj keeps, for {seq:,} / context tokens "
          f"(a lower bound); plus, transient in attention, {cell(r['kv_gathered_bytes'])} of K/V "
          "(one head_stride=4 group gathered over the context group, full sequence)")


if __name__ == "__main__":
    _main()
