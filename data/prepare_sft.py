"""Chats (JSONL) -> OLMo-core SFT files: token ids and label masks, one conversation per document.

    python -m data.prepare_sft --input=chats.jsonl --out_dir=runs/sft_data [--template=olmo_thinker_no_think_7b]
        [--max_seq_length=32768]

    for each line {"messages": [{"role", "content"}, ...]}:
        ids, mask = data.chat.encode_with_mask(messages)    # ends in exactly one EOS
        ids, mask = ids[:max_seq_length], mask[:max_seq_length]   # only with --max_seq_length
        drop it if mask has no 1 (open-instruct sft_tulu_filter_v1)
    out_dir/token_ids_part_0000.npy    uint32, headerless memmap: the ids, conversation after conversation
    out_dir/labels_mask_part_0000.npy  bool (one byte per token), same length: the masks
    out_dir/sft_manifest.json          counts (conversations kept / dropped, tokens, trained tokens)

The format of open-instruct's `scripts/data/convert_sft_data_for_olmocore.py`: raw `np.memmap`
files named `token_ids_part_XXXX.npy` / `labels_mask_part_XXXX.npy` (the `.npy` name is
OLMo-core's convention; there is no NumPy header), uint32 for the 100,278-token vocabulary,
parts of at most 1 GiB of ids (2^28 tokens). OLMo-core's SFT script reads them with
`NumpyPackedFSLDatasetConfig(paths=[token_ids_part_*.npy], label_mask_paths=[labels_mask_*.npy],
generate_doc_lengths=True)`, and so does `train.py --stage=sft --packed --label_masks`
(data/packed.py pairs each token file with the mask file of the same suffix), so files written by
AI2's converter train here unchanged. One difference: AI2's converter cuts parts at exactly
2^28 tokens, through a conversation if need be; here a part ends at a conversation's end.

`--max_seq_length` is the converter's option of the same name (open-instruct's SLURM scripts for
the 7B's data, scripts/slurm/sft/prepare_dolci_{think,instruct}_data.sh, pass 32768, and so do
sft_{think,instruct}.flags' commands; its default is none): `sft_tulu_tokenize_and_truncate_v1` cuts the rendered conversation and its mask to that many
tokens, then `sft_tulu_filter_v1` drops it if nothing trained is left. A cut conversation has lost
its EOS, so packing (documents split at EOS) reads it and the conversation after it as one
document, which the packer then truncates to the sequence length, as OLMo-core does with such
files. Without the option, a long conversation keeps its EOS and only it is truncated.

Why it is built this way: conversations are read, rendered and appended to the parts one at a
time (AI2's SFT sets run to tens of billions of tokens; held whole, the 7B's would need terabytes
of memory), into a temporary sibling directory renamed into place at the end. A crash, a SIGTERM
or a bad line (named by file and line) leaves either nothing or a complete set: an extra stale
part would otherwise be globbed into training.
"""
from __future__ import annotations

import glob
import json
import os
import sys
from collections.abc import Iterator

import numpy as np

from data import chat

MAX_TOKENS_PER_PART = (1 << 30) // 4  # open-instruct write_memmap_chunked(max_size_gb=1), uint32 ids
MANIFEST = "sft_manifest.json"


def read_chats(path: str, require_answer: bool = True, template: str = chat.INSTRUCT) -> list[list[dict]]:
    """iter_chats' conversations, as a list (chats to answer: eval.py --chat_file)."""
    return list(iter_chats(path, require_answer, template))


def iter_chats(path: str, require_answer: bool = True, template: str = chat.INSTRUCT) -> Iterator[list[dict]]:
    """The "messages" lists of a JSONL file, a line at a time, each one `template` renders;
    ValueError naming `path:line` on a bad line. `require_answer`: each must end with an assistant
    turn (training data)."""
    def parse(row):
        if not isinstance(row, dict):   # a list's "messages" read as null, and the line said so
            kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(row), "a number")
            raise ValueError(f'the line is {kind}, not an object {{"messages": [...]}}')
        messages = row.get("messages")
        chat.check_messages(messages, template)
        if require_answer and messages[-1]["role"] != "assistant":
            raise ValueError("the last message must be the assistant's (a conversation is one "
                             "document ending in EOS)")
        return messages
    return chat.iter_jsonl(path, parse, 'one conversation per line, {"messages": [{"role", "content"}, ...]}')


