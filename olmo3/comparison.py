"""Step-aligned comparison of two runs and its report (DESIGN §5: checkpoint N of one run against
checkpoint N of the other, never a curve against a curve).

    iter_steps(run_a, run_b)          the checkpoint steps both runs saved
    read_metrics(run_dir, keys)       metrics.jsonl -> {step: metrics}
    train_loss_at(metrics, step, w)   mean training loss over the last w logged steps
    train_loss_se(metrics, step, w)   its noise: standard error of that mean about a linear trend
    paired_se(a, b)                   noise of a held-out delta: spread of per-batch differences
    verdict(train_delta, heldout_delta, ...)   the memorization signature of a data bug, flagged
                                      only beyond the noise band measured from the runs themselves
    write_report(rows, out_dir, ...)  report.md, report.csv, report.png (each written atomically)
"""
from __future__ import annotations

import math
import os
from typing import Iterable, Mapping, Optional, Sequence, Union

import numpy as np
from jaxtyping import Float

from olmo3 import atomic, checkpoint
from olmo3.metrics import iter_jsonl


def read_metrics(run_dir: str, keys: Optional[Iterable[str]] = None) -> dict[int, dict]:
    """metrics.jsonl -> {step: metrics}; the lines of a step logged more than once (a resumed run)
    are merged in order, a later value winning (olmo3/metrics.py). `keys`: keep only these
    metrics; the file is streamed, so a stage-1 run's ~1 GB log costs memory for those alone
    (all of it, parsed, holds ~2.5x the file's size: tests/test_metrics.py)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: the run comparison needs each run's metrics.jsonl")
    keep = None if keys is None else set(keys)
    out: dict[int, dict] = {}
    for rec in iter_jsonl(path, torn_tail_ok=True):
        if "step" in rec:
            out.setdefault(int(rec["step"]), {}).update(
                rec if keep is None else {k: v for k, v in rec.items() if k in keep})
    return out


def train_loss_at(metrics: Mapping[int, dict], step: int, window: int) -> float:
    """Mean train/loss over the logged steps in (step - window, step]: one batch is noisy."""
    vals = [m["train/loss"] for s, m in metrics.items() if step - window < s <= step and "train/loss" in m]
    if not vals:
        raise ValueError(f"no train/loss logged in steps ({step - window}, {step}]")
    return float(np.mean(vals))


# Logged training losses a window needs before its noise counts as measured. The residual std of a
# line through n points has n - 2 degrees of freedom, and a band of Z of them assumes many: with
# 3 points two clean runs (seeds apart) were flagged at 4.7% of steps, with 5 at 1.2%, with 20 at
# 0.27% (a helper's simulation of linear trend + Gaussian noise through this module's bands).
MIN_TRAIN_POINTS = 10


def train_loss_se(metrics: Mapping[int, dict], step: int, window: int) -> float:
    """Standard error of train_loss_at's window mean: the residual std of train/loss about a
    least-squares line through the window (the loss still falls inside it; the line takes the
    trend out, what is left is batch-to-batch noise), over sqrt(n). NaN with fewer than
    MIN_TRAIN_POINTS steps."""
    pts = sorted((s, m["train/loss"]) for s, m in metrics.items() if step - window < s <= step and "train/loss" in m)
    if len(pts) < MIN_TRAIN_POINTS:
        return float("nan")
    x, y = np.asarray(pts, np.float64).T
    resid = y - np.polyval(np.polyfit(x, y, 1), x)
    return float(np.sqrt(np.sum(resid ** 2) / (len(y) - 2)) / np.sqrt(len(y)))


Losses = Union[Sequence[float], Float[np.ndarray, " n"]]


def paired_se(a: Losses, b: Losses) -> float:
    """Standard error of mean(b - a) over paired held-out batches (the same batches for both
    runs): the spread of the per-batch differences, ddof 1, over sqrt(n). NaN below 2 batches."""
    d = np.asarray(b, np.float64) - np.asarray(a, np.float64)
    return float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")


# The band: z standard errors. 3 is our choice (a two-sided 3-sigma band flags ~0.3% of clean
# comparisons per step when the noise is Gaussian); --tol adds a floor in nats.
Z = 3.0


def bands(train_se: float, heldout_se: float, z: float = Z, tol: float = 0.0) -> tuple[float, float]:
    """(train band, gap band) in nats. train_se is sqrt(se_A^2 + se_B^2) of the two windows; the
    gap train_delta - heldout_delta has variance train_se^2 + heldout_se^2. A standard error that
    could not be measured (NaN: under MIN_TRAIN_POINTS logged steps in the window, under 2 held-out batches)
    leaves --tol alone as the band, and with no --tol an infinite one: unknown noise flags nothing."""
    unknown = 0.0 if tol > 0 else math.inf
    t = train_se if np.isfinite(train_se) else unknown
    h = heldout_se if np.isfinite(heldout_se) else unknown
    return max(tol, z * t), max(tol, z * float(np.hypot(t, h)))


def measurable(train_se: float, heldout_se: float, tol: float = 0.0) -> bool:
    """Whether bands() can judge a step: both standard errors measured, or a --tol floor given."""
    return tol > 0 or bool(np.isfinite(train_se) and np.isfinite(heldout_se))


def verdict(train_delta: float, heldout_delta: float, tol: float = 0.0, *, train_se: float = 0.0,
            heldout_se: float = 0.0, z: float = Z) -> Optional[str]:
    """Deltas are B - A (negative: B is better). Two clean runs differing only in seed move their
    training and held-out losses together (both measure the same model's quality), so the gap
    train_delta - heldout_delta is noise. The memorization signature of a data bug (DESIGN §4
    bug 1: Poisson resampling lowered training loss, not held-out): B's training loss gained on
    its held-out loss beyond the gap's noise band, while not getting worse beyond its own band."""
    band_t, band_g = bands(train_se, heldout_se, z, tol)
    gap = train_delta - heldout_delta
    if gap < -band_g and train_delta < band_t:
        return (f"training loss {train_delta:+.3f} vs held-out {heldout_delta:+.3f}: B's training loss gained "
                f"{-gap:.3f} nats on its held-out loss, noise band {band_g:.3f} (memorization signature: "
                "check the data order)")
    return None


def write_report(rows: list[dict], out_dir: str, title: str, notes: Sequence[str] = ()) -> dict:
    """report.md, report.csv and report.png (training-loss delta and held-out delta by step)."""
    import csv
    cols = list(dict.fromkeys(k for r in rows for k in r))
    paths = {k: os.path.join(out_dir, f"report.{k}") for k in ("md", "csv", "png")}

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

    for kind, write in (("csv", csv_), ("md", md), ("png", png)):
        with atomic.replacing(paths[kind]) as tmp:
            write(tmp)
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
