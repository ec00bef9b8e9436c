"""SFT: the OLMo 3 chat template, the SFT files, the label-masked loss, train.py --stage=sft.

References: token sequences written out by hand from the template's pieces (and literal cl100k
ids); OLMo-core's own `NumpyPackedFSLDataset` reading our files; transformers' `Olmo3ForCausalLM`
causal-LM loss with -100 labels; an uninterrupted run for resume; Adam's step count for the
optimizer an SFT warm start carries over (OLMo-core loads it when the checkpoint has it).
"""
import bz2
import gzip
import importlib.util
import json
import lzma
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import data
from data import chat, prepare_sft
from test_train import metrics_by_step  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOS, IM_START, IM_END = 100257, 100264, 100265
NL, ASSISTANT = 198, 78191  # cl100k ids of "\n" and "assistant"
FUNCS, CALLS, CALLS_END = 100266, 100268, 100269   # the chat tokenizer's <functions>, <function_calls>, </...>


def text(s):
    return data.dolma2().encode_ordinary(s)


def test_special_token_ids():
    tok = data.dolma2()
    assert tok.encode("<|im_start|><|im_end|><|endoftext|>", allowed_special="all") == [IM_START, IM_END, EOS]
    assert text("\n") == [NL] and text("assistant") == [ASSISTANT]
    assert text("<|im_end|>") != [IM_END]  # content never becomes a turn marker


def test_template_renders_known_sequence():
    """olmo_thinker_no_think_sft_tokenization, two turns: hand-built ids and mask (open-instruct's
    SFT masking rule)."""
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Ciao"}]
    want, mask = [], []

    def add(ids, m):
        want.extend(ids)
        mask.extend([m] * len(ids))

    add([IM_START] + text("system\nYou are a helpful AI assistant.") + [IM_END, NL], 0)   # default system
    add([IM_START] + text("user\nHi") + [IM_END, NL] + [IM_START, ASSISTANT, NL], 0)
    add(text("Hello!") + [IM_END], 1)              # an earlier answer trains its <|im_end|> ...
    add([NL], 0)                                   # ... not the newline after it
    add([IM_START] + text("user\nBye") + [IM_END, NL] + [IM_START, ASSISTANT, NL], 0)
    add(text("Ciao") + [EOS], 1)                   # the last answer ends in EOS, trained
    ids, m = chat.encode_with_mask(msgs, "olmo_thinker_no_think_sft_tokenization")
    assert ids.tolist() == want and m.astype(int).tolist() == mask
    assert ids.dtype == np.uint32 and (ids == EOS).sum() == 1


def test_think_templates_mask_and_system_turn():
    """olmo_thinker (Think DPO) masks the tokens of its generation prompt "assistant\\n<think>"
    counted from the start of the answer, as open-instruct measures the prompt (docs/olmo3.md: "masks
    the first <think> token"); the 7B's Think SFT template trains them, under the OLMo identity
    system turn."""
    msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>Add them.</think>4"}]
    user = [IM_START] + text("user\n2+2?") + [IM_END, NL]
    answer = [IM_START] + text("assistant\n<think>Add them.</think>4") + [EOS]
    generic = [IM_START] + text("system\nYou are a helpful AI assistant.") + [IM_END, NL]
    ids, m = chat.encode_with_mask(msgs, "olmo_thinker")
    masked = len(generic + user + [IM_START] + text("assistant\n<think>"))
    assert ids.tolist() == generic + user + answer
    assert m.astype(int).tolist() == [0] * masked + [1] * (len(ids) - masked)
    assert masked > len(generic + user + [IM_START, ASSISTANT, NL])   # "<think>" itself is masked

    identity = [IM_START] + text("system\nYou are Olmo, a helpful AI assistant built by Ai2. Your date cutoff is "
                                 "December 2024, and your model weights are available at "
                                 "https://huggingface.co/allenai.") + [IM_END, NL]
    ids, m = chat.encode_with_mask(msgs, "olmo_thinker_no_think_7b")
    assert ids.tolist() == identity + user + answer
    prompt = len(identity + user + [IM_START, ASSISTANT, NL])
    assert m.astype(int).tolist() == [0] * prompt + [1] * (len(ids) - prompt)
    assert chat.generation_prompt(msgs[:1], "olmo_thinker_no_think_7b") == identity + user + [IM_START, ASSISTANT, NL]
    assert chat.generation_prompt(msgs[:1], "olmo_thinker_no_think_7b", think=True) == \
        identity + user + [IM_START] + text("assistant\n<think>")


def test_template_system_and_generation_prompt():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    sys_ids = [IM_START] + text("system\nBe brief. You do not currently have access to any functions. "
                                "<functions></functions>") + [IM_END, NL]
    user_ids = [IM_START] + text("user\n2+2?") + [IM_END, NL]
    assert chat.generation_prompt(msgs, "olmo") == sys_ids + user_ids + [IM_START, ASSISTANT, NL]
    assert chat.generation_prompt(msgs, "olmo_thinker") == sys_ids + user_ids + [IM_START] + text("assistant\n<think>")
    assert chat.generation_prompt(msgs, "olmo_thinker", think=False) == sys_ids + user_ids + [IM_START, ASSISTANT, NL]
    olmo_default = chat.encode([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "olmo")
    assert olmo_default[:3] == [IM_START] + text("system\nYou are OLMo")[:2]


def test_a_system_turn_anywhere_replaces_the_default():
    """The templates add their default system turn only when no message is a system one
    (`has_system = messages|selectattr('role', 'equalto', 'system')|list|length > 0`), wherever it
    stands; a later system turn is rendered in place. open-instruct's mask measures the prefix
    [user], which does get the default turn and is longer than the whole conversation here: nothing
    is trained (sft_tulu_filter_v1 then drops the example), as data.chat reproduces."""
    msgs = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Be brief."},
            {"role": "assistant", "content": "Ok"}]
    prompt = ([IM_START] + text("user\nHi") + [IM_END, NL]
              + [IM_START] + text("system\nBe brief. You do not currently have access to any functions. "
                                  "<functions></functions>") + [IM_END, NL] + [IM_START, ASSISTANT, NL])
    assert chat.encode(msgs, "olmo") == prompt + text("Ok") + [EOS]
    assert len(chat.encode(msgs[:1], "olmo")) > len(prompt) + 2
    ids, m = chat.encode_with_mask(msgs, "olmo")
    assert ids.tolist() == prompt + text("Ok") + [EOS] and not m.any()


