"""Checkpoints: async, keep-N, one atomic step directory per save (orbax-checkpoint).

Layout: `<run_dir>/checkpoints/<N>/` holds
    state/   every array of the state PyTree (model, optimizer state, ...) as one flat dict keyed
             by its dotted path ("model.layers.q_proj", "opt.mu.embed"), so the
             checkpoint is readable without our classes and errors can name the tensor;
    extra/   a JSON dict chosen by the caller (data-loader state, data fingerprint, config, stage),
             and under "tensor_checksums" a checksum of every tensor's bits, taken when it was saved
             and compared when it is read: Orbax's OCDBT files carry none, and a flipped bit in one
             read back without an error (an element of a 4096-float tensor came back off by 3e17).
Orbax writes `<N>.orbax-checkpoint-tmp*` and renames it to `<N>` only when every host has
finished (commit_success.txt on object stores), so a crash mid-save leaves a tmp dir that
`latest_step()` never returns, and the previous checkpoint untouched. Stale tmp dirs are removed
when the next writable manager opens the directory.

Step convention (the whole codebase): a checkpoint labelled N means N optimizer steps are done.
The next step run is step N+1 (1-based, as logged) and reads batch index N (0-based); its lr is
schedule(N) (see schedules.py). Save after finishing step N with label N, never N+1.

Restoring takes an abstract state (`eqx.filter_eval_shape(...)`, or jax.ShapeDtypeStruct leaves
carrying the target shardings, or concrete arrays whose shardings are reused): arrays are read
straight into the target sharding, so a checkpoint written on 8 devices restores onto 1 or 2,
or onto another mesh. Non-array leaves (static fields, activation functions) come from the
abstract state via eqx.combine. Dtypes follow the abstract state (orbax casts).
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
from typing import Any, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jaxtyping import PyTree

from olmo3.cli import NonFiniteError, UserError, exception_chain, storage_error_kind

CHECKPOINTS = "checkpoints"
DELETED = ".deleted"   # under checkpoints/: old steps on their way out (keep-N)


class DamagedElsewhereError(RuntimeError):
    """One process of several could not read its part of a checkpoint: it marked the step and
    ends the attempt (exit 1, retried); every process of the rerun falls back past it."""


class DamagedCheckpointError(UserError):
    """A complete checkpoint that does not read back: `.step`, `.file` (the damaged file, or the
    step directory when no single file can be named)."""

    def __init__(self, message: str, step: int, file: str):
        super().__init__(message)
        self.step, self.file = step, file


class ChangedBitsError(DamagedCheckpointError):
    """A checkpoint whose tensors read back with other bits than were saved (checksums). Every
    process computes the same global checksums, so all find it at once and fall back together."""


_JSON_FILES = ("_CHECKPOINT_METADATA", "extra/metadata", "state/_METADATA", "state/_sharding")


def _json_files(step_dir: str) -> list[str]:
    meta = [os.path.join(step_dir, f) for f in _JSON_FILES]
    arrays = os.path.join(step_dir, "state", "array_metadatas")
    if os.path.isdir(arrays):
        meta += sorted(os.path.join(arrays, f) for f in os.listdir(arrays))
    return meta


def damaged_file(step_dir: str, error: BaseException) -> str:
    """The file of a checkpoint step that does not read: the first JSON metadata file that does
    not parse, else a local file named by an error in `error`'s chain (one that is there and not a
    directory, or one of the step's that is missing), else the step directory."""
    for path in _json_files(step_dir):
        try:
            with open(path) as f:
                json.load(f)
        except FileNotFoundError:
            continue
        except (ValueError, OSError):
            return path
    named = (m.group(1) for link in exception_chain(error) for m in re.finditer(r'local file "([^"]+)"', str(link)))
    inside = os.path.join(step_dir, "")
    return next((path for path in named if os.path.isfile(path)
                 or path.startswith(inside) and not os.path.exists(path)), step_dir)


def _storage_reason(error: BaseException) -> tuple[Optional[str], str]:
    """(tensor, reason) of a read that failed: the tensor TensorStore names ('Error reading
    "model.embed/0.0"'), and the message of the innermost error in the chain, the storage's own
    (Orbax's wrapper around it prints a whole TensorStore spec), on one line, cut to 400 characters."""
    links = list(exception_chain(error))
    tensor = next((m.group(1) for link in links for m in [re.search(r'Error reading "([^"/]+)/', str(link))] if m),
                  None)
    return tensor, " ".join(str(links[-1]).split())[:400]


