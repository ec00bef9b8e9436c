"""Convert OLMo 3 weights between Hugging Face safetensors, AI2's OLMo-core training checkpoints
(Adam moments included) and our Orbax checkpoints, with a logit-parity report.

    python convert.py --from=hf:/models/Olmo-3-1025-7B --to=orbax:runs/olmo3-7b-step0 --verify
    python convert.py --from=hf:/models/Olmo-3-1025-7B --to=orbax:runs/init --with_optimizer_state \
        --pad_vocab=100352
    python train.py --stage=1 --flagfile=stage1.flags --init_from=runs/init
        # AI2's step-0 weights; HF checkpoints hold 100278 vocab rows, --pad_vocab adds OLMo-core's
        # padding (stage1.flags' --vocab_size=100352) with OLMo-core's init
    python convert.py --from=orbax:runs/stage1/checkpoints/1413814 --to=hf:/models/mine --verify
        # the padded rows stay behind: HF gets dolma2's 100278 (--hf_vocab_size to choose)
    python convert.py --from=olmo-core:https://olmo-checkpoints.org/ai2-llm/Olmo-3-1025-7B/stage2/step47684/ \
        --to=orbax:runs/ai2-stage2      # AI2's weights AND its SkipStepAdamW moments (§4), then
    python train.py --stage=3 --flagfile=stage3.flags --init_from=runs/ai2-stage2   # warm Adam
    python convert.py --from=orbax:runs/stage3 --to=olmo-core:ckpt/step2000      # and back (§4)

The Orbax side is exactly what train.py's CheckpointManager reads: `<dir>/checkpoints/<step>/`
with the model's tensors under "model.*", and extra = {"model_config": ..., "stage": 0, ...}.
train.py --init_from restores {"model", "opt"} (the stage-2/3 warm start keeps Adam's moments),
so a starting point for it needs --with_optimizer_state (or train.py --init_weights_only; SFT
and DPO take a weights-only checkpoint as it is): zero fp32 moments and Adam count 0, exactly
what a fresh optimizer.init gives, so step 1 is a cold Adam step on AI2's weights.
eval.py reads either kind.

Memory: nothing holds the whole model. HF -> Orbax writes tensor after tensor, each in parts
(one layer of a stacked [n_layers, ...] weight, or <= 256 MB blocks of embed / lm_head / moments),
each part its own storage chunk, so a part is written as soon as it is produced. Orbax -> HF
reads those chunks back one at a time and appends them to a safetensors file whose header was
written first. Peak RSS (VmHWM) measured here: 1.48B parameters (OLMo-2-1B shape, dolma2 vocab,
5.5 GiB fp32) 0.82 GB HF -> Orbax with optimizer state, 0.67 GB Orbax -> HF
(tests/test_convert.py::test_peak_rss_1b_shaped, -m slow); the 7B shape (29 GB fp32) 1.34 GB
(512 MB parts then) and 0.84 GB, 7.5 and 5.4 minutes on 2 CPU cores: flat in model size, set by
the part size. A checkpoint saved by train.py stores each tensor as one chunk; converting it
holds one whole tensor at a time (5.8 GB for the 7B's stacked mlp weights).
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
import resource
import time

import numpy as np
from absl import app, flags, logging

from olmo3 import atomic, cli

# ---------------------------------------------------------------------------------------------
# §0 Flags.
# ---------------------------------------------------------------------------------------------
F = flags.FLAGS
flags.DEFINE_string("from", None, "Source: hf:<dir> (config.json + *.safetensors), orbax:<run dir | checkpoints/<N>> "
                    "or olmo-core:<stepN dir | save folder | URL of a stepN dir> (OLMo-core trainer checkpoint).")
flags.DEFINE_string("to", None, "Destination: orbax:<run dir>, hf:<dir> or olmo-core:<dir> (must not exist or be empty).")
flags.DEFINE_integer("step", 0, "Checkpoint label written on the Orbax side (0: a starting point; from olmo-core: "
                     "default its training step).")
flags.DEFINE_enum("param_dtype", None, ["float32", "bfloat16"],
                  "Orbax parameter dtype (default float32: train.py's master weights; bf16 -> fp32 is exact).")
flags.DEFINE_enum("hf_dtype", None, ["float32", "bfloat16"], "HF output dtype (default: the checkpoint's param dtype).")
flags.DEFINE_bool("with_optimizer_state", False,
                  "Also write zero fp32 Adam moments (Adam count 0), so train.py --init_from can start from "
                  "these weights exactly as from a fresh init. From olmo-core: default true, the checkpoint's "
                  "own SkipStepAdamW moments and count (--nowith_optimizer_state: weights only).")
flags.DEFINE_bool("verify", False, "Run the HF model in torch and ours on the same tokens; report KL/top-1/top-10.")
flags.DEFINE_float("max_kl", 1e-4, "--verify fails when the mean per-token KL(HF || ours) exceeds this (nats).")
flags.DEFINE_integer("verify_seq", 256, "--verify: tokens per sequence.")
flags.DEFINE_integer("verify_batch", 2, "--verify: sequences.")
flags.DEFINE_integer("pad_vocab", None,
                     "HF -> Orbax: pad the vocabulary to N rows, as OLMo-core trains (100352 for dolma2's "
                     "100,278 tokens; stage1.flags' --vocab_size); the new rows get OLMo-core's init.")
flags.DEFINE_integer("pad_seed", 0, "--pad_vocab: PRNG seed of the padded rows.")
flags.DEFINE_integer("hf_vocab_size", None,
                     "Orbax -> HF: rows to keep (default: a vocabulary padded past dolma2's 100,278 tokens "
                     "is cut back to them, as AI2's HF checkpoints hold; otherwise all rows).")
flags.DEFINE_float("shard_gb", 5.0, "HF output: start a new safetensors shard past this size (GB).")
cli.require([
    ("max_kl", lambda v: v is not None and not math.isnan(v), "a number, not NaN (a negative one fails every check)"),
    ("verify_seq", lambda v: v >= 1, ">= 1"),
    ("verify_batch", lambda v: v >= 1, ">= 1"),
    ("shard_gb", lambda v: cli.finite(v) and v > 0, "finite and > 0"),
    ("hf_vocab_size", lambda v: v is None or v >= 1, ">= 1 rows (leave it out for the checkpoint's real tokens)"),
    # 10**25 was written as a label no run could resume (train.py's steps are int32).
    ("step", lambda v: 0 <= v < cli.STEP_LIMIT, f">= 0 and < {cli.STEP_LIMIT:,} (a checkpoint label: the steps "
                                                "trained)")])

WINDOW = 128  # skip-step window (olmo3/optim.py WINDOW, OLMo-core rolling_interval_length)


def _import():
    """Heavy imports after flag parsing, so --help is instant."""
    global eqx, jax, olmo3, hf, checkpoint, heldout, load, olmo_core, OLMo3, optim, schedules, config_from_dict, config_to_dict
    import equinox as eqx
    import jax

    import olmo3
    from olmo3 import checkpoint, heldout, hf, load, olmo_core, optim, schedules
    from olmo3.config import config_from_dict, config_to_dict
    from olmo3.model import OLMo3


# ---------------------------------------------------------------------------------------------
# §1 A lazy tensor for Orbax: its shape and dtype are known up front, its values are produced
# only when Orbax writes it, part by part (one layer of a stacked weight at a time), and tensors
# are written one after another. (Orbax's own numpy handler copies every array and writes them
# all at once: peak memory would be the whole checkpoint.)
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _lazy_tensor_types():
    import jax
    import tensorstore as ts
    from orbax.checkpoint import future, multihost, type_handlers

    class LazyTensor(jax.ShapeDtypeStruct):
        """A ShapeDtypeStruct (so checkpoint.tensor_names lists it) whose `parts()` yields
        (index, numpy array) pieces covering it: blocks of `block` along `axis`, or ((), whole)."""

        def __init__(self, shape, dtype, parts, axis=None, block=None):
            super().__init__(tuple(shape), dtype)
            self.parts, self.axis, self.block = parts, axis, block

    class SequentialNumpyHandler(type_handlers.NumpyHandler):
        """Writes LazyTensors in turn, part by part, as plain numpy arrays (typestr 'np.ndarray',
        the same TensorStore spec as Orbax's numpy handler: restore is Orbax's stock reader).
        Public Orbax API only: `type_handlers.get_json_tspec_write` gives the spec Orbax's own
        handler writes with; metadata files keep Orbax's default name (metadata_key None)."""

        def __init__(self):
            super().__init__(deepcopy_host_arrays=False)

        async def _write_parts(self, value, info, arg):
            await info.await_path_creation()
            chunk = value.shape  # one storage chunk per part: each part's write completes its
            if value.axis is not None:  # chunk, so nothing waits in memory for the rest of the array
                chunk = tuple(value.block if d == value.axis else n for d, n in enumerate(value.shape))
            ocdbt = info.is_ocdbt_checkpoint  # OCDBT files live under a per-process subdirectory
            spec = type_handlers.get_json_tspec_write(
                info, use_ocdbt=ocdbt, global_shape=value.shape, local_shape=chunk, dtype=value.dtype,
                process_index=multihost.process_index() if ocdbt else None, metadata_key=None, arg=arg)
            t = await ts.open(ts.Spec(spec), create=True, open=True, context=info.ts_context)
            for index, part in value.parts():
                if part.dtype != value.dtype:
                    raise ValueError(f"{info.name}: part has dtype {part.dtype}, expected {value.dtype}")
                await t[index].write(part)
                del part

        async def serialize(self, values, infos, args=None):
            args = args or [type_handlers.SaveArgs()] * len(values)

            async def write_in_turn():
                for value, info, arg in zip(values, infos, args):
                    await self._write_parts(value, info, arg)

            return [future.CommitFutureAwaitingContractedSignals(write_in_turn(), name="lazy_tensors")]

    type_handlers.register_type_handler(LazyTensor, SequentialNumpyHandler(),
                                            func=lambda t: issubclass(t, LazyTensor), override=True)
    return LazyTensor


