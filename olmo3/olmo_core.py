"""OLMo-core training checkpoints <-> our model and optimizer state, tensor by tensor.

An OLMo-core trainer checkpoint (train/checkpoint.py `Checkpointer.save`) is a directory

    stepN/model_and_optim/   torch.distributed.checkpoint (DCP): `.metadata` + `__R_K.distcp`
    stepN/train/rankR.pt     the trainer's state (global_step, data loader position, ...)
    stepN/config.json        the experiment config (ConfigSaverCallback), `model` = TransformerConfig
    stepN/.metadata.json     {"ephemeral": ..., "version": ...}

and the DCP state dict is the train module's (`flatten_optimizer_state_dict=True`):

    model.<param>                                   the Transformer's parameters, torch layout
    optim.state.<param>.{exp_avg, exp_avg_sq, step} SkipStepAdamW's fp32 moments and float step
    optim.param_groups.<param>.{lr, betas, eps, weight_decay, initial_lr}

OLMo-core's names (nn/transformer/model.py, block.py, nn/attention, nn/feed_forward.py,
nn/lm_head.py) against ours (olmo3/model.py); torch's Linear stores [out, in], we store [in, out]:

    embeddings.weight                 [V, d]    embed
    blocks.N.attention.w_{q,k,v,out}  [out, in] layers.{q,k,v,o}_proj[N]          (transposed)
    blocks.N.attention.{q,k}_norm     [H*hd]    layers.{q,k}_norm[N]   QK-norm over the full projection
    blocks.N.attention_norm           [d]       layers.post_attention_norm[N]   (reordered-norm block:
    blocks.N.feed_forward_norm        [d]       layers.post_feedforward_norm[N]  the norms follow)
    blocks.N.feed_forward.w1 / w3     [mlp, d]  layers.gate_proj / up_proj[N]   silu(w1 x) * w3 x
    blocks.N.feed_forward.w2          [d, mlp]  layers.down_proj[N]
    lm_head.norm.weight               [d]       norm
    lm_head.w_out.weight              [V, d]    lm_head                          (transposed)

SkipStepAdamW (optim/adamw.py) against olmo3/optim.py: exp_avg -> mu, exp_avg_sq -> nu (same
layout as the parameter, so transposed like it); `step` (one float per parameter, the number of
applied Adam updates: bias correction uses step + 1) -> OptState.count. Its skip-step windows
(`_losses`, `_grad_norms`) are not checkpointed by OLMo-core, so a loaded optimizer starts
with empty windows, as ours does (n_seen 0).

torch is needed for this format only (DCP metadata is a pickle, each stored chunk a torch.save
stream); it is imported on first use with a clear error where it is missing.
"""
from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import re
from typing import Any, Callable, Optional

import numpy as np
from jaxtyping import Shaped

from data import storage
from olmo3.cli import UserError
from olmo3.config import Config, YaRN

# (our Layer field, OLMo-core suffix under blocks.N., transpose?)
LAYER_MAP = (
    ("q_proj", "attention.w_q.weight", True),
    ("k_proj", "attention.w_k.weight", True),
    ("v_proj", "attention.w_v.weight", True),
    ("o_proj", "attention.w_out.weight", True),
    ("q_norm", "attention.q_norm.weight", False),
    ("k_norm", "attention.k_norm.weight", False),
    ("gate_proj", "feed_forward.w1.weight", True),
    ("up_proj", "feed_forward.w3.weight", True),
    ("down_proj", "feed_forward.w2.weight", True),
    ("post_attention_norm", "attention_norm.weight", False),
    ("post_feedforward_norm", "feed_forward_norm.weight", False),
)
# (our top-level field, OLMo-core name, transpose?)
TOP_MAP = (
    ("embed", "embeddings.weight", False),
    ("norm", "lm_head.norm.weight", False),
    ("lm_head", "lm_head.w_out.weight", True),
)
MOMENTS = {"mu": "exp_avg", "nu": "exp_avg_sq"}
MODEL_AND_OPTIM = "model_and_optim"