# Step directories being read, or whose read failed: reports of their abandoned reads are dropped.
_READS: set[str] = set()


def _quiet_abandoned_reads() -> None:
    """When one read of a restore fails, Orbax's restore stops while TensorStore still finishes
    its other reads: each then reports, through sys.unraisablehook, the same damage once more (an
    exception nobody awaits, with the whole TensorStore spec) or that Orbax's event loop is closed:
    dozens of tracebacks, one per tensor, some before the error is caught, burying the one line
    that names the damage (or a fallback's warning). The hook installed here drops those two
    kinds: 'Event loop is closed' (a callback arriving after its loop ended never means more) and
    an exception that names a step directory in _READS. Every other one is still printed."""
    previous = sys.unraisablehook
    if getattr(previous, "olmo3_quiet", False):
        return

    def hook(unraisable):
        e = unraisable.exc_value
        if (isinstance(e, RuntimeError) and str(e) == "Event loop is closed"
                or any(d in str(e) for d in tuple(_READS))):
            return
        previous(unraisable)

    hook.olmo3_quiet = True
    sys.unraisablehook = hook


class NoIntactCheckpointError(UserError):
    """--resume found checkpoints and none of them reads back: training again from step 1 in
    their run directory would pass for a resume (and a resubmission loop would count it as one)."""


class MissingTensorsError(ValueError):
    """The checkpoint lacks tensors the abstract state asks for (`.missing`: their paths), e.g.
    a model-only checkpoint given where the optimizer state is needed."""

    def __init__(self, message: str, missing: list[str]):
        super().__init__(message)
        self.missing = missing


def _is_leaf_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def _key_name(k) -> str:
    tu = jax.tree_util
    if isinstance(k, tu.GetAttrKey):
        return k.name
    if isinstance(k, tu.DictKey):
        return str(k.key)
    if isinstance(k, tu.SequenceKey):
        return str(k.idx)
    if isinstance(k, tu.FlattenedIndexKey):
        return str(k.key)
    return str(k)


