"""OLMo 3 in JAX/Equinox: the model and its machinery.

`olmo3.Config`, `olmo3.YaRN`, `olmo3.OLMo3` and `olmo3.hf` are loaded on first use, so that a
script importing a light module (`olmo3.cli`, `olmo3.launch`) starts without importing JAX.
"""
import importlib

_EXPORTS = {"Config": "olmo3.config", "YaRN": "olmo3.config", "OLMo3": "olmo3.model"}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name == "hf":
        return importlib.import_module("olmo3.hf")
    raise AttributeError(f"module 'olmo3' has no attribute {name!r}")


__all__ = ["Config", "YaRN", "OLMo3", "hf"]
