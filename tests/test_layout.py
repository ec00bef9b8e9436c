"""The repository as the design card draws it (DESIGN §1): a small flat top level, one home per
concept (no import circles between modules), and no private APIs of the libraries we build on.

Read from the source files themselves (ast), so the checks hold for any change, not for a list
kept by hand."""
import ast
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# DESIGN §1: the card, plus README, package metadata, the recipe's flagfiles, CI and launchers.
CARD = {"olmo3", "data", "train.py", "convert.py", "eval.py", "tests", "setup.cfg", "pyproject.toml",
        "README.md", "benchmarks", "launch", ".ci", ".gitignore"}

# Private modules still imported on purpose, each behind a fallback for a JAX without it.
PRIVATE_ALLOWED = {("olmo3/runtime.py", "jax._src"),
                   # a developer tool that captures the Triton IR Pallas builds (no public hook)
                   ("benchmarks/splash_gpu_ptxas.py", "jax._src")}


def _tracked_top_level() -> set[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return {p.split("/", 1)[0] for p in out.splitlines() if p}
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: what is on disk
        return {p for p in os.listdir(ROOT) if not p.startswith(".") or p in CARD}


def test_top_level_is_the_card():
    extra = sorted(p for p in _tracked_top_level() - CARD if not p.endswith(".flags"))
    assert not extra, f"top-level entries outside the design card (DESIGN §1): {extra}"


def _modules(package: str) -> dict[str, str]:
    d = os.path.join(ROOT, package)
    return {f"{package}.{f[:-3]}": os.path.join(d, f) for f in os.listdir(d)
            if f.endswith(".py") and f != "__init__.py"}


def _imports(path: str) -> set[str]:
    """Every module named by an import anywhere in the file (function-level imports included)."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_no_import_circles():
    mods = {**_modules("olmo3"), **_modules("data")}
    graph = {m: sorted(i for i in _imports(p) if i in mods and i != m) for m, p in mods.items()}
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for n in graph[m]:
            assert state.get(n) != 1, f"import circle: {' -> '.join(path + [m, n])}"
            if n not in state:
                visit(n, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_no_private_library_apis():
    files = [os.path.join(dp, f) for top in ("olmo3", "data", "benchmarks") for dp, _, fs in
             os.walk(os.path.join(ROOT, top)) for f in fs if f.endswith(".py")]
    files += [os.path.join(ROOT, f) for f in ("train.py", "convert.py", "eval.py")]
    found = []
    for path in files:
        rel = os.path.relpath(path, ROOT)
        for name in _imports(path):
            parts = name.split(".")
            if any(p.startswith("_") and not p.startswith("__") for p in parts[1:]) and parts[0] in (
                    "jax", "jaxlib", "orbax", "equinox", "optax", "tensorstore"):
                private = ".".join(parts[:next(i for i, p in enumerate(parts) if p.startswith("_")) + 1])
                if (rel, private) not in PRIVATE_ALLOWED:
                    found.append(f"{rel}: {name}")
    assert not found, f"private library modules imported: {found}"