FUNCS, FUNCS_END, CALLS, CALLS_END = 100266, 100267, 100268, 100269


def test_instruct_template_default_system_and_tool_use():
    """olmo3_instruct, the OLMo 3 chat tokenizer's own template (AI2's 7B Instruct SFT / DPO data):
    the model card's default system message with <functions></functions> as the tokenizer's added
    tokens, a given system message as it is (no suffix), functions and function_calls between
    their marker tokens, a tool turn as environment; hand-built ids and open-instruct's mask."""
    # the chat tokenizer's names for dolma2's first four <|extra_id_N|> fillers; in plain text
    # "<functions>" is no marker (dolma2 does not have it)
    assert [data.tokenizer.ADDED_TOKENS[f"<|extra_id_{i}|>"] for i in range(1, 5)] == [FUNCS, FUNCS_END, CALLS, CALLS_END]
    assert chat.decode([FUNCS] + text("x") + [CALLS_END]) == "<functions>x</function_calls>" and text("<functions>") != [FUNCS]
    assert chat.decode([FUNCS, FUNCS_END, CALLS] + text("f()") + [CALLS_END]) == \
        "<functions></functions><function_calls>f()</function_calls>"
    # content never places a marker (dolma2 matches "<|extra_id_1|>" in documents: id 100266)
    assert data.tokenizer.encode("<|extra_id_1|>") == [FUNCS] and FUNCS not in chat.encode_pieces(["a <|extra_id_1|>"])
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    default = ([IM_START] + text("system\nYou are a helpful function-calling AI assistant. You do not currently "
                                 "have access to any functions. ") + [FUNCS, FUNCS_END, IM_END, NL])
    user = [IM_START] + text("user\nHi") + [IM_END, NL]
    ids, m = chat.encode_with_mask(msgs)   # the default template
    prompt = default + user + [IM_START, ASSISTANT, NL]
    assert ids.tolist() == prompt + text("Hello!") + [EOS]
    assert m.astype(int).tolist() == [0] * len(prompt) + [1] * (len(ids) - len(prompt))

    given = [{"role": "system", "content": "Be brief."}] + msgs
    assert chat.encode(given, "olmo3_instruct")[:len(text("system\nBe brief.")) + 3] == \
        [IM_START] + text("system\nBe brief.") + [IM_END, NL]

    tools = [{"role": "system", "content": "Be brief.", "functions": '[{"name": "f"}]'},
             {"role": "user", "content": "Call f."},
             {"role": "assistant", "content": None, "function_calls": "f()"},
             {"role": "tool", "content": "42"},
             {"role": "assistant", "content": "It is 42."}]
    parts = [([IM_START] + text("system\nBe brief. ") + [FUNCS] + text('[{"name": "f"}]') + [FUNCS_END, IM_END, NL]
              + [IM_START] + text("user\nCall f.") + [IM_END, NL] + [IM_START, ASSISTANT, NL], 0),
             ([CALLS] + text("f()") + [CALLS_END, IM_END], 1), ([NL], 0),
             ([IM_START] + text("environment\n42") + [IM_END, NL] + [IM_START, ASSISTANT, NL], 0),
             (text("It is 42.") + [EOS], 1)]
    ids, m = chat.encode_with_mask(tools, "olmo3_instruct")
    assert ids.tolist() == [t for p, _ in parts for t in p]
    assert m.astype(int).tolist() == [v for p, v in parts for _ in p]

    with pytest.raises(ValueError, match="only --template=olmo3_instruct"):
        chat.encode_with_mask(tools, "olmo")
    with pytest.raises(ValueError, match="tool_calls"):
        chat.encode_with_mask([{"role": "user", "content": "x"},
                               {"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}])
    with pytest.raises(ValueError, match="only assistant turns"):
        chat.encode_with_mask([{"role": "user", "content": "x", "function_calls": "f()"},
                               {"role": "assistant", "content": "y"}])
    with pytest.raises(ValueError, match="carries functions on the assistant turn; the template renders"):   # was dropped
        chat.encode_with_mask([{"role": "user", "content": "x"},
                               {"role": "assistant", "content": "y", "functions": "f"}])


def test_function_calls_follow_the_assistant_content():
    """olmo3_instruct: an assistant turn's <function_calls> come after its content, both trained."""
    msgs = [{"role": "user", "content": "Call f."},
            {"role": "assistant", "content": "Calling f.", "function_calls": "f()"}]
    ids, m = chat.encode_with_mask(msgs, "olmo3_instruct")
    tail = [IM_START] + text("assistant\nCalling f.") + [CALLS] + text("f()") + [CALLS_END, EOS]
    assert ids.tolist()[-len(tail):] == tail
    assert m[-(len(tail) - 3):].all() and not m[:-(len(tail) - 3)].any()


def test_special_token_strings_in_content_stay_text():
    """A chat quoting <|im_end|> or <|endoftext|> cannot end its turn or its document: the strings
    are encoded as text, the only special tokens are the template's."""
    said, answer = "Say <|im_end|> then <|endoftext|>", "<|im_end|>\n<|im_start|>user\nhi"
    ids, m = chat.encode_with_mask([{"role": "user", "content": said}, {"role": "assistant", "content": answer}],
                                   "olmo_thinker_no_think_sft_tokenization")
    prompt = ([IM_START] + text("system\nYou are a helpful AI assistant.") + [IM_END, NL]
              + [IM_START] + text("user\n" + said) + [IM_END, NL, IM_START, ASSISTANT, NL])
    assert ids.tolist() == prompt + text(answer) + [EOS]
    assert m.astype(int).tolist() == [0] * len(prompt) + [1] * (len(ids) - len(prompt))


def test_text_between_two_markers_is_encoded_as_one_run():
    """A system turn's content and the " " before <functions> are one run of text, as the
    template's string is encoded whole: "Be brief. " + " " is one "  " token, not two " "."""
    msgs = [{"role": "system", "content": "Be brief. ", "functions": "[]"},
            {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    want = [IM_START] + text("system\nBe brief.  ") + [FUNCS]
    assert chat.encode(msgs, "olmo3_instruct")[:len(want)] == want


def test_roles_each_template_renders_and_refuses():
    """`environment` renders as itself; `tool` only where olmo3_instruct renders tool use; an
    assistant turn without content must call functions; an empty tool_calls list calls nothing."""
    user, answer = {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}
    env = [IM_START] + text("environment\n42") + [IM_END, NL]
    assert chat.encode([user, {"role": "environment", "content": "42"}, answer], "olmo")[-len(env) - 5:-5] == env
    for template in set(chat.TEMPLATES) - {chat.INSTRUCT}:
        with pytest.raises(ValueError, match="message 1 has role 'tool'"):
            chat.encode_with_mask([user, {"role": "tool", "content": "42"}, answer], template)
    with pytest.raises(ValueError, match="message 1 content must be a string, got NoneType"):
        chat.encode_with_mask([user, {"role": "assistant", "content": None}])
    no_calls, _ = chat.encode_with_mask([user, {**answer, "tool_calls": []}])
    assert no_calls.tolist() == chat.encode([user, answer])
    with pytest.raises(ValueError, match="message 1 carries tool_calls"):
        chat.encode_with_mask([user, {**answer, "tool_calls": [{"function": {"name": "f"}}]}])
    assert chat.answer_only([answer, answer]) and not chat.answer_only([answer, user, answer])


def test_last_turn_masks_an_assistant_turn_just_before_the_last():
    """DPO's last-turn masking: with two assistant turns last, only the last is trained (its mask
    starts where open-instruct measures it: the conversation before it plus the generation prompt)."""
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "first"},
            {"role": "assistant", "content": "second"}]
    ids, m = chat.encode_with_mask(msgs, "olmo", last_turn=True)
    start = len(chat.encode(msgs[:2], "olmo", add_generation_prompt=True))
    assert m.astype(int).tolist() == [0] * start + [1] * (len(ids) - start)
    assert "first" not in data.dolma2().decode(ids[m].tolist())


def test_olmo_default_system_turn_in_full():
    """open-instruct's `olmo` template (CHAT_TEMPLATES, 3af17aacf): its default system turn, whole."""
    ids = chat.encode([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "olmo")
    want = [IM_START] + text("system\nYou are OLMo, a helpful function-calling AI assistant built by Ai2. Your date "
                             "cutoff is November 2024, and your model weights are available at "
                             "https://huggingface.co/allenai. You do not currently have access to any functions. "
                             "<functions></functions>") + [IM_END, NL]
    assert ids[:len(want)] == want


def test_prepare_sft_refuses_a_line_its_template_cannot_render_by_file_and_line(tmp_path):
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    bad = {"messages": [{"role": "user", "content": "a"},
                        {"role": "assistant", "content": None, "function_calls": "f()"}]}
    (tmp_path / "c.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"c.jsonl:2: message 1 carries functions / function_calls; "
                                         "only --template=olmo3_instruct"):
        prepare_sft.prepare_sft(str(tmp_path / "c.jsonl"), str(tmp_path / "out"), "olmo")


@pytest.mark.parametrize("line,why", [
    ('{"messages": [}', "not a JSON object"),
    ('{"messages": []}', "non-empty list"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "role 'robot'"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "last message must be the assistant"),
    ('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),   # a RecursionError traceback
    ('[{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]',
     'the line is an array, not an object {"messages": [...]}'),   # it said '"messages" ... got null'
    ('{"messages": [{"role": "user", "content": "Hi\\ud800"}, {"role": "assistant", "content": "b"}]}',
     "message 0 content holds a lone UTF-16 surrogate ('\\ud800' at character 2)"),   # tokenized as U+FFFD, exit 0
], ids=["not_json", "no_messages", "bad_role", "no_reply", "nested_too_deeply", "array", "lone_surrogate"])
def test_prepare_sft_bad_input_names_file_and_line(tmp_path, line, why):
    good = '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}'
    (tmp_path / "in.jsonl").write_text(good + "\n" + line + "\n")
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-m", "data.prepare_sft", f"--input={tmp_path / 'in.jsonl'}",
                        f"--out_dir={tmp_path / 'out'}"], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=120)
    assert p.returncode == 2, p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "in.jsonl:2: " in err[0] and why in err[0], p.stderr
    assert not (tmp_path / "out").exists() and [n for n in os.listdir(tmp_path) if n.startswith(".tmp")] == []


def test_sft_and_dpo_sets_are_prepared_a_line_at_a_time(tmp_path, monkeypatch):
    """Each conversation (pair) is rendered and written before the next line is read: both held
    every line and rendering of the file at once (the 7B's SFT set would need terabytes; measured
    on 300,000 chats: 1.26 GB peak, 0.30 GB streamed)."""
    from data import prepare_dpo
    read, seen = [], []
    iter_jsonl, encode = chat.iter_jsonl, chat.encode_with_mask

    def counted(*args):
        for row in iter_jsonl(*args):
            read.append(1)
            yield row
    monkeypatch.setattr(chat, "iter_jsonl", counted)
    monkeypatch.setattr(chat, "encode_with_mask", lambda *a, **k: (seen.append(len(read)), encode(*a, **k))[1])
    rows = chats(4, seed=1)
    prepare_sft.prepare_sft(str(write_chats(tmp_path / "c.jsonl", rows)), str(tmp_path / "sft"))
    assert seen == [1, 2, 3, 4, 5]   # lines read when each conversation was rendered
    read.clear(), seen.clear()
    pairs = [{"chosen": r["messages"], "rejected": r["messages"][:-1] + [{"role": "assistant", "content": "no"}]}
             for r in rows]
    prepare_dpo.prepare_dpo(str(write_chats(tmp_path / "p.jsonl", pairs)), str(tmp_path / "dpo"))
    assert seen == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]   # both sides of a line


def test_prepare_paths_refuse_an_unexpanded_tilde_and_follow_a_symlink(tmp_path, monkeypatch):
    """--out_dir=~/x made a folder named '~' in the working directory (the check saw the absolute
    path); an --out_dir that is a symlink is checked where it points, as new_directory writes there."""
    from olmo3.cli import UserError
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text("{}\n")
    with pytest.raises(UserError, match=r"^--out_dir='~/x': '~' is not expanded after --flag= or in a flagfile; "
                                        r"write the whole path \(/"):
        chat.check_prepare_paths("in.jsonl", "~/x", None, "chats")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    os.symlink(tmp_path / "full", tmp_path / "link")
    with pytest.raises(FileExistsError, match="--out_dir='link' exists and is not an empty directory"):
        chat.check_prepare_paths("in.jsonl", "link", None, "chats")
    os.symlink(tmp_path / "new", tmp_path / "dangling")
    chat.check_prepare_paths("in.jsonl", "dangling", None, "chats")   # written where it points
    assert not os.path.exists(tmp_path / "~")


def _zstd_frame(data: bytes) -> bytes:
    """One zstd frame of raw blocks (RFC 8878: magic 0xFD2FB528, a single-segment header, a last
    raw block), as zstd writes data it cannot shrink."""
    import struct
    return (struct.pack("<I", 0xFD2FB528) + bytes([0x20, len(data)])
            + struct.pack("<I", (len(data) << 3) | 1)[:3] + data)


def _parquet(rows: list) -> bytes:
    import io
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    out = io.BytesIO()
    pq.write_table(pa.table({"messages": [json.dumps(r["messages"]) for r in rows]}), out)
    return out.getvalue()


@pytest.mark.parametrize("name, write, said", [
    ("c.jsonl.gz", gzip.compress, "gzip-compressed: decompress it (e.g. --input=<(zcat "),
    ("c.jsonl.zst", _zstd_frame, "zstd-compressed: decompress it (e.g. --input=<(zstdcat "),
    ("c.jsonl.xz", lzma.compress, "xz-compressed: decompress it (e.g. --input=<(xzcat "),
    ("c.jsonl.bz2", bz2.compress, "bzip2-compressed: decompress it (e.g. --input=<(bzcat "),
    ("train.parquet", None, "a Parquet file (a Hugging Face dataset's shard): write its rows as JSON lines first"),
], ids=["gzip", "zstd", "xz", "bzip2", "parquet"])
def test_a_compressed_or_parquet_set_is_named_as_such(name, write, said, tmp_path):
    """The forms chat sets ship in, written by their own libraries: each was "<file>:1: not UTF-8
    text" (or, for Parquet, whose first line may decode, "not a JSON object")."""
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]
    path = tmp_path / name
    path.write_bytes(_parquet(rows) if write is None else write(json.dumps(rows[0]).encode() + b"\n"))
    with pytest.raises(ValueError, match="^" + re.escape(f"{path} is {said}")):
        chat.read_jsonl(str(path), lambda row: row, "a line must hold a conversation")
    if name.endswith(".zst") and importlib.util.find_spec("zstandard"):   # the frame is one zstd reads
        assert __import__("zstandard").ZstdDecompressor().decompressobj().decompress(path.read_bytes()) == \
            json.dumps(rows[0]).encode() + b"\n"


def test_prepare_sft_reads_a_pipe_and_says_when_a_chat_is_its_answer_alone(tmp_path):
    """--input may be a pipe (`--input=<(zcat chats.jsonl.gz)`; it was "does not exist"). A
    conversation of only the answer is kept, trained whole as open-instruct's masking trains it,
    and said; an empty --out_dir is refused (it named the current directory); a file saved with
    a byte-order mark is read (its first line was "not a JSON object")."""
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
            {"messages": [{"role": "assistant", "content": "b"}]}]
    env = {**os.environ, "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "data.prepare_sft", "--input=/dev/stdin"]
    p = subprocess.run([*cmd, f"--out_dir={tmp_path / 'out'}"], input="".join(json.dumps(r) + "\n" for r in rows),
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "1 conversation(s) have no turn before the answer (first: conversation 2)" in p.stderr
    answers = [{"role": "assistant", "content": "b"}] * 2   # several answer turns and nothing else: the same
    assert chat.answer_only(answers) and not chat.answer_only([{"role": "system", "content": "s"}, *answers])
    assert json.loads((tmp_path / "out" / prepare_sft.MANIFEST).read_text())["conversations"] == 2
    (tmp_path / "bom.jsonl").write_text("\ufeff" + json.dumps(rows[0]) + "\n")   # saved as "UTF-8 with BOM"
    assert chat.read_jsonl(str(tmp_path / "bom.jsonl"), lambda row: row, "") == [rows[0]]
    p = subprocess.run([*cmd, "--out_dir="], input="", capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].endswith("--out_dir is empty; give a new directory")


def chats(n, seed=0):
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(50)]
    rows = []
    for i in range(n):
        say = lambda k: " ".join(rng.choice(words, k))  # noqa: E731
        msgs = [{"role": "user", "content": say(rng.integers(1, 8))}, {"role": "assistant", "content": say(rng.integers(1, 8))}]
        if i % 3 == 0:
            msgs += [{"role": "user", "content": say(3)}, {"role": "assistant", "content": say(rng.integers(1, 30))}]
        if i % 5 == 0:
            msgs.insert(0, {"role": "system", "content": say(2)})
        rows.append({"messages": msgs})
    rows.append({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]})  # EOS only
    return rows


