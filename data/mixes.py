"""The OLMo 3 data mixes by name: `resolve_mix(name, root, tokenizer)` -> [(label, url), ...].

OLMo-core publishes each mix as a text file (`src/olmo_core/data/mixes/<name>.txt`), one token
file per line: `label,relative/path/{TOKENIZER}/....npy`, `#` comments allowed. A mix is resolved
by replacing `{TOKENIZER}` with the directory name the token files were written under and
prefixing the data root, exactly as OLMo-core's `DataMix.build` does.

Where the lists come from, in order: `mixes_dir=` / `$OLMO3_MIXES_DIR`; `data/mixes/` (written by
`python -m data.write_mixes` from an OLMo-core checkout); the `olmo_core/data/mixes/` directory of an
installed `ai2-olmo-core` package (found without importing it).

The mixes of the recipe (OLMo-core `src/scripts/official/OLMo3/README.md` and the official 7B
scripts `OLMo-3-1025-7B-{pretrain-1,midtrain,long-context}.py`):
    stage 1  OLMo-mix-0625-official           (dolma3, ~5.9T tokens, 1,016 files)
    stage 2  OLMo-midtraining-mix-0625-100B   (dolma3-dolmino, 100B tokens)
    stage 3  OLMo-longmino-mix-0625           (dolma3-longmino)
    eval     v3-small-ppl-validation          (C4 and 10 other Paloma-style domains, one file each)
"""
import importlib.util
import os
from collections.abc import Sequence

# OLMo-core `src/olmo_core/script_utils.py` (--data-root default) and `src/scripts/official/OLMo3/
# README.md`: "pre-tokenized ... available from https://olmo-data.org/". Public and free, but slow;
# AI2 uses gs://ai2-llm or s3://ai2-llm, and a mirror is any root with the same relative paths.
DEFAULT_ROOT = "https://olmo-data.org"

STAGE_MIXES = {1: "OLMo-mix-0625-official", 2: "OLMo-midtraining-mix-0625-100B", 3: "OLMo-longmino-mix-0625"}
VALIDATION_MIX = "v3-small-ppl-validation"  # OLMo-3-1025-7B-pretrain-1.py's LMEvaluatorCallback set

# What {TOKENIZER} becomes, per tokenizer and mix (OLMo-core `data/mixes/__init__.py`,
# `DataMix.build`). The OLMo 3 mixes were tokenized as "allenai/dolma3-tokenizer", the same
# tokenizer as dolma2 under another name; the v3-small and code-fresh perplexity sets use the
# bare "dolma2-tokenizer"; any other mix uses dolma2's identifier "allenai/dolma2-tokenizer"
# (OLMo-core `data/tokenizer.py`, `TokenizerName.dolma2`).
TOKENIZER_DIRS = {
    "dolma2": {
        "OLMo-mix-0625-official": "allenai/dolma3-tokenizer",
        "OLMo-mix-0925-official": "allenai/dolma3-tokenizer",
        "OLMo-midtraining-mix-0625-100B": "allenai/dolma3-tokenizer",
        "OLMo-midtraining-mix-0925-ingredient1-100B": "allenai/dolma3-tokenizer",
        "OLMo-midtraining-mix-0925-ingredient2-100B": "allenai/dolma3-tokenizer",
        "OLMo-longmino-mix-0625": "allenai/dolma3-tokenizer",
        "OLMo-longmino-mix-0925": "allenai/dolma3-tokenizer",
        "v3-small-ppl-validation": "dolma2-tokenizer",
        "c4-ppl-validation": "dolma2-tokenizer",
        "code-fresh-ppl-validation": "dolma2-tokenizer",
        None: "allenai/dolma2-tokenizer",
    },
}

PACKAGE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mixes")


