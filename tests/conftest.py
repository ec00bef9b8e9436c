"""Test setup: 8 host CPU devices and runtime jaxtyping checks for the whole package."""
import atexit
import os
import shutil
import tempfile

import pytest

# Must precede the first `import jax`: the sharding tests use 8 CPU devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxtyping import install_import_hook  # noqa: E402

# Every jaxtyped annotation in olmo3/ and data/ is checked by beartype while tests run.
_hook = install_import_hook(["olmo3", "data"], "beartype.beartype")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# After `import jax`, so only for the scripts tests start as subprocesses (train.py, eval.py,
# convert.py, bench.py): one persistent compilation cache for the session, so that runs of one
# program (a run and its resumed copy, the bad-input cases) compile it once. Programs that
# compile in under a second are not cached (JAX's default threshold). The key is the program,
# the XLA flags and the jaxlib version, so a hit runs the same executable a compile would have.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="olmo3-test-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

# The dataset hub is unreachable from CI: lm-eval tasks read local files, and `datasets` must not
# try the network first. Set for every test and subprocess, not by the tests that need it (which
# left it set, or not, for whichever test files ran next in the same worker).
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# Remote token files' sizes are cached in $OLMO3_DATA_CACHE (default ~/.cache/olmo3-jax): the
# tests' local HTTP servers (a new port each run) wrote their URLs into the user's own cache.
if "OLMO3_DATA_CACHE" not in os.environ:
    os.environ["OLMO3_DATA_CACHE"] = tempfile.mkdtemp(prefix="olmo3-test-data-cache-")
    atexit.register(shutil.rmtree, os.environ["OLMO3_DATA_CACHE"], ignore_errors=True)


# A default-run test that hangs (a deadlocked peer, a lock never released, a mutation that loops)
# fails after this many seconds, naming itself, instead of holding CI to its 90-minute limit. The
# clock includes the module fixtures a file's first test builds (test_bad_inputs.py's: about
# 260 s on 2 busy cores). The slow tests run for longer by design and get none.
DEFAULT_RUN_TIMEOUT_S = 1200


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow") is None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(DEFAULT_RUN_TIMEOUT_S))