def write_chats(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sft_files_load_in_olmo_core(tmp_path, monkeypatch):
    """Our SFT directory, read by OLMo-core's NumpyPackedFSLDataset as its SFT script reads it:
    same instances, same label masks, same document lengths as ours; every document one chat."""
    olmo_data = pytest.importorskip("olmo_core.data", reason="needs ai2-olmo-core")
    monkeypatch.setenv("OLMO_DATA_PREP_WORKERS", "1")
    rows = chats(40)
    m = prepare_sft.prepare_sft(str(write_chats(tmp_path / "c.jsonl", rows)), str(tmp_path / "sft"),
                                "olmo_thinker_no_think_sft_tokenization", max_tokens_per_part=600)
    assert len(m["parts"]) > 1 and m["conversations"] == 41 and m["dropped_without_trained_tokens"] == 0
    paths = prepare_sft.token_files(str(tmp_path / "sft"))
    masks = sorted(str(p) for p in (tmp_path / "sft").glob("labels_mask_*.npy"))   # the SFT script's glob
    theirs = olmo_data.NumpyPackedFSLDatasetConfig(
        tokenizer=olmo_data.TokenizerConfig(vocab_size=data.VOCAB_SIZE, eos_token_id=EOS, pad_token_id=data.PAD_ID),
        paths=paths, label_mask_paths=masks, sequence_length=128, generate_doc_lengths=True,
        dtype=olmo_data.NumpyDatasetDType.uint32, work_dir=str(tmp_path / "work")).build()
    theirs.prepare()
    ours = data.PackedFSLDataset(paths, 128, label_mask_paths=[data.packed.label_mask_path(p) for p in paths])
    assert len(ours) == len(theirs) > 5
    docs = []
    for i in range(len(theirs)):
        t = {k: v.numpy() for k, v in theirs[i].items() if hasattr(v, "numpy")}
        np.testing.assert_array_equal(ours[i]["tokens"], t["input_ids"])
        np.testing.assert_array_equal(ours[i]["label_mask"], t["label_mask"])
        np.testing.assert_array_equal(ours[i]["doc_lens"], t["doc_lens"])
        ends = np.cumsum(t["doc_lens"])
        docs += [(tuple(t["input_ids"][e - n:e].tolist()), tuple(t["label_mask"][e - n:e].tolist()))
                 for n, e in zip(t["doc_lens"], ends)
                 if t["input_ids"][e - 1] == EOS]   # the padding run is no document
    # Every packed document is one whole conversation, ids and mask exactly the template's.
    want = [chat.encode_with_mask(r["messages"], "olmo_thinker_no_think_sft_tokenization") for r in rows]
    assert sorted(docs) == sorted((tuple(i.tolist()), tuple(m.tolist())) for i, m in want)


def test_prepare_sft_parts_end_at_conversations_and_count_what_they_hold(tmp_path):
    """Parts fill with whole conversations until the next would pass the bound (a part the bound
    fits exactly is full); the manifest's counts are those of the files; a token file without its
    mask file, and an unknown template, are refused by name."""
    T = "olmo_thinker_no_think_sft_tokenization"
    rows = chats(9, seed=3)
    full = [chat.encode_with_mask(r["messages"], T) for r in rows]
    lengths = [len(ids) for ids, _ in full]
    bound = lengths[0] + lengths[1]
    want, cur = [], []
    for n in lengths:
        if cur and sum(cur) + n > bound:
            want.append(cur)
            cur = []
        cur.append(n)
    want.append(cur)
    m = prepare_sft.prepare_sft(str(write_chats(tmp_path / "c.jsonl", rows)), str(tmp_path / "sft"), T,
                                max_tokens_per_part=bound)
    ids = [np.fromfile(p, np.uint32) for p in prepare_sft.token_files(str(tmp_path / "sft"))]
    masks = [np.fromfile(data.packed.label_mask_path(p), np.bool_) for p in prepare_sft.token_files(str(tmp_path / "sft"))]
    assert [len(x) for x in ids] == [sum(c) for c in want] and len(ids[0]) == bound
    np.testing.assert_array_equal(np.concatenate(ids), np.concatenate([i for i, _ in full]))
    np.testing.assert_array_equal(np.concatenate(masks), np.concatenate([k for _, k in full]))
    assert (m["tokens"], m["trained_tokens"]) == (sum(map(len, ids)), int(sum(k.sum() for k in masks)))
    os.remove(tmp_path / "sft" / "labels_mask_part_0001.npy")
    with pytest.raises(FileNotFoundError, match="token_ids_part_0001.npy has no labels_mask_part_0001.npy beside it"):
        prepare_sft.token_files(str(tmp_path / "sft"))
    with pytest.raises(ValueError, match="--template='olmo4': choose one of"):
        prepare_sft.prepare_sft(str(tmp_path / "c.jsonl"), str(tmp_path / "sft2"), "olmo4")


def test_prepare_sft_max_seq_length_cuts_then_drops(tmp_path):
    """--max_seq_length as open-instruct's converter: the rendered conversation and its mask cut to
    that many tokens (sft_tulu_tokenize_and_truncate_v1), then dropped when nothing trained is left
    (sft_tulu_filter_v1). A cut conversation ends without EOS."""
    T = "olmo_thinker_no_think_sft_tokenization"
    rows = [{"messages": [{"role": "user", "content": "short"}, {"role": "assistant", "content": "fine"}]},
            {"messages": [{"role": "user", "content": "w " * 60}, {"role": "assistant", "content": "lost"}]},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a b c d " * 30}]}]
    full = [chat.encode_with_mask(r["messages"], T) for r in rows]
    limit = 40
    assert len(full[0][0]) < limit < len(full[2][0]) and not full[1][1][:limit].any() and full[2][1][:limit].any()
    m = prepare_sft.prepare_sft(str(write_chats(tmp_path / "c.jsonl", rows)), str(tmp_path / "sft"), T,
                                max_seq_length=limit)
    assert (m["conversations"], m["dropped_without_trained_tokens"], m["max_seq_length"]) == (2, 1, limit)
    ids = np.fromfile(tmp_path / "sft" / "token_ids_part_0000.npy", np.uint32)
    mask = np.fromfile(tmp_path / "sft" / "labels_mask_part_0000.npy", np.bool_)
    np.testing.assert_array_equal(ids, np.concatenate([full[0][0], full[2][0][:limit]]))
    np.testing.assert_array_equal(mask, np.concatenate([full[0][1], full[2][1][:limit]]))
    assert ids[-1] != EOS and (ids == EOS).sum() == 1
    with pytest.raises(ValueError, match="--max_seq_length=0 must be positive"):
        prepare_sft.prepare_sft(str(tmp_path / "c.jsonl"), str(tmp_path / "sft0"), T, max_seq_length=0)


@pytest.mark.parametrize("seed", [7, 8])
def test_trained_tokens_past_seq_len_are_counted_as_a_numpy_oracle(tmp_path, seed):
    """PackedFSLDataset.trained_tokens: the label-mask tokens inside the packed documents (each
    truncated to seq_len) against the same sums over the files split at EOS by numpy; tokens after
    a file's last EOS are in no document. Part 3 is one token (a one-token document). Seed 8 too:
    with seed 7 alone, file 0's mask happens to count as many tokens over file 1's documents as
    file 1's own, so reading a group's first mask for all its files went unseen."""
    rng = np.random.default_rng(seed)
    seq, paths, want_kept, want_total = 16, [], 0, 0
    for part in range(4):
        lengths = rng.integers(1, 40, size=12) if part < 3 else np.array([1])
        ids = np.concatenate([np.append(rng.integers(0, 1000, n - 1), EOS) for n in lengths]
                             + [[5, 6, 7]] * (part < 3))
        mask = rng.random(len(ids)) < 0.4
        mask[0] = True   # no file may mark nothing
        ids.astype(np.uint32).tofile(tmp_path / f"token_ids_part_{part}.npy")
        mask.tofile(tmp_path / f"labels_mask_part_{part}.npy")
        paths.append(str(tmp_path / f"token_ids_part_{part}.npy"))
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        want_kept += sum(int(mask[s:s + min(n, seq)].sum()) for s, n in zip(starts, lengths))
        want_total += int(mask.sum())
    ds = data.PackedFSLDataset(paths, seq, source_group_size=2, label_mask_paths=[data.packed.label_mask_path(p)
                                                                                 for p in paths])
    assert ds.trained_tokens() == (want_kept, want_total) and want_kept < want_total
    assert want_kept == sum(int(ds[i]["label_mask"].sum()) for i in range(len(ds)))   # what the batches carry


def test_sft_whose_answers_lie_past_seq_len_is_refused(tmp_path):
    """Conversations longer than --seq_len whose trained tokens all come later trained nothing:
    loss 0.0 and grad norm 0 at every step, exit 0 (a held-out set: no loss logged). Now exit 2;
    a set that loses some says how many in a warning."""
    long = [{"messages": [{"role": "user", "content": "w " * 120}, {"role": "assistant", "content": f"a {i}"}]}
            for i in range(8)]
    short = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": f"b {i}"}]}
             for i in range(8)]
    trained = {name: prepare_sft.prepare_sft(str(write_chats(tmp_path / f"{name}.jsonl", rows)),
                                             str(tmp_path / name))["trained_tokens"]
               for name, rows in (("long", long), ("mixed", long + short))}
    base = ["--flagfile=" + os.path.join(ROOT, "tiny_sft.flags"), *SMALL_MODEL, "--max_steps=1"]
    p = run_train([*base, f"--data={tmp_path / 'long'}", "--sft_heldout=", f"--run_dir={tmp_path / 'r1'}"], tmp_path,
                  check=False)
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1] == (
        f"train.py: error: --data={tmp_path / 'long'}: none of its {trained['long']} trained tokens (label mask) lies "
        "within the "
        "first --seq_len=64 tokens of its conversation (packing truncates each to that), so it trains nothing; raise "
        "--seq_len, or prepare the chats with python -m data.prepare_sft --max_seq_length=64, which drops those "
        "with nothing to train within it")
    p = run_train([*base, f"--data={tmp_path / 'mixed'}", f"--sft_heldout={tmp_path / 'long'}",
                   f"--run_dir={tmp_path / 'r2'}"], tmp_path, check=False)
    assert p.returncode == 2 and f"--sft_heldout={tmp_path / 'long'}: none of its {trained['long']} trained" in p.stderr
    assert "so it scores nothing" in p.stderr
    assert (f"--data={tmp_path / 'mixed'}: {trained['long']} of its {trained['mixed']} trained tokens (label mask, "
            f"{100 * trained['long'] / trained['mixed']:.2f}%) lie past --seq_len=64 "
            "in their documents, which packing truncates to that: they are not trained") in p.stderr


