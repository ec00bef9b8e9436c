"""Evaluation machinery shared by convert.py and eval.py (DESIGN §5: "reproduced" means held-out
evidence, not a training-loss curve).

    load_model(path)            an Orbax run/step directory (train.py, convert.py) or an HF directory
    SafetensorsReader/Writer    HF weights tensor by tensor (bf16 included), for streaming conversion
    heldout(...)                held-out CE with the TRAINING loss function (olmo3.step.eval_loss), + bytes
    logit_agreement(...)        per-token KL(a || b), top-1 agreement, top-10 overlap
    Scorer                      log-likelihood of continuations, rolling log-likelihood, greedy
                                generation with a KV cache (the operations lm-eval-harness needs)
    multiple_choice(...)        acc / length-normalized acc with few-shot prompts (lm-eval semantics)
    compare_rows / verdict      step-aligned comparison of two runs, with the memorization signature
"""
from __future__ import annotations

import functools
import json
import math
import os
import struct
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Float, Int, Integer

from olmo3 import checkpoint, hf, rope
from olmo3.hf import ST_NAMES, SafetensorsReader  # noqa: F401  (re-exported: convert.py, tests)
from olmo3.config import Config
from olmo3.model import OLMo3, attention_inputs, layer_output, rms_norm
from olmo3.step import eval_loss

# Configs as JSON (the form train.py writes into every checkpoint's extra["model_config"]).
from olmo3.config import ARCH_FIELDS, config_diff, config_from_dict, config_to_dict  # noqa: E402,F401


# ---- safetensors, tensor by tensor --------------------------------------------------------------
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


# ---- loading a model from any checkpoint --------------------------------------------------------
def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


def read_hf_config(path: str, **overrides) -> Config:
    with open(os.path.join(path, "config.json")) as f:
        return hf.config_from_hf(json.load(f), **overrides)


def load_model(path: str, step: Optional[int] = None, **overrides) -> tuple[OLMo3, dict]:
    """An OLMo3 from an HF directory (config.json + safetensors) or an Orbax checkpoint (a run
    directory, its checkpoints/ directory, or checkpoints/<N>). Returns (model, info), info holding
    "kind", "step" and "config". `overrides` change non-architecture fields (compute_dtype...)."""
    if is_hf_dir(path):
        config = read_hf_config(path, **overrides)
        model = hf.from_hf(SafetensorsReader(path), config)
        return model, {"kind": "hf", "path": path, "step": None, "config": config}
    run, located = checkpoint.locate(path)
    step = located if step is None else step
    mgr = checkpoint.CheckpointManager(run, read_only=True)
    extra = mgr.read_extra(step)
    if "model_config" not in extra:
        raise ValueError(f"checkpoint {run} step {step}: its extra JSON has no 'model_config'; it was not "
                         "written by train.py or convert.py")
    config = config_from_dict(extra["model_config"], **overrides)
    abstract = eqx.filter_eval_shape(OLMo3, config, jax.random.key(0))
    state, _ = mgr.restore(step, {"model": abstract})
    resolved = step if step is not None else mgr.latest_step()
    mgr.close()
    return state["model"], {"kind": "orbax", "path": run, "step": resolved, "config": config}


# ---- held-out loss and bits per byte ------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def token_byte_lengths(vocab_size: int) -> Int[np.ndarray, " vocab"]:
    """UTF-8 bytes of each dolma2 token, for bits per byte. Special tokens (eos, pad...) and rows
    beyond the tokenizer (a padded vocabulary) count 0 bytes: they are not text (Paloma counts
    the bytes of the documents)."""
    import data
    enc = data.dolma2()
    special = set(enc._special_tokens.values())
    out = np.zeros(vocab_size, np.int64)
    for i in range(min(vocab_size, enc.n_vocab)):
        if i not in special:
            try:
                out[i] = len(enc.decode_single_token_bytes(i))
            except KeyError:  # a hole in the rank table
                pass
    return out


@functools.lru_cache(maxsize=8)
def _eval_fn(chunk: int, use_segments: bool):
    return eqx.filter_jit(functools.partial(eval_loss, chunk=chunk, use_segments=use_segments))


