"""Numpy oracles shared by the tests: float64 references for what the model computes in float32."""
import numpy as np


def log_softmax64(x):
    """log softmax over the last axis, in float64 (the max subtracted first)."""
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))