# ---------------------------------------------------------------------------------------------
# §2 HF -> Orbax. Our layout stacks every per-layer weight on a leading [n_layers] axis and
# stores matrices [in, out] (torch Linear stores [out, in]); olmo3/hf.py's LAYER_MAP names them.
# ---------------------------------------------------------------------------------------------
def hf_to_orbax(src: str, dst: str, *, step: int = 0, param_dtype: str = "float32",
                with_optimizer_state: bool = False, pad_vocab: int | None = None,
                pad_seed: int = 0) -> "olmo3.Config":
    _import()
    LazyTensor = _lazy_tensor_types()
    config = hf.read_hf_config(src, param_dtype=param_dtype)
    hf_vocab = config.vocab_size
    if pad_vocab is not None:
        if pad_vocab > 2 * hf_vocab:   # 10**25 rows ran out of time, not of memory, without a word
            raise ValueError(f"--pad_vocab={pad_vocab} is more than twice {src}'s vocabulary of {hf_vocab} rows; "
                             "padding rounds the vocabulary up (OLMo-core: 100278 -> 100352), give such a size")
        if pad_vocab < hf_vocab:
            raise ValueError(f"--pad_vocab={pad_vocab} is smaller than {src}'s vocabulary of {hf_vocab} rows; "
                             f"pass N >= {hf_vocab} (OLMo-core pads dolma2 to 100352)")
        config = config.replace(vocab_size=pad_vocab)
    sd = hf.SafetensorsReader(src)
    abstract = eqx.filter_eval_shape(OLMo3, config, jax.random.key(0))
    dtype = np.dtype(config.pdtype)
    expected = hf.tensor_names(config)
    extra_names = sorted(k for k in sd if k not in expected and "rotary_emb" not in k)
    missing = sorted(expected - set(sd))
    if missing or extra_names:
        raise ValueError(f"{src}: tensors do not match config.json (n_layers={config.n_layers}): missing "
                         f"{missing[:4]}{' ...' if len(missing) > 4 else ''}, unexpected {extra_names[:4]}")

    for name in sorted(expected):
        hf.require_float(name, sd.dtype(name), src)

    def finite(name, a):   # checked as each block streams through
        return hf.require_finite(name, a, src)

    def hf_tensor(name, want_shape, transpose):
        _check_shape(src, sd, name, want_shape, transpose)
        return finite(name, np.asarray(sd[name].T if transpose else sd[name], dtype))

    def vocab_shape(shape, transpose):  # the HF tensor's share of a (possibly padded) vocab matrix
        return (shape[0], hf_vocab) if transpose else (hf_vocab, shape[1])

    def single(name, shape, transpose):  # embed [V, d] in row blocks; lm_head [d, V] in column blocks
        if len(shape) != 2:                                               # the final norm, whole
            _check_shape(src, sd, name, shape, transpose)
            return LazyTensor(shape, dtype, lambda: [((), finite(name, np.asarray(sd[name], dtype)))])
        axis = 1 if transpose else 0
        block = _block(shape, axis, dtype)
        pad = padded_rows(name, shape[axis] - hf_vocab, shape[1 - axis])               # (V - V_hf, d)

        def parts():
            for a in range(0, shape[axis], block):
                rows = finite(name, np.asarray(sd[name][a:a + block], dtype))    # HF rows a..a+block
                if a + block > hf_vocab:  # the block runs into the padding
                    rows = np.concatenate([rows, pad[max(a - hf_vocab, 0):a + block - hf_vocab]])
                yield ((slice(None), slice(a, a + block)) if transpose else slice(a, a + block)), (
                    rows.T if transpose else rows)
        _check_shape(src, sd, name, vocab_shape(shape, transpose), transpose)
        return LazyTensor(shape, dtype, parts, axis, block)

    def padded_rows(name, n, d):
        """OLMo-core's init of the rows past the tokenizer: truncated normal, std 0.02, cut at
        +-3 std (InitMethod.normal for the embedding and the output projection; DESIGN §2)."""
        key = jax.random.fold_in(jax.random.key(pad_seed), 0 if name.startswith("model.embed") else 1)
        return np.asarray(config.init_std * jax.random.truncated_normal(key, -3.0, 3.0, (n, d)), dtype)

    def stacked(suffix, shape, transpose):                               # (L, in, out), a layer at a time
        return LazyTensor(shape, dtype, lambda: ((i, hf_tensor(f"model.layers.{i}.{suffix}", shape[1:], transpose))
                                                 for i in range(shape[0])), 0, 1)

    # Every shape is checked before anything is written.
    for f, suffix, t in hf.LAYER_MAP:
        for i in range(config.n_layers):
            _check_shape(src, sd, f"model.layers.{i}.{suffix}", getattr(abstract.layers, f).shape[1:], t)
    for name, shape, t in [("model.embed_tokens.weight", vocab_shape(abstract.embed.shape, False), False),
                           ("model.norm.weight", abstract.norm.shape, False),
                           ("lm_head.weight", vocab_shape(abstract.lm_head.shape, True), True)]:
        _check_shape(src, sd, name, shape, t)
    layers = {f: stacked(s, getattr(abstract.layers, f).shape, t) for f, s, t in hf.LAYER_MAP}
    model = eqx.tree_at(
        lambda m: (m.embed, m.layers, m.norm, m.lm_head), abstract,
        (single("model.embed_tokens.weight", abstract.embed.shape, False),
         eqx.tree_at(lambda l: [getattr(l, f) for f, _, _ in hf.LAYER_MAP], abstract.layers,
                     [layers[f] for f, _, _ in hf.LAYER_MAP]),
         single("model.norm.weight", abstract.norm.shape, False),
         single("lm_head.weight", abstract.lm_head.shape, True)))
    state = {"model": model}
    if with_optimizer_state:
        state["opt"] = zero_optimizer_state(abstract, LazyTensor)
    extra = {"stage": 0, "model_config": config_to_dict(config), "converted_from": f"hf:{os.path.abspath(src)}",
             "with_optimizer_state": with_optimizer_state, "hf_vocab_size": hf_vocab}
    write_orbax(dst, step, state, extra)
    return config


