"""Mix resolution (data/mixes.py) and the list writer (python -m data.write_mixes).

Expected URLs are written out literally from OLMo-core's documented layout (DataMix.build:
`{root}/{path with {TOKENIZER} replaced}`), not produced by the code under test.
"""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import data
from data import mixes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIX_DIR = "src/olmo_core/data/mixes"   # where OLMo-core keeps its lists

TOY = """# a comment, then a blank line

web,preprocessed/toy/{TOKENIZER}/web/000000.npy
web,preprocessed/toy/{TOKENIZER}/web/000001.npy
code,preprocessed/toy/{TOKENIZER}/code/000000.npy
"""


def _mix_dir(tmp_path, files):
    d = tmp_path / "mixes"
    d.mkdir(exist_ok=True)
    for name, text in files.items():
        (d / f"{name}.txt").write_text(text)
    return str(d)


def test_tokenizer_expansion_and_root(tmp_path):
    d = _mix_dir(tmp_path, {"toy": TOY, "OLMo-mix-0625-official": TOY, "v3-small-ppl-validation": TOY})
    want = [("web", "https://mirror.example/data/preprocessed/toy/allenai/dolma2-tokenizer/web/000000.npy"),
            ("web", "https://mirror.example/data/preprocessed/toy/allenai/dolma2-tokenizer/web/000001.npy"),
            ("code", "https://mirror.example/data/preprocessed/toy/allenai/dolma2-tokenizer/code/000000.npy")]
    for root in ("https://mirror.example/data", "https://mirror.example/data/"):
        assert mixes.resolve_mix("toy", root, mixes_dir=d) == want
    # The OLMo 3 mixes were written under allenai/dolma3-tokenizer, the v3-small sets under
    # dolma2-tokenizer (OLMo-core DataMix.build).
    assert mixes.resolve_mix("OLMo-mix-0625-official", "gs://ai2-llm", mixes_dir=d)[2] == \
        ("code", "gs://ai2-llm/preprocessed/toy/allenai/dolma3-tokenizer/code/000000.npy")
    assert mixes.mix_paths("v3-small-ppl-validation", mixes_dir=d)[0] == \
        "https://olmo-data.org/preprocessed/toy/dolma2-tokenizer/web/000000.npy"
    # first-seen order, not sorted: a validation mix's domains are reported in the list's order
    assert list(mixes.by_label(want).items()) == [("web", [want[0][1], want[1][1]]), ("code", [want[2][1]])]


def test_a_list_with_windows_line_ends_or_trailing_spaces_reads_the_same(tmp_path):
    """OLMo-core's DataMix.build strips each line: a list saved with CRLF line ends would otherwise
    give URLs ending in '.npy\\r', never found."""
    d = _mix_dir(tmp_path, {"toy": TOY})
    (tmp_path / "mixes" / "crlf.txt").write_bytes(TOY.replace("\n", "  \r\n").encode())
    assert mixes.read_mix("crlf", mixes_dir=d) == mixes.read_mix("toy", mixes_dir=d)
    assert len(mixes.read_mix("toy", mixes_dir=d)) == 3


def test_the_stage_mixes_are_the_stage_flagfiles_data():
    """STAGE_MIXES (what python -m data.write_mixes writes by default) names the mix each stage's
    flagfile trains on (OLMo-core's official OLMo 3 7B scripts)."""
    for stage, name in mixes.STAGE_MIXES.items():
        with open(os.path.join(REPO, f"stage{stage}.flags")) as f:
            assert f"--data=mix:{name}" in f.read().splitlines(), stage
    assert mixes.STAGE_MIXES == {1: "OLMo-mix-0625-official", 2: "OLMo-midtraining-mix-0625-100B",
                                 3: "OLMo-longmino-mix-0625"}


def test_unknown_mix_lists_the_available_ones(tmp_path):
    d = _mix_dir(tmp_path, {"toy": TOY, "other-mix": TOY})
    with pytest.raises(ValueError, match=r"unknown data mix 'nope'.*other-mix.*toy.*write_mixes"):
        mixes.resolve_mix("nope", mixes_dir=d)
    with pytest.raises(ValueError, match="bare name"):
        mixes.resolve_mix("../toy", mixes_dir=d)