def tensor_names(tree: PyTree) -> dict[str, Any]:
    """Flat {dotted path: array leaf} of every array (or ShapeDtypeStruct) in `tree`."""
    arrays = eqx.filter(tree, _is_leaf_array)
    flat: dict[str, Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(arrays)[0]:
        name = ".".join(_key_name(k) for k in path) or "_root"
        if "/" in name:
            raise ValueError(f"state path {name!r} contains '/', which orbax would treat as a "
                             "directory; rename the dict key")
        if name in flat:
            raise ValueError(f"two arrays in the state share the path {name!r}")
        flat[name] = leaf
    return flat


def _abstract(leaf) -> Any:
    """ShapeDtypeStruct with a sharding (default: the first local device)."""
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


def locate(path: str) -> tuple[str, Optional[int]]:
    """Resolve a user-given checkpoint path (e.g. --init_from) to (run_dir, step or None=latest).

    Accepts a step directory `<run>/checkpoints/<N>`, a `<run>/checkpoints` directory, or a run
    directory."""
    if "://" in path:   # os.path would look for a local ./gs:/... directory and call it missing
        raise FileNotFoundError(f"{path}: a URL; checkpoints are read through the local filesystem: mount the "
                                "bucket (Cloud Storage FUSE) or copy the run directory here")
    p = os.path.abspath(path.rstrip("/"))
    base = os.path.basename(p)
    parent = os.path.dirname(p)
    # A run directory named by a number inside a folder named checkpoints (/mnt/checkpoints/0042)
    # holds checkpoints/ itself; a step directory never does.
    if base.isdigit() and os.path.basename(parent) == CHECKPOINTS and not os.path.isdir(os.path.join(p, CHECKPOINTS)):
        if not os.path.isdir(p):
            raise FileNotFoundError(f"checkpoint {p} does not exist (incomplete saves end in "
                                    ".orbax-checkpoint-tmp and are not usable)")
        return os.path.dirname(parent), int(base)
    if base == CHECKPOINTS and os.path.isdir(p):
        return parent, None
    if os.path.isdir(os.path.join(p, CHECKPOINTS)):
        return p, None
    if os.path.isfile(os.path.join(p, "config.json")):   # olmo3.hf.is_hf_dir: weights to convert first
        raise FileNotFoundError(f"{path}: a Hugging Face directory, not a run directory; convert it first: "
                                f"python convert.py --from=hf:{path} --to=orbax:<new run dir>, then give that run")
    raise FileNotFoundError(f"{path}: not a run directory, a {CHECKPOINTS}/ directory or a "
                            f"{CHECKPOINTS}/<step> directory")


# The skip-step windows record each step's raw loss and grad norm, a skipped NaN one included
# (OLMo-core semantics): a non-finite value there is the record of a skipped step, not damage.
FINITE_EXEMPT = ("loss_window", "gnorm_window")


@jax.jit
def _finite_flags(leaves: list) -> jax.Array:
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def nonfinite_tensors(flat: dict[str, Any]) -> list[str]:
    """Names of the float tensors of `flat` (tensor_names' dict) holding a NaN or inf, found by
    one jitted reduction per tensor on the devices that hold it (a bool per tensor comes back).
    Cost at the 7B shape: README, "When things go wrong"."""
    names = [n for n, x in flat.items() if isinstance(x, (jax.Array, np.ndarray))
             and jnp.issubdtype(x.dtype, jnp.inexact) and not n.endswith(FINITE_EXEMPT)]
    if not names:
        return []
    ok = np.asarray(_finite_flags([flat[n] for n in names]))
    return [n for n, good in zip(names, ok) if not good]


CHECKSUMS = "tensor_checksums"   # the key in extra/


def _bit_sum_pair(x: jax.Array, start: jax.Array, full_shape: tuple[int, ...]) -> jax.Array:
    """bit_sums' pair of `x`, a block of a tensor of shape `full_shape` whose first element sits at
    index `start` (uint32, one per axis): its elements weighted by their positions in the whole tensor."""
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:
        width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)   # 8 bytes: a trailing axis of 2
    full = tuple(full_shape) + bits.shape[len(full_shape):]
    pos = jnp.zeros(bits.shape, jnp.uint32)
    for axis in range(bits.ndim):   # the flat (row-major) position in the whole tensor, mod 2**32
        first = start[axis] if axis < len(full_shape) else jnp.uint32(0)
        pos = pos * jnp.uint32(full[axis]) + first + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis)
    return jnp.stack([jnp.sum(bits, dtype=jnp.uint32),
                      jnp.sum(bits * (pos * jnp.uint32(2654435761) + jnp.uint32(1)), dtype=jnp.uint32)])


@jax.jit
def bit_sums(leaves: list) -> jax.Array:
    """uint32 [len(leaves), 2]: per array, (sum of its bits, sum of bits * (2654435761 * flat
    position + 1)), mod 2**32. Exact, and independent of the order (so of the sharding) it is
    summed in. One flipped bit changes the pair (2**k is never 0 mod 2**32, and where the second
    sum's weight is even the first sum sees it), and moving a block of elements elsewhere changes
    the second. Bools count as 0 / 1, 8-byte elements as two 4-byte words. Also the DPO reference's
    identity (olmo3/reference.py)."""
    return jnp.stack([_bit_sum_pair(x, jnp.zeros(x.ndim, jnp.uint32), x.shape) for x in leaves])


_block_bit_sums = jax.jit(_bit_sum_pair, static_argnums=2)


class BlockChecksums:
    """A checkpoint's saved checksums, checked as its tensors are read a block at a time
    (convert.py streams a layer, or a block of rows, never a whole 7B tensor): both sums of
    bit_sums run over elements, each weighted by its position in the whole tensor, so the blocks'
    pairs add up, mod 2**32, to the tensor's. A tensor is compared once its blocks cover it, and
    one that differs raises ChangedBitsError, as CheckpointManager.restore does."""

    def __init__(self, mgr: "CheckpointManager", step: int):
        self._mgr, self._step = mgr, step
        self._saved = mgr.saved_checksums(step)
        self._blocks: dict[str, dict[tuple, tuple[np.ndarray, int]]] = {}   # name -> {start: (pair, size)}

    def add(self, name: str, block: np.ndarray, start: tuple[int, ...], full_shape: tuple[int, ...]) -> None:
        """`block` of the stored tensor `name` (of shape `full_shape`), its first element at `start`;
        a block indexed out of leading axes (layer i of a stacked tensor) has them back as size 1."""
        if name not in self._saved:   # a checkpoint from before checksums
            return
        block = block.reshape((1,) * (len(full_shape) - block.ndim) + block.shape)
        blocks = self._blocks.setdefault(name, {})
        blocks[tuple(start)] = (np.asarray(_block_bit_sums(block, np.asarray(start, np.uint32), tuple(full_shape))),
                                block.size)
        if sum(size for _, size in blocks.values()) < math.prod(full_shape):
            return
        got = [int(v) for v in np.sum([pair for pair, _ in blocks.values()], axis=0, dtype=np.uint32)]
        if got != list(self._saved[name]):
            raise self._mgr.changed_bits(self._step, [name])