def torch_module():
    """torch, or a one-line error saying how to get it (only this format needs it)."""
    try:
        import torch
        import torch.distributed.checkpoint  # noqa: F401
    except ImportError as e:
        raise UserError(f"reading or writing OLMo-core checkpoints needs torch ({e}); "
                        "pip install 'olmo3-jax[olmo-core]' (or pip install torch)") from None
    return torch


def param_names(n_layers: int) -> list[tuple[str, Optional[int], str, bool]]:
    """(our field, layer or None, OLMo-core parameter name, transpose) for every parameter, in
    our checkpoint's order (embed, stacked layer fields, norm, lm_head)."""
    out = [("embed", None, "embeddings.weight", False)]
    out += [(f, i, f"blocks.{i}.{s}", t) for f, s, t in LAYER_MAP for i in range(n_layers)]
    out += [(f, None, name, t) for f, name, t in TOP_MAP[1:]]
    return out


# ---- finding a checkpoint ---------------------------------------------------------------------
def locate(path: str) -> tuple[str, str, Optional[int]]:
    """(step dir, DCP dir, step or None) for a user-given path: `stepN/`, `stepN/model_and_optim/`,
    a bare DCP directory (`.metadata` inside), or a save folder holding `stepN/` dirs (the newest).
    A URL (http(s)://, gs://, s3://: directories cannot be listed there) names a step directory,
    as OLMo-core's own `load_path` does."""
    if storage.is_remote(path):
        url = path.rstrip("/")
        if url.endswith("/" + MODEL_AND_OPTIM):
            url = url[:-len(MODEL_AND_OPTIM) - 1]
        return url, f"{url}/{MODEL_AND_OPTIM}", _step_of(url)
    p = os.path.abspath(storage.local_path(path).rstrip("/"))
    if not os.path.isdir(p):
        raise FileNotFoundError(f"--from=olmo-core:{path}: no such directory")
    if os.path.isfile(os.path.join(p, MODEL_AND_OPTIM, ".metadata")):
        return p, os.path.join(p, MODEL_AND_OPTIM), _step_of(p)
    if os.path.isfile(os.path.join(p, ".metadata")):
        step_dir = os.path.dirname(p) if os.path.basename(p) == MODEL_AND_OPTIM else p
        return step_dir, p, _step_of(step_dir)
    steps = sorted((int(m.group(1)), d) for d in os.listdir(p) if (m := re.fullmatch(r"step(\d+)", d))
                   and os.path.isfile(os.path.join(p, d, MODEL_AND_OPTIM, ".metadata")))
    if not steps:
        raise FileNotFoundError(f"--from=olmo-core:{path}: not an OLMo-core checkpoint (no {MODEL_AND_OPTIM}/"
                                ".metadata, no .metadata, no stepN/ checkpoint inside); pass a stepN directory")
    step, d = steps[-1]
    return os.path.join(p, d), os.path.join(p, d, MODEL_AND_OPTIM), step


def _step_of(step_dir: str) -> Optional[int]:
    m = re.fullmatch(r"step(\d+)", os.path.basename(step_dir.rstrip("/")))
    return int(m.group(1)) if m else None


class MissingFileError(UserError, FileNotFoundError):
    """A file of the checkpoint is not there: one line for the user, and still a
    FileNotFoundError to a reader for which the file is optional (read_config's config.json)."""


def read_file(path: str, start: int = 0, stop: Optional[int] = None) -> bytes:
    """Bytes [start, stop) of a local file or a URL (data/storage.py's retried byte-range reads,
    the machinery of the remote data mixes); stop None: to the end."""
    # A missing file was a traceback (in Orbax's writer thread too), or, remote, a data mix's advice
    # (--data_root, --tokenizer) that convert.py has no flags for.
    missing = f"{path} is missing: the checkpoint is incomplete; download (or copy) all of its files again"
    if storage.is_remote(path):
        try:
            if stop is None:
                stop = storage.fetch_size(path)
            return storage.read_bytes(path, start, stop)
        except storage.MissingRemoteFileError as e:
            raise MissingFileError(missing) from e
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(-1 if stop is None else stop - start)
    except FileNotFoundError as e:
        raise MissingFileError(missing) from e
    if stop is not None and len(data) != stop - start:
        raise UserError(f"{path} is truncated: bytes [{start}, {stop}) asked for, {len(data)} read; "
                        "download the checkpoint again")
    return data