def test_unknown_tokenizer_and_bad_lines(tmp_path):
    d = _mix_dir(tmp_path, {"toy": TOY, "bad": "web,preprocessed/no-placeholder/0.npy\n", "empty": "# nothing\n"})
    with pytest.raises(ValueError, match=r"unknown tokenizer 'gpt2' for data mix 'toy'.*dolma2"):
        mixes.resolve_mix("toy", tokenizer="gpt2", mixes_dir=d)
    with pytest.raises(ValueError, match=re.escape(os.path.join(d, "bad.txt")) + ":1"):
        mixes.resolve_mix("bad", mixes_dir=d)
    with pytest.raises(ValueError, match="lists no files"):
        mixes.resolve_mix("empty", mixes_dir=d)
    d = _mix_dir(tmp_path, {"nolabel": ",preprocessed/toy/{TOKENIZER}/0.npy\n",
                            "extra": "web,preprocessed/toy/{TOKENIZER}/0.npy,x\n"})
    for name in ("nolabel", "extra"):
        with pytest.raises(ValueError, match=re.escape(os.path.join(d, f"{name}.txt")) + ":1"):
            mixes.resolve_mix(name, mixes_dir=d)
    with pytest.raises(ValueError, match="empty data root"):
        mixes.resolve_mix("toy", "", mixes_dir=d)


def test_lists_searched_argument_then_environment_then_package_then_olmo_core(tmp_path, monkeypatch):
    """The module docstring's order, first match wins: mixes_dir=, $OLMO3_MIXES_DIR, data/mixes/,
    then the installed ai2-olmo-core's lists. Each directory holds a list of the same names whose
    label says where it lies."""
    names = ("toy", "v3-small-ppl-validation")   # the second is also one of OLMo-core's own lists
    where = {}
    for k in ("arg", "env", "pkg"):
        os.makedirs(tmp_path / k)
        where[k] = _mix_dir(tmp_path / k, {n: f"{k},preprocessed/{{TOKENIZER}}/0.npy\n" for n in names})
    monkeypatch.setattr(mixes, "PACKAGE_DIR", where["pkg"])
    monkeypatch.setenv("OLMO3_MIXES_DIR", where["env"])
    label = lambda name, **kw: mixes.resolve_mix(name, "/r", **kw)[0][0]   # noqa: E731
    for name in names:
        assert label(name, mixes_dir=where["arg"]) == "arg"
        assert label(name) == "env"
    monkeypatch.delenv("OLMO3_MIXES_DIR")
    for name in names:
        assert label(name) == "pkg"
    assert mixes.search_dirs(where["arg"])[:2] == [where["arg"], where["pkg"]]
    # A mistyped directory was skipped, and a list of the same name elsewhere (OLMo-core's) read instead.
    monkeypatch.setenv("OLMO3_MIXES_DIR", where["env"] + "-typo")
    with pytest.raises(FileNotFoundError, match=f"^OLMO3_MIXES_DIR='{where['env']}-typo' is not a directory"):
        label(names[0])


def test_mix_to_dataset_on_a_local_root(tmp_path):
    """A resolved mix is what FSLDataset takes; a local mirror and a file:// root read the same."""
    d = _mix_dir(tmp_path, {"toy": TOY})
    root = tmp_path / "root"
    rng = np.random.default_rng(0)
    want = []
    for _, url in mixes.resolve_mix("toy", str(root), mixes_dir=d):
        os.makedirs(os.path.dirname(url), exist_ok=True)
        t = rng.integers(0, data.VOCAB_SIZE, size=3 * 32 + 5, dtype=np.uint32)
        t.tofile(url)
        want += [t[j * 32:(j + 1) * 32] for j in range(3)]
    ds = data.FSLDataset(mixes.mix_paths("toy", str(root), mixes_dir=d), 32)
    ds2 = data.FSLDataset(mixes.mix_paths("toy", f"file://{root}", mixes_dir=d), 32)
    assert len(ds) == len(ds2) == 9 and ds.fingerprint == ds2.fingerprint
    for i, w in enumerate(want):
        np.testing.assert_array_equal(ds[i], w)
        np.testing.assert_array_equal(ds2[i], w)


