"""The frozen DPO reference: its per-sequence log-probs, computed once and cached beside the data.

    identity    = sha256(model config, precision, for each weight: path, dtype, shape, two checksums of its bits)
    fingerprint = sha256(identity, data fingerprint, seq_len)
    <pairs dir>/reference_logps.npz = {fingerprint, sums float32 [pairs, 2], counts int32 [pairs, 2]}

    load_or_compute(path, fingerprint, compute):
        the file exists:  same fingerprint -> its sums;  another -> UserError naming the file and the fix
        it does not:      sums, counts = compute(); written to a temporary file, then renamed

open-instruct (`dpo_tune_cache.py`) also runs the reference once over the data before training and
keeps the results: in memory at the commit the OLMo 3 scripts cite (`get_cache_ref_logprobs`,
3af17aacf), on disk keyed by a hash of the model name and the data config in later versions
(`dpo_utils.build_reference_logprobs_cache`). Here the key is the reference's *weights*: two integer checksums per tensor of its
raw bits (a plain sum and a position-weighted sum, both mod 2^32, so exact and independent of how
the tensor is sharded), so a renamed or copied checkpoint keeps its cache and a retrained one at
the same path does not. The identity also holds the precision the log-probs were computed in
(compute_dtype, float8): the reference must score at the policy's precision, or the first step's
loss is not log 2. The data fingerprint (data/preference.py) covers the files' contents and
seq_len. The attention kernel, remat policy, layer scan and block sizes are left out: they do not
change what is computed.
"""
from __future__ import annotations

import hashlib
import json
import os
import zipfile
from typing import Callable

import equinox as eqx
import jax
import numpy as np
from jaxtyping import PyTree

from olmo3 import atomic
from olmo3.checkpoint import bit_sums
from olmo3.cli import UserError

CACHE_NAME = "reference_logps.npz"


def weights_identity(model: PyTree) -> str:
    """sha256 hex of the model's architecture and precision, and every weight's path, dtype, shape
    and bit checksums."""
    from olmo3.config import config_to_dict
    config = config_to_dict(model.config) | {"compute_dtype": model.config.compute_dtype,
                                             "float8": model.config.float8}
    arrays = eqx.filter(model, eqx.is_inexact_array)
    named = jax.tree_util.tree_flatten_with_path(arrays)[0]
    sums = np.asarray(bit_sums([x for _, x in named]))
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for (path, x), s in zip(named, sums):
        h.update(f"{jax.tree_util.keystr(path)},{x.dtype},{tuple(x.shape)},{np.asarray(s).tolist()};".encode())
    return h.hexdigest()


def fingerprint(reference_identity: str, data_fingerprint: str, seq_len: int) -> str:
    """What a cache of reference log-probs is valid for."""
    key = f"reference={reference_identity},data={data_fingerprint},seq_len={seq_len}"
    return hashlib.sha256(key.encode()).hexdigest()


def default_path(pairs_dir: str) -> str:
    return os.path.join(os.fspath(pairs_dir), CACHE_NAME)


def load(path: str, expected: str, *, elsewhere: str = "pass --reference_cache=<another file>") -> np.ndarray | None:
    """The cached sums float32 [pairs, 2], None if `path` does not exist; a cache made for another
    reference, data set or seq_len is a user error naming the file and the fix: delete it, or
    `elsewhere` (how this run's cache goes to another file: --reference_cache moves only the
    training set's; a held-out set's cache lives beside its pairs)."""
    if not os.path.exists(path):
        return None
    try:
        with np.load(path) as z:
            found, sums = str(z["fingerprint"]), np.asarray(z["sums"], np.float32)
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as e:   # empty: EOFError; cut: BadZipFile
        raise UserError(f"reference log-probs cache {path} is unreadable ({e}); delete it to recompute it") from e
    if found != expected:
        raise UserError(
            f"reference log-probs cache {path} was computed for another reference model (weights or "
            "--compute_dtype / --float8), data set or seq_len "
            f"(fingerprint {found[:12]}..., this run needs {expected[:12]}...); delete it to recompute it with this "
            f"reference, or {elsewhere}")
    return sums


def write(path: str, expected: str, sums: np.ndarray, counts: np.ndarray) -> None:
    """Whole or not at all (olmo3/atomic.py)."""
    with atomic.replacing(path, suffix=".npz") as tmp:
        np.savez(tmp, fingerprint=np.array(expected), sums=np.asarray(sums, np.float32),
                 counts=np.asarray(counts, np.int32))


def load_or_compute(path: str, expected: str, compute: Callable[[], tuple[np.ndarray, np.ndarray]], *,
                    write_file: bool = True) -> tuple[np.ndarray, bool]:
    """(sums [pairs, 2], whether they were computed now). `compute() -> (sums, counts)` runs on every
    process (it is a sharded computation); only the one with `write_file` writes."""
    sums = load(path, expected)
    if sums is not None:
        return sums, False
    sums, counts = compute()
    if write_file:
        write(path, expected, sums, counts)
    return np.asarray(sums, np.float32), True