def test_label_masked_loss_equals_transformers():
    """Mean CE over the label-masked targets (train step's loss, z-loss off) against transformers'
    Olmo3ForCausalLM(labels=...) with -100 wherever the target token is masked."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import jax.numpy as jnp

    from olmo3 import hf
    from olmo3.step import loss_sums
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_model import hf_config, random_hf_model
    cfg = hf_config()
    ref = random_hf_model(cfg, seed=3)
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, cfg.vocab_size, size=(3, 40))
    mask = rng.random(tokens.shape) < 0.4
    mask[2] = False  # a row with nothing to train on still counts nothing
    labels = np.where(mask, tokens, -100)
    with torch.no_grad():
        want = float(ref(torch.tensor(tokens), labels=torch.tensor(labels)).loss)
    model = hf.from_hf(dict(ref.state_dict()), hf.config_from_hf(cfg.to_dict()))
    batch = {"tokens": jnp.asarray(tokens, jnp.int32), "label_mask": jnp.asarray(mask),
             "instance_mask": jnp.ones(3, bool)}
    ce, _, n = loss_sums(model, batch, chunk=16, use_segments=False, z_loss=None)
    assert int(n) == int(mask[:, 1:].sum())
    assert float(ce) / float(n) == pytest.approx(want, rel=1e-5)


@pytest.fixture(scope="module")
def per_document_reference():
    """A packed, label-masked batch and transformers' float64 loss over it, each document run alone
    (what attention within documents computes): CE of tokens[t + 1] at every t with mask[t + 1], over
    their count. Rows: a mask whose first token is 1 (never a target: nothing precedes it), all
    padding, only the first token marked (no target), every token marked, random masks; documents
    crossing sliding windows. Returns (our model, batch, loss, d loss / d lm_head, d loss / d embed)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from olmo3 import hf
    from data.packing import segments_from_lengths
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_model import hf_config, random_hf_model
    cfg = hf_config(sliding_window=5)
    ref = random_hf_model(cfg, seed=3).double()
    rng = np.random.default_rng(0)
    B, T = 8, 24
    tokens = rng.integers(0, cfg.vocab_size, (B, T))
    mask = rng.random((B, T)) < 0.5
    mask[0, 0] = True
    mask[1] = False
    mask[2] = False
    mask[2, 0] = True
    mask[3] = True
    doc_lens = [[10, 8, 6], [T], [T], [5, 19], [T], [3, 3, 18], [12, 12], [1, 23]]
    total, count = torch.zeros((), dtype=torch.float64), 0
    for b, lens in enumerate(doc_lens):
        for s, L in zip(np.cumsum([0] + lens[:-1]), lens):
            logp = torch.log_softmax(ref(torch.tensor(tokens[b:b + 1, s:s + L])).logits[0], -1)
            for t in range(s, min(s + L, T - 1)):
                if mask[b, t + 1]:
                    total, count = total - logp[t - s, tokens[b, t + 1]], count + 1
    loss = total / count
    loss.backward()
    model = hf.from_hf({k: v.float() for k, v in ref.state_dict().items()}, hf.config_from_hf(cfg.to_dict()))
    batch = {"tokens": tokens.astype(np.int32), "label_mask": mask, "instance_mask": np.ones(B, bool),
             "segment_ids": np.stack([segments_from_lengths(np.array(d)) for d in doc_lens])}
    return (model, batch, float(loss), ref.lm_head.weight.grad.numpy().T,
            ref.model.embed_tokens.weight.grad.numpy())