def test_lists_found_in_an_installed_olmo_core(tmp_path, monkeypatch):
    """With `pip install ai2-olmo-core`, its packaged lists resolve without python -m data.write_mixes."""
    pkg = tmp_path / "site" / "olmo_core"
    (pkg / "data" / "mixes").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (pkg / "data" / "mixes" / "toy-installed.txt").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in [m for m in sys.modules if m == "olmo_core" or m.startswith("olmo_core.")]:
        monkeypatch.delitem(sys.modules, name)  # another test imported the real one: find_spec would see it
    monkeypatch.delenv("OLMO3_MIXES_DIR", raising=False)
    assert "toy-installed" in mixes.available_mixes()
    assert mixes.mix_paths("toy-installed", "/r")[0] == "/r/preprocessed/toy/allenai/dolma2-tokenizer/web/000000.npy"


def _write_mixes(*args):
    return subprocess.run([sys.executable, "-m", "data.write_mixes", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_write_mixes_from_a_checkout(tmp_path):
    src = tmp_path / "OLMo-core" / "src" / "olmo_core" / "data" / "mixes"
    src.mkdir(parents=True)
    (src / "toy.txt").write_text(TOY)
    (src / "broken.txt").write_text("web,preprocessed/x/0.npy\n")
    out = tmp_path / "out"
    r = _write_mixes(f"--olmo_core={tmp_path / 'OLMo-core'}", "--mixes=toy", f"--out_dir={out}")
    assert r.returncode == 0, r.stderr
    lines = (out / "toy.txt").read_text().splitlines()
    assert lines[0].startswith("# toy: copied by data/write_mixes.py from allenai/OLMo-core")
    assert lines[1:] == [ln for ln in TOY.splitlines() if ln and not ln.startswith("#")]
    assert [u for _, u in mixes.resolve_mix("toy", "/r", mixes_dir=str(out))][-1] == \
        "/r/preprocessed/toy/allenai/dolma2-tokenizer/code/000000.npy"
    r = _write_mixes(f"--olmo_core={tmp_path / 'OLMo-core'}", "--mixes=broken", f"--out_dir={out}")
    assert r.returncode == 2 and "broken.txt line 1" in r.stderr and "Traceback" not in r.stderr
    assert not (out / "broken.txt").exists()
    r = _write_mixes(f"--olmo_core={tmp_path}", "--mixes=toy", f"--out_dir={out}")
    assert r.returncode == 2 and "OLMo-core checkout" in r.stderr.strip().splitlines()[-1]
    assert "Traceback" not in r.stderr


def _git(*args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True, capture_output=True)


def test_write_mixes_reads_a_bare_git_directory_at_a_revision_and_refuses_bad_lists(tmp_path):
    """--olmo_core as a bare git directory or a checkout: the list as it was at --rev (`git show`;
    a checkout's working tree was read whatever --rev said), its commit in the header; a list of comments only or a line with a third field is refused, not written. (In
    one interpreter: write_mixes' flags would clash with other scripts' in the test process.)"""
    work = tmp_path / "work"
    src = work / "src" / "olmo_core" / "data" / "mixes"
    src.mkdir(parents=True)
    _git("init", "-q", str(work))
    (src / "toy.txt").write_text(TOY)
    (src / "comments.txt").write_text("# nothing\n\n# here\n")
    (src / "extra.txt").write_text("web,preprocessed/toy/{TOKENIZER}/web/000000.npy,1.0\n")
    _git("-C", str(work), "add", "-A")
    _git("-C", str(work), "commit", "-qm", "one")
    (src / "toy.txt").write_text("new,preprocessed/toy/{TOKENIZER}/new/000000.npy\n")
    _git("-C", str(work), "commit", "-qam", "two")
    bare = tmp_path / "OLMo-core.git"
    _git("clone", "-q", "--bare", str(work), str(bare))
    (src / "toy.txt").write_text("edited,preprocessed/toy/{TOKENIZER}/e/000000.npy\n")   # uncommitted
    first = subprocess.run(["git", f"--git-dir={bare}", "rev-parse", "HEAD~1"], capture_output=True,
                           text=True, check=True).stdout.strip()
    script = f"""
import json
from data import write_mixes as w
out = {{}}
for root, name, rev in (({str(bare)!r}, "toy", "HEAD~1"), ({str(bare)!r}, "toy", "HEAD"),
                        ({str(bare)!r}, "comments", "HEAD"), ({str(bare)!r}, "extra", "HEAD"),
                        ({str(bare)!r}, "toy", "v9-no-such-tag"), ({str(work)!r}, "toy", "HEAD~1"),
                        ({str(work)!r}, "toy", "HEAD")):
    key = ("work:" if root == {str(work)!r} else "") + name + "@" + rev
    try:
        text, source = w.read_source(root, name, rev)
        out[key] = w.normalize(name, text, source)
    except ValueError as e:
        out[key] = "ValueError: " + str(e)
for line in ("a,p/{{TOKENIZER}}/f.npy", "\\t a,p/{{TOKENIZER}}/f.npy  ", "a,p/{{TOKENIZER}}/f.json", "a,p/dolma2/f.npy", "a p/{{TOKENIZER}}/f.npy"):
    try:
        out["line " + line] = w.normalize("x", line + "\\n", "src").splitlines()[1]
    except ValueError as e:
        out["line " + line] = "ValueError: " + str(e)
print(json.dumps(out))
"""
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    old = got["toy@HEAD~1"].splitlines()
    assert old[0] == f"# toy: copied by data/write_mixes.py from allenai/OLMo-core @ {first}: {MIX_DIR}/toy.txt"
    assert old[1:] == [ln for ln in TOY.splitlines() if ln and not ln.startswith("#")]
    assert got["toy@HEAD"].splitlines()[1:] == ["new,preprocessed/toy/{TOKENIZER}/new/000000.npy"]
    assert got["comments@HEAD"].startswith("ValueError: ") and "lists no files" in got["comments@HEAD"]
    assert got["extra@HEAD"].startswith("ValueError: ") and "extra.txt line 1" in got["extra@HEAD"]
    # a revision git does not know was written into the header as given
    assert got["toy@v9-no-such-tag"] == f"ValueError: --rev='v9-no-such-tag' is no commit of {bare}; give a " \
                                        "commit, tag or branch it has (git fetch it first)"
    # a checkout with a working tree: the list at --rev, not the working tree's (edited, uncommitted)
    assert got["work:toy@HEAD~1"] == got["toy@HEAD~1"]
    assert got["work:toy@HEAD"] == got["toy@HEAD"]
    assert "differs from its copy at --rev=HEAD" in r.stderr
    # a line is 'label,path' with the {TOKENIZER} directory and a .npy file, as DataMix.build reads it
    assert got["line a,p/{TOKENIZER}/f.npy"] == "a,p/{TOKENIZER}/f.npy"
    assert got["line \t a,p/{TOKENIZER}/f.npy  "] == "a,p/{TOKENIZER}/f.npy"   # stripped, as DataMix.build reads it
    for bad in ("a,p/{TOKENIZER}/f.json", "a,p/dolma2/f.npy", "a p/{TOKENIZER}/f.npy"):
        assert got["line " + bad].startswith("ValueError: src line 1: expected 'label,path/{TOKENIZER}/...npy'"), bad


def test_every_installed_olmo_core_mix_resolves_as_olmo_core_builds_it():
    """Each DataMix of the installed ai2-olmo-core (its own lists) against DataMix.build: the
    same URLs and labels in the same order, tokenizer directory included."""
    olmo_core_mixes = pytest.importorskip("olmo_core.data.mixes")
    from olmo_core.data.tokenizer import TokenizerName
    root = "https://olmo-data.org"
    for mix in olmo_core_mixes.DataMix:
        paths, labels = mix.build(root, TokenizerName.dolma2)
        assert mixes.resolve_mix(mix.value, root, "dolma2") == list(zip(labels, paths)), mix.value


# Sizes stated by OLMo-core's OLMo 3 README and the official scripts' mixes (see data/mixes.py).
REAL = {"OLMo-mix-0625-official": 1016, "OLMo-midtraining-mix-0625-100B": None, "OLMo-longmino-mix-0625": None,
        "v3-small-ppl-validation": 11}


@pytest.mark.parametrize("name", sorted(REAL))
def test_written_recipe_mixes(name):
    """Checks the generated lists when python -m data.write_mixes has been run (they are not committed)."""
    if name not in mixes.available_mixes():
        pytest.skip(f"{name} not written here; run python -m data.write_mixes --olmo_core=...")
    pairs = mixes.resolve_mix(name)
    urls = [u for _, u in pairs]
    if REAL[name] is not None:
        assert len(pairs) == REAL[name]
    assert len(set(urls)) == len(urls) and all(u.endswith(".npy") for u in urls)
    assert all(u.startswith("https://olmo-data.org/") and "{" not in u for u in urls)
    if name == "v3-small-ppl-validation":
        assert "c4_en-validation" in mixes.by_label(pairs)
