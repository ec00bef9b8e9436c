"""Scoring text with a model: what lm-eval-harness asks of an LM, and multiple-choice tasks.

    Scorer(model).loglikelihood(context, continuation)   sum log p(continuation | context), greedy?
    Scorer(model).loglikelihood_rolling(tokens, prefix)  log p(tokens) in windows of max_length
    Scorer(model).generate(prompt, n)                    greedy / sampled (top-p) decoding with a KV cache
    token_scores(model, tokens, targets, chunk)          per position: log p(target), is it the argmax?
    multiple_choice(scorer, docs, ...)                   acc / acc_norm with few-shot prompts
    continuation_scores(model, batch)                    batched: per row, sum log p of the
                                                         continuation and log p of choice tokens
    lm_eval_adapter(model)                               an `lm_eval.api.model.LM` over Scorer

The KV-cache decoder (`_extend`) runs the model's own layer pieces (olmo3.model.attention_inputs /
layer_output); only attention reads the cache, with the same causal and sliding-window masks.
"""
from __future__ import annotations

import math
import os
from typing import Callable, Optional, Sequence, Union

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from olmo3 import rope
from olmo3.config import matmul_precision
from olmo3.metrics import read_jsonl
from olmo3.model import OLMo3, attention_inputs, layer_output, rms_norm


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
        s = jnp.einsum("tkgd,skd->kgts", qg, kc.astype(dt), preferred_element_type=jnp.float32,
                       precision=matmul_precision(dt))
        s = s * c.head_dim ** -0.5
        mask = causal & (in_window | full)
        s = jnp.where(mask[None, None], s, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(s, axis=-1).astype(dt)
        o = jnp.einsum("kgts,skd->tkgd", probs, vc.astype(dt), preferred_element_type=jnp.float32,
                       precision=matmul_precision(dt))
        return layer_output(c, p, x, o.astype(dt).reshape(T, c.q_dim)), (kc, vc)

    x = model.embed[tokens].astype(c.dtype)
    x, (k_cache, v_cache) = jax.lax.scan(layer, x, (model.layers, is_full, k_cache, v_cache))
    return model.head(rms_norm(x, model.norm, c.norm_eps)), k_cache, v_cache


_extend_jit = eqx.filter_jit(_extend, donate="all-except-first")  # the caches are updated in place


Tokens = Union[Sequence[int], np.ndarray]  # token ids: a list or a 1-D integer array


# Prompt tokens per prefill call. _extend's attention scores are [heads, tokens, cache] fp32: a
# whole 32k-token prompt of the 7B would hold 32 x 32k x 32k x 4 bytes = 137 GB of them (x2 with
# the probabilities), in chunks of 512 it holds 2 GB at a 32k cache.
PREFILL_CHUNK = 512


def _bucket(n: int, size: int = 64) -> int:
    return max(size, -(-n // size) * size)


def _pow2(n: int, least: int = 64) -> int:
    return max(least, 1 << (n - 1).bit_length())


# Positions per block of the LM head when scoring: a block's [SCORE_CHUNK, vocab] fp32 logits are
# alive at a time. A whole 65,536-token window of the 7B (a vocabulary of ~100k; eval.py's
# --max_length defaults to the context the model trained with) held 26 GB of them on the device,
# and as much again on the host with its log-softmax temporaries; 512 positions hold 0.2 GB.
SCORE_CHUNK = 512


def token_scores(model: OLMo3, tokens: Int[Array, " seq"], targets: Int[Array, " seq"], chunk: int,
                 rows: Optional[int] = None) -> tuple[Float[Array, " seq"], Bool[Array, " seq"]]:
    """Per position t: (log p(targets[t] | tokens[:t+1]), whether targets[t] is the argmax of the
    logits). The hidden states are computed whole, the LM head `chunk` positions at a time, so no
    [seq, vocab] logits exist. `rows`: the softmax and argmax over the first `rows` logits only
    (the tokenizer's tokens, as the model's HF export holds them); None: all of them, as the
    model trained."""
    return head_scores(model, model.hidden(tokens), targets, chunk, rows)


def head_scores(model: OLMo3, h: Float[Array, "seq d_model"], targets: Int[Array, " seq"], chunk: int,
                rows: Optional[int] = None) -> tuple[Float[Array, " seq"], Bool[Array, " seq"]]:
    """token_scores from the final hidden states `h`: the LM head runs `chunk` positions at a time
    (a last partial block is padded, and its padding dropped)."""
    seq = h.shape[0]
    pad = -seq % chunk
    h, targets = jnp.pad(h, ((0, pad), (0, 0))), jnp.pad(targets, (0, pad))
    n = h.shape[0] // chunk

    def block(xs):
        hb, tb = xs
        logits = model.head(hb)[:, :rows]                                              # (chunk, V)
        lp = jnp.take_along_axis(logits, tb[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(logits, axis=-1)
        return lp, jnp.argmax(logits, axis=-1) == tb

    lp, greedy = jax.lax.map(block, (h.reshape(n, chunk, h.shape[-1]), targets.reshape(n, chunk)))
    return lp.reshape(-1)[:seq], greedy.reshape(-1)[:seq]


token_scores_jit = eqx.filter_jit(token_scores)


def score_shape(n: int) -> tuple[int, int]:
    """(padded length, head chunk) with which Scorer scores n positions: buckets of 64 up to
    SCORE_CHUNK, whole chunks beyond it."""
    if n <= SCORE_CHUNK:
        return _bucket(n), _bucket(n)
    return _bucket(n, SCORE_CHUNK), SCORE_CHUNK


def nucleus(weights: Float[np.ndarray, " vocab"], top_p: float) -> Float[np.ndarray, " vocab"]:
    """Top-p (nucleus) sampling's distribution: the most probable tokens whose probability reaches
    `top_p` (the one that crosses it kept), renormalised; zero elsewhere. A token is kept when
    the tokens more probable than it hold less than top_p, as transformers' TopPLogitsWarper
    decides (it removes a token whose ascending cumulative probability is <= 1 - top_p). Among
    tokens tied at the cut-off the lower ids are kept; transformers keeps the same number of
    them, in the order of torch's unstable sort."""
    p = weights / weights.sum()
    if top_p >= 1:
        return p
    order = np.argsort(-p, kind="stable")
    above = np.cumsum(p[order]) - p[order]              # the probability of the tokens before each
    keep = np.zeros_like(p)
    keep[order[above < top_p]] = p[order[above < top_p]]
    return keep / keep.sum()


class Scorer:
    """Log-likelihoods and generation (greedy or sampled) for one model: what lm-eval-harness
    asks of an LM.

    Token lists in, numbers out; `tokenizer` (encode/decode/eot_token) is only used by the
    string-level helpers. Sequences are right-padded (score_shape) so jit compiles a handful of
    shapes; padding after the last real token cannot change causal logits.
    `rows`: log-likelihoods normalise over the first `rows` logits only (see token_scores);
    None: over all the model's rows."""

    def __init__(self, model: OLMo3, tokenizer=None, max_length: int = 2048, rows: Optional[int] = None):
        self.model, self.tokenizer, self.max_length = model, tokenizer, max_length
        self.rows = None if rows is None or rows >= model.config.vocab_size else rows
        self.truncated = 0   # loglikelihood requests whose context was cut from the left to fit

    def _check(self, tokens: list) -> None:
        n = self.rows or self.model.config.vocab_size
        bad = next((t for t in tokens if not 0 <= t < n), None)
        if bad is not None:   # JAX's gather would clamp it: wrong scores, no error
            rows = " (its tokenizer's rows; the rest is padding)" if self.rows else ""
            raise ValueError(f"token id {bad} is outside the model's vocabulary of {n}{rows}: "
                             "the tokenizer does not match the model")

    def _scores(self, seq: list) -> tuple[np.ndarray, np.ndarray]:
        """token_scores of `seq[:-1]` predicting `seq[1:]` (len(seq) - 1 <= max_length)."""
        self._check(seq)
        n = len(seq) - 1
        length, chunk = score_shape(n)
        tokens, targets = np.zeros(length, np.int32), np.zeros(length, np.int32)
        tokens[:n], targets[:n] = seq[:-1], seq[1:]
        lp, greedy = token_scores_jit(self.model, jnp.asarray(tokens), jnp.asarray(targets), chunk, self.rows)
        return np.asarray(lp)[:n], np.asarray(greedy)[:n]

    def loglikelihood(self, context: Tokens, continuation: Tokens) -> tuple[float, bool]:
        """(sum of log p(continuation | context), whether greedy decoding yields it)."""
        context, continuation = [int(t) for t in context], [int(t) for t in continuation]
        if not continuation:
            raise ValueError("loglikelihood: empty continuation")
        if not context:   # the first continuation token would have nothing to be predicted from
            raise ValueError("loglikelihood: an empty context needs a prefix token (e.g. eos)")
        if len(continuation) > self.max_length:   # as lm-eval's HFLM asserts
            raise ValueError(f"loglikelihood: a continuation of {len(continuation)} tokens does not fit "
                             f"max_length={self.max_length}; give a max_length of at least {len(continuation)}")
        self.truncated += len(context) + len(continuation) > self.max_length + 1
        seq = (context + continuation)[-(self.max_length + 1):]
        lp, greedy = self._scores(seq)
        k = len(continuation)
        return float(lp[-k:].sum()), bool(greedy[-k:].all())

    def loglikelihood_rolling(self, tokens: Tokens, prefix: int) -> float:
        """log p(tokens) given a single prefix token, in windows of max_length predictions, each
        with as much preceding context as fits (lm-eval's rolling windows, context length 1)."""
        t = [int(prefix)] + [int(x) for x in tokens]
        total = 0.0
        for a in range(1, len(t), self.max_length):
            b = min(a + self.max_length, len(t))
            lo = max(0, b - 1 - self.max_length)
            lp, _ = self._scores(t[lo:b])            # predicts t[lo + 1:b]; the last b - a are new
            total += float(lp[a - 1 - lo:].sum())
        return total

    def generate(self, prompt: Tokens, max_new_tokens: int, stop: Optional[Callable[[list[int]], bool]] = None,
                 eos_id: Optional[int] = None, temperature: float = 0.0, seed: int = 0,
                 vocab_size: Optional[int] = None, top_p: float = 1.0) -> list[int]:
        """Decoding with a KV cache: a prefill (in chunks of up to PREFILL_CHUNK tokens), then one
        token per step. Greedy at temperature 0, else sampled from softmax(logits / temperature), cut to
        its `top_p` nucleus (numpy's generator seeded with `seed`).
        The prompt and `max_new_tokens` must fit `max_length` together: nothing is cut here (a
        caller that wants lm-eval's left truncation does it, knowing what it drops).
        `vocab_size`: only ids below it are generated, the tokenizer's tokens. OLMo-core pads
        dolma2's 100278 rows to 100352; the padding rows are no token (the tokenizer cannot decode
        them) and the model's HF export drops them, so generation picks from the real rows only."""
        if not 0 < top_p <= 1:   # NaN too
            raise ValueError(f"generate: top_p={top_p} must be in (0, 1] (1: no nucleus cut)")
        if top_p < 1 and temperature <= 0:
            raise ValueError(f"generate: top_p={top_p} samples; give a temperature > 0 (0 is greedy decoding)")
        rng = np.random.default_rng(seed)
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("generate: the prompt is empty; give at least one token")
        if len(prompt) + max_new_tokens > self.max_length:
            raise ValueError(f"generate: a prompt of {len(prompt)} tokens and {max_new_tokens} new tokens do not fit "
                             f"the context of {self.max_length} tokens (max_length)")

        def pick(logits) -> int:
            x = np.asarray(logits, np.float64)[:vocab_size]
            if temperature <= 0:
                return int(np.argmax(x))
            p = nucleus(np.exp((x - x.max()) / temperature), top_p)
            return int(rng.choice(len(p), p=p))

        c = self.model.config
        self._check(prompt)
        n = len(prompt)
        # A chat file's or a generation task's prompts of every length compile a few shapes of the
        # prefill and the decode step (minutes each for the 7B on a GPU): prefill chunks of powers
        # of two, caches of four sizes per octave past 256 tokens (at most a quarter longer than
        # needed; buckets of 64 below), never past the context rounded up to 64. Buckets of 64
        # compiled both per 64 tokens.
        chunk = min(_pow2(n), PREFILL_CHUNK)
        padded = np.zeros(-(-n // chunk) * chunk, np.int32)                 # whole chunks of the prompt
        padded[:n] = prompt
        need = n + max_new_tokens   # <= max_length; S >= len(padded): no chunk writes past the cache
        S = max(min(_bucket(need, max(64, _pow2(need) // 8)), _bucket(self.max_length)), len(padded))
        kc = jnp.zeros((c.n_layers, S, c.n_kv_heads, c.head_dim), c.dtype)
        vc = jnp.zeros_like(kc)
        for a in range(0, len(padded), chunk):   # prefill: scores [heads, chunk, S], never [heads, n, S]
            logits, kc, vc = _extend_jit(self.model, kc, vc, jnp.asarray(padded[a:a + chunk]), jnp.int32(a))
        nxt = pick(logits[n - 1 - (len(padded) - chunk)])
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
            nxt = pick(logits[0])
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
    """Token ids of `text`: with the dolma2 tokenizer as data.tokenizer.encode gives them (AI2's
    non-special added tokens matched, special-token strings as plain text); another tiktoken
    tokenizer with its special-token strings as text (tiktoken refuses them by default)."""
    import data
    if tokenizer is data.dolma2():
        return data.tokenizer.encode(text)
    try:
        return tokenizer.encode(text, disallowed_special=())
    except TypeError:  # not tiktoken
        return tokenizer.encode(text)


# ---- batched continuation scores (OLMo's in-loop requests, olmo3/oe_tasks.py) --------------------
CONTINUATION_CHUNK = 128   # LM-head positions per block; oe_tasks pads rows to multiples of 128 too


def continuation_scores(model: OLMo3, batch: dict, gather: Optional[Callable] = None
                        ) -> tuple[Float[Array, " rows"], Float[Array, "rows choices"]]:
    """Per row of a right-padded [B, T] batch: (sum of log p(targets[t] | tokens[:t+1]) over the
    positions with weights[t] > 0, log p(choices[k] | tokens[:pos+1]) for each k). The first is a
    continuation's log-likelihood (targets = the continuation, weight 1 at the positions that
    predict it, 0 elsewhere: a selection, not a scale; padding's log p is never added); the second is OLMo's
    "fast MC": every one-token answer scored at the last context position by one forward pass.

    Rows run one at a time (`lax.map`) and the LM head 128 positions at a time (`head_scores`), so
    only [128, vocab] fp32 logits are alive, not a row's [T, vocab].
    `gather` is olmo3/sharding.py's per-layer FSDP all-gather, as in held-out evaluation."""
    def one(xs):
        tokens, targets, weights, pos, choices = xs
        h = model.hidden(tokens, gather=gather)                                        # (T, d)
        tok, _ = head_scores(model, h, targets, CONTINUATION_CHUNK)
        last = model.head(h[pos])                                                      # (V,)
        return jnp.sum(jnp.where(weights > 0, tok, 0.0)), last[choices] - jax.nn.logsumexp(last)

    return jax.lax.map(one, (batch["tokens"], batch["targets"], batch["weights"], batch["pos"],
                             batch["choices"]))


continuation_scores_jit = eqx.filter_jit(continuation_scores)


# ---- downstream multiple choice ------------------------------------------------------------------
def load_task(path: str, num_fewshot: int = 0) -> tuple[list[dict], list[dict]]:
    """(docs, few-shot pool) of a local multiple-choice task: jsonl lines with "context" (str),
    "choices" (list of non-empty str) and "gold" (int). Few-shot examples come from
    `<name>.fewshot.jsonl` next to it when present (lines of the same form), else from the other
    documents of the task; a pool with fewer than `num_fewshot` is refused, naming its file."""
    docs = _task_documents(path)
    shots_path = path[:-len(".jsonl")] + ".fewshot.jsonl" if path.endswith(".jsonl") else None
    pool = _task_documents(shots_path) if shots_path and os.path.exists(shots_path) else None
    have = len(pool) if pool is not None else len(docs) - 1
    if num_fewshot > have:
        raise ValueError(f"{shots_path if pool is not None else path}: num_fewshot={num_fewshot} but "
                         + (f"it holds {have} examples" if pool is not None else
                            f"each document takes its shots from the other {have} (no {shots_path or '<name>.fewshot.jsonl'})"))
    return docs, pool


def _task_documents(path: str) -> list[dict]:
    """The documents of one task file, each checked: a bad one is named before anything is scored."""
    docs = read_jsonl(path)
    if not docs:
        raise ValueError(f"{path}: no documents; a task file holds one JSON object per line with 'context', "
                         "'choices' and 'gold'")
    for i, d in enumerate(docs):
        if not (isinstance(d, dict) and isinstance(d.get("context"), str) and isinstance(d.get("choices"), list)
                and d["choices"] and all(isinstance(c, str) and c for c in d["choices"])
                and isinstance(d.get("gold"), int) and not isinstance(d["gold"], bool)):
            raise ValueError(f"{path}: document {i} needs 'context' (str), 'choices' (a non-empty list of non-empty "
                             f"strings) and 'gold' (an index into choices); got "
                             + (f"keys {sorted(d)}" if isinstance(d, dict) else type(d).__name__)
                             + (f", choices {d['choices']!r:.80}" if isinstance(d, dict) and "choices" in d else ""))
        if not 0 <= d["gold"] < len(d["choices"]):
            raise ValueError(f"{path}: document {i} has 'gold' {d['gold']}, not an index into its "
                             f"{len(d['choices'])} choices (0..{len(d['choices']) - 1})")
    return docs


def fewshot_prompt(doc: dict, index: int, docs: list[dict], pool: Optional[list[dict]], k: int,
                   delimiter: str = " ", separator: str = "\n\n", seed: int = 1234) -> str:
    """k solved examples (context + delimiter + gold choice), then the document's context. The
    examples: k distinct ones of `pool` (a few-shot split), else of the task's other documents,
    drawn by numpy's generator seeded `seed + index`, so each document's prompt is fixed whatever
    --limit scores. lm-eval draws from one random.Random(1234) per task instead: its prompts hold
    other examples (the format is the same). Neither uses a copy of the document itself."""
    if k == 0:
        return doc["context"]
    candidates = [d for j, d in enumerate(pool if pool is not None else docs)
                  if d != doc and (pool is not None or j != index)]
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
    with the KV cache and cuts the text at the first stop string. A task's generation kwargs read
    as HFLM reads them (lm-eval 0.4.13's normalize_gen_kwargs): the answer's length under any of
    its names, and sampling when do_sample is set or, unset, when temperature > 0; a task that
    samples is refused (HFLM's samples are torch's random draws, not ours).
    Log-likelihoods, greedy checks and generation use the tokenizer's rows only (its n_vocab, when it
    says): OLMo-core pads dolma2's 100278 rows to 100352, and HFLM scores the HF export, which
    drops the padding rows, so its softmax never sees them."""
    from lm_eval.api.model import LM

    import data
    tok = tokenizer or data.dolma2()

    class OLMo3LM(LM):
        def __init__(self):
            super().__init__()
            self.scorer = Scorer(model, tok, max_length, rows=getattr(tok, "n_vocab", None))
            self.requests, self.cut = 0, 0   # requests answered; generation contexts cut to fit

        @property
        def truncated(self) -> int:
            """Requests whose context was cut from the left to fit max_length (HFLM cuts the same)."""
            return self.scorer.truncated + self.cut

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            self.requests += len(requests)
            return [self.scorer.loglikelihood(*self.scorer.split_encode(*r.args)) for r in requests]

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):   # windows: nothing is cut
            self.requests += len(requests)
            return [self.scorer.loglikelihood_rolling(encode(tok, r.args[0]), tok.eot_token) for r in requests]

        def generate_until(self, requests, disable_tqdm: bool = False):
            out = []
            for r in requests:
                context, kwargs = r.args
                kwargs = dict(kwargs or {})
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                eos = tok.decode([tok.eot_token])
                until += [eos] * bool(eos and eos not in until)   # lm-eval's HFLM adds EOS to every stop list
                # as lm-eval 0.4.13's normalize_gen_kwargs: the first length named, in HFLM's order of
                # preference, and a temperature above 0 samples unless the task says do_sample: false
                key = next((k for k in ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")
                            if kwargs.get(k) is not None), None)
                n = int(kwargs[key]) if key else max_gen_toks
                do_sample, temperature = kwargs.get("do_sample"), float(kwargs.get("temperature") or 0.0)
                if do_sample or (do_sample is None and temperature > 0):   # HFLM samples (temperature, top_k, top_p)
                    raise ValueError(f"generate_until: the task asks for sampling (do_sample={do_sample}, temperature="
                                     f"{temperature}); this adapter decodes greedily only, so its answers would not "
                                     "be the samples the task scores; run the task with HFLM")
                room = self.scorer.max_length - n
                if room < 1:
                    raise ValueError(f"generate_until: {key or 'max_gen_toks'}={n} leaves no room for a context in "
                                     f"--max_length={self.scorer.max_length}")
                # HFLM keeps the last max_length - max_gen_toks tokens of the context, so that the
                # whole max_gen_toks can be generated
                stop = lambda ids: any(u in tok.decode(ids) for u in until)  # noqa: E731
                prompt = encode(tok, context)
                self.requests, self.cut = self.requests + 1, self.cut + (len(prompt) > room)
                ids = self.scorer.generate(prompt[-room:], n, stop=stop,
                                           eos_id=tok.eot_token, vocab_size=self.scorer.rows)
                text = tok.decode(ids)
                for u in filter(None, until):   # as HFLM: "" stops at the first token (every text holds it), cuts nothing
                    text = text.split(u)[0]
                out.append(text)
            return out

    return OLMo3LM()