PART_BYTES = 2**28  # embed / lm_head / optimizer moments are written in parts of at most 256 MB
MAX_PARTS = 64


def _block(shape, axis, dtype):
    """Rows (along `axis`) per part: the largest divisor of shape[axis] whose slab stays under
    PART_BYTES, unless that makes more than MAX_PARTS tiny parts (a vocabulary with awkward
    divisors), then the smallest divisor giving at most MAX_PARTS. 100278 = 9 x 11142: the dolma2
    embedding goes in 9 parts of 183 MB at d_model 4096 (fp32), 6 of 137 MB at d_model 2048."""
    n = shape[axis]
    slab = math.prod(shape) // n * np.dtype(dtype).itemsize
    divisors = [c for c in range(1, n + 1) if n % c == 0]
    fit = [c for c in divisors if c * slab <= PART_BYTES]
    block = max(fit) if fit else 1
    if n // block > MAX_PARTS:
        block = min(c for c in divisors if n // c <= MAX_PARTS)
    return block


def _check_shape(src, sd, name, our_shape, transpose):
    want = tuple(our_shape[::-1]) if transpose else tuple(our_shape)
    if tuple(sd.shape(name)) != want:
        raise ValueError(f"{src}: tensor {name!r} has shape {tuple(sd.shape(name))}, config.json implies {want}; "
                         "the config does not describe these weights")


def zero_optimizer_state(abstract_model, LazyTensor):
    """Fresh SkipStepAdamW state (zero fp32 mu/nu, Adam count 0, empty skip-step windows), the
    same values `optimizer.init` gives; train.py's warm start keeps count 0, so the first
    update is a cold Adam step on the converted weights."""
    opt = optim.SkipStepAdamW(schedules.constant_schedule(0.0), window=WINDOW)
    abstract_opt = eqx.filter_eval_shape(opt.init, abstract_model)
    def zeros(s):  # blocks along the first axis, as the weights
        if not s.shape:
            return LazyTensor(s.shape, s.dtype, lambda: [((), np.zeros(s.shape, s.dtype))])
        block = 1 if len(s.shape) == 3 else _block(s.shape, 0, s.dtype)
        return LazyTensor(s.shape, s.dtype, lambda: ((slice(a, a + block), np.zeros((block, *s.shape[1:]), s.dtype))
                                                     for a in range(0, s.shape[0], block)), 0, block)
    return jax.tree.map(zeros, abstract_opt)


def write_orbax(dst: str, step: int, state, extra: dict) -> None:
    if os.path.isdir(dst) and os.listdir(dst):  # a run directory of its own, as the --to help says
        held = (checkpoint.CheckpointManager(dst, read_only=True).all_steps()
                if os.path.isdir(os.path.join(dst, checkpoint.CHECKPOINTS)) else [])
        raise FileExistsError(f"--to=orbax:{dst} " + (f"already holds checkpoints {held}" if held else
                                                      "exists and is not empty") + "; choose a new directory")
    # In a temporary sibling, renamed into place when complete: a tensor that fails to read
    # mid-write (a damaged source) left <dst>/checkpoints/<step>.orbax-checkpoint-tmp, and the
    # rerun was refused for the directory it had left.
    with checkpoint.new_directory(dst, "Orbax checkpoint") as tmp:
        mgr = checkpoint.CheckpointManager(tmp, keep=None, async_save=False)
        mgr.save(step, state, extra)
        mgr.wait()
        mgr.close()


# ---------------------------------------------------------------------------------------------
# §3 Orbax -> HF: read one stacked tensor at a time, write its layers into the safetensors file(s).
# ---------------------------------------------------------------------------------------------
def orbax_to_hf(src: str, dst: str, *, hf_dtype: str | None = None, shard_gb: float = 5.0,
                hf_vocab_size: int | None = None) -> "olmo3.Config":
    _import()
    run, step = checkpoint.locate(src)
    mgr = checkpoint.CheckpointManager(run, read_only=True)
    step = mgr.verify(step)  # a damaged checkpoint is named before anything is written
    extra = mgr.read_extra(step)
    if "model_config" not in extra:
        raise ValueError(f"{src}: checkpoint extra has no model_config (not written by train.py or convert.py)")
    config = config_from_dict(extra["model_config"])
    abstract = eqx.filter_eval_shape(OLMo3, config, jax.random.key(0))
    out_dtype = np.dtype(getattr(jax.numpy, hf_dtype or config.param_dtype))
    floor = extra.get("hf_vocab_size") or unpadded_vocab(config.vocab_size)   # the real tokens' rows
    hf_vocab = floor if hf_vocab_size is None else hf_vocab_size   # 0 was taken for "unset"
    if not floor <= hf_vocab <= config.vocab_size:   # only padding rows may be dropped
        raise ValueError(f"--hf_vocab_size={hf_vocab}: keep between the {floor} rows of real tokens and the "
                         f"checkpoint's {config.vocab_size}")
    if hf_vocab < config.vocab_size:
        logging.info("dropping vocabulary rows %d..%d (OLMo-core's padding) from the HF output",
                     hf_vocab, config.vocab_size - 1)
    L = config.n_layers
    layer_fields = {f for f, _, _ in hf.LAYER_MAP}
    checksums = checkpoint.BlockChecksums(mgr, step)   # a tensor with other bits than saved stops the writer

    # (our field, HF names, per-name slice of the stacked array, transpose)
    plan = [("embed", ["model.embed_tokens.weight"], False)]
    plan += [(f, [f"model.layers.{i}.{s}" for i in range(L)], t) for f, s, t in hf.LAYER_MAP]
    plan += [("norm", ["model.norm.weight"], False), ("lm_head", ["lm_head.weight"], True)]

    def our_shape(field):
        return (getattr(abstract.layers, field) if field in layer_fields else getattr(abstract, field)).shape

    def hf_shape(field, transpose):
        s = our_shape(field)[1:] if field in layer_fields else our_shape(field)
        s = tuple(s[::-1]) if transpose else tuple(s)
        return (hf_vocab, *s[1:]) if field in ("embed", "lm_head") else s

    # Shards: tensors in plan order, a new file past shard_gb (HF's own index format).
    specs, shards, size = [], [[]], 0
    limit = int(shard_gb * 1e9)
    for field, names, t in plan:
        for n in names:
            nbytes = int(np.prod(hf_shape(field, t))) * out_dtype.itemsize
            if shards[-1] and size + nbytes > limit:
                shards.append([])
                size = 0
            shards[-1].append((n, hf_shape(field, t), out_dtype))
            size += nbytes
            specs.append(n)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])

    try:
        with hf.new_hf_dir(dst, config.replace(param_dtype=str(out_dtype), vocab_size=hf_vocab)) as tmp:
            writers = [hf.SafetensorsWriter(os.path.join(tmp, f), s) for f, s in zip(files, shards)]
            shard_of = {n: k for k, s in enumerate(shards) for n, _, _ in s}
            for field, names, transpose in plan:
                stacked, row = field in layer_fields, 0   # row: HF rows of embed / lm_head written so far
                for i, part in read_parts(mgr, step, field, our_shape(field), config.pdtype, stacked, transpose,
                                          checksums):
                    name = names[i] if stacked else names[0]
                    part = part.T if transpose else part
                    if field in ("embed", "lm_head"):  # padded vocabulary rows stay behind
                        part, row = part[:max(hf_vocab - row, 0)], row + len(part)
                    if len(part):
                        writers[shard_of[name]].write(name, part)
                    del part
            for w in writers:
                w.close()
            if len(files) > 1:
                index = {"metadata": {"total_size": int(sum(np.prod(s[1]) * out_dtype.itemsize
                                                            for sh in shards for s in sh))},
                         "weight_map": {n: files[k] for n, k in shard_of.items()}}
                with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                    json.dump(index, f, indent=2)
    finally:
        mgr.close()
    return config


