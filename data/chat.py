"""The OLMo 3 chat template: a conversation -> dolma2 token ids and a label mask.

    render(messages):  [default system turn, if none is given]
                       for m in messages:
                           system:      <|im_start|> "system\\n" content SUFFIX <|im_end|> "\\n"
                           user / environment: <|im_start|> role "\\n" content <|im_end|> "\\n"
                           assistant:   <|im_start|> "assistant\\n" content [CALLS]
                                        + (<|endoftext|> if last else <|im_end|> "\\n")
                       [+ <|im_start|> "assistant\\n" (+ "<think>" for olmo_thinker) if generating]
    templates differ in the default system turn, the system SUFFIX and the generation prompt:
        olmo3_instruct                           the 7B's Instruct SFT + DPO data  generic, tools  no <think>
        olmo                                     open-instruct's Instruct template OLMo identity   no <think>
        olmo_thinker                             Think DPO                         generic         <think>
        olmo_thinker_no_think_7b                 the 7B's Think SFT data           OLMo identity   no <think>
        olmo_thinker_no_think_sft_tokenization   the 32B's Think SFT data          generic         no <think>
    olmo3_instruct is the chat template of the OLMo 3 chat tokenizer (allenai/olmo-3-tokenizer-instruct-dev,
    Olmo-3-7B-Instruct's own): AI2 tokenized the 7B Instruct SFT and DPO data with it (open-instruct
    docs/olmo3.md; its scripts pass the unregistered --chat_template_name olmo123, which falls back to
    the tokenizer's template). Its default system turn is "You are a helpful function-calling AI
    assistant. You do not currently have access to any functions. <functions></functions>" (the
    model card's default system message), a given system message is rendered as it is (SUFFIX
    empty; with `functions`: " <functions>" f "</functions>"), and an assistant turn's
    `function_calls` follow its content as CALLS = <function_calls> f </function_calls>; <functions>,
    </functions>, <function_calls>, </function_calls> are that tokenizer's added tokens 100266-100269.
    A user turn's `functions` are not rendered there, a `tool` turn is rendered as `environment`.
    The other four are open-instruct's CHAT_TEMPLATES (3af17aacf): SUFFIX = " You do not currently
    have access to any functions. <functions></functions>", as text; tool use is refused there.
    mask[t] = 0 on every token of a non-assistant turn, from where the conversation up to it ends
              to where it ends with that turn (+ the template's generation prompt when an
              assistant turn follows); 1 elsewhere: assistant content and its <|im_end|> / EOS.

open-instruct's OLMo 3 chat templates (open_instruct/dataset_transformation.py,
CHAT_TEMPLATES) with its SFT masking (`sft_tulu_tokenize_and_truncate_v1`): the span of each
non-assistant message is measured by rendering the prefixes messages[:i] and messages[:i+1].
A prefix ending in an assistant turn renders that turn as the last one (ending in EOS, one token),
so the next span starts one token after the turn's <|im_end|>: the <|im_end|> of an earlier
assistant turn is trained, the "\\n" after it is not, and the final EOS is trained. One
conversation ends in exactly one EOS, so OLMo-core's packing (documents split at EOS) keeps it
one document. `convert_sft_data_for_olmocore.py` writes mask = (label != -100).

Why it is built this way: the template is a few lines of string assembly, not Jinja, so the
token sequence is visible here; special tokens and tool markers are placed only by the template
(content is encoded as text by data.tokenizer.encode_chat_text, so a chat that quotes "<|im_end|>"
cannot end its own turn; Hugging Face tokenizers would parse it as the special token).

"<think>" and the mask: the mask's prompt is the template's own generation prompt, measured in
tokens, as open-instruct measures it. With `olmo_thinker` (the Think DPO script's template) that
prompt ends in "<think>", so the first tokens of every answer, "<think>" when the answer starts
with it, are masked ("our code incorrectly masks the first <think> token as part of the prompt",
open-instruct docs/olmo3.md); Think DPO trained that way. The Think SFT data was tokenized with a
`_no_think` template (the 7B with `olmo_thinker_no_think_7b`, docs/olmo3.md), so a leading
"<think>" is trained there; `generation_prompt(..., think=True)` adds it for inference, as the
released Think chat template does.
Tool use (`functions`, `function_calls`) is rendered by olmo3_instruct only; OpenAI-style
`tool_calls` lists are refused (write them as the `function_calls` text the data carries; an empty
one calls nothing and is accepted).
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from absl import logging
from jaxtyping import Bool, UInt32

from data import tokenizer
from data.tokenizer import (EOS_ID, FUNCTION_CALLS_END_ID, FUNCTION_CALLS_ID, FUNCTIONS_END_ID, FUNCTIONS_ID,
                            IM_END_ID, IM_START_ID, dolma2)

ROLES = ("system", "user", "assistant", "environment")
INSTRUCT = "olmo3_instruct"
NO_FUNCTIONS = "You do not currently have access to any functions. "
# The default system turn when a conversation has none: the OLMo 3 chat tokenizer's template (the
# Olmo-3-7B-Instruct model card's default system message) and open-instruct CHAT_TEMPLATES, 3af17aacf.
DEFAULT_SYSTEM = {
    INSTRUCT: "You are a helpful function-calling AI assistant. " + NO_FUNCTIONS,  # + <functions></functions> ids
    "olmo": ("You are OLMo, a helpful function-calling AI assistant built by Ai2. Your date cutoff is "
             "November 2024, and your model weights are available at https://huggingface.co/allenai. "
             "You do not currently have access to any functions. <functions></functions>"),
    "olmo_thinker": "You are a helpful AI assistant.",
    "olmo_thinker_no_think_7b": ("You are Olmo, a helpful AI assistant built by Ai2. Your date cutoff is "
                                 "December 2024, and your model weights are available at "
                                 "https://huggingface.co/allenai."),
    "olmo_thinker_no_think_sft_tokenization": "You are a helpful AI assistant.",
}
TEMPLATES = tuple(DEFAULT_SYSTEM)
THINK_PROMPT = ("olmo_thinker",)   # the templates whose generation prompt ends with "<think>"
# Appended to a given system message by open-instruct's templates (olmo3_instruct appends nothing).
SYSTEM_SUFFIX = " " + NO_FUNCTIONS + "<functions></functions>"
THINK = "<think>"  # olmo_thinker's generation prompt ends with it (plain text in dolma2)

Piece = int | str  # a special token id placed by the template, or text to encode


def check_messages(messages, template: str = INSTRUCT, field: str = "messages") -> None:
    """Raise ValueError naming the problem unless `messages` (the line's `field`) is a non-empty
    list of {"role": one of ROLES, "content": str} dicts that `template` renders: olmo3_instruct
    also takes a `tool` role, `functions` (str) on system and user turns and `function_calls`
    (str) on assistant turns, whose content may then be null."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f'"{field}" must be a non-empty list of {{"role", "content"}} objects, '
                         f'got {json.dumps(messages)[:40]}')
    tools = template == INSTRUCT
    roles = ROLES + ("tool",) if tools else ROLES
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f'message {i} must be an object with "role" and "content"')
        if m["role"] not in roles:
            raise ValueError(f"message {i} has role {m['role']!r}; the {template} template knows {', '.join(roles)}")
        if m.get("tool_calls"):   # an empty list (exports put one on every message) calls nothing
            raise ValueError(f"message {i} carries tool_calls; write the calls as a function_calls string")
        calls = m.get("function_calls")
        if (m.get("functions") is not None or calls is not None) and not tools:
            raise ValueError(f"message {i} carries functions / function_calls; only --template={INSTRUCT} "
                             f"renders tool use (the {template} template's tool markers are not modelled here)")
        for key in ("functions", "function_calls"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise ValueError(f"message {i} {key} must be a string, got {type(m[key]).__name__}")
        if calls is not None and m["role"] != "assistant":
            raise ValueError(f"message {i} has function_calls on a {m['role']} turn; only assistant turns call functions")
        if m.get("functions") is not None and m["role"] not in ("system", "user"):   # it was not rendered
            raise ValueError(f"message {i} carries functions on the {m['role']} turn; the template renders the "
                             "functions offered on system and user turns only")
        if not isinstance(m["content"], str) and not (m["content"] is None and calls is not None):
            raise ValueError(f"message {i} content must be a string, got {type(m['content']).__name__}")
        for key in ("content", "functions", "function_calls"):   # JSON's "\ud800" alone: the tokenizer wrote U+FFFD
            text = m.get(key)
            if isinstance(text, str) and not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise ValueError(f"message {i} {key} holds a lone UTF-16 surrogate ({text[e.start]!r} at character "
                                     f"{e.start}), which is no character; escape a character outside the BMP as its "
                                     "surrogate pair, or write it as UTF-8") from None


def answer_only(messages: Sequence[dict]) -> bool:
    """No turn before the answer (`check_messages`' messages): only assistant turns, which
    open-instruct's masking leaves wholly trained, the template's default system turn with them."""
    return all(m["role"] == "assistant" for m in messages)


def warn_rows(path: str, rows: list[int], noun: str, what: str, why: str) -> None:
    """One warning for the rows of `path` (0-based indices) that are kept but are worth a look:
    '<path>: N <noun>(s) <what> (first: <noun> i); <why>'."""
    if rows:
        logging.warning("%s: %d %s(s) %s (first: %s %d); %s", path, len(rows), noun, what, noun, rows[0] + 1, why)


# The files a JSONL set is often shipped as, by their first bytes (their formats' magic numbers).
_NOT_JSONL = {b"\x1f\x8b": "gzip-compressed: decompress it (e.g. --input=<(zcat {path}))",
              b"\x28\xb5\x2f\xfd": "zstd-compressed: decompress it (e.g. --input=<(zstdcat {path}))",
              b"\xfd7zXZ\x00": "xz-compressed: decompress it (e.g. --input=<(xzcat {path}))",
              b"BZh": "bzip2-compressed: decompress it (e.g. --input=<(bzcat {path}))",
              b"PAR1": "a Parquet file (a Hugging Face dataset's shard): write its rows as JSON lines first"}


def read_jsonl(path: str, parse: Callable[[object], object], what: str) -> list:
    """iter_jsonl's rows, as a list (a file that fits in memory: chats to answer)."""
    return list(iter_jsonl(path, parse, what))


def iter_jsonl(path: str, parse: Callable[[object], object], what: str) -> Iterator:
    """parse(row) of every non-empty line of a JSONL file (a byte-order mark opening it is skipped),
    a line at a time: SFT and DPO sets run to tens of billions of tokens. A bad line (not JSON, or
    `parse` raises ValueError) becomes one ValueError naming `path:line`, the problem and `what` a
    line must hold; so does a file with no line."""
    rows = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            kind = next((k for magic, k in _NOT_JSONL.items() if raw.startswith(magic)), None) if n == 1 else None
            if kind:
                raise ValueError(f"{path} is {kind.format(path=path)}") from None
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{n}: not UTF-8 text ({e.reason} at byte {e.start} of the line); "
                                 f"{what}") from None
            if n == 1:   # an editor's "UTF-8 with BOM": json.loads refused the first line
                line = line.removeprefix("\ufeff")
            if not line.strip():
                continue
            try:
                row = parse(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON object ({e.msg}); {what}") from None
            except RecursionError:   # nested deeper than Python's recursion limit
                raise ValueError(f"{path}:{n}: nested too deeply to be a conversation; {what}") from None
            except ValueError as e:
                raise ValueError(f"{path}:{n}: {e}; {what}") from None
            rows += 1
            yield row
    if not rows:
        raise ValueError(f"{path}: nothing in the file; {what}")


def check_prepare_paths(input_path: str, out_dir: str, max_seq_length: int | None, what: str) -> None:
    """The checks python -m data.prepare_sft / prepare_dpo make before reading anything: --input a
    JSONL file (or a pipe), --out_dir new (or empty) and creatable, --max_seq_length positive. ValueError /
    FileExistsError naming the flag and the fix (exit status 2)."""
    if os.path.isdir(input_path):
        raise ValueError(f"--input={input_path!r} is a directory; pass a JSONL file ({what})")
    if not os.path.exists(input_path):   # a pipe is read as a file (--input=<(zcat chats.jsonl.gz))
        raise FileNotFoundError(f"--input={input_path!r} does not exist; pass a JSONL file ({what})")
    if not out_dir:   # it named the current directory
        raise ValueError("--out_dir is empty; give a new directory")
    if max_seq_length is not None and max_seq_length < 1:
        raise ValueError(f"--max_seq_length={max_seq_length} must be positive")
    out = os.path.realpath(out_dir)   # a symlink is followed, as new_directory follows it
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise FileExistsError(f"--out_dir={out_dir!r} exists and is not an empty directory; choose a new directory")
    from olmo3 import atomic   # a directory can be made and renamed there (the output is renamed into place)
    atomic.check_directory(out, "--out_dir", out_dir)


def pieces(messages: Sequence[dict], template: str = INSTRUCT, add_generation_prompt: bool = False,
           think: bool | None = None) -> list[Piece]:
    """The rendered conversation as special ids and text pieces (see the module docstring);
    the generation prompt ends with "<think>" when `think`, by default when the template's does."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown chat template {template!r}; choose one of {', '.join(TEMPLATES)}")
    think = opens_think(template, think)
    tools = template == INSTRUCT
    out: list[Piece] = []
    if not any(m["role"] == "system" for m in messages):
        out += [IM_START_ID, "system\n" + DEFAULT_SYSTEM[template]]
        out += [FUNCTIONS_ID, FUNCTIONS_END_ID] if tools else []
        out += [IM_END_ID, "\n"]
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        if role == "system":
            out += [IM_START_ID, "system\n" + content]
            if not tools:
                out += [SYSTEM_SUFFIX]
            elif m.get("functions") is not None:
                out += [" ", FUNCTIONS_ID, m["functions"], FUNCTIONS_END_ID]
            out += [IM_END_ID, "\n"]
        elif role == "assistant":
            out += [IM_START_ID, "assistant\n" + (content or "")]
            if m.get("function_calls") is not None:
                out += [FUNCTION_CALLS_ID, m["function_calls"], FUNCTION_CALLS_END_ID]
            out += [EOS_ID] if i == len(messages) - 1 else [IM_END_ID, "\n"]
        else:  # user, environment (olmo3_instruct: tool as environment)
            out += [IM_START_ID, f"{'environment' if role == 'tool' else role}\n{content}", IM_END_ID, "\n"]
    if add_generation_prompt:
        out += [IM_START_ID, "assistant\n" + (THINK if think else "")]
    return out


def encode_pieces(ps: Sequence[Piece]) -> list[int]:
    """Token ids: special ids as they are, each run of text encoded as one string (as a Hugging
    Face tokenizer sees the text between two special tokens)."""
    ids, text = [], ""
    for p in list(ps) + [None]:
        if isinstance(p, str):
            text += p
            continue
        if text:
            ids += tokenizer.encode_chat_text(text)
            text = ""
        if p is not None:
            ids.append(int(p))
    return ids


def encode(messages: Sequence[dict], template: str = INSTRUCT, add_generation_prompt: bool = False) -> list[int]:
    """Token ids of the rendered conversation, as the template renders it."""
    return encode_pieces(pieces(messages, template, add_generation_prompt))


def encode_with_mask(messages: Sequence[dict], template: str = INSTRUCT, last_turn: bool = False
                     ) -> tuple[UInt32[np.ndarray, " n"], Bool[np.ndarray, " n"]]:
    """(token ids uint32, label mask bool): open-instruct's SFT masking (module docstring), every
    assistant turn trained; `last_turn`: only the last message, every earlier one masked, the
    assistant's included (open-instruct's `last_turn_tulu_tokenize_and_truncate_v1`, what its DPO
    trains on since "mask all turns but last for dpo", #617)."""
    check_messages(messages, template)
    ids = encode(messages, template)
    mask = np.ones(len(ids), np.bool_)
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and not (last_turn and i + 1 < len(messages)):
            continue
        start = 0 if i == 0 else len(encode(messages[:i], template))
        prompt_follows = i + 1 < len(messages) and messages[i + 1]["role"] == "assistant"
        end = len(encode(messages[:i + 1], template, add_generation_prompt=prompt_follows))
        mask[start:end] = False
    return np.asarray(ids, np.uint32), mask


def opens_think(template: str, think: bool | None = None) -> bool:
    """Whether the generation prompt ends with "<think>": as `think` says, by default as the
    template's does (olmo_thinker)."""
    return template in THINK_PROMPT if think is None else think


def generation_prompt(messages: Sequence[dict], template: str = INSTRUCT, think: bool | None = None) -> list[int]:
    """Token ids that ask the model for the next assistant turn; "<think>" opens it when `think`,
    by default as the template does (olmo_thinker)."""
    check_messages(messages, template)
    return encode_pieces(pieces(messages, template, add_generation_prompt=True, think=think))


# The chat tokenizer's names of the tool markers (dolma2 calls those ids <|extra_id_1..4|>).
_TOOL_NAMES = {FUNCTIONS_ID: "<functions>", FUNCTIONS_END_ID: "</functions>",
               FUNCTION_CALLS_ID: "<function_calls>", FUNCTION_CALLS_END_ID: "</function_calls>"}


def decode(ids: Sequence[int]) -> str:
    """Text of generated ids, the chat markers spelled out (the tool markers as olmo3_instruct's
    tokenizer names them)."""
    out, run = [], []
    for t in [int(t) for t in ids] + [None]:
        if t in _TOOL_NAMES or t is None:
            out.append(dolma2().decode(run))
            run = []
            if t is not None:
                out.append(_TOOL_NAMES[t])
        else:
            run.append(t)
    return "".join(out)