def heldout(model: OLMo3, dataset, *, batch_size: int, max_batches: Optional[int] = None,
            chunk: int = 1024, use_segments: bool = False,
            byte_lengths: Optional[Int[np.ndarray, " vocab"]] = None) -> dict:
    """Held-out CE of fixed batches: {"ce_sum", "tokens", "bytes", "loss", "bpb", "batches"}.

    The batches are `data.get_batch(dataset, batch_size, seed=0, step=b)`, the same fixed order
    train.py's in-run evaluation reads, and the loss is olmo3.step.eval_loss, the training loss
    function itself: eval.py's number on a checkpoint equals the run's own eval/<domain>/loss."""
    import data
    n = len(dataset) // batch_size
    if n == 0:
        raise ValueError(f"held-out set {dataset!r} has {len(dataset)} instances, fewer than one batch of "
                         f"{batch_size}; lower --eval_batch_size")
    if max_batches is not None:
        n = min(n, max_batches)
    fn = _eval_fn(chunk, use_segments)
    ce = tokens = nbytes = 0.0
    for b in range(n):
        rows = data.get_batch(dataset, batch_size, 0, b)
        batch = {"tokens": jnp.asarray(rows["tokens"]), "instance_mask": jnp.asarray(rows["instance_mask"]),
                 "segment_ids": jnp.asarray(rows["segment_ids"])}
        s, c = fn(model, batch)
        ce, tokens = ce + float(s), tokens + float(c)
        if byte_lengths is not None:  # the targets are tokens[:, 1:]
            nbytes += float(byte_lengths[rows["tokens"][:, 1:]].sum())
    out = {"ce_sum": ce, "tokens": tokens, "bytes": nbytes, "loss": ce / tokens, "batches": n}
    out["bpb"] = ce / (math.log(2) * nbytes) if nbytes else float("nan")
    return out


# ---- two models on identical inputs -------------------------------------------------------------
def logit_agreement(ref_logits: Float[np.ndarray, "*tokens vocab"], logits: Float[np.ndarray, "*tokens vocab_b"],
                    top_k: int = 10) -> dict:
    """Per-token KL(ref || other) in float64, top-1 agreement and top-k overlap (fraction of the
    reference's top k found in the other's top k). Inputs [..., vocab]."""
    a = np.asarray(ref_logits, np.float64).reshape(-1, ref_logits.shape[-1])
    b = np.asarray(logits, np.float64).reshape(-1, logits.shape[-1])
    if a.shape != b.shape:
        raise ValueError(f"logit shapes differ: {a.shape} vs {b.shape} (different vocab sizes?)")
    la = a - a.max(-1, keepdims=True)
    la -= np.log(np.exp(la).sum(-1, keepdims=True))
    lb = b - b.max(-1, keepdims=True)
    lb -= np.log(np.exp(lb).sum(-1, keepdims=True))
    kl = np.maximum((np.exp(la) * (la - lb)).sum(-1), 0.0)
    ta = np.argpartition(-a, top_k - 1, axis=-1)[:, :top_k]
    tb = np.argpartition(-b, top_k - 1, axis=-1)[:, :top_k]
    overlap = np.mean([len(np.intersect1d(x, y)) / top_k for x, y in zip(ta, tb)])
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "kl_sum": float(kl.sum()),
            "top1": float(np.mean(a.argmax(-1) == b.argmax(-1))), f"top{top_k}": float(overlap),
            "tokens": int(kl.size)}


def model_agreement(model_a: OLMo3, model_b: OLMo3, token_rows: Integer[np.ndarray, "batch seq"]) -> dict:
    """KL(a || b), top-1, top-10 of two models over [B, T] token rows (means over all tokens)."""
    if model_a.config.vocab_size != model_b.config.vocab_size:
        raise ValueError(f"models have different vocab sizes ({model_a.config.vocab_size} vs "
                         f"{model_b.config.vocab_size}); token-level KL needs the same vocabulary")
    fa, fb = _logits_fn(), _logits_fn()
    parts = []
    for row in np.asarray(token_rows):
        t = jnp.asarray(row, jnp.int32)
        parts.append(logit_agreement(np.asarray(fa(model_a, t)), np.asarray(fb(model_b, t))))
    n = sum(p["tokens"] for p in parts)
    return {"kl_mean": sum(p["kl_sum"] for p in parts) / n, "kl_max": max(p["kl_max"] for p in parts),
            "top1": sum(p["top1"] * p["tokens"] for p in parts) / n,
            "top10": sum(p["top10"] * p["tokens"] for p in parts) / n, "tokens": n}