class PartWriter:
    """Appends conversations (ids, mask) to the part files of a new directory, a part ending at the
    conversation that would pass `max_tokens_per_part`; holds one conversation at a time. `parts`
    and the counts (conversations, tokens, trained_tokens) describe what it wrote."""

    def __init__(self, out_dir: str, max_tokens_per_part: int = MAX_TOKENS_PER_PART):
        self.out_dir, self.max_tokens_per_part = out_dir, max_tokens_per_part
        self.parts: list[str] = []
        self.conversations = self.tokens = self.trained_tokens = 0
        self._files, self._size = None, 0

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        if self._files is None or (self._size and self._size + len(ids) > self.max_tokens_per_part):
            self._next_part()
        self._files[0].write(np.asarray(ids, np.uint32).tobytes())   # raw bytes, as np.memmap(mode="w+") writes
        self._files[1].write(np.asarray(mask, np.bool_).tobytes())
        self._size += len(ids)
        self.conversations += 1
        self.tokens += len(ids)
        self.trained_tokens += int(np.count_nonzero(mask))

    def _next_part(self) -> None:
        self.close()
        i = len(self.parts)
        self.parts.append(os.path.join(self.out_dir, f"token_ids_part_{i:04d}.npy"))
        self._files = (open(self.parts[-1], "wb"), open(os.path.join(self.out_dir, f"labels_mask_part_{i:04d}.npy"), "wb"))
        self._size = 0

    def close(self) -> None:
        for f in self._files or ():
            f.close()
        self._files = None


def prepare_sft(input_path: str, out_dir: str, template: str = chat.INSTRUCT,
                max_tokens_per_part: int = MAX_TOKENS_PER_PART, max_seq_length: int | None = None) -> dict:
    """Render, mask and write `input_path` into the new directory `out_dir`, a conversation at a
    time (a failure leaves nothing: module docstring); returns the manifest."""
    if template not in chat.TEMPLATES:
        raise ValueError(f"--template={template!r}: choose one of {', '.join(chat.TEMPLATES)}")
    chat.check_prepare_paths(input_path, out_dir, max_seq_length, '{"messages": [...]} lines')
    out_dir = os.path.abspath(out_dir)
    bare, dropped = [], 0
    from olmo3.checkpoint import new_directory   # temp sibling, renamed into place or removed
    with new_directory(out_dir, "SFT data") as tmp:
        parts = PartWriter(tmp, max_tokens_per_part)
        try:
            for i, messages in enumerate(iter_chats(input_path, template=template)):
                if chat.answer_only(messages):
                    bare.append(i)
                ids, mask = chat.encode_with_mask(messages, template)
                ids, mask = ids[:max_seq_length], mask[:max_seq_length]   # open-instruct sft_tulu_tokenize_and_truncate_v1
                if mask.any():   # sft_tulu_filter_v1: a conversation with nothing to train is dropped
                    parts.add(ids, mask)
                else:
                    dropped += 1
        finally:
            parts.close()
        if not parts.conversations:
            raise ValueError(f"{input_path}: no conversation has an assistant token to train on"
                             + (f" within --max_seq_length={max_seq_length} tokens" if max_seq_length else ""))
        manifest = {"input": os.path.abspath(input_path), "template": template, "max_seq_length": max_seq_length,
                    "conversations": parts.conversations, "dropped_without_trained_tokens": dropped,
                    "tokens": parts.tokens, "trained_tokens": parts.trained_tokens,
                    "parts": [os.path.basename(p) for p in parts.parts]}
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
    # Kept, as open-instruct keeps them: nothing is masked, so every token trains.
    chat.warn_rows(input_path, bare, "conversation", "have no turn before the answer", "all of each is trained, "
                   "the template's system turn included (open-instruct's masking)")
    return manifest


def token_files(directory: str, flag: str = "--data") -> list[str]:
    """The token_ids_part_*.npy files of an SFT directory, each with its labels_mask_*.npy."""
    from data.packed import label_mask_path
    paths = sorted(glob.glob(os.path.join(directory, "token_ids_*.npy")))
    if not paths:
        raise FileNotFoundError(f"{flag}={directory!r} holds no token_ids_*.npy; write it with "
                                "python -m data.prepare_sft or open-instruct's convert_sft_data_for_olmocore.py")
    for p in paths:
        if not os.path.isfile(label_mask_path(p)):
            raise FileNotFoundError(f"{flag}={directory!r}: {os.path.basename(p)} has no "
                                    f"{os.path.basename(label_mask_path(p))} beside it")
    return paths


def main(argv):
    from absl import flags

    del argv
    f = flags.FLAGS
    m = prepare_sft(f.input, f.out_dir, f.template, max_seq_length=f.max_seq_length)
    print(f"wrote {len(m['parts'])} part(s) to {os.path.abspath(f.out_dir)}: {m['conversations']:,} conversations "
          f"({m['dropped_without_trained_tokens']} dropped: nothing to train), {m['tokens']:,} tokens, "
          f"{m['trained_tokens']:,} trained")


if __name__ == "__main__":
    from absl import flags

    from olmo3 import cli
    flags.DEFINE_string("input", None, 'JSONL: one {"messages": [{"role", "content"}, ...]} per line', required=True)
    flags.DEFINE_string("out_dir", None, "new directory for token_ids_part_*.npy / labels_mask_part_*.npy",
                        required=True)
    flags.DEFINE_enum("template", chat.INSTRUCT, list(chat.TEMPLATES), "OLMo 3 chat template (data/chat.py)")
    flags.DEFINE_integer("max_seq_length", None, "cut each rendered conversation to this many tokens, as "
                         "open-instruct's converter does (default: no cut; see the module docstring)")
    sys.exit(cli.run(main))
