"""data.docstring_chats: the instruction and preference sets of the README's SFT / DPO evidence."""
import json
import random

from data import chat, corpus
from data import docstring_chats as dc

TEMPLATE = "olmo_thinker_no_think_sft_tokenization"

SOURCE = '''
def documented(a, b):
    """Add two numbers.

    A second paragraph that is not the answer.
    """
    c = a + b
    return c


def one_liner():
    "Too short: no body to show."


def undocumented(x):
    y = x
    return y


class K:
    def method(self):
        """Return self.
        Still the first paragraph."""
        return self
'''


def test_functions_with_docstrings_strips_the_docstring_and_keeps_the_first_paragraph():
    found = dict((d, s) for s, d in dc.functions_with_docstrings(SOURCE))
    assert set(found) == {"Add two numbers.", "Return self.\nStill the first paragraph."}
    assert found["Add two numbers."] == "def documented(a, b):\n    c = a + b\n    return c"
    assert found["Return self.\nStill the first paragraph."] == "def method(self):\n    return self"
    assert dc.functions_with_docstrings("def broken(:\n") == []


def _fake_corpus(monkeypatch, n_docs=12, extra=()):
    docs = []
    for k in range(n_docs):
        body = "".join(f'def f{k}_{i}(x):\n    """Doc {k} {i}{" word" * i}."""\n    return x + {i}\n\n'
                       for i in range(4))
        docs.append(corpus.Document(name=f"mod{k}.py", text=body, domain="code"))
    docs += [corpus.Document(name=name, text=text, domain="code") for name, text in extra]
    monkeypatch.setattr(corpus, "documents", lambda source: iter(docs))
    heldout = {"mod1.py", "mod5.py"} | {name for name, _ in extra if name.startswith("held")}
    # as data/corpus.py names a held-out document's split: heldout/<domain>
    monkeypatch.setattr(corpus, "split_of", lambda doc, fraction=None: "heldout/code" if doc.name in heldout else "train")
    return heldout


def test_build_splits_by_document_fits_and_cuts_a_fixed_shuffle(monkeypatch):
    heldout = _fake_corpus(monkeypatch)
    limit = 51   # rendered lengths 49-52 tokens (i = 0..3): f*_3 does not fit
    sets = dc.build(limit, TEMPLATE, seed=0, max_train=None, max_heldout=None)
    held_mods = {s.split("(")[0].removeprefix("def f").split("_")[0] for s, _ in sets["heldout"]}
    assert held_mods == {m.removeprefix("mod").removesuffix(".py") for m in heldout}
    assert not {s for s, _ in sets["train"]} & {s for s, _ in sets["heldout"]}
    for split in sets.values():
        for source, answer in split:
            assert len(chat.encode(dc.conversation(source, answer), TEMPLATE)) <= limit
    assert len(sets["train"]) == 30 and len(sets["heldout"]) == 6   # 3 of 4 functions in each of 10 + 2
    # the README's "first 320 of --max_train=480 are --max_train=320": a seeded shuffle, then a cut
    assert dc.build(limit, TEMPLATE, 0, 5, 2)["train"] == sets["train"][:5]
    assert dc.build(limit, TEMPLATE, 0, None, None) == sets
    assert dc.build(limit, TEMPLATE, 1, None, None)["train"] != sets["train"]
    # a pure function of the corpus, the seed and the limits: not of the order documents are read in
    docs = list(corpus.documents("stdlib-code"))
    monkeypatch.setattr(corpus, "documents", lambda source: iter(docs[::-1]))
    assert dc.build(limit, TEMPLATE, 0, None, None) == sets


def test_preference_rows_reject_a_wrong_answer_that_fits():
    pairs = [(f"def f{i}(): pass", ("short " if i % 3 else "a long docstring " * 30) + str(i)) for i in range(30)]
    fits = lambda conv: len(conv[1]["content"]) < 100   # noqa: E731
    rows = dc.preference_rows(pairs, seed=0, fits=fits)
    assert rows == dc.preference_rows(pairs, seed=0, fits=fits)
    for i, (row, (source, answer)) in enumerate(zip(rows, pairs)):
        assert row["chosen"] == dc.conversation(source, answer)
        assert row["rejected"][0] == row["chosen"][0]
        wrong = row["rejected"][1]["content"]
        assert wrong != answer
        if i % 2 == 1:   # odd rows: the real answer's words, shuffled
            assert sorted(wrong.split()) == sorted(answer.split()) or wrong.endswith(" not")
        elif len(answer) < 100:   # even rows: another function's answer, one that fits
            assert wrong in {a for _, a in pairs} and fits(row["rejected"])


