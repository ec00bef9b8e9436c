"""A model from any checkpoint: an HF directory (config.json + safetensors) or an Orbax checkpoint
written by train.py or convert.py (a run directory, its checkpoints/ directory, or one step).

    load_model(path)  ->  (OLMo3, {"kind": "hf" | "orbax", "path", "step", "config", "seq_len"})
    (seq_len: the sequence length the run trained on, from its loader state; None for HF)

The Orbax side reads the architecture from the checkpoint's own extra JSON ("model_config"), so
eval.py and convert.py never need the flags a run was trained with.
"""
from __future__ import annotations

import os
from typing import Optional

import equinox as eqx
import jax

from olmo3 import checkpoint, hf
from olmo3.olmo_core import MODEL_AND_OPTIM
from olmo3.config import config_from_dict
from olmo3.model import OLMo3


def load_model(path: str, step: Optional[int] = None, **overrides) -> tuple[OLMo3, dict]:
    """An OLMo3 from an HF directory (config.json + safetensors) or an Orbax checkpoint (a run
    directory, its checkpoints/ directory, or checkpoints/<N>). Returns (model, info), info holding
    "kind", "step", "config", "seq_len" (the run's training sequence length, when known) and
    "doc_lengths" (whether the run attended within documents; None when unknown), "eval_padded"
    (whether it scored held-out loss on padded documents; None when unknown), "precision" (the
    run's {"compute_dtype", "float8"}, train.py's extra JSON; None when unknown). `overrides`
    change non-architecture fields (compute_dtype...)."""
    if os.path.isdir(os.path.join(path, MODEL_AND_OPTIM)):
        raise ValueError(f"{path} is an OLMo-core checkpoint; convert it first: python convert.py "
                         f"--from=olmo-core:{path} --to=orbax:<new run dir>, then give that run")
    if hf.is_hf_dir(path):
        if step is not None:   # it was ignored: the directory's one model was loaded
            raise ValueError(f"{path} is a Hugging Face directory, which holds one model; a step (eval.py "
                             f"--model_step={step}) picks a checkpoint of an Orbax run: drop it")
        config = hf.read_hf_config(path, **overrides)
        model = hf.from_hf(hf.SafetensorsReader(path), config)
        return model, {"kind": "hf", "path": path, "step": None, "config": config, "seq_len": None,
                       "doc_lengths": None, "eval_padded": None, "precision": None}
    run, located = checkpoint.locate(path)
    if None not in (located, step) and located != step:   # one of the two was ignored
        raise ValueError(f"{path} is checkpoint {located}, and a step (eval.py --model_step={step}) names "
                         f"another: give the run directory {run} with the step, or the checkpoint alone")
    step = located if step is None else step
    mgr = checkpoint.CheckpointManager(run, read_only=True)
    step = mgr.verify(step)  # a damaged checkpoint is named (the file) before any array is read
    extra = mgr.read_extra(step)
    if "model_config" not in extra:
        raise ValueError(f"checkpoint {run} step {step}: its extra JSON has no 'model_config'; it was not "
                         "written by train.py or convert.py")
    config = config_from_dict(extra["model_config"], **overrides)
    abstract = eqx.filter_eval_shape(OLMo3, config, jax.random.key(0))
    state, _ = mgr.restore(step, {"model": abstract})
    mgr.close()
    return state["model"], {"kind": "orbax", "path": run, "step": step, "config": config,
                            "seq_len": (extra.get("loader") or {}).get("seq_len"), "doc_lengths": doc_lengths(extra),
                            "eval_padded": extra.get("eval_padded"), "precision": extra.get("precision")}


def doc_lengths(extra: dict) -> Optional[bool]:
    """Whether the train.py run of this checkpoint's extra JSON attended within documents (its
    --doc_lengths; before it was saved: on for stage 3 and SFT, train.py's default); None for a
    checkpoint not written by train.py."""
    if "doc_lengths" in extra:
        return bool(extra["doc_lengths"])
    return str(extra["stage"]) in ("3", "sft") if "stage" in extra else None
