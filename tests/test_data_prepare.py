"""prepare: OLMo-core token files, deterministic split and bytes, mixtures, idempotent ensure_corpus,
clear errors and nothing half-written."""
import glob
import gzip
import hashlib
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import data
from data import prepare as prep

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _make_corpus(root, name, n_docs, seed):
    """A user corpus of .txt, .jsonl and .jsonl.gz files; returns [(document name, text)] in read order."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "def", "return", "the", "of", "é", "🙂", "\n", "  ", "42", "x=1;"]
    texts = [" ".join(rng.choice(words, size=int(rng.integers(5, 120)))) for _ in range(n_docs)]
    d = root / name
    os.makedirs(d / "sub")
    docs = []
    k = n_docs // 3
    for i in range(k):  # sorted order within a directory: a/.., b.jsonl, sub/
        (d / f"a{i:03d}.txt").write_text(texts[i], encoding="utf-8")
        docs.append((f"{name}/a{i:03d}.txt", texts[i]))
    with open(d / "b.jsonl", "w", encoding="utf-8") as f:
        for j, t in enumerate(texts[k:2 * k]):
            f.write(json.dumps({"text": t, "id": j}) + "\n")
            docs.append((f"{name}/b.jsonl:{j + 1}", t))
    with gzip.open(d / "sub" / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        for j, t in enumerate(texts[2 * k:]):
            f.write(json.dumps({"text": t}) + "\n")
            docs.append((f"{name}/sub/c.jsonl.gz:{j + 1}", t))
    return str(d), docs


def _heldout(name, fraction=0.1):  # the documented split rule, written out independently: the hash of
    key = name.split("/", 1)[1]      # the path inside the corpus folder (and line), not the folder's name
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64 < fraction


def _split_tokens(out_dir, manifest, split):
    return np.concatenate([np.fromfile(os.path.join(out_dir, f["path"]), dtype=np.uint32)
                           for f in manifest["splits"][split]["files"]])


def test_format_split_and_byte_identical_builds(tmp_path, monkeypatch):
    src, docs = _make_corpus(tmp_path, "web", 240, 0)
    enc = data.dolma2()
    out1, out2 = str(tmp_path / "o1"), str(tmp_path / "o2")
    m1 = prep.prepare(src, out1, workers=1, progress=False)
    monkeypatch.setattr(prep, "_CHUNK_CHARS", 2000)   # dozens of chunks in flight: written in input order
    m2 = prep.prepare(src, out2, workers=2, progress=False)
    assert m1 == m2
    assert sorted(m1["splits"]) == ["heldout/web", "train"]
    for split, keep in (("train", lambda n: not _heldout(n)), ("heldout/web", _heldout)):
        chosen = [t for n, t in docs if keep(n)]
        want = [tok for t in chosen for tok in enc.encode_ordinary(t.strip()) + [data.EOS_ID]]   # as `dolma tokens`
        np.testing.assert_array_equal(_split_tokens(out1, m1, split), np.array(want, dtype=np.uint32))
        assert m1["splits"][split]["documents"] == len(chosen) > 0
        for f in m1["splits"][split]["files"]:
            b1 = open(os.path.join(out1, f["path"]), "rb").read()
            assert b1 == open(os.path.join(out2, f["path"]), "rb").read()  # byte-identical
            assert hashlib.sha256(b1).hexdigest() == f["sha256"] and len(b1) == 4 * f["tokens"]
            assert int((np.frombuffer(b1, np.uint32) == data.EOS_ID).sum()) == f["documents"]
    assert open(os.path.join(out1, "manifest.json"), "rb").read() == open(os.path.join(out2, "manifest.json"), "rb").read()
    assert m1["tokenizer"]["eos_id"] == data.EOS_ID and m1["tokenizer"]["vocab_size"] == data.VOCAB_SIZE
    assert not [p for p in _all_files(out1) if ".tmp" in p]


def _all_files(root):
    return [os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs]


def _files_of(documents, bound, size=len):
    """prepare's layout, written out: whole documents in order, a new file before one would pass
    `bound` tokens, a document longer than the bound alone in its file."""
    files, cur = [], []
    for doc in documents:
        if cur and sum(map(size, cur)) + size(doc) > bound:
            files.append(cur)
            cur = []
        cur.append(doc)
    return files + [cur]


def test_bounded_files(tmp_path):
    src, _ = _make_corpus(tmp_path, "web", 120, 1)
    whole = prep.prepare(src, str(tmp_path / "whole"), workers=1, progress=False)
    bounded = prep.prepare(src, str(tmp_path / "bounded"), workers=1, max_tokens_per_file=300, progress=False)
    files = bounded["splits"]["train"]["files"]
    assert len(files) > 3
    assert all(f["tokens"] <= 300 for f in files)
    np.testing.assert_array_equal(_split_tokens(str(tmp_path / "whole"), whole, "train"),
                                  _split_tokens(str(tmp_path / "bounded"), bounded, "train"))
    ds = data.open_split(str(tmp_path / "bounded"), "train", 32)
    assert len(ds) == sum(f["tokens"] // 32 for f in files)
    # The layout, written out: whole documents in order, a new file before one would pass the bound,
    # so a file the bound fits exactly is full; a document longer than the bound alone in its file.
    tokens = _split_tokens(str(tmp_path / "whole"), whole, "train")
    lengths = np.diff(np.flatnonzero(tokens == data.EOS_ID) + 1, prepend=0)
    bound = int(lengths[:3].sum())
    want = _files_of(lengths.tolist(), bound, size=int)
    exact = prep.prepare(src, str(tmp_path / "exact"), workers=1, max_tokens_per_file=bound, progress=False)
    got = exact["splits"]["train"]["files"]
    assert [(f["documents"], f["tokens"]) for f in got] == [(len(c), sum(c)) for c in want]
    assert got[0]["tokens"] == bound


def test_mixture_weights_and_upsampling(tmp_path):
    a, _ = _make_corpus(tmp_path, "a", 150, 2)
    b, _ = _make_corpus(tmp_path, "b", 90, 3)
    out = str(tmp_path / "mix")
    m = prep.prepare(f"{a}:3,{b}:1", out, workers=1, progress=False)
    assert sorted(m["splits"]) == ["heldout/a", "heldout/b", "train"]
    ta, tb = (x["train_tokens_taken"] for x in m["mixture"])
    avail = [x["train_tokens_available"] for x in m["mixture"]]
    total = min(avail[0] / 0.75, avail[1] / 0.25)
    max_doc = 200  # no document here is longer than this many tokens
    assert abs(ta - 0.75 * total) < max_doc and abs(tb - 0.25 * total) < max_doc
    assert ta <= avail[0] and tb <= avail[1]
    train = _split_tokens(out, m, "train")
    assert len(train) == ta + tb == m["splits"]["train"]["tokens"]
    # Whole documents, taken from the start of each source's train split.
    src_a = _split_tokens(out, m, "train") [:ta]
    a_train = np.concatenate([np.fromfile(os.path.join(out, "sources/0/train", f), np.uint32)
                              for f in sorted(os.listdir(os.path.join(out, "sources/0/train")))])
    np.testing.assert_array_equal(src_a, a_train[:ta])
    assert train[ta - 1] == data.EOS_ID and train[-1] == data.EOS_ID
    # Asking for more tokens than a source has repeats it from its start (upsampling).
    up = prep.prepare(f"{a}:1,{b}:1", str(tmp_path / "up"), workers=1, mixture_tokens=4 * sum(avail), progress=False)
    tb_up = up["mixture"][1]
    assert tb_up["train_tokens_taken"] > 2 * tb_up["train_tokens_available"]


def test_mixture_tokens_take_the_shortest_whole_document_prefix_of_each_share(tmp_path):
    """--mixture_tokens=T: source i supplies T * w_i / sum(w) tokens, rounded up to whole documents
    from the start of its train split (cycled when it has fewer): the oracle below, per source."""
    a, _ = _make_corpus(tmp_path, "a", 60, 12)
    b, _ = _make_corpus(tmp_path, "b", 30, 13)
    prep.prepare(f"{a}:1,{b}:3", str(tmp_path / "m1"), workers=1, progress=False)
    trains = [np.concatenate([np.fromfile(p, np.uint32) for p in sorted((tmp_path / "m1" / "sources" / str(i) / "train").iterdir())])
              for i in range(2)]
    ends = [np.flatnonzero(t == data.EOS_ID) + 1 for t in trains]
    total = 4 * int(ends[0][len(ends[0]) // 3])   # a's share (1/4) ends exactly at a document's end
    m = prep.prepare(f"{a}:1,{b}:3", str(tmp_path / "m2"), workers=1, mixture_tokens=total, progress=False)
    want = []
    for t, e, share in zip(trains, ends, (total // 4, 3 * total // 4)):
        reps = -(-share // len(t)) + 1
        cyc = np.tile(t, reps)
        cyc_ends = np.concatenate([e + r * len(t) for r in range(reps)])
        want.append(cyc[:int(cyc_ends[np.searchsorted(cyc_ends, share)])])
    assert [x["train_tokens_taken"] for x in m["mixture"]] == [len(w) for w in want]
    assert len(want[0]) == total // 4 and len(want[1]) > len(trains[1])   # exact for a; b repeated
    np.testing.assert_array_equal(_split_tokens(str(tmp_path / "m2"), m, "train"), np.concatenate(want))


def test_a_document_longer_than_the_bound_is_alone_and_nothing_after_it_is_lost(tmp_path):
    """Oracle: each document as dolma's `tokenize_file` writes it (stripped text, then eos), packed
    greedily in plain Python: a new file before one would pass the bound, a longer one alone."""
    d = tmp_path / "web"
    d.mkdir()
    texts = ["a short one", " ".join(f"w{i}" for i in range(200)), "after the long one", "and the last"]
    for i, t in enumerate(texts):
        (d / f"{i}.txt").write_text(t)
    out = str(tmp_path / "out")
    m = prep.prepare(str(d), out, workers=1, max_tokens_per_file=40, heldout_fraction=0.0, progress=False)
    enc = data.dolma2()
    docs = [enc.encode_ordinary(t.strip()) + [data.EOS_ID] for t in texts]
    assert len(docs[1]) > 40
    want = _files_of(docs, 40)
    files = m["splits"]["train"]["files"]
    assert [np.fromfile(os.path.join(out, f["path"]), np.uint32).tolist() for f in files] == [sum(c, []) for c in want]
    assert [f["documents"] for f in files] == [len(c) for c in want] and m["splits"]["train"]["documents"] == 4
    data.verify(out)


def test_ensure_corpus_is_idempotent_and_repairs(tmp_path):
    src, _ = _make_corpus(tmp_path, "web", 90, 4)
    out = str(tmp_path / "out")
    paths = data.ensure_corpus(out, src, workers=1, progress=False)
    assert sorted(paths) == ["heldout/web", "train"]
    f = paths["train"][0]
    stamp = os.stat(f).st_mtime_ns
    assert data.ensure_corpus(out, src, workers=1, progress=False) == paths
    assert os.stat(f).st_mtime_ns == stamp  # reused, not rebuilt
    good = open(f, "rb").read()
    # A truncated file is a clear error when opened through the manifest, and ensure_corpus repairs it.
    with open(f, "r+b") as fh:
        fh.truncate(len(good) - 64)
    with pytest.raises(ValueError, match="truncated"):
        data.open_split(out, "train", 8)
    with pytest.raises(ValueError, match="truncated"):
        data.verify(out)
    data.ensure_corpus(out, src, workers=1, progress=False)
    assert open(f, "rb").read() == good
    # One token changed in place (same size), or one appended: named by verify, repaired.
    for edit, says in (("r+b", "sha256 differs"), ("ab", f"has {len(good) + 4} bytes")):
        with open(f, edit) as fh:
            if edit == "r+b":
                fh.seek(len(good) - 8)
            fh.write(np.uint32(7).tobytes())
        with pytest.raises(ValueError, match=says):
            data.verify(out)
        data.ensure_corpus(out, src, workers=1, progress=False)
        assert open(f, "rb").read() == good
    # An unreadable manifest: a clear error naming it, and ensure_corpus rebuilds.
    with open(os.path.join(out, "manifest.json"), "w") as fh:
        fh.write('{"format": "olmo-core-fsl-uint32/v1", "splits": {"train": {"files": [{"pa')
    with pytest.raises(ValueError, match="manifest.json: unreadable manifest"):
        data.load_manifest(out)
    data.ensure_corpus(out, src, workers=1, progress=False)
    assert data.verify(out)["source"] == src
    manifest = open(os.path.join(out, "manifest.json")).read()
    with open(os.path.join(out, "manifest.json"), "w") as fh:   # another format version
        fh.write(manifest.replace(prep.FORMAT, "olmo-core-fsl-uint32/v0"))
    with pytest.raises(ValueError, match="manifest.json: unreadable manifest.*expected"):
        data.load_manifest(out)
    with open(os.path.join(out, "manifest.json"), "w") as fh:
        fh.write(manifest)
    # Other settings make the build stale: the held-out fraction (oracle: the split rule) and the file bound.
    names = [n for n, _ in _make_corpus(tmp_path / "again", "web", 90, 4)[1]]
    data.ensure_corpus(out, src, workers=1, progress=False, heldout_fraction=0.5)
    assert data.load_manifest(out)["splits"]["heldout/web"]["documents"] == sum(_heldout(n, 0.5) for n in names)
    data.ensure_corpus(out, src, workers=1, progress=False, heldout_fraction=0.5, max_tokens_per_file=200)
    assert all(f["tokens"] <= 200 for f in data.verify(out)["splits"]["train"]["files"])
    # A build killed before its manifest, its temporary file left behind: rebuilt over, not refused.
    os.remove(os.path.join(out, "manifest.json"))
    open(os.path.join(out, ".train-00000.npy.1.0.tmp"), "wb").close()
    data.ensure_corpus(out, src, workers=1, progress=False)
    assert data.verify(out)["max_tokens_per_file"] == prep.DEFAULT_MAX_TOKENS_PER_FILE
    # New inputs make the build stale.
    with open(os.path.join(src, "zzz.txt"), "w") as fh:
        fh.write("a new document")
    data.ensure_corpus(out, src, workers=1, progress=False)
    assert data.load_manifest(out)["splits"]["train"]["documents"] + data.load_manifest(out)["splits"]["heldout/web"]["documents"] == 91
    # So does a document edited in place (same names, same number of files): the new text is trained on.
    with open(os.path.join(src, "zzz.txt"), "w") as fh:
        fh.write("an edited document")
    data.ensure_corpus(out, src, workers=1, progress=False)
    tokens = _split_tokens(out, data.load_manifest(out), "train").tolist()
    documents = set(map(tuple, np.split(tokens, np.flatnonzero(np.asarray(tokens) == data.EOS_ID)[:-1] + 1)))
    enc = data.dolma2()
    assert tuple(enc.encode_ordinary("an edited document") + [data.EOS_ID]) in documents
    assert tuple(enc.encode_ordinary("a new document") + [data.EOS_ID]) not in documents
    # And a build made under other tokenization rules (its manifest's "tokenizer" record), which
    # verify alone accepts (the vocabulary is the same).
    path = os.path.join(out, "manifest.json")
    old = json.load(open(path))
    old["tokenizer"] = {**old["tokenizer"], "documents": "text as is, eos after each"}
    with open(path, "w") as fh:
        json.dump(old, fh)
    data.verify(out)
    data.ensure_corpus(out, src, workers=1, progress=False)
    assert data.load_manifest(out)["tokenizer"] == prep.TOKENIZER


def test_contents_digest_follows_the_token_files_bytes(tmp_path):
    """contents_digest: sha256 over the sha256s of the split's files as they are on disk; a document
    edited to another text of the same token count (same names and sizes) changes it."""
    d = tmp_path / "web"
    d.mkdir()
    texts = ["x = 1", "y = 2", "z = 3"]
    for i, t in enumerate(texts):
        (d / f"d{i}.txt").write_text(t)
    out = str(tmp_path / "out")
    data.ensure_corpus(out, str(d), workers=1, progress=False, heldout_fraction=0.0, max_tokens_per_file=8)
    files = data.load_manifest(out)["splits"]["train"]["files"]
    on_disk = [hashlib.sha256(open(os.path.join(out, f["path"]), "rb").read()).hexdigest() for f in files]
    before = prep.contents_digest(out, "train")
    assert before == hashlib.sha256("\n".join(on_disk).encode()).hexdigest()
    enc = data.dolma2()
    assert len(enc.encode_ordinary("y = 4")) == len(enc.encode_ordinary("y = 2"))
    (d / "d1.txt").write_text("y = 4")
    data.ensure_corpus(out, str(d), workers=1, progress=False, heldout_fraction=0.0, max_tokens_per_file=8)
    assert [(f["path"], f["tokens"]) for f in data.load_manifest(out)["splits"]["train"]["files"]] == \
        [(f["path"], f["tokens"]) for f in files]
    assert prep.contents_digest(out, "train") != before


def test_a_corpus_moved_or_renamed_splits_the_same_and_its_default_folder_is_its_own(tmp_path, caplog, monkeypatch):
    """The split hashes the path inside the corpus folder: a copy under another name holds out the
    same documents (a document trained on from one copy is never held out from the other). The
    default folder a run prepares into names the corpus by its path: /a/web and /b/web differ,
    /a/web/ is /a/web."""
    import shutil
    src, docs = _make_corpus(tmp_path / "a", "web", 90, 8)
    shutil.copytree(src, tmp_path / "b" / "renamed")
    m1 = prep.prepare(src, str(tmp_path / "o1"), workers=1, progress=False)
    m2 = prep.prepare(str(tmp_path / "b" / "renamed"), str(tmp_path / "o2"), workers=1, progress=False)
    def contents(split):
        return [(f["sha256"], f["documents"]) for f in split["files"]]
    assert contents(m1["splits"]["heldout/web"]) == contents(m2["splits"]["heldout/renamed"])
    assert contents(m1["splits"]["train"]) == contents(m2["splits"]["train"])
    shutil.copytree(src, tmp_path / "b" / "web")
    names = {prep.default_dir_name(x) for x in (src, src + "/", os.path.join(src, "sub", ".."))}
    assert len(names) == 1 and names != {prep.default_dir_name(str(tmp_path / "b" / "web"))}
    assert names.pop().startswith("web-")
    monkeypatch.chdir(tmp_path / "b")   # a relative path is the corpus where it lies
    assert prep.default_dir_name("web") == prep.default_dir_name(str(tmp_path / "b" / "web"))
    monkeypatch.chdir(tmp_path / "a")
    assert prep.default_dir_name("web") == prep.default_dir_name(src) != prep.default_dir_name(str(tmp_path / "b" / "web"))
    assert prep.default_dir_name("stdlib") == "stdlib"   # where the embedded default always went
    mix = f"stdlib-docs:0.5,{src}:0.5"
    assert prep.default_dir_name(mix) != prep.default_dir_name(f"stdlib-docs:0.5,{src}:0.25")
    # The same corpus spelled with a trailing slash is the same build: not rebuilt.
    out = str(tmp_path / "o1")
    stamp = os.stat(os.path.join(out, m1["splits"]["train"]["files"][0]["path"])).st_mtime_ns
    data.ensure_corpus(out, src + "/", workers=1, progress=False)
    assert os.stat(os.path.join(out, m1["splits"]["train"]["files"][0]["path"])).st_mtime_ns == stamp
    # A build from before the path-only split is reused (a resumed run keeps its data), and said.
    old = {k: v for k, v in m1.items() if k != "split"}
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(old, f)
    with caplog.at_level("WARNING"):
        data.ensure_corpus(out, src, workers=1, progress=False)
    assert os.stat(os.path.join(out, m1["splits"]["train"]["files"][0]["path"])).st_mtime_ns == stamp
    assert "a build of the same files made now holds out other documents" in caplog.text


def test_lone_surrogates_symlinked_folders_and_nothing_to_train_on(tmp_path):
    """JSON's lone surrogate escapes become U+FFFD (they used to crash the tokenizer without naming
    the file); a symlinked folder is read, each real folder once (a link up the tree is no loop); a corpus whose documents
    are all blank or held out is one error naming it, not a KeyError."""
    d = tmp_path / "web"
    os.makedirs(d / "real")
    (d / "a.jsonl").write_text('{"text": "half \\ud800 a pair \\ud83d\\ude00"}\n', encoding="utf-8")
    (d / "real" / "b.txt").write_text("in a linked folder", encoding="utf-8")
    os.symlink(d / "real", d / "linked")
    os.symlink(d, d / "real" / "up")   # a loop
    out = str(tmp_path / "out")
    m = prep.prepare(str(d), out, workers=1, progress=False, heldout_fraction=0.0)
    tokens = _split_tokens(out, m, "train")
    enc = data.dolma2()
    want = [enc.encode_ordinary(t) + [data.EOS_ID] for t in
            ("half \ufffd a pair \U0001f600", "in a linked folder")]
    np.testing.assert_array_equal(tokens, np.array(sum(want, []), dtype=np.uint32))
    assert m["splits"]["train"]["documents"] == 2   # a.jsonl, linked/b.txt; real/ is the same folder, up/ a loop
    blank = tmp_path / "blank"
    os.makedirs(blank)
    (blank / "a.txt").write_text(" \n\t ")
    with pytest.raises(ValueError, match=f"corpus '{blank}' gives no training document: every document is blank"):
        prep.prepare(str(blank), str(tmp_path / "o2"), workers=1, progress=False)
    with pytest.raises(ValueError, match="every document is held out"):
        prep.prepare(f"stdlib-docs:1,{d}:1", str(tmp_path / "o3"), workers=1, progress=False, heldout_fraction=0.999999)


def test_bad_corpus_leaves_nothing_half_written(tmp_path, monkeypatch):
    src, _ = _make_corpus(tmp_path, "web", 60, 5)
    good, _ = _make_corpus(tmp_path, "good", 60, 5)
    out = str(tmp_path / "out")
    prep.prepare(src, out, workers=1, max_tokens_per_file=100, progress=False)   # an earlier build, rebuilt over
    with open(os.path.join(src, "sub", "d.jsonl"), "w") as f:
        f.write(json.dumps({"text": "fine"}) + "\n" + '{"txt": "no text field"}\n')
    monkeypatch.setattr(prep, "_CHUNK_CHARS", 500)   # files written and renamed before the bad line is read
    with pytest.raises(ValueError, match=r"d\.jsonl:2.*'text'"):
        prep.prepare(src, out, workers=1, max_tokens_per_file=100, progress=False)
    left = _all_files(out)
    assert not [p for p in left if ".tmp" in p] and "manifest.json" not in map(os.path.basename, left)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prep.prepare(str(tmp_path / "nope"), out, workers=1, progress=False)
    with pytest.raises(ValueError, match=r"heldout_fraction must be in \[0, 1\), got 1.0"):
        prep.prepare(src, str(tmp_path / "new"), workers=1, progress=False, heldout_fraction=1.0)
    os.makedirs(tmp_path / "emptydir")
    with pytest.raises(ValueError, match="no .txt"):
        prep.prepare(str(tmp_path / "emptydir"), out, workers=1, progress=False)
    with pytest.raises(ValueError, match="no .txt"):   # into a new directory: it is not left behind
        prep.prepare(str(tmp_path / "emptydir"), str(tmp_path / "new"), workers=1, progress=False)
    assert not os.path.exists(tmp_path / "new")
    # A mixture whose second source is bad: the first source's finished files went too (they stayed).
    with pytest.raises(ValueError, match=r"d\.jsonl:2.*'text'"):
        prep.prepare(f"{good}:1,{src}:1", str(tmp_path / "new"), workers=1, max_tokens_per_file=100, progress=False)
    assert not os.path.exists(tmp_path / "new")
    os.makedirs(tmp_path / "given")   # a directory the user made stays, empty
    with pytest.raises(ValueError, match=r"d\.jsonl:2.*'text'"):
        prep.prepare(f"{good}:1,{src}:1", str(tmp_path / "given"), workers=1, max_tokens_per_file=100, progress=False)
    assert os.listdir(tmp_path / "given") == []
    # A mixture larger than the disk: refused before writing it (it wrote until the disk was full).
    import shutil
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 40, 1 << 40, 1 << 30))
    with pytest.raises(ValueError, match=r"mixture_tokens=1,000,000,000 needs 3\.7 GiB of uint32 tokens in .*new, "
                                         r"which has 1\.0 GiB free"):
        prep.prepare(f"{good}:1,{good}:1", str(tmp_path / "new"), workers=1, progress=False,
                     mixture_tokens=10**9)
    assert not os.path.exists(tmp_path / "new")
    # A rebuild first removes the earlier build's files: a disk it filled holds the rebuild. The
    # disk: exactly the first build's bytes, its free space what the files under mix/ leave.
    other, _ = _make_corpus(tmp_path, "other", 30, 6)
    mix = str(tmp_path / "mix")
    built = prep.prepare(f"{good}:1,{other}:1", mix, workers=1, progress=False, max_tokens_per_file=100)
    used = lambda: sum(os.path.getsize(p) for p in _all_files(mix))   # noqa: E731
    capacity = used()
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(capacity, used(), capacity - used()))
    assert prep.prepare(f"{good}:1,{other}:1", mix, workers=1, progress=False, max_tokens_per_file=100) == built
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 40, 1 << 40, 0))   # full
    with pytest.raises(ValueError, match=r"the mixture's [\d,]+ train tokens \(the default: the most that repeats no source\) needs .* "
                                         r"which has 0\.0 GiB free; ask for fewer tokens \(--mixture_tokens\)"):
        prep.prepare(f"{good}:1,{other}:1", str(tmp_path / "mix2"), workers=1, progress=False)
    assert not os.path.exists(tmp_path / "mix2")


def test_replacing_another_sources_corpus_says_so(tmp_path, caplog):
    """Allowed (a prepared corpus is rebuilt in place), but it went without a word; the same
    source, spelled otherwise, rebuilds quietly."""
    a, _ = _make_corpus(tmp_path, "a", 12, 1)
    b, _ = _make_corpus(tmp_path, "b", 12, 2)
    out = str(tmp_path / "out")
    with caplog.at_level("WARNING"):
        prep.prepare(a, out, workers=1, progress=False)
        prep.prepare(a + "/", out, workers=1, progress=False)
        assert "replacing" not in caplog.text
        prep.prepare(b, out, workers=1, progress=False)
    assert f"{out} held the prepared corpus of {a + '/'!r}; replacing it with {b!r}" in caplog.text


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"   # a zombie has exited
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_die_with_a_sigkilled_prepare(tmp_path):
    """A prepare killed outright (a job's time limit, the OOM killer) takes its encoding workers
    with it; they used to wait on the task queue forever, each holding the tokenizer."""
    import signal
    import time
    p = subprocess.Popen([sys.executable, "-m", "data.prepare", "--source=stdlib-code", f"--out_dir={tmp_path / 'o'}",
                          "--workers=2"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers = []
    try:
        deadline = time.time() + 120
        while len(_children(p.pid)) < 2:
            assert time.time() < deadline and p.poll() is None, "no encoding workers started"
            time.sleep(0.1)
        workers = _children(p.pid)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        deadline = time.time() + 30
        while any(map(_alive, workers)):
            assert time.time() < deadline, f"workers {workers} outlived their prepare"
            time.sleep(0.1)
    finally:
        p.kill()
        for w in workers:   # a failure leaves nothing running
            if _alive(w):
                os.kill(w, signal.SIGKILL)


def test_cli_matches_library(tmp_path):
    src, _ = _make_corpus(tmp_path, "web", 60, 6)
    lib = prep.prepare(src, str(tmp_path / "lib"), workers=1, progress=False)
    out = str(tmp_path / "cli")
    r = subprocess.run([sys.executable, "-m", "data.prepare", f"--source={src}", f"--out_dir={out}", "--workers=2"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "tokens/s" in r.stdout
    assert data.load_manifest(out) == lib


@pytest.mark.parametrize("args,says", [
    (["--max_tokens_per_file=0"], "--max_tokens_per_file must be >= 1"),
    (["--heldout_fraction=nan"], "--heldout_fraction must be in [0, 1)"),
    (["--workers=0"], "--workers must be >= 1"),
    (["--workers=100000"], "at most 4 per CPU core of this machine"),   # was the OOM killer, without a word
    (["--source=SRC_FILE"], "is a file; pass a directory"),
    (["--out_dir=SRC_FILE"], "is a file; give a directory"),
    (["--out_dir=DANGLING"], "which does not exist; create that directory, or give another out_dir"),   # File exists
    (["--out_dir=MINE", "--source=stdlib-docs"], "holds ['notes.txt']; a prepared corpus is written into a new"),
    (["--out_dir=THEIRS", "--source=stdlib-docs"], "holds a manifest.json that is not a prepared corpus's"),
    (["--mixture_tokens=1000", "--source=stdlib-docs"], "sizes a mixture of sources ('a:w,b:w'); 'stdlib-docs' is "
                                                           "one source"),   # ignored: the whole source was written
    (["--verify", "--workers=1"], "--workers does not apply with --verify"),   # ignored
    (["SRC_FILE"], "Unknown arguments ["),   # the corpus as a positional argument was ignored: stdlib was prepared
])
def test_cli_bad_input_is_one_line_exit_2(tmp_path, args, says):
    """Bad values, and an --out_dir of someone's other files (their manifest.json was overwritten)."""
    (tmp_path / "f.txt").write_text("a file")
    for name, entry in (("mine", "notes.txt"), ("theirs", "manifest.json")):
        os.makedirs(tmp_path / name)
        (tmp_path / name / entry).write_text('{"mine": true}')
    before = {p: p.read_text() for p in tmp_path.glob("*/*")}
    args = [a.replace("SRC_FILE", str(tmp_path / "f.txt")).replace("MINE", str(tmp_path / "mine"))
            .replace("THEIRS", str(tmp_path / "theirs")).replace("DANGLING", str(tmp_path / "dangling")) for a in args]
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    if not any(a.startswith("--out_dir") for a in args):
        args.append(f"--out_dir={tmp_path / 'out'}")
    r = subprocess.run([sys.executable, "-m", "data.prepare", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert says in r.stderr.strip().splitlines()[-1] and not os.path.exists(tmp_path / "out")
    assert {p: p.read_text() for p in tmp_path.glob("*/*")} == before


def test_embedded_docs_corpus(tmp_path):
    """The small half of the embedded corpus (pydoc topics), with a look at its text."""
    out = str(tmp_path / "docs")
    paths = data.ensure_corpus(out, "stdlib-docs", workers=1, progress=False)
    assert sorted(paths) == ["heldout/docs", "train"]
    m = data.load_manifest(out)
    assert m["splits"]["heldout/docs"]["documents"] >= 10 and m["splits"]["train"]["tokens"] > 50_000
    ds = data.FSLDataset(paths["train"], 256)
    text = data.dolma2().decode(ds[0].tolist())
    assert len(text) > 200


def test_full_stdlib_corpus(tmp_path):
    """The real embedded corpus (~7.8M tokens; ~5 s on 2 cores, kept in the default run)."""
    out = str(tmp_path / "stdlib")
    paths = data.ensure_corpus(out)
    assert sorted(paths) == ["heldout/code", "heldout/docs", "train"]
    m = data.verify(out)
    total = sum(s["tokens"] for s in m["splits"].values())
    assert total > 5_000_000
    assert m["splits"]["heldout/code"]["documents"] > 100


def test_damaged_corpus_files_are_named(tmp_path, caplog):
    """A .jsonl.gz cut short or not gzip at all, a broken link, a pipe and a line nested past
    Python's recursion limit each stop with the file's name (they were tracebacks without it, or,
    for the pipe, a read that never returns); a .txt of other bytes than UTF-8 is read with one
    warning naming it."""
    from data import corpus
    whole = gzip.compress(b"".join(json.dumps({"text": f"doc {i} " * 40}).encode() + b"\n" for i in range(40)))
    cases = {"cut.jsonl.gz": lambda p: p.write_bytes(whole[:len(whole) // 2]),
             "plain.jsonl.gz": lambda p: p.write_text('{"text": "not compressed"}\n'),
             "gone.txt": lambda p: os.symlink(tmp_path / "nowhere.txt", p),
             "pipe.txt": lambda p: os.mkfifo(p),
             "deep.jsonl": lambda p: p.write_text('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")}
    expected = {"cut.jsonl.gz": "not a whole gzip file", "plain.jsonl.gz": "not a whole gzip file",
                "gone.txt": "is a symbolic link to", "pipe.txt": "is not a regular file",
                "deep.jsonl": r"deep\.jsonl:1: expected a JSON object"}
    for name, make in cases.items():
        d = tmp_path / name.replace(".", "_")
        os.makedirs(d)
        (d / "a.txt").write_text("a fine document")
        make(d / name)
        with pytest.raises((ValueError, FileNotFoundError), match=re.escape(str(d / name))) as e:
            list(corpus.directory_documents(str(d)))
        assert re.search(expected[name], str(e.value)), (name, e.value)
    latin = tmp_path / "latin"
    os.makedirs(latin)
    (latin / "a.txt").write_bytes("café".encode("latin-1"))
    with caplog.at_level("WARNING"):
        docs = list(corpus.directory_documents(str(latin)))
    assert docs[0].text == "caf\ufffd" and "1 .txt file(s) hold bytes that are not UTF-8, read as U+FFFD (e.g. a.txt)" in caplog.text


def test_stdlib_corpus_is_the_standard_librarys_own_files(tmp_path, monkeypatch):
    """The embedded code corpus: every .py file under the stdlib root, named by its path there, in
    sorted order; installed packages (site-packages, dist-packages: under the stdlib root on most
    installs) and __pycache__ are not part of it."""
    from data import corpus
    root = tmp_path / "lib"
    for rel in ("zz.py", "a.py", "json/__init__.py", "json/notes.txt", "site-packages/numpy/x.py",
                "dist-packages/y.py", "__pycache__/z.py", "email/__pycache__/w.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(f"# {rel}\n")
    monkeypatch.setattr(corpus, "stdlib_root", lambda: str(root))
    assert [(d.name, d.text, d.domain) for d in corpus.documents("stdlib-code")] == [
        (f"stdlib/{rel}", f"# {rel}\n", "code") for rel in ("a.py", "zz.py", "json/__init__.py")]
    docs = list(corpus.documents("stdlib-docs"))   # pydoc_data.topics, one document per topic
    assert len(docs) > 50 and all(d.domain == "docs" and d.name.startswith("pydoc_data.topics/") for d in docs)


def test_user_corpus_skips_blank_jsonl_lines_and_hidden_folders(tmp_path):
    """A blank line of a .jsonl file is no document, and the others keep their line numbers;
    hidden folders (.git, .cache) are not read."""
    from data import corpus
    d = tmp_path / "web"
    (d / ".git").mkdir(parents=True)
    (d / ".git" / "x.txt").write_text("not a document")
    (d / "a.jsonl").write_text('{"text": "one"}\n\n   \n{"text": "four"}\n')
    assert [(x.name, x.text, x.key) for x in corpus.directory_documents(str(d))] == [
        ("web/a.jsonl:1", "one", "a.jsonl:1"), ("web/a.jsonl:4", "four", "a.jsonl:4")]


def test_documents_in_forms_the_reader_does_not_take_are_named(tmp_path, caplog):
    """Dolma's *.json.gz shards, zstd or gzipped text beside .jsonl files were left out without a
    word (the corpus was its few readable files); other files (a README) are not documents."""
    from data import corpus
    d = tmp_path / "web"
    d.mkdir()
    (d / "a.jsonl").write_text('{"text": "one"}\n')
    for name in ("b.json.gz", "c.jsonl.zst", "d.txt.gz", "README.md", "LICENSE"):
        (d / name).write_bytes(b"x")
    with caplog.at_level("WARNING"):
        assert [x.name for x in corpus.directory_documents(str(d))] == ["web/a.jsonl:1"]
    assert [r.getMessage() for r in caplog.records] == [
        f"corpus {d}: 3 file(s) left out, only .txt, .jsonl and .jsonl.gz are read (e.g. b.json.gz, c.jsonl.zst, "
        "d.txt.gz); decompress them, or rename gzipped JSON lines to .jsonl.gz"]


def test_mixture_specs(tmp_path):
    """parse_mixture: weights default to 1, must be finite and > 0; directories normalised (so two spellings
    are the same mixture) and required to exist."""
    from data import corpus
    web = str(tmp_path / "web")
    os.makedirs(web)
    assert corpus.parse_mixture(f"stdlib-docs:0.5, {web}/:2") == [("stdlib-docs", 0.5), (web, 2.0)]
    assert corpus.parse_mixture(web) == [(web, 1.0)]
    assert corpus.same_mixture(f"{web}/:1,stdlib", f"{tmp_path}/web/../web,stdlib:1.0")
    assert not corpus.same_mixture(f"{web}:1,stdlib", f"{web}:2,stdlib")
    # inf passed `> 0` and died in the shares' arithmetic: "cannot convert float NaN to integer"
    for bad, says in ((f"{web}:0", "must be finite and > 0"), (f"{web}:-1", "must be finite and > 0"),
                      (f"{web}:inf", "must be finite and > 0, got inf"), (f"{web}:nan", "must be finite and > 0"),
                      (" , ", "names no source"),
                      (f"{tmp_path}/nope:1", "does not exist")):
        with pytest.raises((ValueError, FileNotFoundError), match=says):
            corpus.parse_mixture(bad)


def test_held_out_documents_of_two_sources_of_one_domain_are_all_kept(tmp_path):
    """Two sources of one domain (/x/web and /y/web) share heldout/web, which holds both sources'
    held-out documents. Oracle: each source prepared on its own."""
    a, _ = _make_corpus(tmp_path / "x", "web", 60, 11)
    b, _ = _make_corpus(tmp_path / "y", "web", 60, 12)
    alone = [prep.prepare(s, str(tmp_path / f"alone{i}"), workers=1, heldout_fraction=0.3, progress=False)
             for i, s in enumerate((a, b))]
    out = str(tmp_path / "mix")
    held = prep.prepare(f"{a}:1,{b}:1", out, workers=1, heldout_fraction=0.3, progress=False)["splits"]["heldout/web"]
    parts = [m["splits"]["heldout/web"] for m in alone]
    assert all(p["documents"] > 0 for p in parts) and held["documents"] == sum(p["documents"] for p in parts)
    np.testing.assert_array_equal(_split_tokens(out, {"splits": {"h": held}}, "h"), np.concatenate(
        [_split_tokens(str(tmp_path / f"alone{i}"), m, "heldout/web") for i, m in enumerate(alone)]))


def test_ensure_corpus_keeps_another_sources_build_and_a_builds_own_settings(tmp_path):
    """train.py --data_dir / eval.py --eval_data_dir holding the build of another source (a --data
    forgotten): it was replaced, warning only, so hours of tokenization were lost and the run
    trained on the default corpus. Now refused with the directory unchanged. A build made with its
    own settings (python -m data.prepare --heldout_fraction) is used as made by a caller that gives
    none (it was rebuilt with the defaults), and rebuilt with them when its inputs change."""
    web, _ = _make_corpus(tmp_path, "web", 60, 1)
    other, _ = _make_corpus(tmp_path, "other", 30, 2)
    out = str(tmp_path / "out")
    prep.prepare(web, out, workers=1, progress=False, heldout_fraction=0.5)
    before = {p: open(p, "rb").read() for p in glob.glob(os.path.join(out, "**", "*"), recursive=True)
              if os.path.isfile(p)}
    with pytest.raises(ValueError, match=rf"{out} holds the prepared corpus of {web!r}, not of {other!r}; "
                                         r"nothing was changed"):
        data.ensure_corpus(out, other, workers=1, progress=False)
    assert data.ensure_corpus(out, web, workers=1, progress=False)   # reused as it was made
    after = {p: open(p, "rb").read() for p in glob.glob(os.path.join(out, "**", "*"), recursive=True)
             if os.path.isfile(p)}
    assert after == before
    with open(os.path.join(web, "a000.txt"), "a", encoding="utf-8") as f:
        f.write(" an edit")
    data.ensure_corpus(out, web, workers=1, progress=False)
    assert data.verify(out)["heldout_fraction"] == {"default": 0.5}
    assert data.ensure_corpus(out, web, workers=1, progress=False, heldout_fraction=0.1)   # a setting given: rebuilt
    assert data.verify(out)["heldout_fraction"] == {"default": 0.1}


def test_a_rebuild_clears_the_packings_and_a_killed_builds_temporaries(tmp_path):
    """train.py --packed caches packings in <--data_dir>/packing: that folder made every later
    rebuild of the directory refuse it as 'someone else's files', and a packing of the replaced
    token files stayed. A SIGKILLed build's hidden temporaries (up to a token file each) stayed
    after every later build."""
    web, _ = _make_corpus(tmp_path, "web", 30, 1)
    out = tmp_path / "out"
    prep.prepare(web, str(out), workers=1, progress=False)
    (out / prep.PACKING).mkdir()
    (out / prep.PACKING / "packed-0.npz").write_bytes(b"old")
    leftover = out / "train" / ".train-00000.npy.123.abcd1234.tmp"
    leftover.write_bytes(b"\0" * 64)
    prep.prepare(web, str(out), workers=1, progress=False)
    assert not (out / prep.PACKING).exists() and not leftover.exists()
    assert data.verify(str(out))["source"] == web


def test_a_rebuild_leaves_none_of_the_old_builds_files(tmp_path):
    """A rebuild from a smaller source left the old build's later token files beside the new
    ones: unlisted, but read by a glob of train/*.npy (OLMo-core's way) and never freed."""
    web, _ = _make_corpus(tmp_path, "web", 30, 1)
    out = tmp_path / "out"
    prep.prepare(web, str(out), workers=1, progress=False, max_tokens_per_file=300)
    assert len(glob.glob(str(out / "train" / "*.npy"))) > 2
    small = tmp_path / "small"
    small.mkdir()
    for i in range(3):
        (small / f"a{i}.txt").write_text(f"short document {i}")
    manifest = prep.prepare(str(small), str(out), workers=1, progress=False, max_tokens_per_file=300,
                            heldout_fraction=0.0)
    listed = sorted(str(out / f["path"]) for split in manifest["splits"].values() for f in split["files"])
    assert sorted(glob.glob(str(out / "**" / "*.npy"), recursive=True)) == listed


@pytest.mark.parametrize("damage", ["no_tokenizer", "tokenizer_null", "inputs_string", "no_mixture_tokens"])
def test_a_manifest_without_what_verify_compares_is_unreadable(tmp_path, damage):
    """A manifest lacking a key verify or ensure_corpus reads (an older layout, a hand edit) was a
    KeyError / AttributeError traceback, exit 1 (retried); now the unreadable-manifest line, exit 2,
    and ensure_corpus (train.py, eval.py) rebuilds it."""
    out = tmp_path / "docs"
    prep.prepare("stdlib-docs", str(out), workers=1, progress=False)
    manifest = json.loads((out / prep.MANIFEST).read_text())
    key = {"no_tokenizer": "tokenizer", "tokenizer_null": "tokenizer", "inputs_string": "inputs",
           "no_mixture_tokens": "mixture_tokens"}[damage]
    if damage in ("no_tokenizer", "no_mixture_tokens"):
        del manifest[key]
    else:
        manifest[key] = None if damage == "tokenizer_null" else "x"
    (out / prep.MANIFEST).write_text(json.dumps(manifest))
    r = subprocess.run([sys.executable, "-m", "data.prepare", "--verify", f"--out_dir={out}"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"{out / prep.MANIFEST}: unreadable manifest (" in r.stderr.strip().splitlines()[-1]
    assert key in r.stderr.strip().splitlines()[-1]
    data.ensure_corpus(str(out), "stdlib-docs", workers=1, progress=False)
    assert data.verify(str(out))["tokenizer"] == prep.TOKENIZER