def unpadded_vocab(vocab_size: int) -> int:
    """HF rows of a vocabulary: OLMo-core pads dolma2's 100,278 tokens (to 100352); rows past the
    tokenizer are padding, which AI2's HF checkpoints do not hold. Smaller research
    vocabularies are kept whole."""
    import data
    return min(vocab_size, data.VOCAB_SIZE)


def read_parts(mgr, step, field, shape, dtype, stacked, transpose, checksums=None):
    """Yield (layer, array) pieces of one model tensor, straight from TensorStore: a layer at a
    time, or blocks of rows of the HF tensor (embed rows; lm_head columns), when the checkpoint's
    storage chunks allow (convert.py's layout), else the whole tensor; through Orbax's restore if
    the checkpoint is not in Orbax's OCDBT + zarr layout. `checksums` (checkpoint.BlockChecksums)
    sees every piece read from TensorStore, so a tensor with other bits than were saved stops the
    conversion when its last piece is read (Orbax's restore checks its own)."""
    import tensorstore as ts
    name = f"model.layers.{field}" if stacked else f"model.{field}"
    state_dir = os.path.join(mgr.directory, str(step), "state")  # olmo3/checkpoint.py's layout
    try:
        t = ts.open({"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{state_dir}", "path": name}},
                    open=True, read=True, context=ts.Context({"cache_pool": {"total_bytes_limit": 0}})).result()
    except ValueError as e:  # another layout: let Orbax find the tensor (whole tensor in memory)
        logging.info("reading %s through Orbax (%s)", name, e)
        want = {"model": {"layers": {field: jax.ShapeDtypeStruct(shape, dtype)}} if stacked else
                {field: jax.ShapeDtypeStruct(shape, dtype)}}
        state, _ = mgr.restore(step, want)
        arr = np.asarray(state["model"]["layers"][field] if stacked else state["model"][field])
        yield from (enumerate(arr) if stacked else [(0, arr)])
        return
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"checkpoint {state_dir}: tensor {name!r} has shape {tuple(t.shape)}, model_config "
                         f"implies {tuple(shape)}")

    def read(block, start):
        a = block.read().result()
        if checksums is not None:
            checksums.add(name, a, start, shape)
        return a

    zeros = (0,) * len(shape)
    chunk = t.chunk_layout.read_chunk.shape
    if stacked:
        if chunk[0] == 1:
            for i in range(shape[0]):
                yield i, read(t[i], (i,) + zeros[1:])
        else:
            yield from enumerate(read(t, zeros))
        return
    axis = 1 if transpose else 0  # the axis along which HF rows run
    if len(shape) == 2 and all(c == n for d, (c, n) in enumerate(zip(chunk, shape)) if d != axis):
        for a in range(0, shape[axis], chunk[axis]):
            yield 0, read(t[:, a:a + chunk[axis]], (0, a)) if axis else read(t[a:a + chunk[axis]], (a, 0))
    else:
        yield 0, read(t, zeros)