def test_preference_rows_draw_every_other_answer_and_never_their_own():
    """An even row's rejected answer is drawn from the other functions' answers, each of them
    possible (the last one included) and never the row's own: over 200 seeds, row 0 of three
    pairs gets both others, row 2 both of its others."""
    pairs = [("def a(): pass", "Return a."), ("def b(): pass", "Return b."), ("def c(): pass", "Return c.")]
    drawn = {0: set(), 2: set()}
    for seed in range(200):
        rows = dc.preference_rows(pairs, seed=seed)
        for i in drawn:
            drawn[i].add(rows[i]["rejected"][1]["content"])
    assert drawn == {0: {"Return b.", "Return c."}, 2: {"Return a.", "Return b."}}


def test_a_function_of_a_training_module_is_never_held_out_nor_trained_on_twice(monkeypatch):
    """One function in a training module and a held-out one (three_way_cmp: unittest/util.py and
    ctypes/test/test_libc.py) was a held-out pair the base model had trained on; one in two
    training modules was two training pairs."""
    def twice(name):
        return (f"{name}.py", 'def twice(x):\n    """Twice."""\n    return 2 * x\n')
    _fake_corpus(monkeypatch)
    base = dc.build(51, TEMPLATE, seed=0, max_train=None, max_heldout=None)
    _fake_corpus(monkeypatch, extra=[twice("train_a"), twice("train_b"), twice("held_a")])
    sets = dc.build(51, TEMPLATE, seed=0, max_train=None, max_heldout=None)
    assert not {s for s, _ in sets["train"]} & {s for s, _ in sets["heldout"]}
    assert set(sets["heldout"]) == set(base["heldout"]) and len(sets["heldout"]) == len(base["heldout"])
    assert sets["train"].count(("def twice(x):\n    return 2 * x", "Twice.")) == 1
    assert sorted(p for p in sets["train"] if p[1] != "Twice.") == sorted(base["train"])
    # The training copy's docstring too long to fit: no training pair, but the base model read its
    # module all the same, so the held-out copy is still dropped.
    long = ("train_long.py", 'def twice(x):\n    """' + "Twice, twice" * 20 + '."""\n    return 2 * x\n')
    _fake_corpus(monkeypatch, extra=[long, twice("held_a")])
    sets = dc.build(51, TEMPLATE, seed=0, max_train=None, max_heldout=None)
    assert set(sets["heldout"]) == set(base["heldout"]) and sorted(sets["train"]) == sorted(base["train"])


def test_corrupt_always_differs():
    rng = random.Random(0)
    for answer in ("one", "same same", "Return the value.", "a b c d e f"):
        assert dc.corrupt(answer, rng) != answer
    # Eight shuffles of two words give them back once in 256 draws (seed 439 here): the answer
    # itself was the rejected side. Whatever its spacing, never the answer's words in order.
    for answer in ("Return self.", "Return the\n    value."):
        for seed in range(2000):
            assert dc.corrupt(answer, random.Random(seed)).split() != answer.split(), (answer, seed)


def test_readme_command_fits_every_side_in_the_tiny_sequence(tmp_path):
    """The README's command: every chosen and every rejected side fits --max_tokens=256, so
    prepare_dpo --max_seq_length=256 truncates none (three rejected sides did before)."""
    import subprocess
    import sys
    subprocess.run([sys.executable, "-m", "data.docstring_chats", f"--out={tmp_path}", "--max_train=480",
                    "--max_heldout=64"], check=True, capture_output=True, text=True)
    for split, n in (("train", 480), ("heldout", 64)):
        sft = [json.loads(line) for line in open(tmp_path / f"sft_{split}.jsonl")]
        dpo = [json.loads(line) for line in open(tmp_path / f"dpo_{split}.jsonl")]
        assert len(sft) == len(dpo) == n
        for row, pair in zip(sft, dpo):
            assert pair["chosen"] == row["messages"]
            for side in ("chosen", "rejected"):
                assert len(chat.encode(pair[side], TEMPLATE)) <= 256, (split, json.dumps(pair)[:200])


def test_bad_counts_are_refused_before_anything_is_written(tmp_path):
    """--max_tokens below 1, or below every conversation's length, would keep no conversation (it
    wrote four empty files, exit 0); a --max_train / --max_heldout below 1 likewise; an empty
    --out was errno's "No such file or directory: ''". Each is one line naming the flag, exit 2."""
    import subprocess
    import sys
    for flag, line in (("--max_tokens=0", "--max_tokens=0 must be >= 1"),
                       ("--max_train=0", "--max_train=0 must be >= 1"),
                       ("--max_tokens=8", "--max_tokens=8: no train conversation fits in 8 tokens"),
                       ("--max_heldout=-2", "--max_heldout=-2 must be >= 1"),
                       ("--out=", "--out is empty; give a directory for the chat files")):
        out = tmp_path / flag.strip("-").split("=")[0]
        p = subprocess.run([sys.executable, "-m", "data.docstring_chats", f"--out={out}", flag],
                           capture_output=True, text=True)
        assert p.returncode == 2 and p.stderr.strip().splitlines() == [
            f"docstring_chats.py: error: {line}" + p.stderr.split(line, 1)[-1].rstrip()], p.stderr
        assert not out.exists()
