"""Preference JSONL -> the pair files `train.py --stage=dpo` reads (data/preference.py).

    python -m data.prepare_dpo --input=pairs.jsonl --out_dir=runs/dpo_data [--template=olmo_thinker]

    for each line {"chosen": [{"role", "content"}, ...], "rejected": [...]}:
        each side: ids, mask = data.chat.encode_with_mask(messages, last_turn=True)   # the response trained
                   truncated to --max_seq_length
        drop the pair if either side keeps no trained token        # preference_tulu_filter_v1
    out_dir/token_ids.npy, labels_mask.npy, pairs.json              # data/preference.py

open-instruct's preference format and tokenization: `chosen` / `rejected` message lists sharing
the prompt (`preference_tulu_tokenize_and_truncate_v1`, which its DPO registers as
`preference_tulu_tokenize_and_truncate_v1_2`: each side rendered whole, labels -100 on every message
but the last, earlier assistant turns included (`last_turn_tulu_tokenize_and_truncate_v1`), then
truncated to `max_seq_length`), 16,384 tokens in the OLMo 3 DPO scripts
(`7b_{think,instruct}_dpo.sh`: `--max_seq_length 16384`). Pairs are read and written one at a
time, into a temporary sibling directory renamed into place at the end: a bad line (named by file
and line), a crash or a SIGTERM leaves nothing.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator

from data import chat
from data.preference import write_pairs

MAX_SEQ_LENGTH = 16_384  # open-instruct scripts/train/olmo3/7b_{think,instruct}_dpo.sh


def iter_pairs(path: str, template: str = chat.INSTRUCT) -> Iterator[tuple[list[dict], list[dict]]]:
    """(chosen, rejected) message lists of a JSONL file, a line at a time, each one `template`
    renders; ValueError naming `path:line` on a bad line."""
    def parse(row):
        if not isinstance(row, dict) or "chosen" not in row or "rejected" not in row:
            raise ValueError('expected an object with "chosen" and "rejected" message lists')
        for side in ("chosen", "rejected"):
            chat.check_messages(row[side], template, side)
            if row[side][-1]["role"] != "assistant":
                raise ValueError(f"the last {side} message must be the assistant's response")
        if isinstance(row.get("prompt"), list) and any(chat.answer_only(row[s]) for s in ("chosen", "rejected")):
            # TRL's explicit-prompt format: read as it stands, the prompt was dropped and each side
            # trained whole (the template's system turn included), with exit status 0.
            raise ValueError('"prompt" holds the prompt turns and a side only its answer (TRL\'s explicit-prompt '
                             'format); write each side as the whole conversation, the prompt turns then the answer '
                             '(open-instruct\'s format)')
        return row["chosen"], row["rejected"]
    return chat.iter_jsonl(path, parse, 'one preference pair per line, '
                                        '{"chosen": [{"role", "content"}, ...], "rejected": [...]}')


def _rendered(messages: list[dict]) -> list[dict]:
    """What the templates render of `messages` (other keys: ids, ...)."""
    return [{k: m.get(k) for k in ("role", "content", "functions", "function_calls")} for m in messages]


def _prompt(messages: list[dict]) -> list[dict]:
    """What the templates render of the turns before the answer."""
    return _rendered(messages[:-1])


def prepare_dpo(input_path: str, out_dir: str, template: str = chat.INSTRUCT, max_seq_length: int = MAX_SEQ_LENGTH) -> dict:
    """Render, truncate, filter and write into the new directory `out_dir`, a pair at a time (a
    temporary sibling renamed into place: a failure leaves nothing); returns the manifest
    (data/preference.py)."""
    chat.check_prepare_paths(input_path, out_dir, max_seq_length, '{"chosen": [...], "rejected": [...]} lines')
    same, bare, other = [], [], []

    def rendered():
        for i, (c, r) in enumerate(iter_pairs(input_path, template)):
            if _rendered(c) == _rendered(r):   # sides apart only in an id render alike: margin 0
                same.append(i)
            if chat.answer_only(c) or chat.answer_only(r):
                bare.append(i)
            if _prompt(c) != _prompt(r):
                other.append(i)
            yield (chat.encode_with_mask(c, template, last_turn=True),
                   chat.encode_with_mask(r, template, last_turn=True))
    from olmo3.checkpoint import new_directory
    with new_directory(out_dir, "DPO data") as tmp:
        manifest = write_pairs(tmp, rendered(), max_seq_length=max_seq_length, display=out_dir,
                               info={"template": template, "source": os.path.basename(input_path),
                                     "tokenizer": "dolma2"})
    # Each kept, as open-instruct keeps them; but each is a data bug worth a look.
    chat.warn_rows(input_path, same, "pair", "have the same chosen and rejected messages",
                   "each trains nothing (its margin is 0, its loss log 2) and weighs in every batch's mean")
    chat.warn_rows(input_path, bare, "pair", "have a side with no turn before its answer", "all of that side is "
                   "trained, the template's system turn included (open-instruct's masking)")
    # The loss compares two answers to one prompt; a misaligned join of two files does this.
    chat.warn_rows(input_path, other, "pair", "have different prompts (the messages before the final answer) on "
                   "the chosen and rejected sides", "DPO compares two answers to one prompt")
    return manifest


def main(argv):
    from absl import flags
    del argv
    f = flags.FLAGS
    m = prepare_dpo(f.input, f.out_dir, f.template, f.max_seq_length)
    tokens = sum(m["lengths"])
    print(f"{m['pairs']:,} pairs ({m['dropped']:,} dropped: a side with nothing to train), {tokens:,} tokens "
          f"-> {f.out_dir}")


if __name__ == "__main__":
    from absl import flags

    from olmo3 import cli
    flags.DEFINE_string("input", None, 'JSONL: one {"chosen": [...], "rejected": [...]} per line', required=True)
    flags.DEFINE_string("out_dir", None, "directory for token_ids.npy, labels_mask.npy, pairs.json", required=True)
    flags.DEFINE_enum("template", chat.INSTRUCT, list(chat.TEMPLATES), "OLMo 3 chat template (data/chat.py)")
    flags.DEFINE_integer("max_seq_length", MAX_SEQ_LENGTH, "truncate each side to this many tokens")
    sys.exit(cli.run(main))