# ---------------------------------------------------------------------------------------------
# §4 OLMo-core <-> Orbax: AI2's own training checkpoints (torch distributed checkpoints), Adam
# moments included, so that stage 2 / 3 start from AI2's warm Adam (DESIGN §3). Names, layouts
# and the optimizer-state mapping are in olmo3/olmo_core.py; the Orbax side is §1's LazyTensor.
# ---------------------------------------------------------------------------------------------
def olmo_core_to_orbax(src: str, dst: str, *, step: int | None = None, param_dtype: str = "float32",
                       with_optimizer_state: bool = True) -> "olmo3.Config":
    """An OLMo-core checkpoint (olmo3/olmo_core.py's locate: a stepN dir, local or URL) as
    <dst>/checkpoints/<label>: the model, and SkipStepAdamW's moments and count as our OptState
    (train.py --init_from's {"model", "opt"}). Label: `step`, else the checkpoint's step."""
    _import()
    LazyTensor = _lazy_tensor_types()
    step_dir, dcp_dir, oc_step = olmo_core.locate(src)
    reader = olmo_core.DistCheckpointReader(dcp_dir)
    config, config_from = olmo_core.read_config(step_dir, reader, param_dtype=param_dtype)
    logging.info("%s: model config from %s", src, config_from)
    abstract = eqx.filter_eval_shape(OLMo3, config, jax.random.key(0))
    names = olmo_core.param_names(config.n_layers)
    for field, layer, name, t in names:  # every shape is checked before anything is written
        ours = (getattr(abstract.layers, field).shape[1:] if layer is not None else getattr(abstract, field).shape)
        want = tuple(ours[::-1]) if t else tuple(ours)
        got = reader.shape(f"model.{name}") if f"model.{name}" in reader.tensors else "missing"
        if got != want:
            raise ValueError(f"{dcp_dir}: tensor model.{name} is {got}, the model config ({config_from}) implies {want}")
    extra_tensors = sorted(set(n for n in reader.tensors if n.startswith("model.")) - {f"model.{n[2]}" for n in names})
    deeper = sorted({int(m.group(1)) for n in extra_tensors if (m := re.match(r"model\.blocks\.(\d+)\.", n))})
    if deeper and deeper[0] >= config.n_layers:
        raise ValueError(f"{dcp_dir}: the checkpoint has blocks up to {deeper[-1]}, more than the {config.n_layers} "
                         f"layers of the model config ({config_from}); give the run's own config.json")
    if extra_tensors:   # biases, attention sinks, gates: an architecture this model does not have
        raise ValueError(f"{dcp_dir}: tensor(s) {extra_tensors[:4]}{' ...' if len(extra_tensors) > 4 else ''} are not "
                         "part of an OLMo 3 model (no biases, sinks or gates); converting would drop them")

    def tree(key, dtype):  # our model's structure, each leaf read from the checkpoint when Orbax writes it
        def lazy(field, stacked, name, t):
            shape = (getattr(abstract.layers, field) if stacked else getattr(abstract, field)).shape
            if stacked:                                                        # (L, in, out), a layer at a time
                return LazyTensor(shape, dtype, lambda: ((i, olmo_core.read_layer(reader, key(f"blocks.{i}.{name}"), t, dtype))
                                                         for i in range(config.n_layers)), 0, 1)
            if len(shape) == 1:
                return LazyTensor(shape, dtype, lambda: [((), olmo_core.read_layer(reader, key(name), t, dtype))])
            axis = 1 if t else 0  # embed [V, d] in row blocks, lm_head [d, V] in column blocks (as §2)
            block = _block(shape, axis, dtype)

            def parts():
                whole = olmo_core.read_layer(reader, key(name), t, dtype)  # one tensor in memory at a time
                for a in range(0, shape[axis], block):
                    yield ((slice(None), slice(a, a + block)) if axis else slice(a, a + block)), (
                        whole[:, a:a + block] if axis else whole[a:a + block])
            return LazyTensor(shape, dtype, parts, axis, block)
        layers = eqx.tree_at(lambda l: [getattr(l, f) for f, _, _ in olmo_core.LAYER_MAP], abstract.layers,
                             [lazy(f, True, s, t) for f, s, t in olmo_core.LAYER_MAP])
        return eqx.tree_at(lambda m: (m.embed, m.layers, m.norm, m.lm_head), abstract,
                           (lazy("embed", False, "embeddings.weight", False), layers,
                            lazy("norm", False, "lm_head.norm.weight", False),
                            lazy("lm_head", False, "lm_head.w_out.weight", True)))

    state = {"model": tree(lambda n: f"model.{n}", np.dtype(config.pdtype))}
    extra = {"stage": 0, "model_config": config_to_dict(config), "converted_from": f"olmo-core:{step_dir}",
             "olmo_core_step": oc_step, "with_optimizer_state": with_optimizer_state}
    if with_optimizer_state:   # every moment checked before anything is written, as the weights
        count, counts = olmo_core.adam_count(reader)   # none at all: one line saying so
        missing = [f"optim.state.{name}.{m}" for _, _, name, _ in names for m in olmo_core.MOMENTS.values()
                   if f"optim.state.{name}.{m}" not in reader.tensors
                   or reader.shape(f"optim.state.{name}.{m}") != reader.shape(f"model.{name}")]
        if missing:
            raise ValueError(f"{dcp_dir}: no Adam moments of the weights' shapes for {missing[:3]}"
                             f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''} (frozen parameters "
                             "have none); convert the weights alone with --nowith_optimizer_state")
        if len(counts) > 1:
            logging.warning("%s: parameters disagree on the Adam step %s; using %d", src, sorted(counts), count)
        if count == 0 and oc_step:  # OLMo-core before step_increment_bugfix never advanced `step`
            logging.warning("%s: Adam step 0 at training step %d: written without OLMo-core's "
                            "step_increment_bugfix; bias correction restarts here", src, oc_step)
        opt = optim.SkipStepAdamW(schedules.constant_schedule(0.0), window=WINDOW)
        abstract_opt = eqx.filter_eval_shape(opt.init, abstract)
        scalar = lambda v: LazyTensor((), np.int32, lambda: [((), np.asarray(v, np.int32))])  # noqa: E731
        moments = [tree(lambda n, m=m: f"optim.state.{n}.{m}", np.dtype(np.float32)) for m in olmo_core.MOMENTS.values()]
        opt_state = eqx.tree_at(lambda s: (s.step, s.count, s.mu, s.nu), abstract_opt,
                                (scalar(oc_step if oc_step is not None else count), scalar(count), *moments))
        zeros = lambda s: LazyTensor(s.shape, s.dtype, lambda: [((), np.zeros(s.shape, s.dtype))])  # noqa: E731
        # Empty skip-step windows: OLMo-core does not checkpoint its own (olmo3/olmo_core.py).
        opt_state = eqx.tree_at(lambda s: (s.loss_window, s.gnorm_window, s.n_seen), opt_state,
                                (zeros(abstract_opt.loss_window), zeros(abstract_opt.gnorm_window),
                                 zeros(abstract_opt.n_seen)))
        state["opt"] = opt_state
        extra["adam_count"] = count
    write_orbax(dst, step if step is not None else (oc_step or 0), state, extra)
    return config


