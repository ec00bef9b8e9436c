"""An instruction set from the embedded corpus: "write the docstring of this function".

    python -m data.docstring_chats --out=runs/docstrings
    for each function of a standard-library module that has a docstring and a body:
        user:      "Write the docstring of this Python function.\\n\\n" + its source, docstring removed
        assistant: the docstring's first paragraph (inspect.cleandoc)
    split by the module's corpus split (data/corpus.py): functions of held-out documents are
    held out, but for those a training document holds too, so neither the base model nor SFT
    has seen them
    out/sft_{train,heldout}.jsonl   {"messages": [user, assistant]}               (data.prepare_sft)
    out/dpo_{train,heldout}.jsonl   {"chosen": [user, real], "rejected": [user, wrong]}
        wrong = another function's docstring that fits --max_tokens too (even rows), or the real one
                with its words shuffled (odd rows, and even rows where 16 draws found none)

Why: the CPU evidence of issue 16 needs chats whose answers are checkable and whose held-out
half is really unseen; docstrings are real, short, and tied to the code above them. Only
conversations whose rendered tokens fit `--max_tokens` are kept (the tiny model's sequence),
shortest functions first, then a seeded shuffle, so the set is a pure function of the corpus,
the seed and the limits. Preference rows use open-instruct's `chosen` / `rejected` message lists.
"""
from __future__ import annotations

import ast
import inspect
import json
import os
import random
import sys

from data import chat, corpus
from olmo3 import atomic

PROMPT = "Write the docstring of this Python function.\n\n"


