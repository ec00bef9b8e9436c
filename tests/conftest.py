"""Test setup: 8 host CPU devices and runtime jaxtyping checks for the whole package."""
import os

# Must precede the first `import jax`: the sharding tests use 8 CPU devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxtyping import install_import_hook  # noqa: E402

# Every jaxtyped annotation in olmo3/ and data/ is checked by beartype while tests run.
_hook = install_import_hook(["olmo3", "data"], "beartype.beartype")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