def orbax_to_olmo_core(src: str, dst: str) -> "olmo3.Config":
    """Our checkpoint as an OLMo-core one: <dst>/model_and_optim/ (DCP) + config.json +
    .metadata.json, loadable by OLMo-core's Checkpointer.load with load_trainer_state=False (its
    stage-2/3 scripts' setting; no train/ state is written). Adam moments and count go along when
    the checkpoint holds them; parameters and moments are fp32 (OLMo-core's master weights).
    A Trainer's load_path must name <dst>/model_and_optim: OLMo-core counts a directory as a
    checkpoint when it holds `.metadata` itself or trainer state (Checkpointer.dir_is_checkpoint),
    and <dst> holds neither, so a Trainer pointed at <dst> would train from scratch."""
    _import()
    run, step = checkpoint.locate(src)
    mgr = checkpoint.CheckpointManager(run, read_only=True)
    step = mgr.verify(step)
    extra = mgr.read_extra(step)
    if "model_config" not in extra:
        raise ValueError(f"{src}: checkpoint extra has no model_config (not written by train.py or convert.py)")
    config = config_from_dict(extra["model_config"])
    model_config = olmo_core.config_to_olmo_core(config)   # what OLMo-core cannot build stops here, before writing
    abstract = eqx.filter_eval_shape(OLMo3, config, jax.random.key(0))
    stored = mgr.stored_tensors(step)
    with_opt = "opt.count" in stored
    if os.path.exists(dst) and os.listdir(dst):
        raise FileExistsError(f"--to=olmo-core:{dst} exists and is not empty; choose a new directory")
    f32 = np.dtype(np.float32)
    specs, source = {}, {}  # OLMo-core name -> (shape, dtype); -> (our stored name, layer or None, transpose)
    for field, layer, name, t in olmo_core.param_names(config.n_layers):
        ours = getattr(abstract.layers, field).shape[1:] if layer is not None else getattr(abstract, field).shape
        shape = tuple(ours[::-1]) if t else tuple(ours)
        path = f"layers.{field}" if layer is not None else field
        specs[f"model.{name}"] = (shape, f32)
        source[f"model.{name}"] = (f"model.{path}", layer, t)
        if with_opt:
            for ours_m, theirs in olmo_core.MOMENTS.items():
                specs[f"optim.state.{name}.{theirs}"] = (shape, f32)
                source[f"optim.state.{name}.{theirs}"] = (f"opt.{ours_m}.{path}", layer, t)
            specs[f"optim.state.{name}.step"] = ((), f32)
    checksums = checkpoint.BlockChecksums(mgr, step)   # a tensor with other bits than saved stops the writer
    count = float(np.asarray(read_stored(mgr, step, "opt.count", (), checksums))) if with_opt else None

    def produce(name):  # called by torch's writer, one tensor at a time
        if name.endswith(".step"):
            return np.asarray(count, f32)
        ours, layer, t = source[name]
        a = np.asarray(read_stored(mgr, step, ours, layer, checksums), f32)
        return a.T if t else a

    groups = {}
    if with_opt:  # param groups as OLMo-core's flattened optimizer state dict holds them. On load
        # OLMo-core keeps its own config's initial_lr (OptimConfig.fixed_fields) and its scheduler
        # resets lr every step; betas, eps and weight decay come from here: the run's.
        run_flags = extra.get("flags") or {}
        lr = float(run_flags.get("lr") or schedules.STAGE1_PEAK)
        adam = {"b1": optim.BETAS[0], "b2": optim.BETAS[1], "eps": optim.EPS, "weight_decay": optim.WEIGHT_DECAY}
        if not set(adam) <= set(run_flags):   # saved before train.py recorded them (or by convert.py)
            logging.warning("%s does not record its run's AdamW settings: the OLMo-core param groups get the "
                            "recipe's (betas %s, eps %g, weight decay %g); a run trained with others (DPO's b2 "
                            "0.999, SFT and DPO's weight decay 0) resumes in OLMo-core with these", src,
                            optim.BETAS, optim.EPS, optim.WEIGHT_DECAY)
        adam.update({k: float(run_flags[k]) for k in adam if run_flags.get(k) is not None})
        for _, _, name, _ in olmo_core.param_names(config.n_layers):
            wd = 0.0 if name == "embeddings.weight" else adam["weight_decay"]  # the recipe's groups (olmo3/model.py)
            groups.update({f"optim.param_groups.{name}.lr": lr, f"optim.param_groups.{name}.initial_lr": lr,
                           f"optim.param_groups.{name}.betas": (adam["b1"], adam["b2"]),
                           f"optim.param_groups.{name}.eps": adam["eps"],
                           f"optim.param_groups.{name}.weight_decay": wd})
    try:
        with checkpoint.new_directory(dst, "OLMo-core checkpoint") as tmp:
            olmo_core.write_dist_checkpoint(os.path.join(tmp, olmo_core.MODEL_AND_OPTIM), specs, produce, groups)
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump({"model": model_config}, f, indent=1)
            with open(os.path.join(tmp, ".metadata.json"), "w") as f:
                json.dump({"ephemeral": False}, f)
    finally:
        mgr.close()
    return config