# ---- reading ----------------------------------------------------------------------------------
@dataclasses.dataclass
class _StorageInfo:
    """Where a stored chunk lives: OLMo-core pickles its own class of this shape
    (distributed/checkpoint/filesystem.py) into `.metadata`, torch its own; both read as this."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: Any = None


@dataclasses.dataclass
class _StoragePrefix:
    prefix: str


def _unpickler():
    import pickle

    class Unpickler(pickle.Unpickler):
        """torch's DCP metadata classes, with OLMo-core's storage records mapped to ours (reading
        needs torch, not the ai2-olmo-core package). `.metadata` is a pickle, possibly fetched
        from a URL: only torch's checkpoint classes, torch.Size and dtypes, and a few plain
        containers are allowed, never an arbitrary callable."""

        SAFE_BUILTINS = {"set", "frozenset", "tuple", "list", "dict", "int", "float", "str", "bytes", "bool", "slice"}

        def find_class(self, module, name):
            if module.startswith("olmo_core.") and name in ("_StorageInfo", "_StoragePrefix"):
                return {"_StorageInfo": _StorageInfo, "_StoragePrefix": _StoragePrefix}[name]
            import torch
            torch_value = module == "torch" and (name == "Size" or isinstance(
                getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)))
            if (torch_value or module.startswith("torch.distributed.checkpoint.")
                    or (module, name) == ("torch.serialization", "_get_layout")  # a layout by its name
                    or (module == "builtins" and name in self.SAFE_BUILTINS)
                    or module in ("collections", "enum", "pathlib")):
                return super().find_class(module, name)
            raise pickle.UnpicklingError(f"{module}.{name}: not a class torch distributed-checkpoint metadata holds")
    return Unpickler


class DistCheckpointReader:
    """Tensors of a DCP directory (local or a URL) by name, one at a time: each tensor is
    reassembled from the chunks it was saved in (one per rank that held a shard), each chunk
    read by byte range and decoded with torch.load. Memory: one tensor plus one chunk."""

    def __init__(self, dcp_dir: str):
        self.torch = torch_module()
        self.path = dcp_dir
        meta_path = self._join(".metadata")
        try:
            raw = read_file(meta_path)
        except (FileNotFoundError, storage.RemoteFileError) as e:
            raise FileNotFoundError(f"{meta_path}: cannot read the checkpoint metadata ({e})") from None
        try:
            self.metadata = _unpickler()(io.BytesIO(raw)).load()
        except Exception as e:  # noqa: BLE001 -- a damaged pickle raises many types
            raise UserError(f"{meta_path} does not read as torch distributed-checkpoint metadata "
                            f"({' '.join(str(e).split())[:160]}); download the checkpoint again") from None
        md = self.metadata.state_dict_metadata
        self.tensors = {k: v for k, v in md.items() if hasattr(v, "chunks")}
        self._where = {(k.fqn, tuple(k.offset)): v for k, v in self.metadata.storage_data.items() if k.offset is not None}

    def _join(self, name: str) -> str:
        return f"{self.path}/{name}" if storage.is_remote(self.path) else os.path.join(self.path, name)

    def shape(self, name: str) -> tuple:
        return tuple(self.tensors[name].size)

    def read(self, name: str):
        """The whole tensor `name` as a torch tensor in its stored dtype."""
        torch = self.torch
        meta = self.tensors[name]
        whole = len(meta.chunks) == 1 and tuple(meta.chunks[0].sizes) == tuple(meta.size)
        out = None if whole else torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for chunk in meta.chunks:
            info = self._where.get((name, tuple(chunk.offsets)))
            if info is None:
                raise UserError(f"{self.path}/.metadata lists a chunk of {name!r} at {tuple(chunk.offsets)} but no "
                                "file holding it; the checkpoint is damaged: download it again")
            if getattr(info, "transform_descriptors", None):
                raise UserError(f"{self.path}: tensor {name!r} is stored with transforms {info.transform_descriptors} "
                                "(compression?); only plain torch.save chunks are supported")
            raw = read_file(self._join(info.relative_path), info.offset, info.offset + info.length)
            try:
                part = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001
                where = self._join(info.relative_path)
                if info.offset == 0 and raw[8:9] == b"{":  # a safetensors header: u64 length, then JSON
                    raise UserError(f"{where} is a safetensors-format distributed checkpoint (torch's "
                                    "FileSystemWriter(serialization_format=SAFETENSORS)); only the default "
                                    "torch.save format, which OLMo-core writes, is read: save it again with "
                                    "the default") from None
                raise UserError(f"{where}: the chunk of {name!r} at byte {info.offset} does not decode "
                                f"({' '.join(str(e).split())[:120]}); download the checkpoint again") from None
            del raw
            if tuple(part.shape) != tuple(chunk.sizes):
                raise UserError(f"{self.path}: chunk of {name!r} has shape {tuple(part.shape)}, metadata says "
                                f"{tuple(chunk.sizes)}; the checkpoint is damaged")
            if whole:  # saved by one rank: the chunk is the tensor
                return part
            out[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))] = part
            del part
        return out

    def numpy(self, name: str, dtype) -> Shaped[np.ndarray, "..."]:
        t = self.read(name)
        if t.dtype == self.torch.bfloat16:  # numpy has no bf16: exact through fp32
            t = t.float()
        return np.asarray(t.numpy(), dtype)


def read_config(step_dir: str, reader: DistCheckpointReader, **overrides) -> tuple[Config, str]:
    """Our Config for the checkpoint: from `config.json` (what OLMo-core's ConfigSaverCallback
    writes beside every checkpoint) when present, else from the tensor shapes with OLMo 3 7B's
    head_dim 128, window 4096, pattern, theta and eps (DESIGN §2). Returns (config, where from)."""
    remote = storage.is_remote(step_dir)
    candidates = ([f"{step_dir}/config.json"] if remote else
                  [os.path.join(step_dir, "config.json"), os.path.join(os.path.dirname(step_dir), "config.json")])
    for path in candidates:
        try:
            raw = read_file(path)
        except (FileNotFoundError, storage.RemoteFileError):
            continue
        else:
            try:
                model = json.loads(raw)["model"]
                return config_from_olmo_core(model, **overrides), path
            except NotOLMo3 as e:
                raise UserError(f"{path}: {e}; this codebase computes OLMo 3 only and cannot convert this "
                                "model") from None
            except (ValueError, KeyError, TypeError, AttributeError) as e:   # a list or a string for a section
                raise UserError(f"{path}: not an OLMo-core experiment config with a 'model' section "
                                f"({e}); remove it to infer the model from the tensor shapes") from None
    names = reader.tensors
    n_layers = len({m.group(1) for k in names if (m := re.match(r"model\.blocks\.(\d+)\.", k))})
    vocab, d_model = reader.shape("model.embeddings.weight")
    q_dim = reader.shape("model.blocks.0.attention.w_q.weight")[0]
    kv_dim = reader.shape("model.blocks.0.attention.w_k.weight")[0]
    if q_dim % 128 or kv_dim % 128:
        raise UserError(f"{step_dir}: no config.json, and the attention width {q_dim} is not a multiple of "
                        "OLMo 3's head_dim 128; put the run's config.json beside the checkpoint")
    kw = dict(vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=q_dim // 128,
              n_kv_heads=kv_dim // 128, head_dim=128,
              mlp_hidden=reader.shape("model.blocks.0.feed_forward.w1.weight")[0])
    kw.update(overrides)
    return Config(**kw), "tensor shapes (no config.json; OLMo 3 7B head_dim, window, RoPE and eps assumed)"


def layer_windows(sliding_window: dict, n_layers: int) -> list[int]:
    """Each layer's window (-1: full attention) by OLMo-core's rule
    (`SlidingWindowAttentionConfig._get_window_size`): the first and last layers are forced full
    when asked (both default to True), and a forced first layer shifts the pattern by one."""
    pattern = [int(w) for w in sliding_window.get("pattern", [-1])]
    if not pattern:   # OLMo-core would divide by its length
        raise ValueError("sliding_window.pattern is empty; OLMo 3's is [4096, 4096, 4096, -1]")
    first = sliding_window.get("force_full_attention_on_first_layer", True)
    last = sliding_window.get("force_full_attention_on_last_layer", True)
    out = []
    for i in range(n_layers):
        forced = (first and i == 0) or (last and i == n_layers - 1)
        out.append(-1 if forced else pattern[(i - 1 if first else i) % len(pattern)])
    return out


def _mixer(block: dict) -> dict:
    """A block's attention config: `sequence_mixer` since OLMo-core 3.0, `attention` in the
    configs of the OLMo 3 runs themselves (OLMo-core 2.x; 3.0's `from_dict` still reads both)."""
    return block.get("sequence_mixer") or block.get("attention") or {}


class NotOLMo3(ValueError):
    """An OLMo-core model setting that OLMo 3 does not have and this model cannot compute."""


def _strip_scaling(block: dict) -> dict:
    """A block config without its RoPE scaling and class tags, to compare an override with."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("_CLASS_", "scaling")}
        return x
    out = strip(block)
    if "attention" in out and "sequence_mixer" not in out:   # OLMo-core 2.x's name for it
        out["sequence_mixer"] = out.pop("attention")
    return out


def _bias(module: dict) -> bool:
    """OLMo-core's reading of a `bias` left unset: a bias (attention, feed-forward, LM head and
    RMSNorm alike)."""
    return True if module.get("bias") is None else bool(module["bias"])


# OLMo-core 3.0.0 YaRNRoPEScalingConfig's fields (nn/rope.py), and attention_rescale_factor: configs
# written before OLMo-core PR #456 (Nov 2025, OLMo 3's own) hold it, unused by YaRN, and OLMo-core
# drops it when it reads them (YaRNRoPEScalingConfig._IGNORE_FIELDS).
_YARN_FIELDS = {"factor", "beta_fast", "beta_slow", "old_context_len", "attention_rescale_factor"}


def _refuse_unlike_olmo3(model: dict, per_layer: list[int]) -> None:
    """Every setting of OLMo-core's TransformerConfig that changes the computation must be OLMo
    3's (`TransformerConfig.olmo3_7B`, OLMo-core 3.0.0), or the weights would convert bit for bit
    into a model computing something else (an embed_scale of 8 moved the logits by 0.41, a
    clip_qkv by 0.37, a LayerNorm for RMSNorm by 0.28, GELU for SiLU by 0.05, all converting
    with exit 0)."""
    block = model["block"]
    att, ff, lm_head = _mixer(block), block.get("feed_forward") or {}, model.get("lm_head") or {}
    norms = {"block.layer_norm": block.get("layer_norm"), "qk_norm": att.get("qk_norm"),
             "lm_head.layer_norm": lm_head.get("layer_norm")}
    want = {  # field: (value, OLMo 3's value); absent fields take OLMo-core's defaults
        "name": (model.get("name", "default"), "default"),
        "tie_word_embeddings": (bool(model.get("tie_word_embeddings")), False),
        "embed_scale": (model.get("embed_scale"), None),
        "embedding_norm": (model.get("embedding_norm"), None),
        "block_pattern": (model.get("block_pattern"), None),
        "block.name": (block.get("name"), "reordered_norm"),
        "block.feed_forward_moe": (block.get("feed_forward_moe"), None),
        "block.attention_residual_alpha": (block.get("attention_residual_alpha"), None),
        "block.feed_forward_residual_alpha": (block.get("feed_forward_residual_alpha"), None),
        "attention.name": (att.get("name", "default"), "default"),
        "attention.bias": (_bias(att), False),
        "attention.gate": (att.get("gate"), None),
        "attention.clip_qkv": (att.get("clip_qkv"), None),
        "attention.use_head_qk_norm": (bool(att.get("use_head_qk_norm")), False),
        "attention.qk_norm_per_head_gains": (bool(att.get("qk_norm_per_head_gains")), False),
        "attention.scalable_softmax": (bool(att.get("scalable_softmax")), False),
        "attention.attention_sinks": (bool(att.get("attention_sinks")), False),
        "attention.rope.name": ((att.get("rope") or {}).get("name"), "default"),
        "attention.rope.partial_rotary_factor": (float((att.get("rope") or {}).get("partial_rotary_factor", 1.0)), 1.0),
        "attention.rope.no_global_rope": (bool((att.get("rope") or {}).get("no_global_rope")), False),
        "feed_forward.name": (ff.get("name", "default"), "default"),
        "feed_forward.activation": (ff.get("activation", "silu"), "silu"),
        "feed_forward.bias": (_bias(ff), False),
        "lm_head.name": (lm_head.get("name", "default"), "default"),
        "lm_head.bias": (_bias(lm_head), False),
    }
    for where, norm in norms.items():   # fused_rms: the same RMSNorm as one kernel
        want[where] = ({"fused_rms": "rms"}.get(norm and norm.get("name"), norm and norm.get("name")), "rms")
        want[where + ".bias"] = (_bias(norm or {}), False)
    for field, (got, ok) in want.items():
        if got != ok:
            raise NotOLMo3(f"{field} is {got!r} where OLMo 3 has {ok!r}")
    eps = {where: (norm or {}).get("eps") for where, norm in norms.items()}   # our Config has one norm_eps
    if len(set(eps.values())) > 1:
        raise NotOLMo3(f"norm eps differ ({', '.join(f'{k}.eps={v!r}' for k, v in eps.items())}) where OLMo 3 "
                       "has one eps (1e-6) for every norm")
    full = {i for i, w in enumerate(per_layer) if w == -1}
    overrides = {int(i): over for i, over in (model.get("block_overrides") or {}).items()}
    for i, over in overrides.items():
        if _strip_scaling(over) != _strip_scaling(block):
            raise NotOLMo3(f"block_overrides[{i}] changes more than RoPE scaling")
        # ... and to YaRN: Stepwise (Llama 3) scaling has YaRN's factor and old_context_len
        scaling = (_mixer(over).get("rope") or {}).get("scaling") or {}
        kind = scaling.get("_CLASS_", "YaRNRoPEScalingConfig").rsplit(".", 1)[-1]
        if scaling and (kind != "YaRNRoPEScalingConfig" or not set(scaling) - {"_CLASS_"} <= _YARN_FIELDS):
            raise NotOLMo3(f"block_overrides[{i}].attention.rope.scaling is {kind} "
                           f"({sorted(set(scaling) - {'_CLASS_'})}) where OLMo 3 has YaRNRoPEScalingConfig")
    scalings = [json.dumps((_mixer(over).get("rope") or {}).get("scaling"), sort_keys=True) for over in overrides.values()]
    if overrides and (set(overrides) != full or len(set(scalings)) > 1):
        raise NotOLMo3(f"block_overrides on layers {sorted(overrides)}: OLMo 3 scales RoPE alike on its "
                       f"full-attention layers, {sorted(full)}")


def config_from_olmo_core(model: dict, **overrides) -> Config:
    """Our Config from OLMo-core's TransformerConfig dict (`as_config_dict()`): an OLMo 3
    reordered-norm, QK-normed, SwiGLU transformer with its sliding-window pattern (the shortest
    period of OLMo-core's per-layer windows: layers are scanned in whole periods); YaRN where its
    block overrides (on the full-attention layers, `with_rope_scaling`) carry it. Any other
    setting raises NotOLMo3."""
    block = model["block"]
    att = _mixer(block)
    if block.get("name") != "reordered_norm" or not att.get("qk_norm") or att.get("use_head_qk_norm"):
        raise NotOLMo3(f"block {block.get('name')!r} with qk_norm={bool(att.get('qk_norm'))}, "
                       f"use_head_qk_norm={att.get('use_head_qk_norm')}: not an OLMo 3 model")
    n_heads = int(att["n_heads"])
    d_model = int(model["d_model"])
    head_dim = int(att.get("head_dim") or d_model // n_heads)
    n_layers = int(model["n_layers"])
    sw = att.get("sliding_window")
    per_layer = layer_windows(sw, n_layers) if sw else [-1] * n_layers
    _refuse_unlike_olmo3(model, per_layer)
    windows = {w for w in per_layer if w != -1}
    if len(windows) > 1:
        raise NotOLMo3(f"sliding window {sw}: windows {sorted(windows)}; OLMo 3 has one window size")
    period = next(p for p in range(1, n_layers + 1)
                  if n_layers % p == 0 and per_layer == per_layer[:p] * (n_layers // p))
    if (att.get("rope") or {}).get("scaling"):
        raise NotOLMo3("RoPE scaling on every layer (with_rope_scaling(full_attn_layers_only=False)); OLMo 3 "
                         "applies YaRN to its full-attention layers only (DESIGN §2)")
    yarn = None
    for over in (model.get("block_overrides") or {}).values():
        scaling = (_mixer(over).get("rope") or {}).get("scaling")
        if scaling:  # OLMo-core YaRNRoPEScalingConfig: no attention-factor field, always m-scale's default
            yarn = YaRN(factor=float(scaling["factor"]), original_max_position=int(scaling["old_context_len"]),
                        beta_fast=float(scaling.get("beta_fast", 32)), beta_slow=float(scaling.get("beta_slow", 1)))
    kw = dict(vocab_size=int(model["vocab_size"]), d_model=d_model, n_layers=n_layers,
              n_heads=n_heads, n_kv_heads=int(att.get("n_kv_heads") or n_heads), head_dim=head_dim,
              mlp_hidden=int(block["feed_forward"]["hidden_size"]),
              window=windows.pop() if windows else 4096,
              layer_pattern=tuple("full" if w == -1 else "sliding" for w in per_layer[:period]),
              rope_theta=float(att["rope"]["theta"]), yarn=yarn,
              norm_eps=float(block["layer_norm"]["eps"]))
    kw.update(overrides)
    return Config(**kw)


def config_to_olmo_core(c: Config) -> dict:
    """The `model` section of an OLMo-core config.json for our Config, in the shape of
    TransformerConfig.as_config_dict() (nn/transformer/config.py `olmo3_7B`: reordered-norm
    blocks, QK-norm over the full projection, SwiGLU, RMSNorm everywhere, untied head, fp32;
    YaRN as `with_rope_scaling` puts it: block overrides of the full-attention layers)."""
    cls = "olmo_core.nn."
    norm = {"name": "rms", "eps": c.norm_eps, "bias": False, "dtype": "float32", "_CLASS_": cls + "layer_norm.LayerNormConfig"}

    def block(yarn):
        rope = {"name": "default", "theta": int(c.rope_theta) if float(c.rope_theta).is_integer() else c.rope_theta,
                "full_precision": True, "_CLASS_": cls + "rope.RoPEConfig"}
        if yarn is not None:
            rope["scaling"] = {"factor": yarn.factor, "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow,
                               "old_context_len": yarn.original_max_position,
                               "_CLASS_": cls + "rope.YaRNRoPEScalingConfig"}
            # OLMo-core's YaRNRoPEScalingConfig has no attention factor: it always uses
            # 0.1 ln(factor) + 1 (nn/rope.py), and its from_dict refuses an unknown key.
            if abs(yarn.mscale - (0.1 * math.log(yarn.factor) + 1.0)) > 1e-9:
                raise ValueError(f"YaRN attention factor {yarn.mscale} is not OLMo-core's 0.1 ln({yarn.factor}) + 1: "
                                 "an OLMo-core config cannot express it")
        return {"name": "reordered_norm", "_CLASS_": cls + "transformer.config.TransformerBlockConfig",
                "sequence_mixer": {"name": "default", "n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads,
                                   "head_dim": c.head_dim, "bias": False, "rope": rope, "qk_norm": dict(norm),
                                   "use_head_qk_norm": False, "dtype": "float32",
                                   "sliding_window": {"pattern": [c.window if t == "sliding" else -1 for t in c.layer_pattern],
                                                      "force_full_attention_on_first_layer": False,
                                                      "force_full_attention_on_last_layer": c.layer_types()[-1] == "full",
                                                      "_CLASS_": cls + "attention.SlidingWindowAttentionConfig"},
                                   "_CLASS_": cls + "attention.AttentionConfig"},
                "layer_norm": dict(norm),
                "feed_forward": {"hidden_size": c.mlp_hidden, "name": "default", "bias": False, "dtype": "float32",
                                 "activation": "silu", "_CLASS_": cls + "feed_forward.FeedForwardConfig"}}
    out = {"d_model": c.d_model, "vocab_size": c.vocab_size, "n_layers": c.n_layers, "block": block(None),
           "lm_head": {"name": "default", "layer_norm": dict(norm), "bias": False, "dtype": "float32",
                       "_CLASS_": cls + "lm_head.LMHeadConfig"},
           "name": "default", "dtype": "float32", "init_method": "normal", "init_std": c.init_std,
           "_CLASS_": cls + "transformer.config.TransformerConfig"}
    if c.yarn is not None:
        out["block_overrides"] = {str(i): block(c.yarn) for i, t in enumerate(c.layer_types()) if t == "full"}
    return out


def adam_count(reader: DistCheckpointReader) -> tuple[int, set]:
    """The Adam update count: SkipStepAdamW's per-parameter float `step` (all equal: one
    step_factor per step). Returns (count, the distinct values found)."""
    values = {float(reader.read(k)) for k in reader.tensors if k.startswith("optim.state.") and k.endswith(".step")}
    if not values:
        raise UserError(f"checkpoint {reader.path} holds no optimizer state (optim.state.*); convert with "
                        "--nowith_optimizer_state, or pass a checkpoint saved with its optimizer")
    return int(max(values)), values


def read_layer(reader: DistCheckpointReader, name: str, transpose: bool, dtype) -> Shaped[np.ndarray, "..."]:
    """One OLMo-core tensor in our layout ([in, out]): a transposed view, not a copy (the
    writer copies part by part)."""
    a = reader.numpy(name, dtype)
    return a.T if transpose else a


# ---- writing ----------------------------------------------------------------------------------
def write_dist_checkpoint(dcp_dir: str, specs: dict[str, tuple[tuple, Any]],
                          produce: Callable[[str], Shaped[np.ndarray, "..."]], extra: dict[str, Any]) -> None:
    """A DCP directory that OLMo-core's `load_model_and_optim_state` / Checkpointer.load read,
    written one tensor at a time: `specs` = {name: (shape, numpy dtype)}, `produce(name)` makes the
    tensor when torch's writer asks for it, `extra` = non-tensor entries (param-group values).

    Streaming: the state dict holds only `meta` tensors (shape and dtype, no data); a planner
    subclass produces each tensor in `resolve_data`, and one file per tensor
    (single_file_per_rank=False) lets torch's writer drop each tensor once written (with one file
    per rank it keeps every tensor of the file until the file is closed)."""
    torch = torch_module()
    import warnings

    import torch.distributed.checkpoint as dcp

    def to_torch(dtype):
        return {np.dtype(np.float32): torch.float32, np.dtype(np.int64): torch.int64}.get(np.dtype(dtype)) or \
            getattr(torch, str(np.dtype(dtype)))

    state = {name: torch.empty(shape, dtype=to_torch(dtype), device="meta") for name, (shape, dtype) in specs.items()}
    state.update(extra)

    class Producing(dcp.DefaultSavePlanner):
        def resolve_data(self, write_item):
            name = write_item.index.fqn
            if name in specs:
                return torch.from_numpy(np.require(produce(name), requirements=["C", "W"]))  # copies only if needed
            return super().resolve_data(write_item)

    from torch.distributed.checkpoint.api import CheckpointException
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.save(state, storage_writer=dcp.FileSystemWriter(dcp_dir, single_file_per_rank=False, thread_count=1),
                     planner=Producing(), no_dist=True)
        except CheckpointException as e:   # what `produce` raised (a damaged source: exit 2), not torch's rank table
            raise next(iter(e.failures.values()))[0] from None