def functions_with_docstrings(text: str) -> list[tuple[str, str]]:
    """(source without the docstring, first docstring paragraph) of each function in `text`."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        doc = ast.get_docstring(node)
        first = node.body[0]
        if not doc or first.lineno == node.lineno:  # a one-line `def f(): "doc"` has no body to show
            continue
        summary = inspect.cleandoc(doc).split("\n\n")[0].strip()
        body = lines[node.lineno - 1:first.lineno - 1] + lines[first.end_lineno:node.end_lineno]
        indent = min(len(s) - len(s.lstrip()) for s in body if s.strip())
        source = "\n".join(s[indent:] for s in body).strip("\n")
        if summary and source:
            out.append((source, summary))
    return out


def build(max_tokens: int, template: str, seed: int, max_train: int | None, max_heldout: int | None) -> dict:
    """{split: [(source, docstring)]} for "train" and "heldout", each a seeded shuffle."""
    found = {"train": [], "heldout": []}
    seen = set()   # every training function's code: the base model read the modules whole, fitting or not
    for doc in corpus.documents("stdlib-code"):
        split = "train" if corpus.split_of(doc) == "train" else "heldout"
        for source, summary in functions_with_docstrings(doc.text):
            if split == "train":
                seen.add(source)
            n = len(chat.encode(conversation(source, summary), template))
            if n <= max_tokens:
                found[split].append((n, doc.name, source, summary))
    rng = random.Random(seed)
    # The same function can sit in several modules (three_way_cmp: unittest/util.py, a training
    # module, and ctypes/test/test_libc.py, a held-out one): a held-out function whose code a
    # training module holds was seen by the base model, and is dropped; so is a repeat within a
    # split. After the shuffle, so that the other functions keep their places.
    out = {}
    for split, limit in (("train", max_train), ("heldout", max_heldout)):
        rows = sorted(set(found[split]))   # a fixed order before the shuffle
        rng.shuffle(rows)
        kept = {}   # insertion-ordered
        for _, _, source, summary in rows:
            if split == "train" or source not in seen:
                kept.setdefault((source, summary), None)
        out[split] = list(kept)[:limit]
    return out


def conversation(source: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": PROMPT + source}, {"role": "assistant", "content": answer}]


def corrupt(answer: str, rng: random.Random) -> str:
    """`answer` with its words shuffled (with " not" added where they are all one word): never
    the answer itself, whatever its spacing."""
    words = answer.split()
    for _ in range(8):
        rng.shuffle(words)
        if words != answer.split() or len(set(words)) < 2:
            break
    if len(set(words)) < 2:
        return " ".join(words) + " not"
    if words == answer.split():   # eight shuffles gave it back: a rotation, which cannot
        words = words[1:] + words[:1]
    return " ".join(words)


def preference_rows(pairs: list[tuple[str, str]], seed: int, fits=lambda conv: True) -> list[dict]:
    """open-instruct preference rows. `fits(conversation)` says whether a rejected side fits the
    sequence (`--max_tokens`): another function's docstring can be longer than the real one, and
    prepare_dpo would truncate that side alone."""
    rng, rows = random.Random(seed + 1), []
    for i, (source, answer) in enumerate(pairs):
        wrong = None
        if i % 2 == 0 and len(pairs) > 1:
            for _ in range(16):   # another function's docstring that fits, else the shuffled answer
                j = rng.randrange(len(pairs) - 1)
                other = pairs[j + (j >= i)][1]
                if other != answer and fits(conversation(source, other)):
                    wrong = other
                    break
        if wrong is None:
            wrong = corrupt(answer, rng)
        rows.append({"chosen": conversation(source, answer), "rejected": conversation(source, wrong)})
    return rows


def write_jsonl(path: str, rows: list[dict]) -> None:
    atomic.write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def main(argv):
    from absl import flags

    del argv
    f = flags.FLAGS
    if f.max_tokens < 1:
        raise ValueError(f"--max_tokens={f.max_tokens} must be >= 1 (the model's sequence length)")
    for name in ("max_train", "max_heldout"):
        if getattr(f, name) is not None and getattr(f, name) < 1:   # 0 wrote empty files, and exit 0
            raise ValueError(f"--{name}={getattr(f, name)} must be >= 1 (or left out: every function)")
    if not f.out:   # errno's "No such file or directory: ''"
        raise ValueError("--out is empty; give a directory for the chat files")
    if os.path.exists(f.out) and not os.path.isdir(f.out):
        raise FileExistsError(f"--out={f.out!r} is a file; give a directory")
    atomic.check_writable(f.out, "--out")   # a path under a file: errno's "Not a directory", no flag named
    sets = build(f.max_tokens, f.template, f.seed, f.max_train, f.max_heldout)
    for split, pairs in sets.items():   # four empty files and exit 0, found out only by prepare_sft
        if not pairs:
            raise ValueError(f"--max_tokens={f.max_tokens}: no {split} conversation fits in {f.max_tokens} tokens; "
                             "raise it (the model's sequence length)")
    os.makedirs(f.out, exist_ok=True)
    for split, pairs in sets.items():
        write_jsonl(os.path.join(f.out, f"sft_{split}.jsonl"), [{"messages": conversation(s, d)} for s, d in pairs])
        rows = preference_rows(pairs, f.seed, lambda conv: len(chat.encode(conv, f.template)) <= f.max_tokens)
        write_jsonl(os.path.join(f.out, f"dpo_{split}.jsonl"), rows)
        print(f"{split}: {len(pairs):,} functions -> {f.out}/sft_{split}.jsonl, {f.out}/dpo_{split}.jsonl")


if __name__ == "__main__":
    from absl import flags

    from olmo3 import cli
    flags.DEFINE_string("out", None, "directory for sft_*.jsonl and dpo_*.jsonl", required=True)
    flags.DEFINE_integer("max_tokens", 256, "keep conversations whose rendered tokens fit (the model's seq_len)")
    flags.DEFINE_enum("template", "olmo_thinker_no_think_sft_tokenization", list(chat.TEMPLATES),
                      "chat template used to measure lengths")
    flags.DEFINE_integer("seed", 0, "shuffle seed")
    flags.DEFINE_integer("max_train", None, "at most this many training functions")
    flags.DEFINE_integer("max_heldout", None, "at most this many held-out functions")
    sys.exit(cli.run(main))