def read_stored(mgr, step, name, index, checksums=None):
    """One stored tensor of our checkpoint (`index` None), or layer `index` of a stacked one,
    through TensorStore (train.py / convert.py's OCDBT + zarr layout), else through Orbax.
    `checksums`: as read_parts'."""
    import tensorstore as ts
    state_dir = os.path.join(mgr.directory, str(step), "state")
    try:
        t = ts.open({"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{state_dir}", "path": name}},
                    open=True, read=True, context=ts.Context({"cache_pool": {"total_bytes_limit": 0}})).result()
    except ValueError:
        shape = mgr.stored_tensors(step)[name]
        want = jax.ShapeDtypeStruct(shape, np.float32 if name != "opt.count" else np.int32)
        for key in reversed(name.split(".")):
            want = {key: want}
        state, _ = mgr.restore(step, want)
        for key in name.split("."):
            state = state[key]
        return np.asarray(state if index is None else state[index])
    a = (t if index is None else t[index]).read().result()
    if checksums is not None:
        start = (0,) * len(t.shape) if index in (None, ()) else (index,) + (0,) * (len(t.shape) - 1)
        checksums.add(name, a, start, tuple(t.shape))
    return a


# ---------------------------------------------------------------------------------------------
# §5 Parity: the HF model in torch vs ours on the same tokens (DESIGN §5: the write-up reached
# KL ~1.5e-3 in bf16, 98.75% top-1; two correct fp32 implementations agree to ~1e-6 or better).
# ---------------------------------------------------------------------------------------------
def verify(hf_dir: str, ours, *, seq: int = 256, batch: int = 2, seed: int = 0) -> dict:
    _import()
    try:
        import torch
        import transformers
    except ImportError as e:
        raise RuntimeError(f"--verify needs torch and transformers ({e}); pip install torch transformers") from e
    import jax.numpy as jnp
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    V = ref.config.vocab_size
    rng = np.random.default_rng(seed)
    if V >= 100278:  # real text through the dolma2 tokenizer, as a user would feed it
        import data
        text = open(os.path.abspath(__file__)).read()
        ids = data.tokenizer.encode(text)
        rows = np.stack([np.resize(np.roll(ids, -k * seq), seq) for k in range(batch)])
    else:
        rows = rng.integers(0, V, size=(batch, seq))
    with torch.no_grad():
        ref_logits = ref(torch.tensor(rows, dtype=torch.long)).logits.float().numpy()
    ours_logits = np.asarray(jax.vmap(ours)(jnp.asarray(rows, jnp.int32)))
    # A padded vocabulary (--pad_vocab) is compared on the HF rows: the padding is not HF's to score.
    return heldout.logit_agreement(ref_logits, ours_logits[..., :ref_logits.shape[-1]])


