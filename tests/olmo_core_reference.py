"""A small OLMo 3 trained and checkpointed by OLMo-core itself: the independent reference for
convert.py's olmo-core: path (tests/test_olmo_core.py).

    model   TransformerConfig.olmo3_7B(vocab_size=100352) scaled down (d_model 64, 4 layers of
            4 heads x 16, MLP 192, window 8): reordered norm, QK-norm over the full projection,
            3 sliding + 1 full layers, the padded dolma2 vocabulary; OLMo-core's own init
    train   OLMo-core's TransformerTrainModule: its loss (CE + z-loss 1e-5), backward, grad-norm
            clipping at 1.0, its LinearWithWarmup scheduler and SkipStepAdamW (betas 0.9/0.95,
            wd 0.1, no decay on embeddings.weight), as in OLMo-3-1025-7B-midtrain.py
    save    OLMo-core's Checkpointer after 2 steps: <run>/step2/{model_and_optim/*.distcp,
            train/rank0.pt, .metadata.json}, plus config.json as its ConfigSaverCallback writes it
    then    step 3 in OLMo-core on a fixed batch; its params and moments are the reference for
            our own step 3 after conversion

Single process: OLMo-core's train module and torch.distributed.checkpoint run without a process
group. The Trainer itself is replaced by `_Trainer`, which holds the only fields the train module
and the scheduler read (global_step, max_steps, device) and drops the metrics.
"""
from __future__ import annotations

import json
import os

import numpy as np

SEQ, BATCH, STEPS, MAX_STEPS = 32, 2, 2, 10
LR = 1e-3           # large enough that one step moves every parameter measurably
WINDOW = 8          # sliding window < SEQ, so the sliding layers really slide
VOCAB = 100352      # OLMo-core TokenizerConfig.dolma2().padded_vocab_size()
TOKENIZER_VOCAB = 100278


class _Trainer:
    """The fields of olmo_core.train.Trainer that TransformerTrainModule and Scheduler read."""

    def __init__(self, torch):
        self.device = torch.device("cpu")
        self.max_steps = MAX_STEPS
        self.global_step = 0
        self.metrics = {}

    def record_metric(self, name, value, reduce_type=None, namespace=None, **_):
        self.metrics[f"{namespace}/{name}" if namespace else name] = float(value)

    def record_ce_loss(self, value, reduce_type=None):
        self.metrics["train/CE loss"] = float(value)


def olmo_core_config():
    """OLMo-core's OLMo 3 7B config, scaled down; torch SDPA attention so it runs on CPU."""
    from olmo_core.nn.attention import AttentionBackendName
    from olmo_core.nn.transformer import TransformerConfig
    cfg = TransformerConfig.olmo3_7B(vocab_size=VOCAB, attn_backend=AttentionBackendName.torch)
    cfg.d_model, cfg.n_layers = 64, 4
    cfg.block.sequence_mixer.n_heads = 4
    cfg.block.feed_forward.hidden_size = 192
    cfg.block.sequence_mixer.sliding_window.pattern = [WINDOW, WINDOW, WINDOW, -1]
    return cfg


def train_module(model, torch, rank_batch: int = BATCH, dp_config=None):
    from olmo_core.optim import LinearWithWarmup, OptimGroupOverride, SkipStepAdamWConfig
    from olmo_core.train.train_module import TransformerTrainModule
    optim = SkipStepAdamWConfig(lr=LR, weight_decay=0.1, betas=(0.9, 0.95), group_overrides=[
        OptimGroupOverride(params=["embeddings.weight"], opts={"weight_decay": 0.0})])
    tm = TransformerTrainModule(model=model, optim=optim, rank_microbatch_size=rank_batch * SEQ,
                                max_sequence_length=SEQ, z_loss_multiplier=1e-5, max_grad_norm=1.0,
                                scheduler=LinearWithWarmup(warmup=0, alpha_f=0.0),
                                device=torch.device("cpu"), dp_config=dp_config)
    tm._attach_trainer(_Trainer(torch))
    return tm


def batches(seed: int = 0) -> np.ndarray:
    """(STEPS + 1, BATCH, SEQ) token ids; a few of each row in the padded range, so the padded
    embedding rows are read and trained too."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, TOKENIZER_VOCAB, size=(STEPS + 1, BATCH, SEQ))
    b[..., 5] = rng.integers(TOKENIZER_VOCAB, VOCAB, size=(STEPS + 1, BATCH))
    return b


def step(tm, tokens, torch) -> dict:
    tm.trainer.global_step += 1  # OLMo-core's trainer increments before the step (schedules.py)
    tm.zero_grads()
    tm.train_batch({"input_ids": torch.as_tensor(tokens, dtype=torch.long)})
    tm.optim_step()
    return dict(tm.trainer.metrics)


def numpy_state(tm) -> dict:
    """name -> numpy of every parameter and of its exp_avg / exp_avg_sq / step (OLMo-core names)."""
    out = {}
    for name, p in tm.model.named_parameters():
        out[f"model.{name}"] = p.detach().numpy().copy()
        st = tm.optim.state[p]
        for k in ("exp_avg", "exp_avg_sq", "step"):
            out[f"optim.state.{name}.{k}"] = st[k].detach().numpy().copy()
    return out


def build(run_dir: str, eval_tokens: np.ndarray) -> dict:
    """Train 2 steps, save <run_dir>/step2, then run step 3. Returns the reference numbers:
    logits at step 2 on `eval_tokens`, the state at step 2 and after step 3, step-3's batch and
    metrics."""
    import torch
    from olmo_core.train.checkpoint import Checkpointer
    torch.manual_seed(0)
    cfg = olmo_core_config()
    model = cfg.build(init_device="cpu")
    model.init_weights(device=torch.device("cpu"))
    with torch.no_grad():  # norm gains away from 1, so a QK-norm or norm mix-up shows in the logits
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.mul_(0.5 + torch.rand(p.shape, generator=g))
    tm = train_module(model, torch)
    data = batches()
    for i in range(STEPS):
        step(tm, data[i], torch)
    step_dir = os.path.join(run_dir, f"step{STEPS}")
    Checkpointer(work_dir=os.path.join(run_dir, "work")).save(
        step_dir, tm, {"global_step": STEPS, "global_train_tokens_seen": STEPS * BATCH * SEQ})
    with open(os.path.join(step_dir, "config.json"), "w") as f:  # what ConfigSaverCallback writes
        json.dump({"model": cfg.as_config_dict()}, f)
    ref = {"state": numpy_state(tm)}
    tm.model.eval()
    with torch.no_grad():
        ref["logits"] = tm.model(torch.as_tensor(eval_tokens, dtype=torch.long)).float().numpy()
    ref["metrics3"] = step(tm, data[STEPS], torch)
    ref["state3"] = numpy_state(tm)
    ref["batch3"] = data[STEPS]
    return ref
