"""One frozen dataclass describing an OLMo 3 model, with the presets the recipe uses.

Numbers are from AI2's released `allenai/Olmo-3-1025-7B` config.json and OLMo-core's
`OLMo-3-1025-7B-*.py` training scripts (see ../shared/DESIGN.md §2).
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Literal, Mapping, Optional

import jax.numpy as jnp

LayerType = Literal["sliding", "full"]
RematPolicy = Literal["none", "full", "save_proj", "save_dots"]
AttentionImpl = Literal["xla", "splash", "cudnn"]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def matmul_precision(dtype) -> Optional[str]:
    """The `precision=` of every model matmul on `dtype` inputs. float32 compute is the exact
    mode (HF and OLMo-core verification), so its matmuls run in float32: by default XLA takes one
    bfloat16 pass on TPU and TF32 on NVIDIA tensor cores for float32 inputs (docs.jax.dev
    "Matmul precision"), torch does not (`torch.backends.cuda.matmul.allow_tf32` is False by
    default). Other dtypes keep the platform's default (no effect on the CPU either way)."""
    return "highest" if jnp.dtype(dtype) == jnp.float32 else None


def float8_eligible(shape: tuple[int, ...]) -> bool:
    """Whether a linear weight of (..., in, out) `shape` may run in float8: both matrix dimensions
    multiples of 16, torchao's condition for Float8Linear (its float8 matmul's alignment)."""
    return shape[-2] % 16 == 0 and shape[-1] % 16 == 0


@dataclasses.dataclass(frozen=True)
class YaRN:
    """YaRN context extension (Peng et al. 2023) as configured for OLMo 3 stage 3."""

    factor: float = 8.0
    original_max_position: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # None means the YaRN paper's default 0.1 * ln(factor) + 1 (= 1.2079 for factor 8).
    attention_factor: Optional[float] = None

    @property
    def mscale(self) -> float:
        if self.attention_factor is not None:
            return float(self.attention_factor)
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