def _peak_rss_gb() -> float:
    """This process's peak resident set (VmHWM). Not ru_maxrss: Linux carries it across execve,
    so a child of a big parent would report the parent's size."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _parse(spec: str, flag: str) -> tuple[str, str]:
    kind, sep, path = (spec or "").partition(":")
    if not sep or kind not in ("hf", "orbax", "olmo-core") or not path:
        raise app.UsageError(f"--{flag}={spec!r}: expected hf:<dir>, orbax:<dir> or olmo-core:<dir or URL>")
    if "://" in path and (kind != "olmo-core" or flag == "to"):   # os.path would write ./gs:/... locally
        raise app.UsageError(f"--{flag}={spec!r}: {kind}: takes a local or mounted directory, not a URL "
                             "(only --from=olmo-core: reads a URL); mount the bucket (Cloud Storage FUSE) or copy it")
    return kind, path


def _source_config(kind: str, path: str) -> "olmo3.Config | None":
    """The architecture of an hf: or orbax: source, read from its config / extra JSON alone
    (None when the checkpoint does not say: the conversion then names what is missing)."""
    _import()
    if kind == "hf":
        return hf.read_hf_config(path)
    run, step = checkpoint.locate(path)
    mgr = checkpoint.CheckpointManager(run, read_only=True)
    try:
        saved = mgr.read_extra(step).get("model_config")
    finally:
        mgr.close()
    return config_from_dict(saved) if saved else None


def main(argv):
    del argv   # cli.run refused any positional argument
    from olmo3 import logs
    logs.quiet_library_logs()   # our lines only, unless --verbosity asks for Orbax's and JAX's
    (src_kind, src), (dst_kind, dst) = _parse(F["from"].value, "from"), _parse(F.to, "to")
    if src_kind == dst_kind or "orbax" not in (src_kind, dst_kind):
        raise app.UsageError("--from and --to must be one orbax: and one hf: or olmo-core:")
    atomic.check_directory(dst, "--to", F.to)   # every format is written to a temporary directory, then renamed
    cli.advise(disk_full=f"free space under {dst} (--to), then convert again")
    if F.verify and "hf" in (src_kind, dst_kind):   # before converting, not after
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
        except ImportError as e:
            raise app.UsageError(f"--verify needs torch and transformers ({e}); pip install torch transformers, "
                                 "or convert without --verify") from None
    source = _source_config(src_kind, src) if F.verify and src_kind != "olmo-core" else None
    if source is not None:   # the parity forward fits the model's positions
        positions = source.max_position_embeddings
        if F.verify_seq > positions:
            raise app.UsageError(f"--verify_seq={F.verify_seq} is past the model's {positions} positions; give at "
                                 f"most {positions}")
    for names, needs in ((("max_kl", "verify_seq", "verify_batch"), "verify"),
                         (("pad_seed",), "pad_vocab")):   # each was ignored without it
        if not F[needs].value:
            cli.refuse_given(names, f"applies only with --{needs}; add --{needs}, or drop {{flag}}")
    if src_kind == "orbax":   # each was ignored: --step=2 of a run converted its newest step
        for names, hint in ((("step",), "; to convert step N of a run, give --from=orbax:<run>/checkpoints/N"),
                            (("param_dtype", "with_optimizer_state", "pad_vocab"), "")):
            cli.refuse_given(names, "applies to the checkpoint written on the Orbax side (--to=orbax:), not to "
                             f"--from=orbax:{hint}")
    if dst_kind != "hf":   # each was ignored
        cli.refuse_given(("hf_dtype", "hf_vocab_size", "shard_gb"), "only applies to --to=hf:")
    t0 = time.time()
    if "olmo-core" in (src_kind, dst_kind):  # §4
        cli.refuse_given(("verify", "pad_vocab"), "applies to hf: conversions, not olmo-core:")
        if src_kind == "olmo-core":
            config = olmo_core_to_orbax(src, dst, step=F.step if F["step"].present else None,
                                        param_dtype=F.param_dtype or "float32",
                                        with_optimizer_state=F.with_optimizer_state if F["with_optimizer_state"].present else True)
        else:
            config = orbax_to_olmo_core(src, dst)
        print(f"converted {src_kind}:{src} -> {dst_kind}:{dst}: {config.num_params():,} parameters in "
              f"{time.time() - t0:.1f} s, peak RSS {_peak_rss_gb():.2f} GB")
        if dst_kind == "olmo-core":   # OLMo-core's load asks for optimizer state by default, and fails without it
            dcp = os.path.join(dst, olmo_core.MODEL_AND_OPTIM)
            moments = any(k.startswith("optim.state.") for k in olmo_core.DistCheckpointReader(dcp).tensors)
            print(f"OLMo-core: load_path={dcp}, load_trainer_state=False, load_optim_state={moments} ("
                  + ("the model and optimizer state" if moments else "the model's weights only")
                  + f"; {dst} itself holds no trainer state)")
        return
    if src_kind == "hf":
        config = hf_to_orbax(src, dst, step=F.step, param_dtype=F.param_dtype or "float32",
                             with_optimizer_state=F.with_optimizer_state, pad_vocab=F.pad_vocab,
                             pad_seed=F.pad_seed)
        hf_dir, orbax_dir = src, dst
    else:
        config = orbax_to_hf(src, dst, hf_dtype=F.hf_dtype, shard_gb=F.shard_gb, hf_vocab_size=F.hf_vocab_size)
        hf_dir, orbax_dir = dst, src
    peak_gb = _peak_rss_gb()
    print(f"converted {src_kind}:{src} -> {dst_kind}:{dst}: {config.num_params():,} parameters in "
          f"{time.time() - t0:.1f} s, peak RSS {peak_gb:.2f} GB")
    if F.verify:
        ours, _ = load.load_model(orbax_dir)
        r = verify(hf_dir, ours, seq=F.verify_seq, batch=F.verify_batch)
        print(f"parity on {r['tokens']} tokens: KL(HF || ours) mean {r['kl_mean']:.3g} max {r['kl_max']:.3g} "
              f"nats | top-1 agreement {100 * r['top1']:.2f}% | top-10 overlap {100 * r['top10']:.2f}%")
        if not r["kl_mean"] <= F.max_kl:   # a rerun converts to the same numbers: exit 2, not retried
            raise cli.UserError(f"--verify failed: mean KL {r['kl_mean']:.3g} > --max_kl={F.max_kl}; the converted "
                                f"model is at {dst}, for inspection (delete it before converting again)")


if __name__ == "__main__":
    flags.mark_flags_as_required(["from", "to"])
    cli.run(main)  # a user's error: one line, exit 2 (olmo3/cli.py)
