"""OLMo 3 in JAX/Equinox: the model and its machinery."""
from olmo3.config import Config, YaRN

__all__ = ["Config", "YaRN"]
from olmo3.model import OLMo3  # noqa: E402
from olmo3 import hf  # noqa: E402,F401

__all__ += ["OLMo3", "hf"]