def search_dirs(mixes_dir: str | None = None) -> list[str]:
    """Directories searched for `<name>.txt`, first match wins."""
    given = mixes_dir or os.environ.get("OLMO3_MIXES_DIR") or None
    if given and not os.path.isdir(given):   # it was skipped: OLMo-core's list of the same name was read instead
        said = f"mixes_dir={given!r}" if mixes_dir else f"OLMO3_MIXES_DIR={given!r}"
        raise FileNotFoundError(f"{said} is not a directory; give the directory that holds your <mix>.txt files")
    dirs = [given, PACKAGE_DIR]
    spec = importlib.util.find_spec("olmo_core")  # locates the package without importing it
    if spec is not None and spec.submodule_search_locations:
        dirs += [os.path.join(d, "data", "mixes") for d in spec.submodule_search_locations]
    return [d for d in dirs if d and os.path.isdir(d)]


def available_mixes(mixes_dir: str | None = None) -> list[str]:
    names = {f[:-4] for d in search_dirs(mixes_dir) for f in os.listdir(d) if f.endswith(".txt")}
    return sorted(names)


def _mix_file(name: str, mixes_dir: str | None) -> str:
    if not name or os.path.basename(name) != name or name.endswith(".txt"):
        raise ValueError(f"mix name {name!r} must be a bare name like {STAGE_MIXES[1]!r}")
    for d in search_dirs(mixes_dir):
        path = os.path.join(d, name + ".txt")
        if os.path.isfile(path):
            return path
    have = available_mixes(mixes_dir)
    raise ValueError(
        f"unknown data mix {name!r}. Available: {', '.join(have) if have else '(none found)'}. "
        f"Searched {search_dirs(mixes_dir) or [PACKAGE_DIR]}. OLMo-core's lists come with its PyPI "
        "package: `pip install --no-deps ai2-olmo-core==3.0.0` (only its data files are read), or "
        "`python -m data.write_mixes --olmo_core=PATH_TO_OLMO_CORE_CHECKOUT`.")


def read_mix(name: str, mixes_dir: str | None = None) -> list[tuple[str, str]]:
    """The (label, relative path template) lines of a mix file, `{TOKENIZER}` unexpanded."""
    path = _mix_file(name, mixes_dir)
    lines = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split(",")
            if len(parts) != 2 or "{TOKENIZER}" not in parts[1] or not parts[0]:
                raise ValueError(f"{path}:{n}: expected 'label,relative/path/{{TOKENIZER}}/...npy', got {line!r}")
            lines.append((parts[0], parts[1]))
    if not lines:
        raise ValueError(f"data mix {name!r} ({path}) lists no files")
    return lines


def tokenizer_dir(name: str, tokenizer: str = "dolma2") -> str:
    if tokenizer not in TOKENIZER_DIRS:
        raise ValueError(f"unknown tokenizer {tokenizer!r} for data mix {name!r}; the OLMo 3 token files "
                         f"exist for: {', '.join(TOKENIZER_DIRS)}")
    dirs = TOKENIZER_DIRS[tokenizer]
    return dirs.get(name, dirs[None])


def resolve_mix(
    name: str,
    root: str = DEFAULT_ROOT,
    tokenizer: str = "dolma2",
    *,
    mixes_dir: str | None = None,
) -> list[tuple[str, str]]:
    """[(label, url)] for mix `name` under data root `root` (a URL or a local directory; a mirror
    with the same relative layout works), in the mix file's order."""
    tok = tokenizer_dir(name, tokenizer)
    if not root:
        raise ValueError(f"data mix {name!r}: empty data root; pass --data_root (default {DEFAULT_ROOT})")
    base = root if root.endswith("/") else root + "/"
    return [(label, base + rel.replace("{TOKENIZER}", tok)) for label, rel in read_mix(name, mixes_dir)]


def mix_paths(name: str, root: str = DEFAULT_ROOT, tokenizer: str = "dolma2", **kw) -> list[str]:
    """Just the URLs, in order: what `data.FSLDataset(paths, seq_len)` takes."""
    return [url for _, url in resolve_mix(name, root, tokenizer, **kw)]


def by_label(pairs: Sequence[tuple[str, str]]) -> dict[str, list[str]]:
    """{label: [url, ...]} in first-seen order: one entry per domain of a validation mix."""
    out: dict[str, list[str]] = {}
    for label, url in pairs:
        out.setdefault(label, []).append(url)
    return out
