"""OLMo 3 in JAX/Equinox: the model and its machinery."""
from olmo3.config import Config, YaRN

__all__ = ["Config", "YaRN"]