@dataclasses.dataclass(frozen=True)
class Config:
    """An OLMo 3 architecture. Hashable, so it can be a static field of the model."""

    vocab_size: int = 100278          # dolma2; OLMo-core pads to 100352 for training
    d_model: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32              # MHA in the 7B; fewer for GQA research variants
    head_dim: int = 128
    mlp_hidden: int = 11008
    window: int = 4096                # a sliding query sees itself and window-1 keys before it
    layer_pattern: tuple[LayerType, ...] = ("sliding", "sliding", "sliding", "full")
    rope_theta: float = 500_000.0
    yarn: Optional[YaRN] = None       # applied to full-attention layers only (OLMo-core)
    max_position_embeddings: int = 65536
    norm_eps: float = 1e-6
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    attention: AttentionImpl = "xla"
    remat: RematPolicy = "save_proj"
    # True: the layers run under jax.lax.scan over pattern groups (compile time flat in depth).
    # False: a Python loop over the groups; compile time grows with depth, but no residual is
    # stacked into [n_groups, ...] buffers for the backward (on the issue-14 CPU config, 2
    # groups, the step is 5.6% faster: benchmarks/bench_cpu.flags).
    scan_layers: bool = True
    # The seven projections of every layer through float8 (torchao's tensorwise Float8Linear, as
    # the stage-3 recipe trains: olmo3/float8.py). A way of computing, like remat: not saved as
    # part of a checkpoint's architecture.
    float8: bool = False
    init_std: float = 0.02            # OLMo-core: truncated normal, cut at +-3 std
    # Mosaic (TPU) Splash tiles, read when attention == "splash"; the GPU kernel picks its own
    # (olmo3/splash_gpu.py block_sizes).
    splash_block_q: int = 2048
    splash_block_kv: int = 2048

    def __post_init__(self):
        sizes = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_hidden",
                 "max_position_embeddings")
        errors = [f"{name}={getattr(self, name)} must be >= 1" for name in sizes if getattr(self, name) < 1]
        if not self.layer_pattern:
            errors.append("layer_pattern=() is empty: give each layer's attention, e.g. sliding,sliding,sliding,full")
        if errors:   # the checks below divide by them
            raise ValueError("Invalid olmo3.Config: " + "; ".join(errors))
        if self.n_layers % len(self.layer_pattern) != 0:
            errors.append(
                f"n_layers={self.n_layers} is not a multiple of the layer pattern length "
                f"{len(self.layer_pattern)} ({'/'.join(self.layer_pattern)}); layers are scanned in "
                f"whole pattern groups, so choose n_layers as a multiple of {len(self.layer_pattern)}")
        if any(t not in ("sliding", "full") for t in self.layer_pattern):
            errors.append(f"layer_pattern={self.layer_pattern}: entries must be 'sliding' or 'full'")
        if self.n_heads % self.n_kv_heads != 0:
            errors.append(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            errors.append(f"head_dim={self.head_dim} must be even: RoPE rotates pairs of dimensions")
        if self.window < 1:
            errors.append(f"window={self.window} must be >= 1")
        # NaN losses with exit 0 before (an HF config.json's rope_theta 0 or rms_norm_eps -1)
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            errors.append(f"rope_theta={self.rope_theta} must be a finite number > 0")
        if not (math.isfinite(self.norm_eps) and self.norm_eps > 0):
            errors.append(f"norm_eps={self.norm_eps} must be a finite number > 0")
        if self.yarn is not None and not (math.isfinite(self.yarn.factor) and self.yarn.factor >= 1
                                          and self.yarn.original_max_position >= 1):
            errors.append(f"yarn={self.yarn}: factor must be a finite number >= 1 and original_max_position >= 1")
        # a NaN attention factor made every full-attention layer NaN, a 0 one flattened its softmax
        if self.yarn is not None and not all(
                v is None or (math.isfinite(v) and v > 0)
                for v in (self.yarn.beta_fast, self.yarn.beta_slow, self.yarn.attention_factor)):
            errors.append(f"yarn={self.yarn}: beta_fast, beta_slow and attention_factor must be finite numbers > 0")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in _DTYPES:
                errors.append(f"{name}={getattr(self, name)!r}: choose one of {sorted(_DTYPES)}")
        if self.attention not in ("xla", "splash", "cudnn"):
            errors.append(f"attention={self.attention!r}: choose xla, splash or cudnn")
        if self.remat not in ("none", "full", "save_proj", "save_dots"):
            errors.append(f"remat={self.remat!r}: choose none, full, save_proj or save_dots")
        if self.float8 and len(self.float8_left_out()) == len(self.projection_shapes()):   # float8 did nothing
            errors.append("float8=True, but no projection has both dimensions multiples of 16 ("
                          + ", ".join(self.float8_left_out()) + "), torchao's condition for Float8Linear: choose "
                          "d_model, n_heads x head_dim, n_kv_heads x head_dim and mlp_hidden as multiples of 16, "
                          "or leave float8 off")
        if errors:
            raise ValueError("Invalid olmo3.Config: " + "; ".join(errors))

    # ---- presets --------------------------------------------------------------------------
    @classmethod
    def olmo3_7b(cls, **overrides) -> "Config":
        """The released OLMo 3 7B (allenai/Olmo-3-1025-7B), stages 1 and 2."""
        return cls(**overrides)

    @classmethod
    def olmo3_7b_16x256(cls, **overrides) -> "Config":
        """The write-up's ablation: 16 heads x head_dim 256, identical params and FLOPs."""
        return cls(**{"n_heads": 16, "n_kv_heads": 16, "head_dim": 256, **overrides})

    @classmethod
    def olmo3_7b_long(cls, **overrides) -> "Config":
        """Stage 3: YaRN (factor 8 over 8192) on the full-attention layers, 65536 positions."""
        return cls(**{"yarn": YaRN(), "max_position_embeddings": 65536, **overrides})

    @classmethod
    def tiny(cls, **overrides) -> "Config":
        """A CPU-sized OLMo 3 with the real vocabulary, pattern and window semantics."""
        base = dict(d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, head_dim=64,
                    mlp_hidden=768, window=128, max_position_embeddings=4096)
        return cls(**{**base, **overrides})

    PRESETS = ("olmo3_7b", "olmo3_7b_16x256", "olmo3_7b_long", "tiny")

    @classmethod
    def preset(cls, name: str, **overrides) -> "Config":
        if name not in cls.PRESETS:
            raise ValueError(f"Unknown config preset {name!r}; choose one of {cls.PRESETS}")
        return getattr(cls, name)(**overrides)

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    # ---- derived quantities ----------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """Each layer's seven linears, (in, out) as the model keeps their weights."""
        d, q, kv, mlp = self.d_model, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.mlp_hidden
        return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
                "gate_proj": (d, mlp), "up_proj": (d, mlp), "down_proj": (mlp, d)}

    def float8_left_out(self) -> list[str]:
        """With float8: the projections that stay in the compute dtype, 'name (in x out)', a
        dimension not a multiple of 16 (olmo3.model.uses_float8; torchao's Float8Linear filter)."""
        return [f"{n} ({a}x{b})" for n, (a, b) in self.projection_shapes().items()
                if self.float8 and not float8_eligible((a, b))]

    @property
    def n_groups(self) -> int:
        """Number of repeating layer-pattern groups (the scan length)."""
        return self.n_layers // len(self.layer_pattern)

    @property
    def dtype(self):
        return _DTYPES[self.compute_dtype]

    @property
    def pdtype(self):
        return _DTYPES[self.param_dtype]

    def layer_types(self) -> tuple[LayerType, ...]:
        return tuple(self.layer_pattern[i % len(self.layer_pattern)] for i in range(self.n_layers))

    def params_per_layer(self) -> int:
        d = self.d_model
        attn = d * self.q_dim + 2 * d * self.kv_dim + self.q_dim * d
        qk_norm = self.q_dim + self.kv_dim
        mlp = 3 * d * self.mlp_hidden
        return attn + qk_norm + mlp + 2 * d

    def num_params(self, include_embedding: bool = True) -> int:
        """Exact parameter count (7,298,011,136 for the 7B with vocab 100278)."""
        n = self.n_layers * self.params_per_layer() + self.d_model  # + final norm
        n += self.vocab_size * self.d_model                         # lm_head (untied)
        if include_embedding:
            n += self.vocab_size * self.d_model
        return n

    def train_flops_per_token(self, seq_len: int, convention: str = "writeup") -> float:
        """Training (forward + backward) FLOPs per token.

        "writeup": 6 x (all params but the input embedding) + 6 x seq x (heads*head_dim) per
        layer, full causal attention in every layer (the MaxText write-up's accounting, which
        gives 1565 TFLOP/device/step for the 7B at 512 x 8192 on 128 devices).
        "sliding": the same dense part, but attention counts the keys each query really sees:
        mean over positions of min(pos + 1, window) in sliding layers, pos + 1 in full layers;
        QK^T and PV are 2 FLOPs per multiply-add each, x3 for forward + backward.
        """
        dense = 6.0 * self.num_params(include_embedding=False)
        if convention == "writeup":
            return dense + 6.0 * seq_len * self.q_dim * self.n_layers
        if convention == "sliding":
            total = 0.0
            for t in self.layer_types():
                w = seq_len if t == "full" else min(self.window, seq_len)
                # mean over q of min(q + 1, w), q = 0..seq_len-1
                keys = (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len
                total += 12.0 * self.q_dim * keys
            return dense + total
        raise ValueError(f"convention={convention!r}: choose 'writeup' or 'sliding'")


# Fields that define a checkpoint's math (stored as extra["model_config"] in every checkpoint);
# the attention kernel, remat policy and compute dtype may change between runs.
ARCH_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_hidden",
               "window", "layer_pattern", "rope_theta", "yarn", "norm_eps", "param_dtype")