@functools.lru_cache(maxsize=1)
def _logits_fn():
    return eqx.filter_jit(lambda m, t: m(t))


# ---- KV-cache decoding ---------------------------------------------------------------------------
def _extend(model: OLMo3, k_cache: jax.Array, v_cache: jax.Array, tokens: jax.Array, start: jax.Array):
    """Run `tokens` [T] at positions start.. start+T-1 against the cache [L, S, KV, hd]; returns
    (logits [T, V] fp32, k_cache, v_cache). The layer's projections, norms, RoPE and MLP are
    OLMo3's own (olmo3.model.attention_inputs / layer_output); only attention reads the cache."""
    c = model.config
    T, S = tokens.shape[0], k_cache.shape[1]
    pos = start + jnp.arange(T, dtype=jnp.int32)
    tables = {"sliding": rope.cos_sin(pos, c.head_dim, c.rope_theta, None),
              "full": rope.cos_sin(pos, c.head_dim, c.rope_theta, c.yarn)}
    is_full = jnp.asarray([t == "full" for t in c.layer_types()])
    kpos = jnp.arange(S)
    causal = kpos[None, :] <= pos[:, None]                                   # (T, S)
    in_window = (pos[:, None] - kpos[None, :]) < c.window

    def layer(x, xs):
        p, full, kc, vc = xs
        dt = x.dtype
        cos = jnp.where(full, tables["full"][0], tables["sliding"][0])
        sin = jnp.where(full, tables["full"][1], tables["sliding"][1])
        q, k, v = attention_inputs(c, p, x, cos, sin)                             # (T, H|KV, hd)
        kc = jax.lax.dynamic_update_slice(kc, k.astype(kc.dtype), (start, 0, 0))
        vc = jax.lax.dynamic_update_slice(vc, v.astype(vc.dtype), (start, 0, 0))
        G = c.n_heads // c.n_kv_heads
        qg = q.reshape(T, c.n_kv_heads, G, c.head_dim)                             # (T, KV, G, hd)
        s = jnp.einsum("tkgd,skd->kgts", qg, kc.astype(dt), preferred_element_type=jnp.float32)
        s = s * c.head_dim ** -0.5
        mask = causal & (in_window | full)
        s = jnp.where(mask[None, None], s, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(s, axis=-1).astype(dt)
        o = jnp.einsum("kgts,skd->tkgd", probs, vc.astype(dt), preferred_element_type=jnp.float32)
        return layer_output(c, p, x, o.astype(dt).reshape(T, c.q_dim)), (kc, vc)

    x = model.embed[tokens].astype(c.dtype)
    x, (k_cache, v_cache) = jax.lax.scan(layer, x, (model.layers, is_full, k_cache, v_cache))
    h = rms_norm(x, model.norm, c.norm_eps)
    return jnp.dot(h, model.lm_head.astype(h.dtype), preferred_element_type=jnp.float32), k_cache, v_cache


_extend_jit = eqx.filter_jit(_extend, donate="all-except-first")  # the caches are updated in place


Tokens = Union[Sequence[int], np.ndarray]  # token ids: a list or a 1-D integer array


def _bucket(n: int, size: int = 64) -> int:
    return max(size, -(-n // size) * size)


class Scorer:
    """Log-likelihoods and greedy generation for one model: what lm-eval-harness asks of an LM.

    Token lists in, numbers out; `tokenizer` (encode/decode/eot_token) is only used by the
    string-level helpers. Sequences are right-padded to buckets of 64 so jit compiles a handful
    of shapes; padding after the last real token cannot change causal logits."""

    def __init__(self, model: OLMo3, tokenizer=None, max_length: int = 2048):
        self.model, self.tokenizer, self.max_length = model, tokenizer, max_length

    def _check(self, tokens: list) -> None:
        top = max(tokens, default=0)
        if top >= self.model.config.vocab_size or min(tokens, default=0) < 0:
            raise ValueError(f"token id {top} is outside the model's vocabulary of {self.model.config.vocab_size}: "
                             "the tokenizer does not match the model")

    def _logprobs(self, tokens: list) -> np.ndarray:
        """log_softmax of the logits at every position of `tokens` (len <= max_length)."""
        self._check(tokens)
        n = len(tokens)
        padded = np.zeros(_bucket(n), np.int32)
        padded[:n] = tokens
        logits = np.asarray(_logits_fn()(self.model, jnp.asarray(padded)))[:n]
        return logits - _logsumexp(logits)

    def loglikelihood(self, context: Tokens, continuation: Tokens) -> tuple[float, bool]:
        """(sum of log p(continuation | context), whether greedy decoding yields it)."""
        context, continuation = [int(t) for t in context], [int(t) for t in continuation]
        if not continuation:
            raise ValueError("loglikelihood: empty continuation")
        seq = (context + continuation)[-(self.max_length + 1):]
        if len(seq) < 2:
            raise ValueError("loglikelihood: an empty context needs a prefix token (e.g. eos)")
        lp = self._logprobs(seq[:-1])
        targets = np.asarray(seq[1:])
        k = len(continuation)
        rows, tg = lp[-k:], targets[-k:]
        return float(rows[np.arange(k), tg].sum()), bool((rows.argmax(-1) == tg).all())

    def loglikelihood_rolling(self, tokens: Tokens, prefix: int) -> float:
        """log p(tokens) given a single prefix token, in windows of max_length predictions, each
        with as much preceding context as fits (lm-eval's rolling windows, context length 1)."""
        t = [int(prefix)] + [int(x) for x in tokens]
        total = 0.0
        for a in range(1, len(t), self.max_length):
            b = min(a + self.max_length, len(t))
            lo = max(0, b - 1 - self.max_length)
            lp = self._logprobs(t[lo:b - 1])
            idx = np.arange(a, b)
            total += float(lp[idx - 1 - lo, np.asarray(t)[idx]].sum())
        return total

    def generate(self, prompt: Tokens, max_new_tokens: int, stop: Optional[Callable[[list[int]], bool]] = None,
                 eos_id: Optional[int] = None) -> list[int]:
        """Greedy decoding with a KV cache: one prefill, then one token per step."""
        c = self.model.config
        prompt = [int(t) for t in prompt][-(self.max_length - 1):]
        self._check(prompt)
        max_new_tokens = max(0, min(max_new_tokens, self.max_length - len(prompt)))
        S = _bucket(len(prompt) + max_new_tokens)
        kc = jnp.zeros((c.n_layers, S, c.n_kv_heads, c.head_dim), c.dtype)
        vc = jnp.zeros_like(kc)
        padded = np.zeros(_bucket(len(prompt)), np.int32)
        padded[:len(prompt)] = prompt
        if len(padded) > S:
            padded = padded[:S]
        logits, kc, vc = _extend_jit(self.model, kc, vc, jnp.asarray(padded), jnp.int32(0))
        nxt = int(np.argmax(np.asarray(logits[len(prompt) - 1])))
        out: list[int] = []
        pos = len(prompt)
        while len(out) < max_new_tokens:
            out.append(nxt)
            if (eos_id is not None and nxt == eos_id) or (stop is not None and stop(out)):
                break
            if len(out) == max_new_tokens:
                break
            logits, kc, vc = _extend_jit(self.model, kc, vc, jnp.asarray([nxt], jnp.int32), jnp.int32(pos))
            pos += 1
            nxt = int(np.argmax(np.asarray(logits[0])))
        return out

    # -- string level (lm-eval conventions) --------------------------------------------------
    def split_encode(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's `_encode_pair`: trailing spaces of the context move to the continuation;
        the whole string is encoded once and split after the context's tokens."""
        tok = self.tokenizer
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        whole = encode(tok, context + continuation)
        ctx = encode(tok, context) if context else [tok.eot_token]
        if not context:
            return ctx, whole
        return ctx, whole[len(ctx):]


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text`; special-token strings in the text are encoded as plain text (tiktoken
    refuses them by default)."""
    try:
        return tokenizer.encode(text, disallowed_special=())
    except TypeError:  # not tiktoken
        return tokenizer.encode(text)


def _logsumexp(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return m + np.log(np.exp(x - m).sum(-1, keepdims=True))


# ---- downstream multiple choice ------------------------------------------------------------------
def read_jsonl(path: str) -> list[dict]:
    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not JSON ({e})") from e
    return out


def load_task(path: str) -> tuple[list[dict], list[dict]]:
    """(docs, few-shot pool) of a local multiple-choice task: jsonl lines with "context" (str),
    "choices" (list of str) and "gold" (int). Few-shot examples come from `<name>.fewshot.jsonl`
    next to it when present, else from the other documents of the task."""
    docs = read_jsonl(path)
    for i, d in enumerate(docs):
        if not (isinstance(d.get("context"), str) and isinstance(d.get("choices"), list) and d["choices"]
                and isinstance(d.get("gold"), int) and 0 <= d["gold"] < len(d["choices"])):
            raise ValueError(f"{path}: document {i} needs 'context' (str), 'choices' (non-empty list) and "
                             f"'gold' (an index into choices); got keys {sorted(d)}")
    shots_path = path[:-len(".jsonl")] + ".fewshot.jsonl" if path.endswith(".jsonl") else None
    pool = read_jsonl(shots_path) if shots_path and os.path.exists(shots_path) else None
    return docs, pool


def fewshot_prompt(doc: dict, index: int, docs: list[dict], pool: Optional[list[dict]], k: int,
                   delimiter: str = " ", separator: str = "\n\n", seed: int = 1234) -> str:
    """k solved examples (context + delimiter + gold choice), then the document's context."""
    if k == 0:
        return doc["context"]
    candidates = pool if pool is not None else [d for j, d in enumerate(docs) if j != index]
    if len(candidates) < k:
        raise ValueError(f"num_fewshot={k} but only {len(candidates)} examples available")
    rng = np.random.default_rng(seed + index)
    shots = [candidates[j] for j in rng.choice(len(candidates), size=k, replace=False)]
    return "".join(s["context"] + delimiter + s["choices"][s["gold"]] + separator for s in shots) + doc["context"]


def mean_stderr(values: Sequence[float]) -> float:
    """Standard error of a mean, sample std (ddof 1), as lm-eval's `mean_stderr`."""
    v = np.asarray(values, np.float64)
    return float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else float("nan")


def multiple_choice(scorer: Scorer, docs: list[dict], pool: Optional[list[dict]] = None, *,
                    num_fewshot: int = 0, delimiter: str = " ", limit: Optional[int] = None) -> dict:
    """acc (argmax of sum log p) and acc_norm (argmax of log p / characters of the choice), each
    with its standard error — lm-eval-harness's `multiple_choice` output type."""
    acc, acc_norm = [], []
    for i, doc in enumerate(docs[:limit] if limit else docs):
        ctx = fewshot_prompt(doc, i, docs, pool, num_fewshot, delimiter)
        lls = np.array([scorer.loglikelihood(*scorer.split_encode(ctx, delimiter + ch))[0] for ch in doc["choices"]])
        lens = np.array([len(ch) for ch in doc["choices"]], np.float64)
        acc.append(float(np.argmax(lls) == doc["gold"]))
        acc_norm.append(float(np.argmax(lls / np.maximum(lens, 1)) == doc["gold"]))
    return {"acc": float(np.mean(acc)), "acc_stderr": mean_stderr(acc), "acc_norm": float(np.mean(acc_norm)),
            "acc_norm_stderr": mean_stderr(acc_norm), "n": len(acc)}


# ---- the lm-eval-harness adapter -----------------------------------------------------------------
def lm_eval_adapter(model: OLMo3, tokenizer=None, max_length: int = 2048, max_gen_toks: int = 256):
    """An instance of `lm_eval.api.model.LM` driving our model (pip install lm-eval; 0.4.x).

    loglikelihood and loglikelihood_rolling score with `Scorer`; generate_until decodes greedily
    with the KV cache and cuts the text at the first stop string."""
    from lm_eval.api.model import LM

    import data
    tok = tokenizer or data.dolma2()

    class OLMo3LM(LM):
        def __init__(self):
            super().__init__()
            self.scorer = Scorer(model, tok, max_length)

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return [self.scorer.loglikelihood(*self.scorer.split_encode(*r.args)) for r in requests]

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return [self.scorer.loglikelihood_rolling(encode(tok, r.args[0]), tok.eot_token) for r in requests]

        def generate_until(self, requests, disable_tqdm: bool = False):
            out = []
            for r in requests:
                context, kwargs = r.args
                kwargs = dict(kwargs or {})
                until = kwargs.get("until") or [tok.decode([tok.eot_token])]
                until = [until] if isinstance(until, str) else list(until)
                n = int(kwargs.get("max_gen_toks", max_gen_toks))
                stop = lambda ids: any(u in tok.decode(ids) for u in until)  # noqa: E731
                ids = self.scorer.generate(encode(tok, context), n, stop=stop, eos_id=tok.eot_token)
                text = tok.decode(ids)
                for u in until:
                    text = text.split(u)[0]
                out.append(text)
            return out

    return OLMo3LM()


# ---- step-aligned comparison of two runs ---------------------------------------------------------
def read_metrics(run_dir: str) -> dict[int, dict]:
    """metrics.jsonl -> {step: metrics}; a step logged twice (a resumed run) keeps the last line."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: the run comparison needs each run's metrics.jsonl")
    out: dict[int, dict] = {}
    for rec in read_jsonl(path):
        if "step" in rec:
            out[int(rec["step"])] = rec
    return out


def train_loss_at(metrics: Mapping[int, dict], step: int, window: int) -> float:
    """Mean train/loss over the logged steps in (step - window, step]: one batch is noisy."""
    vals = [m["train/loss"] for s, m in metrics.items() if step - window < s <= step and "train/loss" in m]
    if not vals:
        raise ValueError(f"no train/loss logged in steps ({step - window}, {step}]")
    return float(np.mean(vals))


def verdict(train_delta: float, heldout_delta: float, tol: float) -> Optional[str]:
    """Deltas are B - A (negative: B is better). The memorization signature of a data bug: B's
    training loss improved by more than `tol` nats, and its held-out loss improved by less than
    half as much (DESIGN §4 bug 1: Poisson resampling lowered training loss, not held-out)."""
    if train_delta < -tol and heldout_delta > train_delta / 2:
        return "training loss improved but held-out did not (memorization signature: check the data order)"
    return None


def write_report(rows: list[dict], out_dir: str, title: str, notes: Sequence[str] = ()) -> dict:
    """report.md, report.csv and report.png (training-loss delta and held-out delta by step)."""
    import csv
    os.makedirs(out_dir, exist_ok=True)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    paths = {k: os.path.join(out_dir, f"report.{k}") for k in ("md", "csv", "png")}

    def atomic(path, write):
        tmp = path + ".tmp"
        write(tmp)
        os.replace(tmp, path)

    def csv_(tmp):
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            w.writerows(rows)

    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))  # noqa: E731

    def md(tmp):
        with open(tmp, "w") as f:
            f.write(f"# {title}\n\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n")
            for r in rows:
                f.write("| " + " | ".join(fmt(r.get(c)) for c in cols) + " |\n")
            for n in notes:
                f.write(f"\n{n}\n")

    def png(tmp):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        steps = [r["step"] for r in rows]
        ax.plot(steps, [r["train_delta"] for r in rows], "o-", label="training loss delta (B - A)")
        ax.plot(steps, [r["heldout_delta"] for r in rows], "s-", label="held-out loss delta (B - A)")
        ax.axhline(0.0, color="gray", lw=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("nats")
        ax.set_title(title)
        ax.legend()
        fig.tight_layout()
        fig.savefig(tmp, format="png")
        plt.close(fig)

    atomic(paths["csv"], csv_)
    atomic(paths["md"], md)
    atomic(paths["png"], png)
    return paths


def iter_steps(run_a: str, run_b: str, steps: Optional[Iterable[int]] = None) -> tuple[list[int], list[str]]:
    """Checkpoint steps to compare and notes. Explicit `steps` must exist in both runs."""
    mgrs = [checkpoint.CheckpointManager(r, read_only=True) for r in (run_a, run_b)]
    have = [set(m.all_steps()) for m in mgrs]
    for m in mgrs:
        m.close()
    if steps is not None:
        steps = sorted(set(int(s) for s in steps))
        for run, h in zip((run_a, run_b), have):
            missing = [s for s in steps if s not in h]
            if missing:
                raise FileNotFoundError(f"run {run} has no checkpoint for step(s) {missing}; it has "
                                        f"{sorted(h)}. Compare steps both runs saved (step-aligned).")
        return steps, []
    common = sorted(have[0] & have[1])
    if not common:
        raise ValueError(f"runs {run_a} ({sorted(have[0])}) and {run_b} ({sorted(have[1])}) share no "
                         "checkpoint step; comparisons are step-aligned")
    only = sorted(have[0] ^ have[1])
    return common, ([f"Steps saved by only one run (not compared): {only}"] if only else [])