@pytest.mark.parametrize("mesh,microbatches", [(None, 4), ("fsdp:2", 4), ("data:2,fsdp:2", 1), ("fsdp:1,context:2", 2)])
def test_sft_loss_and_gradient_on_any_mesh_equal_per_document_transformers(per_document_reference, mesh, microbatches):
    """The training gradient (olmo3.sharding, z-loss 0, --doc_lengths) on 1, 2 and 4 devices, in
    microbatches (some with no target at all), with context parallelism: the same mean over the
    global batch's targets as transformers' per-document loss, and its gradient."""
    import jax

    from olmo3 import sharding as sh
    model, batch, want, d_lm_head, d_embed = per_document_reference
    size = int(np.prod([int(axis.split(":")[1]) for axis in mesh.split(",")])) if mesh else 1
    m = sh.make_mesh(mesh, devices=jax.devices()[:size])
    grad_fn = sh.make_grad_fn(m, sh.param_specs(model, m), microbatches=microbatches, chunk=16, z_loss=0.0,
                              use_segments=True)
    grads, ce, _ = jax.jit(grad_fn)(model, sh.global_batch(batch, m))
    assert float(ce) == pytest.approx(want, rel=1e-6)
    for got, ref in ((grads.lm_head, d_lm_head), (grads.embed, d_embed)):
        assert np.linalg.norm(np.asarray(got) - ref) / np.linalg.norm(ref) < 1e-5


