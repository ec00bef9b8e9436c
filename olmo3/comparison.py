"""Step-aligned comparison of two runs and its report (DESIGN §5: checkpoint N of one run against
checkpoint N of the other, never a curve against a curve).

    iter_steps(run_a, run_b)          the checkpoint steps both runs saved
    read_metrics(run_dir)             metrics.jsonl -> {step: metrics}
    train_loss_at(metrics, step, w)   mean training loss over the last w logged steps
    verdict(train_delta, heldout_delta, tol)   the memorization signature of a data bug
    write_report(rows, out_dir, ...)  report.md, report.csv, report.png (each written atomically)
"""
from __future__ import annotations

import os
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

from olmo3 import checkpoint
from olmo3.metrics import read_jsonl


def read_metrics(run_dir: str) -> dict[int, dict]:
    """metrics.jsonl -> {step: metrics}; a step logged twice (a resumed run) keeps the last line."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: the run comparison needs each run's metrics.jsonl")
    out: dict[int, dict] = {}
    for rec in read_jsonl(path):
        if "step" in rec:
            out[int(rec["step"])] = rec
    return out


def train_loss_at(metrics: Mapping[int, dict], step: int, window: int) -> float:
    """Mean train/loss over the logged steps in (step - window, step]: one batch is noisy."""
    vals = [m["train/loss"] for s, m in metrics.items() if step - window < s <= step and "train/loss" in m]
    if not vals:
        raise ValueError(f"no train/loss logged in steps ({step - window}, {step}]")
    return float(np.mean(vals))


def verdict(train_delta: float, heldout_delta: float, tol: float) -> Optional[str]:
    """Deltas are B - A (negative: B is better). The memorization signature of a data bug: B's
    training loss improved by more than `tol` nats, and its held-out loss improved by less than
    half as much (DESIGN §4 bug 1: Poisson resampling lowered training loss, not held-out)."""
    if train_delta < -tol and heldout_delta > train_delta / 2:
        return "training loss improved but held-out did not (memorization signature: check the data order)"
    return None


def write_report(rows: list[dict], out_dir: str, title: str, notes: Sequence[str] = ()) -> dict:
    """report.md, report.csv and report.png (training-loss delta and held-out delta by step)."""
    import csv
    os.makedirs(out_dir, exist_ok=True)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    paths = {k: os.path.join(out_dir, f"report.{k}") for k in ("md", "csv", "png")}

    def atomic(path, write):
        tmp = path + ".tmp"
        write(tmp)
        os.replace(tmp, path)

    def csv_(tmp):
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            w.writerows(rows)

    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))  # noqa: E731

    def md(tmp):
        with open(tmp, "w") as f:
            f.write(f"# {title}\n\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n")
            for r in rows:
                f.write("| " + " | ".join(fmt(r.get(c)) for c in cols) + " |\n")
            for n in notes:
                f.write(f"\n{n}\n")

    def png(tmp):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        steps = [r["step"] for r in rows]
        ax.plot(steps, [r["train_delta"] for r in rows], "o-", label="training loss delta (B - A)")
        ax.plot(steps, [r["heldout_delta"] for r in rows], "s-", label="held-out loss delta (B - A)")
        ax.axhline(0.0, color="gray", lw=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("nats")
        ax.set_title(title)
        ax.legend()
        fig.tight_layout()
        fig.savefig(tmp, format="png")
        plt.close(fig)

    atomic(paths["csv"], csv_)
    atomic(paths["md"], md)
    atomic(paths["png"], png)
    return paths


def iter_steps(run_a: str, run_b: str, steps: Optional[Iterable[int]] = None) -> tuple[list[int], list[str]]:
    """Checkpoint steps to compare and notes. Explicit `steps` must exist in both runs."""
    mgrs = [checkpoint.CheckpointManager(r, read_only=True) for r in (run_a, run_b)]
    have = [set(m.all_steps()) for m in mgrs]
    for m in mgrs:
        m.close()
    if steps is not None:
        steps = sorted(set(int(s) for s in steps))
        for run, h in zip((run_a, run_b), have):
            missing = [s for s in steps if s not in h]
            if missing:
                raise FileNotFoundError(f"run {run} has no checkpoint for step(s) {missing}; it has "
                                        f"{sorted(h)}. Compare steps both runs saved (step-aligned).")
        return steps, []
    common = sorted(have[0] & have[1])
    if not common:
        raise ValueError(f"runs {run_a} ({sorted(have[0])}) and {run_b} ({sorted(have[1])}) share no "
                         "checkpoint step; comparisons are step-aligned")
    only = sorted(have[0] ^ have[1])
    return common, ([f"Steps saved by only one run (not compared): {only}"] if only else [])