def tensor_checksums(flat: dict[str, Any]) -> dict[str, list[int]]:
    """{name: bit_sums pair} of the arrays of `flat` (tensor_names' dict), by one jitted pass on the
    devices that hold them (two uint32 per tensor come back)."""
    names = [n for n, x in flat.items() if isinstance(x, (jax.Array, np.ndarray))]
    if not names:
        return {}
    return dict(zip(names, np.asarray(bit_sums([flat[n] for n in names])).tolist()))


@contextlib.contextmanager
def new_directory(path: Union[str, os.PathLike], what: str = "checkpoint"):
    """Yields a temporary sibling of `path` to fill; on success it is renamed into place, on
    failure removed. A crash never leaves a half-written `what` at `path`, and `path` must be
    new or empty (HF and OLMo-core checkpoints written by convert.py, SFT and DPO data; Orbax
    does its own). A symlink at `path` is followed: the output lands where it points (renaming
    onto the link failed after all the work). The temporary's name holds this process's id and
    host: one that a killed writer left (SIGKILL runs no cleanup; a 7B conversion's is tens of
    GB) is removed by the next writer of `path` on that host, one whose writer still runs is not.
    Another process that fills `path` meanwhile wins: this one's output is removed and said."""
    path = os.path.realpath(os.fspath(path))
    if os.path.exists(path) and os.listdir(path):
        raise FileExistsError(f"{path!r} exists and is not empty; choose a new directory for the {what}")
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    _remove_dead_temporaries(parent, name)
    tmp = tempfile.mkdtemp(prefix=f".tmp-{name}-{os.getpid()}@{_this_host()}-", dir=parent)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; what it becomes is not
    try:
        yield tmp
        try:
            if os.path.exists(path):
                os.rmdir(path)
            os.rename(tmp, path)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise FileExistsError(f"{path!r} was filled by another process while this one wrote its {what}, "
                                  "which was removed; choose a new directory") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _this_host() -> str:
    """This host as process ids see it: its name and its PID namespace (containers that share a
    host name, `docker --network=host`, number their processes apart)."""
    try:
        return f"{socket.gethostname()}~{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:   # no /proc: the name alone
        return socket.gethostname()


def _remove_dead_temporaries(parent: str, name: str) -> None:
    """new_directory's temporaries for `name` in `parent` whose writer, on this host, has exited."""
    here = _this_host()
    # mkdtemp's random suffix has no '-': the host is everything between '@' and the last '-'
    pattern = re.compile(rf"\.tmp-{re.escape(name)}-(\d+)@(.+)-[^-]+")
    for entry in os.listdir(parent):
        m = pattern.fullmatch(entry)
        if not (m and m.group(2) == here):
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:   # gone: what it left is nobody's
            logging.warning("removing %s, left by a writer of %s that was killed", os.path.join(parent, entry), name)
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
        except OSError:   # alive (another user's): still writing
            pass


