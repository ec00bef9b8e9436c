"""Write the OLMo 3 mix lists into data/mixes/ from an OLMo-core checkout.

    git clone https://github.com/allenai/OLMo-core /tmp/OLMo-core
    python -m data.write_mixes --olmo_core=/tmp/OLMo-core

The lists are facts published by AI2 (`src/olmo_core/data/mixes/<name>.txt`); this script only
checks and normalizes them: every line is `label,relative/path/{TOKENIZER}/....npy`, comments and
blank lines are dropped, and a header records where the list came from. `--olmo_core` may also be
a bare git directory (read at `--rev` with `git show`). Files are written to a temporary name and
renamed, so a failed run leaves the previous lists intact.
"""
import os
import re
import subprocess

from absl import flags, logging

from data import mixes
from olmo3 import atomic

MIX_DIR = "src/olmo_core/data/mixes"
# The recipe's three stages and the perplexity sets (see data/mixes.py).
DEFAULT_MIXES = [*mixes.STAGE_MIXES.values(), mixes.VALIDATION_MIX, "code-fresh-ppl-validation"]

flags.DEFINE_string("olmo_core", None, "an OLMo-core checkout (or bare git directory)", required=True)
flags.DEFINE_string("rev", "HEAD", "git revision to read when --olmo_core is a git directory")
flags.DEFINE_list("mixes", DEFAULT_MIXES, "mix names to write")
flags.DEFINE_string("out_dir", mixes.PACKAGE_DIR, "where to write <name>.txt")
FLAGS = flags.FLAGS

_LINE = re.compile(r"[^,\s]+,[^,\s]*\{TOKENIZER\}[^,\s]*\.npy")


def _git_dir(root: str) -> str | None:
    for d in (root, os.path.join(root, ".git")):
        if os.path.isfile(os.path.join(d, "HEAD")) and os.path.isdir(os.path.join(d, "objects")):
            return d
    return None


def read_source(root: str, name: str, rev: str = "HEAD") -> tuple[str, str]:
    """(text of <name>.txt, a description of where it came from). In a git checkout (or a bare
    git directory) the list as committed at `rev`, whose commit the description names: the
    working tree was read whatever --rev said, its uncommitted edits under a clean commit's name,
    and a --rev git does not know was written into the header as given."""
    path = os.path.join(root, MIX_DIR, name + ".txt")
    git = _git_dir(root)
    if not git:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} does not exist; is --olmo_core an OLMo-core checkout?")
        with open(path) as f:
            return f.read(), f"allenai/OLMo-core: {MIX_DIR}/{name}.txt"
    r = subprocess.run(["git", f"--git-dir={git}", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                       capture_output=True, text=True)
    if r.returncode:
        raise ValueError(f"--rev={rev!r} is no commit of {root}; give a commit, tag or branch it has "
                         "(git fetch it first)")
    commit = r.stdout.strip()
    r = subprocess.run(["git", f"--git-dir={git}", "show", f"{commit}:{MIX_DIR}/{name}.txt"],
                       capture_output=True, text=True)
    if r.returncode:
        raise FileNotFoundError(f"{MIX_DIR}/{name}.txt is not in {root} at {rev}: {r.stderr.strip()}")
    if os.path.isfile(path):
        with open(path) as f:
            if f.read() != r.stdout:
                logging.warning("%s differs from its copy at --rev=%s (%s): the committed list is written", path,
                                rev, commit[:12])
    return r.stdout, f"allenai/OLMo-core @ {commit}: {MIX_DIR}/{name}.txt"


def normalize(name: str, text: str, source: str) -> str:
    out = [f"# {name}: copied by data/write_mixes.py from {source}"]
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not _LINE.fullmatch(line):
            raise ValueError(f"{source} line {n}: expected 'label,path/{{TOKENIZER}}/...npy', got {line!r}")
        out.append(line)
    if len(out) == 1:
        raise ValueError(f"{source} lists no files")
    return "\n".join(out) + "\n"


def write(out_dir: str, name: str, body: str) -> str:
    dest = os.path.join(out_dir, name + ".txt")
    atomic.write_text(dest, body)
    return dest


def main(argv):
    del argv
    for name in FLAGS.mixes:
        text, source = read_source(FLAGS.olmo_core, name, FLAGS.rev)
        body = normalize(name, text, source)
        dest = write(FLAGS.out_dir, name, body)
        print(f"{dest}: {body.count(chr(10)) - 1} files")


if __name__ == "__main__":
    from olmo3 import cli
    cli.run(main)
