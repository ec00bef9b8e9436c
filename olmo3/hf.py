"""Hugging Face `Olmo3ForCausalLM` <-> `olmo3.OLMo3`, tensor by tensor.

HF names (DESIGN §2): `model.embed_tokens.weight` [V, d]; `model.layers.N.self_attn.{q,k,v,o}_proj
.weight`, `...self_attn.{q,k}_norm.weight`, `model.layers.N.mlp.{gate,up,down}_proj.weight`,
`model.layers.N.{post_attention,post_feedforward}_layernorm.weight`, `model.norm.weight`,
`lm_head.weight` [V, d]. torch's Linear stores [out, in]; we store [in, out], hence the transposes.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from typing import Any, Mapping, Optional, Sequence, Union

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from olmo3.config import Config, YaRN
from olmo3.model import Layer, OLMo3

# (our Layer field, HF suffix under model.layers.N., transpose?)
LAYER_MAP = (
    ("q_proj", "self_attn.q_proj.weight", True),
    ("k_proj", "self_attn.k_proj.weight", True),
    ("v_proj", "self_attn.v_proj.weight", True),
    ("o_proj", "self_attn.o_proj.weight", True),
    ("q_norm", "self_attn.q_norm.weight", False),
    ("k_norm", "self_attn.k_norm.weight", False),
    ("gate_proj", "mlp.gate_proj.weight", True),
    ("up_proj", "mlp.up_proj.weight", True),
    ("down_proj", "mlp.down_proj.weight", True),
    ("post_attention_norm", "post_attention_layernorm.weight", False),
    ("post_feedforward_norm", "post_feedforward_layernorm.weight", False),
)
EOS_ID, PAD_ID = 100257, 100277  # dolma2 (DESIGN §2)


# ---- config ---------------------------------------------------------------------------------
def _pattern(layer_types: list[str], n_layers: int) -> tuple[str, ...]:
    """Shortest repeating pattern of 'sliding'/'full' that tiles the HF `layer_types` list."""
    if n_layers < 1:
        raise ValueError(f"HF config num_hidden_layers={n_layers}: a model has at least one layer")
    short = [{"sliding_attention": "sliding", "full_attention": "full"}.get(t) for t in layer_types]
    if None in short or len(short) != n_layers:
        raise ValueError(f"HF config layer_types={layer_types!r}: expected {n_layers} entries of "
                         "'sliding_attention'/'full_attention'")
    for p in range(1, n_layers + 1):
        if n_layers % p == 0 and all(short[i] == short[i % p] for i in range(n_layers)):
            return tuple(short[:p])
    raise AssertionError("unreachable")


def _rope_params(hf: Mapping[str, Any]) -> tuple[float, Optional[YaRN]]:
    """(theta, YaRN or None) from either `rope_parameters` (per layer type) or old `rope_scaling`."""
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(f"HF config rope_parameters={params!r}; expected an object per layer type")
    if params and "full_attention" not in params and "sliding_attention" not in params:
        # transformers 5 fills in default per-layer-type entries and its Olmo3 reads only those:
        # this one is ignored there (theta 500,000, no YaRN), and refused here unless it says as much
        if (params.get("rope_type", params.get("type", "default")) == "default"
                and _field(params, "rope_theta", float, 500_000.0) == 500_000.0):
            return 500_000.0, None
        raise ValueError(f"HF config rope_parameters={params!r} has no 'full_attention' / 'sliding_attention' entry, "
                         "which transformers 5's Olmo3 reads (it ignores the rest); write the parameters per layer "
                         "type, or as rope_theta + rope_scaling (transformers 4.x)")
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        sliding = dict(params.get("sliding_attention") or {})
        top = _field(hf, "rope_theta", float, None)
        if top not in (None, 500_000.0) and (full.get("rope_theta") is None or sliding.get("rope_theta") is None):
            raise ValueError(f"HF config has rope_theta={top} beside a rope_parameters entry without one, which "
                             "transformers 5 reads as 500,000 or as rope_theta by the entries' order; give "
                             "rope_theta in both rope_parameters entries")
        for entry in (full, sliding):   # transformers 5's Olmo3Config default for an entry without one
            if entry.get("rope_theta") is None:
                entry["rope_theta"] = 500_000.0
    else:  # no rope_parameters: rope_theta + rope_scaling applied to full layers (transformers 4.x)
        full = dict(hf.get("rope_scaling") or {})
        sliding = {"rope_type": "default"}
    theta = _field(full, "rope_theta", float, _field(hf, "rope_theta", float, 500_000.0))
    if float(sliding.get("rope_theta", theta)) != theta:
        raise ValueError("HF config has different rope_theta for sliding and full layers; unsupported")
    if sliding.get("rope_type", "default") != "default":
        raise ValueError(f"HF config applies rope_type={sliding['rope_type']!r} to sliding layers; OLMo 3 "
                         "applies YaRN to full-attention layers only (DESIGN §2)")
    kind = full.get("rope_type", full.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise ValueError(f"HF config rope_type={kind!r} for full layers: only 'default' and 'yarn' supported")
    if full.get("truncate") is False:   # transformers 4.x then ramps over the unrounded range
        raise ValueError("HF config has YaRN truncate=false; OLMo 3 (OLMo-core, transformers' default) rounds the "
                         "correction range to whole dimensions, the only YaRN olmo3.rope computes")
    factor = _field(full, "factor", float)
    attention_factor = _field(full, "attention_factor", float, None)
    mscale, mscale_all_dim = _field(full, "mscale", float, None), _field(full, "mscale_all_dim", float, None)
    if attention_factor is None and mscale and mscale_all_dim:   # transformers' _compute_yarn_parameters
        m = lambda k: 0.1 * k * math.log(factor) + 1.0 if factor > 1 else 1.0   # noqa: E731
        attention_factor = m(mscale) / m(mscale_all_dim)
    return theta, YaRN(factor=factor,
                       original_max_position=_field(full, "original_max_position_embeddings", int),
                       beta_fast=_field(full, "beta_fast", float, 32.0),
                       beta_slow=_field(full, "beta_slow", float, 1.0),
                       attention_factor=attention_factor)


_REQUIRED = object()


def _field(hf: Mapping[str, Any], name: str, kind: type, default: Any = _REQUIRED) -> Any:
    """hf[name] as an int or float (`default` when absent or null); a missing or non-numeric value
    is an error naming the field."""
    value = hf.get(name)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"HF config has no {name!r}")
        return default
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not whole):
        raise ValueError(f"HF config field {name!r} is {value!r}; expected {'an integer' if kind is int else 'a number'}")
    return kind(value)


def config_from_hf(hf: Mapping[str, Any], **overrides) -> Config:
    """Our Config from an HF Olmo3 `config.json` dict."""
    if hf.get("model_type") != "olmo3":  # what transformers' AutoConfig dispatches on
        raise ValueError(f"HF config has model_type {hf.get('model_type')!r}, architectures "
                         f"{hf.get('architectures')}; expected an Olmo3ForCausalLM checkpoint (model_type 'olmo3')")
    if hf.get("tie_word_embeddings"):
        raise ValueError("HF config has tie_word_embeddings=true; OLMo 3 has an untied lm_head")
    if hf.get("hidden_act", "silu") != "silu":   # the MLP is SwiGLU; nothing else would read another
        raise ValueError(f"HF config has hidden_act {hf['hidden_act']!r}; OLMo 3's MLP is SwiGLU ('silu')")
    if "sliding_window" in hf and hf["sliding_window"] is None:   # transformers' Olmo3 cannot run it either
        raise ValueError("HF config has sliding_window null; OLMo 3's sliding-attention layers need a window "
                         "(4096 in OLMo 3 7B): give the one the model was trained with")
    n_layers = _field(hf, "num_hidden_layers", int)
    n_heads = _field(hf, "num_attention_heads", int)
    d_model = _field(hf, "hidden_size", int)
    theta, yarn = _rope_params(hf)
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n_layers)]
    kw = dict(
        vocab_size=_field(hf, "vocab_size", int), d_model=d_model, n_layers=n_layers,
        n_heads=n_heads, n_kv_heads=_field(hf, "num_key_value_heads", int, n_heads),
        head_dim=_field(hf, "head_dim", int, d_model // max(n_heads, 1)),
        mlp_hidden=_field(hf, "intermediate_size", int), window=_field(hf, "sliding_window", int, 4096),
        layer_pattern=_pattern(list(layer_types), n_layers), rope_theta=theta, yarn=yarn,
        # transformers' Olmo3Config default (2048), as for rms_norm_eps: a config.json that leaves
        # it out is read the way transformers reads it, not as OLMo 3's 65,536
        max_position_embeddings=_field(hf, "max_position_embeddings", int, 2048),
        norm_eps=_field(hf, "rms_norm_eps", float, 1e-5))   # transformers' Olmo3Config default, not OLMo 3's 1e-6
    kw.update(overrides)
    return Config(**kw)


def config_to_hf(c: Config) -> dict:
    """An HF Olmo3 `config.json` dict for our Config.

    RoPE is written twice: transformers 5's per-layer-type `rope_parameters` (which it reads
    first) and the flat `rope_theta` + `rope_scaling` of transformers 4.x (4.57 is the release AI2
    published OLMo 3 with, and it reads only those: without them it loads theta 10,000 and no YaRN
    without a word). 4.x applies `rope_scaling` to the full-attention layers only, as 5 does."""
    full = {"rope_type": "default", "rope_theta": c.rope_theta}
    scaling = None
    positions = c.max_position_embeddings
    if c.yarn is not None:
        # transformers takes max_position_embeddings as the post-YaRN context: it warns when
        # factor != max_position_embeddings / original_max_position_embeddings, and some of its
        # versions use that ratio as the factor. A checkpoint's model_config does not hold
        # max_position_embeddings (Config's default 65,536 comes back), so write the context
        # YaRN extends to: 8 x 8192 = 65,536 for the 7B, 4 x 256 = 1,024 for tiny_stage3.flags.
        extended = c.yarn.factor * c.yarn.original_max_position
        positions = int(extended) if float(extended).is_integer() else positions
        scaling = {"rope_type": "yarn", "factor": c.yarn.factor,
                   "original_max_position_embeddings": c.yarn.original_max_position,
                   "beta_fast": c.yarn.beta_fast, "beta_slow": c.yarn.beta_slow,
                   "attention_factor": c.yarn.mscale}
        full = {"rope_type": "yarn", "rope_theta": c.rope_theta, **{k: v for k, v in scaling.items() if k != "rope_type"}}
    return {
        "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3",
        "vocab_size": c.vocab_size, "hidden_size": c.d_model, "intermediate_size": c.mlp_hidden,
        "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim, "hidden_act": "silu",
        "max_position_embeddings": positions, "rms_norm_eps": c.norm_eps,
        "sliding_window": c.window, "attention_bias": False, "attention_dropout": 0.0,
        "layer_types": [f"{t}_attention" for t in c.layer_types()],
        "rope_parameters": {"full_attention": full,
                            "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_theta}},
        "rope_theta": c.rope_theta, "rope_scaling": scaling,
        "tie_word_embeddings": False, "bos_token_id": None, "dtype": c.param_dtype,
        # dolma2 ids; a research vocabulary too small to hold them gets none
        "eos_token_id": EOS_ID if EOS_ID < c.vocab_size else None,
        "pad_token_id": PAD_ID if PAD_ID < c.vocab_size else None,
    }


# ---- HF model directories -------------------------------------------------------------------
def is_hf_dir(path: str) -> bool:
    """An HF model directory: config.json beside the safetensors files."""
    return os.path.isfile(os.path.join(path, "config.json"))


def read_hf_config(path: str, **overrides) -> Config:
    """Our Config from `<path>/config.json`; a missing or malformed file is an error naming it."""
    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{cfg_path!r} not found: expected an HF model directory "
                                "(config.json + *.safetensors)") from None
    except NotADirectoryError:   # a file given for the directory ("Not a directory: <file>/config.json")
        raise NotADirectoryError(f"{path!r} is a file: expected an HF model directory (config.json + "
                                 "*.safetensors)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path!r} is not valid JSON ({e}); download or convert the model again") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{cfg_path!r} holds a JSON {type(raw).__name__}, not an object of config fields; "
                         "download or convert the model again")
    try:
        return config_from_hf(raw, **overrides)
    except (ValueError, KeyError, TypeError, AttributeError) as e:   # AttributeError: a list for an object
        raise ValueError(f"{cfg_path!r}: {e}") from None


# ---- tensors --------------------------------------------------------------------------------
def _to_numpy(t) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t
    if hasattr(t, "detach"):  # torch tensor; bf16 has no numpy dtype, go through float32
        import torch
        t = t.detach().cpu()
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    return np.asarray(t)


ST_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
             "BF16": np.dtype(ml_dtypes.bfloat16), "F64": np.dtype(np.float64),
             "I64": np.dtype(np.int64), "I32": np.dtype(np.int32)}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


def _read_index(index: str) -> dict[str, str]:
    """The weight map of model.safetensors.index.json: {tensor name: shard file name}."""
    try:
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not (isinstance(weight_map, dict)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())):
            raise ValueError('its "weight_map" is not an object of tensor names to shard file names')
    except (ValueError, AttributeError) as e:   # not JSON, or JSON of another shape
        raise ValueError(f"{index} is not a safetensors index ({' '.join(str(e).split())[:200]}); download it "
                         "again, or remove it if model.safetensors holds every tensor") from e
    return weight_map


class SafetensorsReader(Mapping):
    """Lazy name -> numpy array over the *.safetensors files of an HF directory.

    Headers are validated with the `safetensors` library (a corrupt or truncated file is a clear
    error naming it); tensors are read from a read-only memmap at the header's offsets, so bf16
    works (safetensors' numpy API has no bf16) and only the tensor asked for is paged in.
    """

    def __init__(self, path: str):
        from safetensors import safe_open
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path!r}; expected an HF model directory")
        index = os.path.join(path, "model.safetensors.index.json")
        weight_map = None
        # The files transformers reads: model.safetensors alone when it is there, else the shards
        # the index names. Every file of the directory was read, the last in sort order winning a
        # name, so a leftover shard of an older download replaced tensors without a word.
        if "model.safetensors" in files:
            files = ["model.safetensors"]
        elif os.path.isfile(index):   # a sharded checkpoint: every shard its index names must be here
            weight_map = _read_index(index)
            shards = set(weight_map.values())
            missing = sorted(shards - set(files))
            if missing:
                raise FileNotFoundError(f"{index} names {len(shards)} shards, {len(missing)} missing from {path!r}: "
                                        f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}; "
                                        "download them again")
            files = sorted(shards)
        self._where: dict[str, tuple[str, np.dtype, tuple, int, int]] = {}
        for f in files:
            full = os.path.join(path, f)
            try:
                with safe_open(full, framework="numpy") as h:
                    names = list(h.keys())
                with open(full, "rb") as fh:
                    (n,) = struct.unpack("<Q", fh.read(8))
                    header = json.loads(fh.read(n))
            except Exception as e:  # bad header, truncated file, not a safetensors file
                raise ValueError(f"cannot read safetensors file {full!r} ({e}); the file is corrupt or "
                                 "truncated: download or convert it again") from e
            size = os.path.getsize(full)
            for name in names:
                meta = header[name]
                if meta["dtype"] not in ST_DTYPES:
                    raise ValueError(f"{full!r}: tensor {name!r} has dtype {meta['dtype']}; supported: "
                                     f"{sorted(ST_DTYPES)}")
                begin, end = meta["data_offsets"]
                if 8 + n + end > size:
                    raise ValueError(f"safetensors file {full!r} is truncated: tensor {name!r} ends at "
                                     f"byte {8 + n + end} of {size}; download or convert it again")
                if name in self._where:
                    raise ValueError(f"tensor {name!r} is in {full!r} and {self._where[name][0]!r}: which is meant "
                                     "is unclear; remove the stale file, or download the model again")
                if weight_map is not None and weight_map.get(name, f) != f:
                    raise ValueError(f"tensor {name!r} is in {full!r}, but {index} puts it in "
                                     f"{weight_map[name]!r}; download the model again")
                self._where[name] = (full, ST_DTYPES[meta["dtype"]], tuple(meta["shape"]), 8 + n + begin,
                                     end - begin)

    def __getitem__(self, name: str) -> np.ndarray:
        full, dtype, shape, offset, nbytes = self._where[name]
        if nbytes == 0:
            return np.zeros(shape, dtype)
        return np.memmap(full, dtype=dtype, mode="r", offset=offset, shape=shape)

    def shape(self, name: str) -> tuple:
        return self._where[name][2]

    def dtype(self, name: str) -> np.dtype:
        return self._where[name][1]

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)


class SafetensorsWriter:
    """Write one safetensors file tensor by tensor: the header (every name, dtype and shape) is
    known up front, then each tensor's bytes are appended in header order."""

    def __init__(self, path: str, specs: Sequence[tuple[str, tuple, np.dtype]], metadata: Optional[dict] = None):
        header, offset = {}, 0
        for name, shape, dtype in specs:
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            header[name] = {"dtype": ST_NAMES[np.dtype(dtype)], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header["__metadata__"] = metadata or {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * ((-len(raw)) % 8)  # the data starts 8-byte aligned
        self._order = [s[0] for s in specs]
        self._specs = {s[0]: s for s in specs}
        self._f = open(path, "wb")
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._next, self._rows = 0, 0

    def write(self, name: str, array: np.ndarray) -> None:
        """Append `array`: the whole tensor, or its next block of rows (leading axis)."""
        want = self._order[self._next] if self._next < len(self._order) else None
        if name != want:
            raise RuntimeError(f"SafetensorsWriter: expected tensor {want!r} next, got {name!r}")
        _, shape, dtype = self._specs[name]
        shape = tuple(shape)
        block = tuple(array.shape)
        if block != shape:
            if not shape or block[1:] != shape[1:] or self._rows + block[0] > shape[0]:
                raise ValueError(f"tensor {name!r}: block {block} does not continue shape {shape} at row {self._rows}")
        self._f.write(np.ascontiguousarray(array, dtype=dtype).tobytes())
        self._rows += block[0] if block != shape else (shape[0] if shape else 1)
        if self._rows >= (shape[0] if shape else 1):
            self._next, self._rows = self._next + 1, 0

    def close(self) -> None:
        if self._next != len(self._order):
            raise RuntimeError(f"SafetensorsWriter closed after {self._next} of {len(self._order)} tensors")
        self._f.close()


def _take(sd: Mapping, name: str, shape: tuple, transpose: bool) -> np.ndarray:
    if name not in sd:   # ValueError: a user's input error (one line, exit 2)
        raise ValueError(f"HF checkpoint has no tensor {name!r}; is the download complete?")
    a = _to_numpy(sd[name])
    require_float(name, a.dtype)
    want = shape[::-1] if transpose else shape
    if tuple(a.shape) != tuple(want):
        raise ValueError(f"HF tensor {name!r} has shape {tuple(a.shape)}, but the config expects "
                         f"{tuple(want)}; check that config.json matches the weights")
    require_finite(name, a)
    return a.T if transpose else a


def require_float(name: str, dtype, where: str = "HF checkpoint") -> None:
    """Integer (quantized) weights would be cast to floats without a word: an error naming them."""
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{where}: tensor {name!r} has dtype {dtype}; weights are floating point (a quantized "
                         "or damaged checkpoint?)")


def require_finite(name: str, a: np.ndarray, where: str = "HF checkpoint") -> np.ndarray:
    """`a`, unless it holds a NaN or inf (no checkpoint of non-finite weights is made from it)."""
    if not np.isfinite(a).all():
        raise ValueError(f"{where}: tensor {name!r} holds NaN or infinite values; the checkpoint is damaged "
                         "(download or convert it again)")
    return a


def tensor_names(c: Config) -> set[str]:
    """The names of an HF Olmo3 checkpoint's tensors for config `c` (rotary buffers aside)."""
    return {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} | {
        f"model.layers.{i}.{suffix}" for i in range(c.n_layers) for _, suffix, _ in LAYER_MAP}


def from_hf(path_or_state_dict: Union[str, os.PathLike, Mapping[str, Any]], config: Optional[Config] = None,
            **overrides) -> OLMo3:
    """Load an HF Olmo3 checkpoint (a directory with config.json + safetensors, or a state dict)."""
    if isinstance(path_or_state_dict, (str, os.PathLike)):
        path = os.fspath(path_or_state_dict)
        if config is None:
            config = read_hf_config(path, **overrides)
        sd: Mapping = SafetensorsReader(path)
    else:
        sd = path_or_state_dict
        if config is None:
            raise ValueError("from_hf(state_dict) needs config=olmo3.Config(...) (or pass an HF directory)")
    c = config
    dt = c.pdtype
    expected = tensor_names(c)
    extra = sorted(k for k in sd if k not in expected and "rotary_emb" not in k)
    if extra:
        raise ValueError(f"HF checkpoint has {len(extra)} tensors the config does not expect, e.g. "
                         f"{extra[:3]}; is n_layers={c.n_layers} right?")

    abstract = eqx.filter_eval_shape(OLMo3, c, jax.random.key(0))
    stacked = {}
    for field, suffix, transpose in LAYER_MAP:
        shape = getattr(abstract.layers, field).shape[1:]
        stacked[field] = jnp.asarray(np.stack(
            [_take(sd, f"model.layers.{i}.{suffix}", shape, transpose) for i in range(c.n_layers)]), dt)
    model = eqx.tree_at(
        lambda m: (m.embed, m.layers, m.norm, m.lm_head), abstract,
        (jnp.asarray(_take(sd, "model.embed_tokens.weight", abstract.embed.shape, False), dt),
         Layer(**stacked),
         jnp.asarray(_take(sd, "model.norm.weight", abstract.norm.shape, False), dt),
         jnp.asarray(_take(sd, "lm_head.weight", abstract.lm_head.shape, True), dt)))
    return model


def state_dict(model: OLMo3) -> dict[str, np.ndarray]:
    """HF-named numpy tensors ([out, in] layout) for our model."""
    sd = {"model.embed_tokens.weight": np.asarray(model.embed),
          "model.norm.weight": np.asarray(model.norm),
          "lm_head.weight": np.asarray(model.lm_head).T}
    for field, suffix, transpose in LAYER_MAP:
        w = np.asarray(getattr(model.layers, field))
        for i in range(model.config.n_layers):
            sd[f"model.layers.{i}.{suffix}"] = w[i].T if transpose else w[i]
    return {k: np.ascontiguousarray(v) for k, v in sd.items()}


@contextlib.contextmanager
def new_hf_dir(path: Union[str, os.PathLike], config: Config):
    """Yields a temporary sibling of `path` to fill with safetensors files; on success writes
    config.json for `config` and renames the directory into place, on failure removes it. A
    crash never leaves a half-written HF checkpoint at `path`, and `path` must be new or empty."""
    from olmo3.checkpoint import new_directory
    with new_directory(path, "HF checkpoint") as tmp:
        yield tmp
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config_to_hf(config), f, indent=2)


def to_hf(model: OLMo3, path: Union[str, os.PathLike]) -> None:
    """Write an HF directory (config.json + model.safetensors) that `from_pretrained` loads, in the
    model's own dtype (bf16 stays bf16), atomically (`new_hf_dir`)."""
    sd = state_dict(model)
    with new_hf_dir(path, model.config) as tmp:
        w = SafetensorsWriter(os.path.join(tmp, "model.safetensors"), [(k, v.shape, v.dtype) for k, v in sd.items()])
        for k, v in sd.items():
            w.write(k, v)
        w.close()