def test_stage_flag_values(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    base = [sys.executable, os.path.join(ROOT, "train.py"), f"--run_dir={tmp_path / 'r'}"]
    p = subprocess.run(base + ["--stage=dpo"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and "data.prepare_dpo" in p.stderr   # --data=stdlib is no preference data
    p = subprocess.run(base + ["--stage=sft"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and "--packed --label_masks" in p.stderr
    p = subprocess.run(base + ["--stage=4"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and "stage" in p.stderr
    # two --sft_heldout sets with one folder name would log as one eval/heldout/...: refused
    for d in ("a", "b"):
        prepare_sft.prepare_sft(str(write_chats(tmp_path / f"{d}.jsonl", chats(4, 0))), str(tmp_path / d / "heldout"),
                                "olmo_thinker_no_think_sft_tokenization")
    p = subprocess.run(base + ["--flagfile=" + os.path.join(ROOT, "tiny_sft.flags"), f"--data={tmp_path / 'a' / 'heldout'}",
                              f"--run_dir={tmp_path / 'r'}", f"--sft_heldout={tmp_path / 'a' / 'heldout'},{tmp_path / 'b' / 'heldout'}"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and "both named 'heldout'" in p.stderr.strip().splitlines()[-1], p.stderr[-2000:]


_HORIZON = """
import sys, train
from absl import app
train.F(["train.py", *sys.argv[2:]])
try:
    train.set_horizon(int(sys.argv[1]))
except app.UsageError as e:
    print("UsageError:", e)
else:
    print(train.F.total_steps, train.F.warmup_steps)
"""


@pytest.mark.parametrize("instances,batch,epochs,fraction", [(75, 1, 2, 0.03), (25, 1, 2, 0.03), (26, 4, 2, 0.03),
                                                             (1000, 8, 3, 0.03), (250, 1, 1, 0.03)])
def test_horizon_from_epochs_as_olmo_core(instances, batch, epochs, fraction):
    """--epochs / --warmup_fraction: total steps = epochs x whole global batches of one epoch (OLMo-core's
    trainer.max_steps for Duration.epochs), warmup where OLMo-core's LinearWithWarmup first reaches the peak
    (Python's round: 150 x 0.03 = 4.5 -> 4, 50 x 0.03 = 1.5 -> 2), the lr 0 on the last step."""
    optim = pytest.importorskip("olmo_core.optim", reason="needs ai2-olmo-core")
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-c", _HORIZON, str(instances), f"--global_batch={batch}", f"--epochs={epochs}",
                        f"--warmup_fraction={fraction}"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    total, warmup = (int(x) for x in p.stdout.split())
    assert total == epochs * (instances // batch)
    ref = optim.LinearWithWarmup(warmup_fraction=fraction, alpha_f=0.0)
    lrs = [ref.get_lr(1.0, n, total) for n in range(total + 1)]
    assert warmup == next(n for n, lr in enumerate(lrs) if lr == 1.0) and lrs[total] == 0.0


def test_epochs_without_warmup_fraction_is_refused_past_the_horizon():
    """--epochs alone kept the default --warmup_steps=2000 over a 12-step horizon: an lr that never reached
    --lr nor decayed (0.6% of it at the end). As --total_steps=12 is refused, so is this."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    run = lambda *flags: subprocess.run([sys.executable, "-c", _HORIZON, "26", "--global_batch=4", *flags],  # noqa: E731
                                        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120).stdout
    assert "UsageError: --warmup_steps=2000 is past the schedule horizon (12 steps" in run("--epochs=2")
    assert run("--epochs=2", "--warmup_steps=3").split() == ["12", "3"]
    assert run("--epochs=2", "--warmup_fraction=0.03").split() == ["12", "0"]
    # the horizon's edges: --max_steps at it, a warmup of all of it (the validators' [0, 1])
    assert run("--epochs=2", "--warmup_fraction=1", "--max_steps=12").split() == ["12", "12"]
    assert run("--total_steps=10", "--warmup_fraction=0.5").split() == ["10", "5"]   # without --epochs too
    # check_flags' downstream check, which a horizon from the data skipped: it ran and scored nothing
    assert ("UsageError: --downstream_eval_interval=100 is past the schedule horizon (12 steps" in
            run("--epochs=2", "--warmup_fraction=0.03", "--downstream_tasks=copycolors_10way_fast",
                "--downstream_eval_interval=100"))


def test_a_given_horizon_gives_way_to_epochs_with_a_warning():
    """--epochs / --warmup_fraction over a --total_steps / --warmup_steps that is given (a base
    flagfile's: tiny.flags under test_train_dpo's --epochs) replaced it without a word."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-c", _HORIZON, "26", "--global_batch=4", "--epochs=2", "--total_steps=100",
                        "--warmup_steps=50", "--warmup_fraction=0.5"], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)
    assert p.stdout.split() == ["12", "6"], p.stderr[-2000:]
    assert "--total_steps=100 gives way to --epochs=2: 12 steps over 26 instances" in p.stderr
    assert "--warmup_steps=50 gives way to --warmup_fraction=0.5: 6 steps" in p.stderr
    p = subprocess.run([sys.executable, "-c", _HORIZON, "26", "--global_batch=4", "--epochs=2", "--warmup_fraction=0.5"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert p.stdout.split() == ["12", "6"] and "gives way" not in p.stderr


# ---- train.py --stage=sft end to end (slow: several train.py runs) -------------------------
SMALL_MODEL = ["--d_model=32", "--n_heads=2",
               "--n_kv_heads=2", "--head_dim=16", "--mlp_hidden=64", "--seq_len=64", "--global_batch=4",
               "--window=16", "--eval_batches=1", "--loss_chunk=128", "--loader_workers=1"]


def run_train(args, tmp_path, check=True):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update({"JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT})
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args],
                       capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    if check and p.returncode != 0:
        raise AssertionError(f"train.py failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return p


@pytest.mark.slow  # four train.py runs: ~3 min on 2 cores
def test_sft_warm_adam_and_exact_resume(tmp_path):
    """A stage-1 base, then SFT from it: Adam's moments and count carry over as OLMo-core's
    load_checkpoint(load_trainer_state=False) loads them (count 4 at step 1 after the base's 3
    steps; --init_weights_only: fresh, count 1), the held-out chats are scored before the first
    step, and a run interrupted at step 2 and resumed equals the uninterrupted one bit for bit."""
    (tmp_path / "docs").mkdir()
    for i in range(20):
        (tmp_path / "docs" / f"{i}.txt").write_text(" ".join(f"w{(i * 7 + j) % 50}" for j in range(200)))
    run_train(["--flagfile=" + os.path.join(ROOT, "tiny.flags"), *SMALL_MODEL, f"--data={tmp_path / 'docs'}",
               f"--data_dir={tmp_path / 'data'}", "--total_steps=3", "--warmup_steps=1", "--save_interval=3",
               f"--run_dir={tmp_path / 'base'}"], tmp_path)
    for split, seed in (("train", 0), ("heldout", 1)):
        prepare_sft.prepare_sft(str(write_chats(tmp_path / f"{split}.jsonl", chats(60, seed))),
                                str(tmp_path / "sft" / split), "olmo_thinker_no_think_sft_tokenization")
    sft = ["--flagfile=" + os.path.join(ROOT, "tiny_sft.flags"), *SMALL_MODEL, f"--data={tmp_path / 'sft' / 'train'}", f"--sft_heldout={tmp_path / 'sft' / 'heldout'}",
           f"--init_from={tmp_path / 'base'}", "--save_interval=2", "--eval_interval=2", "--max_steps=4"]
    run_train(sft + [f"--run_dir={tmp_path / 'a'}"], tmp_path)
    run_train(sft + [f"--run_dir={tmp_path / 'b'}", "--max_steps=2"], tmp_path)
    run_train(sft + [f"--run_dir={tmp_path / 'b'}", "--resume"], tmp_path)
    run_train(sft + [f"--run_dir={tmp_path / 'c'}", "--init_weights_only", "--max_steps=1"], tmp_path)
    a, b = metrics_by_step(tmp_path / "a"), metrics_by_step(tmp_path / "b")
    assert sorted(a) == [0, 1, 2, 3, 4] and a[1]["optim/adam_count"] == 4.0   # the base's Adam, 3 steps on
    assert metrics_by_step(tmp_path / "c")[1]["optim/adam_count"] == 1.0       # fresh Adam
    assert "eval/heldout/loss" in a[0] and "train/loss" not in a[0]             # the base model, before SFT
    assert [a[s]["train/loss"] for s in range(1, 5)] == [b[s]["train/loss"] for s in range(1, 5)]
    assert a[4]["eval/heldout/loss"] == b[4]["eval/heldout/loss"]
    horizon = 2 * data.steps_per_epoch(len(data.PackedFSLDataset(
        prepare_sft.token_files(str(tmp_path / "sft" / "train")), 64)), 4)
    warm = round(0.03 * horizon)   # OLMo-core LinearWithWarmup(warmup_fraction=0.03) on our horizon
    lr1 = 1e-3 / warm if 1 < warm else 1e-3 * (horizon - 1) / max(horizon - warm, 1)
    assert a[1]["optim/lr"] == pytest.approx(lr1, rel=1e-5)