def config_to_dict(c: Config) -> dict:
    d = {k: v for k, v in dataclasses.asdict(c).items() if k in ARCH_FIELDS}
    return json.loads(json.dumps(d, default=str))


def precision(c: Config) -> dict:
    """What a model computes in, not its architecture (ARCH_FIELDS): the compute dtype and whether
    the projections run in float8. train.py keeps its run's in every checkpoint's extra JSON."""
    return {"compute_dtype": c.compute_dtype, "float8": bool(c.float8)}


def config_from_dict(d: Mapping[str, Any], **overrides) -> Config:
    """Inverse of `config_to_dict`."""
    kw = {k: v for k, v in d.items() if k in ARCH_FIELDS}
    if kw.get("layer_pattern") is not None:
        kw["layer_pattern"] = tuple(kw["layer_pattern"])
    if isinstance(kw.get("yarn"), Mapping):
        kw["yarn"] = YaRN(**kw["yarn"])
    kw.update(overrides)
    return Config(**kw)


def config_diff(a: Config, b: Config) -> dict:
    """The architecture fields in which `a` and `b` compute differently, {field: (a's, b's)}. YaRN's
    attention factor compares by value: None (the paper's default) equals that default written out,
    as a conversion from Hugging Face writes it."""
    def resolved(c):
        return c if c.yarn is None else dataclasses.replace(
            c, yarn=dataclasses.replace(c.yarn, attention_factor=c.yarn.mscale))
    da, db = config_to_dict(resolved(a)), config_to_dict(resolved(b))
    return {k: (da.get(k), db.get(k)) for k in ARCH_FIELDS if da.get(k) != db.get(k)}