class CheckpointManager:
    """Saves and restores (state PyTree, extra JSON) under `<run_dir>/checkpoints/<step>/`."""

    def __init__(self, run_dir: str, keep: Optional[int] = 3, async_save: bool = True,
                 read_only: bool = False):
        self.directory = os.path.join(os.path.abspath(run_dir), CHECKPOINTS)
        if read_only and not os.path.isdir(self.directory):
            raise FileNotFoundError(f"no checkpoint directory {self.directory}; pass the run "
                                    "directory that holds checkpoints/ (or a checkpoints/<step>)")
        # Save durations for "checkpoint N saved in S s": orbax calls back from its finalize
        # thread once a save's files are written; the main thread reads them in `finished_saves`.
        self._started: dict[int, float] = {}
        self._finished: list[tuple[int, float]] = []
        self._lock = threading.Lock()
        self._async, self._read_only = async_save and not read_only, read_only
        async_options = (ocp.AsyncOptions(post_finalization_callback=self._on_finalized)
                         if self._async else None)
        # Keep-N deletes old steps by RENAMING them into checkpoints/.deleted/ (one atomic rename)
        # and we empty that folder later: a kill mid-delete then never leaves a half-deleted step
        # that still looks complete (found by tests/test_bad_inputs.py's SIGKILL test). On gs://
        # orbax deletes in place (no rename there).
        options = ocp.CheckpointManagerOptions(  # read-only: the values orbax would force, warning
            max_to_keep=None if read_only else keep, save_interval_steps=0 if read_only else 1,
            create=not read_only, read_only=read_only,
            cleanup_tmp_directories=not read_only, enable_async_checkpointing=async_save,
            async_options=async_options, todelete_subdir=None if read_only else DELETED)
        # Handlers named up front, so a fresh process can read metadata before any save.
        self._mgr = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.PyTreeCheckpointHandler(),
                           "extra": ocp.JsonCheckpointHandler()})
        # checkpoints/.deleted/ is emptied at the next save and at close(), not here: a resume
        # that finds the kept checkpoints damaged names the rotated-out one still there.

    def _purge_deleted(self) -> None:
        """Empty checkpoints/.deleted/ (steps keep-N has already taken out of the list)."""
        if jax.process_index() == 0:
            shutil.rmtree(os.path.join(self.directory, DELETED), ignore_errors=True)

    # -- queries ---------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """Complete checkpoints, ascending (tmp dirs of unfinished saves are never listed)."""
        if self._mgr.is_saving_in_progress():
            # Our own saves are in flight: re-reading the disk now would confuse orbax's
            # keep-N bookkeeping; list what it knows and keep only steps already renamed.
            return sorted(s for s in self._mgr.all_steps()
                          if os.path.isdir(os.path.join(self.directory, str(s))))
        self._mgr.reload()      # see saves made by other processes
        return sorted(self._mgr.all_steps())

    def latest_step(self) -> Optional[int]:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def what_to_resume(self) -> str:
        """The advice a non-finite state ends with: the last good checkpoint, or none yet."""
        last = self.latest_step()
        where = (f"The last good checkpoint is {self.directory}/{last}: resume from it" if last is not None
                 else "No checkpoint was written yet: start again")
        return f"{where} with a lower --lr, or check the data of the steps since"

    def _resolve(self, step: Optional[int]) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no complete checkpoint in {self.directory}; point to a run that saved "
                                        "one (train.py: or start without --resume)")
            return steps[-1]
        if step not in steps:
            raise FileNotFoundError(f"no complete checkpoint for step {step} in "
                                    f"{self.directory}; available: {steps}")
        return step

    # -- save ------------------------------------------------------------------------------
    def save(self, step: int, state: PyTree, extra: Optional[dict] = None) -> None:
        """Start an async save of `state`'s arrays and the JSON `extra` as checkpoint `step`.

        Returns once the arrays are copied off the devices (they may then be donated or
        deleted); the write and the atomic rename finish in the background (see `wait`)."""
        extra = {} if extra is None else extra
        try:
            json.dumps(extra)
        except TypeError as e:
            raise TypeError(f"checkpoint extra must be JSON-serializable: {e}") from None
        if step in self._mgr.all_steps() or os.path.isdir(os.path.join(self.directory, str(step))):
            raise FileExistsError(f"checkpoint {self.directory}/{step} already exists; a "
                                  "checkpoint label is written once (N = steps done)")
        flat = tensor_names(state)
        bad = nonfinite_tensors(flat)
        if bad:
            raise NonFiniteError(f"step {step}: {len(bad)} tensor(s) hold NaN or inf, e.g. {bad[:3]}; checkpoint "
                                 f"{step} was not written. {self.what_to_resume()}")
        self._mgr.wait_until_finished()   # orbax would wait here anyway; this times only our save
        self._purge_deleted()              # the steps the last save's keep-N renamed away
        extra = {**extra, CHECKSUMS: tensor_checksums(flat)}
        with self._lock:
            self._started[int(step)] = time.perf_counter()
        try:
            self._mgr.save(int(step), force=True, args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(flat), extra=ocp.args.JsonSave(extra)))
        except BaseException:
            with self._lock:
                self._started.pop(int(step), None)
            raise
        if not self._async:   # written and committed already
            self._on_finalized()

    def _on_finalized(self) -> None:
        # One save is in flight at a time, so the oldest started one is the one that finished.
        now = time.perf_counter()
        with self._lock:
            if self._started:
                step = min(self._started)
                self._finished.append((step, now - self._started.pop(step)))

    def finished_saves(self) -> list[tuple[int, float]]:
        """(step, seconds from `save` until its files were written) of each save finished since
        the last call, oldest first. Cheap: call it after every training step."""
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def wait(self) -> None:
        """Block until every pending save is committed (renamed into place)."""
        self._mgr.wait_until_finished()

    def close(self) -> None:
        self._mgr.close()
        if not self._read_only:
            self._purge_deleted()

    # -- restore ---------------------------------------------------------------------------
    def _extra(self, step: int) -> dict:
        with self._reading(step):
            out = self._mgr.restore(step, args=ocp.args.Composite(extra=ocp.args.JsonRestore()))
        return dict(out["extra"] or {})

    def read_extra(self, step: Optional[int] = None) -> dict:
        """The JSON `extra` of a checkpoint (cheap: no arrays read)."""
        return {k: v for k, v in self._extra(self._resolve(step)).items() if k != CHECKSUMS}

    def saved_checksums(self, step: int) -> dict[str, list[int]]:
        """{tensor name: bit_sums pair} as saved with checkpoint `step` ({} before checksums)."""
        return self._extra(step).get(CHECKSUMS, {})

    def changed_bits(self, step: int, names: list[str]) -> "ChangedBitsError":
        """The error for tensors of checkpoint `step` whose bits differ from their checksums."""
        where = f"{self.directory}/{step}"
        return ChangedBitsError(
            f"checkpoint {where} is damaged: {len(names)} tensor(s) read back with other bits than were "
            f"saved, e.g. {names[:3]} (their checksums differ); intact checkpoints: "
            f"{[s for s in self.all_steps() if s != step] or 'none'}", step, os.path.join(where, "state"))

    @contextlib.contextmanager
    def _reading(self, step: int):
        """Orbax reads of checkpoint `step`: a failure that a retry may cure (a transient status
        code anywhere in the exception's chain, a dropped connection, a stale network-filesystem
        handle, an INTERNAL / UNKNOWN status: cli.storage_error_kind) propagates as it is (exit 1,
        retried); any other becomes DamagedCheckpointError naming the damaged file, and resuming
        moves that checkpoint aside. A flaky mount must never cost the checkpoints."""
        where = os.path.join(self.directory, str(step))
        _quiet_abandoned_reads()
        reading = os.path.join(where, "")
        _READS.add(reading)
        try:
            yield
        except (MissingTensorsError, UserError):
            raise
        except Exception as e:  # noqa: BLE001 -- classified here
            if storage_error_kind(e):
                raise
            file = damaged_file(where, e)
            tensor, reason = _storage_reason(e)
            what = f"tensor {tensor!r} (under {file})" if tensor and file == where else file
            raise DamagedCheckpointError(
                f"checkpoint {where} is damaged: {what} does not read back ({reason}); "
                f"intact checkpoints: {[s for s in self.all_steps() if s != step] or 'none'}", step, file) from e
        else:
            _READS.discard(reading)

    def stored_tensors(self, step: Optional[int] = None) -> dict[str, tuple]:
        """{dotted name: shape} of every tensor checkpoint `step` holds (no array is read)."""
        step = self._resolve(step)
        meta = self._state_metadata(step)
        return {k: tuple(v.shape) for k, v in dict(meta.tree if hasattr(meta, "tree") else meta).items()}

    def _fitting(self, step: int, abstract_state: PyTree) -> tuple[dict, dict]:
        """({name: abstract tensor} of `abstract_state`, {name: Orbax's metadata} of checkpoint
        `step`), once every tensor asked for is there with its shape."""
        want = {k: _abstract(v) for k, v in tensor_names(abstract_state).items()}
        meta = self._state_metadata(step)
        stored = dict(meta.tree if hasattr(meta, "tree") else meta)
        where = f"{self.directory}/{step}"
        missing = sorted(set(want) - set(stored))
        if missing:
            raise MissingTensorsError(f"checkpoint {where} has no tensor(s) {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''} ({len(missing)} missing; it "
                             f"holds {len(stored)} tensors, e.g. {sorted(stored)[:4]}). Was it "
                             "saved without optimizer state, or by another model config?", missing)
        for name, a in want.items():
            if tuple(stored[name].shape) != tuple(a.shape):
                raise ValueError(f"checkpoint {where}: tensor {name!r} has shape "
                                 f"{tuple(stored[name].shape)} but the model expects "
                                 f"{tuple(a.shape)}; check the model flags against the "
                                 "checkpoint's config")
        return want, stored

    def check_fits(self, step: Optional[int], abstract_state: PyTree) -> set[str]:
        """restore's checks without reading an array: checkpoint `step` (None: the latest) holds
        every tensor of `abstract_state` with its shape (MissingTensorsError, ValueError if not).
        Returns the names of every tensor it holds."""
        return set(self._fitting(self._resolve(step), abstract_state)[1])

    def restore(self, step: Optional[int], abstract_state: PyTree) -> tuple[PyTree, dict]:
        """Read checkpoint `step` (None: the latest) into the structure, shapes, dtypes and
        shardings of `abstract_state`. Returns (state, extra).

        The checkpoint may hold more tensors than asked for (e.g. restore only {"model": ...}
        from a {"model", "opt"} checkpoint); every tensor asked for must exist with its shape."""
        step = self._resolve(step)
        want, stored = self._fitting(step, abstract_state)
        # Tensors with a checksum are read as stored, compared, then cast to the dtype asked for (a
        # warm start with another --param_dtype): a cast before the comparison would skip it.
        extra = self._extra(step)
        saved = extra.pop(CHECKSUMS, {})   # none in checkpoints from before them
        read_as = {n: jax.ShapeDtypeStruct(a.shape, stored[n].dtype, sharding=a.sharding) if n in saved else a
                   for n, a in want.items()}
        restore_args = ocp.checkpoint_utils.construct_restore_args(read_as)
        with self._reading(step):
            flat = self._mgr.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(read_as, restore_args, partial_restore=True)))["state"]
        got = tensor_checksums({n: flat[n] for n in want if n in saved})
        changed = [n for n in got if got[n] != saved[n]]
        if changed:
            raise self.changed_bits(step, changed)
        for n, a in want.items():   # one tensor at a time: at most one extra copy in memory
            if np.dtype(flat[n].dtype) != np.dtype(a.dtype):
                flat[n] = jax.jit(lambda x, d=a.dtype: x.astype(d), out_shardings=a.sharding)(flat[n])
        arrays, static = eqx.partition(abstract_state, _is_leaf_array)
        leaves_paths, treedef = jax.tree_util.tree_flatten_with_path(arrays)
        names = [".".join(_key_name(k) for k in p) or "_root" for p, _ in leaves_paths]
        restored = jax.tree_util.tree_unflatten(treedef, [flat[n] for n in names])
        return eqx.combine(restored, static), extra

    def verify(self, step: Optional[int] = None) -> int:
        """Check checkpoint `step` (None: the latest) as far as it goes without reading arrays:
        every JSON metadata file parses, Orbax lists its tensors, its extra reads. Returns the
        step; raises DamagedCheckpointError naming the damaged file (eval.py, convert.py)."""
        step = self._resolve(step)
        with self._reading(step):
            for path in _json_files(os.path.join(self.directory, str(step))):
                if os.path.exists(path):
                    with open(path) as f:
                        json.load(f)
            self._mgr.restore(step, args=ocp.args.Composite(extra=ocp.args.JsonRestore()))
        self._state_metadata(step)
        return step

    def _state_metadata(self, step: int):
        """Orbax's metadata of checkpoint `step`'s tensors; a step whose state/_METADATA is gone
        (Orbax then answers None) is damaged like any other unreadable file."""
        with self._reading(step):
            meta = self._mgr.item_metadata(step)["state"]
            if meta is None:
                raise FileNotFoundError(f"[Errno 2] No such file: "
                                        f"'{os.path.join(self.directory, str(step), 'state', '_METADATA')}'")
        return meta

    def restore_intact(self, abstract_state: PyTree, check_extra=None) -> tuple[Optional[int], PyTree, dict]:
        """Resume: restore the newest checkpoint that reads back whole. (step, state, extra), or
        (None, None, {}) when there is none at all.

        A damaged newer checkpoint (a truncated file, a torn copy) is logged with the file that
        does not read, and moved aside to `<run_dir>/damaged/<N>[-<time>]`, never deleted, so the
        next save of label N is possible and the bytes stay for inspection. When every one is
        damaged: NoIntactCheckpointError (exit 2), not a fresh start. `check_extra(extra, step)`
        runs before any array is read (train.py's config / stage / recipe-constant check): its
        errors are the user's and end the resume.

        Several processes: each reads the shard files it wrote, so damage may show on one process
        only, while the others are past Orbax's restore barrier; a process cannot fall back alone.
        It marks the step (`<run_dir>/damaged/pending-<N>`, on the shared run directory) and ends
        (DamagedElsewhereError, exit 1: the others stop too, through JAX's heartbeat); the rerun
        reads the marks first, on every process alike, and all skip and move aside those steps."""
        steps = self.all_steps()
        marked = {s for s in steps if self.marked_damaged(s)}
        if jax.process_count() > 1:   # every process has listed the same steps and marks before any acts
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("olmo3: restore_intact listed")
        damaged = []
        result = (None, None, {})
        for step in reversed(steps):
            if step in marked:
                logging.warning("checkpoint %s/%d did not read back on another process at the last attempt; "
                                "falling back to the previous checkpoint", self.directory, step)
                damaged.append(step)
                continue
            try:
                if check_extra is not None:
                    check_extra(self.read_extra(step), step)
                state, extra = self.restore(step, abstract_state)
            except DamagedCheckpointError as e:
                if jax.process_count() > 1 and not isinstance(e, ChangedBitsError):
                    from olmo3 import atomic
                    os.makedirs(os.path.dirname(self._pending(step)), exist_ok=True)
                    with atomic.replacing(self._pending(step)) as tmp, open(tmp, "w") as f:
                        json.dump({"process": jax.process_index(), "error": str(e)}, f)
                    raise DamagedElsewhereError(
                        f"{e}; process {jax.process_index()} of {jax.process_count()} cannot fall back alone: the "
                        f"step is marked ({self._pending(step)}) and every process of the rerun falls back") from e
                logging.warning("%s; falling back to the previous checkpoint", e)
                damaged.append(step)
                continue
            result = (step, state, extra)
            break
        for step in damaged:
            self._move_aside(step)
        if steps and result[0] is None:
            rotated = os.path.join(self.directory, DELETED)
            held = sorted(os.listdir(rotated)) if os.path.isdir(rotated) else []
            raise NoIntactCheckpointError(
                f"no checkpoint of {self.directory} reads back: {sorted(damaged)} are damaged, now in "
                f"{os.path.join(os.path.dirname(self.directory), 'damaged')}. "
                + (f"{rotated} still holds step(s) {held}, rotated out by --keep_checkpoints: move one back "
                   "into checkpoints/ and resume, " if held else "Copy an intact checkpoint back and resume, ")
                + "or start over in a new --run_dir without --resume")
        return result

    def _pending(self, step: int) -> str:
        return os.path.join(os.path.dirname(self.directory), "damaged", f"pending-{step}")

    def marked_damaged(self, step: int) -> bool:
        """Another process of an earlier attempt found checkpoint `step` damaged (restore_intact
        skips it, unread)."""
        return os.path.exists(self._pending(step))

    def _move_aside(self, step: int) -> None:
        """Rename a damaged step directory to <run_dir>/damaged/ (process 0; the others wait)."""
        from jax.experimental import multihost_utils
        if jax.process_index() == 0:
            src = os.path.join(self.directory, str(step))
            dst_dir = os.path.join(os.path.dirname(self.directory), "damaged")
            os.makedirs(dst_dir, exist_ok=True)
            dst = os.path.join(dst_dir, str(step))
            if os.path.exists(dst):
                dst = f"{dst}-{int(time.time())}"
            os.rename(src, dst)
            if os.path.exists(self._pending(step)):
                os.replace(self._pending(step), os.path.join(dst, "damaged_on_another_process.json"))
            logging.warning("moved damaged checkpoint %s aside to %s", src, dst)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"olmo3: damaged checkpoint {step} moved aside")
        self._mgr.reload()
