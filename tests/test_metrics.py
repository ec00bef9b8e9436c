"""What a run prints: the MFU peak, the moving-window tokens/s and ETA, and the log filter.

A fake clock and a fake peak measurement stand in for time and the matmul, so every figure
below is exact arithmetic on the scripted step times (the reference), never a timing.
"""
import json
import logging as std_logging
import math
import os
import sys
import time
import types

import numpy as np
import pytest
from absl import flags
from absl import logging as absl_logging

from olmo3 import logs, metrics


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t

    def advance(self, seconds):
        self.t += seconds


class FakeMeasure:
    """A matmul peak measurement returning scripted FLOP/s, taking `cost` fake seconds each."""

    def __init__(self, clock, values, cost=0.5):
        self.clock, self.values, self.cost, self.calls = clock, list(values), cost, 0

    def __call__(self, repeats):
        self.clock.advance(self.cost)
        value = self.values[min(self.calls, len(self.values) - 1)]
        self.calls += 1
        return value


def run_steps(step_clock, clock, times, start=0):
    out = []
    for i, dt in enumerate(times):
        clock.advance(dt)
        out.append(step_clock.step_done(start + i + 1))
    return out


FLOPS = {"writeup": 150e9, "sliding": 120e9}   # per step
TOKENS = 2048


def test_peak_too_low_is_remeasured_not_clamped():
    """A busy machine measures 100 GFLOP/s at start; a 1 s step of 150 GFLOP proves that wrong.
    The step triggers a re-measurement (200 now), MFU is 150/200, and the 0.5 s of measuring is
    billed to no step."""
    clock = FakeClock()
    measure = FakeMeasure(clock, [100e9, 200e9])
    peak = metrics.PeakFlops(device_kind="cpu", measure=measure, clock=clock, early_steps=0)
    assert peak.value == 100e9 and measure.calls == 1 and "measured" in peak.describe()
    sc = metrics.StepClock(TOKENS, FLOPS, 1, peak, clock=clock)
    m1, m2 = run_steps(sc, clock, [1.0, 1.0])
    assert measure.calls == 2 and peak.value == 200e9
    assert m1["perf/mfu_writeup"] == pytest.approx(150 / 200)
    assert m1["perf/mfu_sliding"] == pytest.approx(120 / 200)
    assert m1["perf/peak_tflops_per_device"] == pytest.approx(0.2)
    assert m2["perf/step_time_s"] == pytest.approx(1.0)        # the measurement is not in it
    assert measure.calls == 2                                   # 75% needs no re-measurement


def test_step_faster_than_any_measurement_becomes_the_peak(caplog):
    """If the matmul never reaches what a step did, the step's rate is the peak: MFU 100%, and a
    line says so; never a figure above 100%."""
    clock = FakeClock()
    peak = metrics.PeakFlops(device_kind="cpu", measure=FakeMeasure(clock, [100e9]), clock=clock,
                             early_steps=0)
    sc = metrics.StepClock(TOKENS, FLOPS, 1, peak, clock=clock)
    with caplog.at_level(std_logging.INFO, logger="absl"):   # absl logs through its own logger
        (m,) = run_steps(sc, clock, [1.0])
    assert peak.value == pytest.approx(150e9)
    assert m["perf/mfu_writeup"] == pytest.approx(1.0)
    assert any("above the peak" in r.getMessage() for r in caplog.records)


def test_flag_peak_too_low_warns_and_rises(caplog):
    """--peak_tflops below what a step reached: a warning, and the step's rate as the peak."""
    clock = FakeClock()
    peak = metrics.PeakFlops(0.1, device_kind="NVIDIA H200", clock=clock)   # 100 GFLOP/s
    sc = metrics.StepClock(TOKENS, FLOPS, 1, peak, clock=clock)
    with caplog.at_level(std_logging.WARNING, logger="absl"):
        (m,) = run_steps(sc, clock, [1.0])
    assert m["perf/mfu_writeup"] == pytest.approx(1.0) and "raised" in peak.describe()
    assert any(r.levelno == std_logging.WARNING and "above the peak" in r.getMessage() for r in caplog.records)


def test_early_and_periodic_remeasurements():
    """Short measurements after the first `early_steps` steps, then one per `refresh_s`; the
    peak is the best of all (a low one, from a busy moment, never lowers it)."""
    clock = FakeClock()
    measure = FakeMeasure(clock, [50e9, 80e9, 60e9, 90e9, 40e9, 95e9, 30e9], cost=0.1)
    peak = metrics.PeakFlops(device_kind="cpu", measure=measure, clock=clock, early_steps=3,
                             refresh_s=100.0)
    sc = metrics.StepClock(TOKENS, {"writeup": 1e9}, 1, peak, clock=clock)
    run_steps(sc, clock, [10.0] * 3)
    assert measure.calls == 1 + 3 and peak.value == 90e9           # max(50, 80, 60, 90)
    run_steps(sc, clock, [10.0] * 9, start=3)                      # 90 s: not yet due
    assert measure.calls == 4
    run_steps(sc, clock, [10.0] * 2, start=12)                     # past 100 s: one more
    assert measure.calls == 5 and peak.value == 90e9               # 40 does not lower it


def test_mfu_never_above_100_percent_on_a_noisy_machine():
    """Random step times and random (often low) peak measurements: no step's MFU, raw or
    windowed, exceeds 1 in either convention."""
    rng = np.random.default_rng(0)
    clock = FakeClock()
    measure = FakeMeasure(clock, list(rng.uniform(20e9, 160e9, 500)), cost=0.2)
    peak = metrics.PeakFlops(device_kind="cpu", measure=measure, clock=clock, refresh_s=30.0)
    sc = metrics.StepClock(TOKENS, FLOPS, 1, peak, window=7, clock=clock)
    for m in run_steps(sc, clock, rng.uniform(0.8, 3.0, 300)):
        for k in ("perf/mfu_writeup", "perf/mfu_sliding", "perf/mfu_writeup_smoothed",
                  "perf/mfu_sliding_smoothed"):
            assert 0 < m[k] <= 1.0 + 1e-12, (k, m[k])


def test_mfu_of_several_devices_divides_by_all_their_peaks():
    """MFU = a step's FLOPs / its time / (devices x per-device peak), raw and windowed; the rate
    that may raise the peak is the per-device one (4 devices at 37.5 GFLOP/s each against a
    50 GFLOP/s peak: 75%, and nothing raised), never the whole job's 150."""
    clock = FakeClock()
    peak = metrics.PeakFlops(0.05, device_kind="cpu", clock=clock)   # --peak_tflops: no measuring
    sc = metrics.StepClock(TOKENS, FLOPS, 4, peak, window=4, clock=clock)
    _, m = run_steps(sc, clock, [30.0, 1.0])   # the compiling step leaves the window
    assert peak.value == 50e9 and peak.source == "--peak_tflops"
    assert m["perf/peak_tflops_per_device"] == pytest.approx(0.05)
    assert m["perf/tflops_per_s_writeup"] == pytest.approx(0.15)   # the job's, all devices
    assert m["perf/total_tokens"] == 2 * TOKENS                     # after step 2: two steps' tokens
    for convention, flops in FLOPS.items():
        mfu = flops / 1.0 / (4 * 50e9)
        assert m[f"perf/mfu_{convention}"] == pytest.approx(mfu)
        assert m[f"perf/mfu_{convention}_smoothed"] == pytest.approx(mfu)


@pytest.mark.parametrize("kind,tflops", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                         ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                                         ("TPU v5 lite", 197.0), ("TPU v5", 459.0), ("TPU v4", 275.0),
                                         ("TPU v6 lite", 918.0), ("TPU7x", 1153.5),
                                         # NVL parts: their own datasheet line (1,671 with sparsity),
                                         # not the SXM part whose name they extend
                                         ("NVIDIA H100 NVL", 835.0), ("NVIDIA H200 NVL", 835.0),
                                         ("NVIDIA H200 141GB HBM3e", 989.0), ("TPU v5p", 459.0)])
def test_nominal_peak_of_known_devices(kind, tflops):
    """Datasheet figures (dense bf16) by JAX device_kind; no measurement on a known device."""
    def never(repeats):
        raise AssertionError("a known device's peak is never measured")
    peak = metrics.PeakFlops(device_kind=kind, measure=never)
    assert peak.value == tflops * 1e12
    assert kind in peak.describe() and "dense bf16" in peak.describe()
    assert peak.update(1, 0.5 * tflops * 1e12) == 0.0


def test_matmul_peak_is_2n3_over_the_fastest_repeat(monkeypatch):
    """An n x n matmul is n^3 multiply-adds, 2 n^3 FLOPs; of several timed repeats the fastest
    is the peak (load only slows one). Scripted clock: repeats of 0.5, 0.25 and 1.0 s."""
    ticks = iter([0.0, 0.5, 0.5, 0.75, 0.75, 1.75])
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    assert metrics.measure_matmul_peak(16, np.float32, repeats=3) == 2 * 16 ** 3 / 0.25


def test_unknown_and_flag_peaks():
    assert metrics.nominal_peak("cpu") is None and metrics.nominal_peak("TPU v4 lite") is None
    assert metrics.nominal_peak("NVIDIA GeForce RTX 4090") is None   # falls back to measuring
    peak = metrics.PeakFlops(123.0, device_kind="NVIDIA H100 80GB HBM3")
    assert peak.value == 123e12 and "--peak_tflops" in peak.describe()


def test_windowed_tokens_per_s_and_eta():
    """The window's mean step time, not the last step's, drives tokens/s and the ETA; the
    compiling first step leaves the window; evaluations and saves add their last duration."""
    clock = FakeClock()
    peak = metrics.PeakFlops(1.0, device_kind="cpu", clock=clock)   # a flag: no measuring
    sc = metrics.StepClock(TOKENS, {"writeup": 1e9}, 1, peak, window=4, clock=clock)
    times = [30.0, 2.0, 2.0, 2.0, 10.0, 2.0, 2.0, 2.0, 2.0]          # compile, then one slow step
    out = run_steps(sc, clock, times)
    assert [m["perf/step_time_s"] for m in out] == pytest.approx(times)          # raw, per step
    assert [m["perf/tokens_per_s"] for m in out] == pytest.approx([TOKENS / t for t in times])
    for i, m in enumerate(out):                                                   # numpy reference
        window = times[max(1, i - 3):i + 1] if i else times[:1]
        assert m["perf/tokens_per_s_smoothed"] == pytest.approx(TOKENS / np.mean(window))
    assert out[4]["perf/tokens_per_s_smoothed"] == pytest.approx(TOKENS / 4.0)  # 2,2,2,10
    # ETA at step 9 of 100, eval every 10, save every 25: brute-force count of what is left.
    with sc.excluded("eval"):
        clock.advance(7.0)
    with sc.excluded("save"):
        clock.advance(3.0)
    step, max_steps = 9, 100
    evals = sum(1 for s in range(step + 1, max_steps + 1) if s % 10 == 0 or s % 25 == 0 or s == max_steps)
    saves = sum(1 for s in range(step + 1, max_steps + 1) if s % 25 == 0 or s == max_steps)
    expect = np.mean(times[-4:]) * (max_steps - step) + 7.0 * evals + 3.0 * saves
    assert sc.eta_s(step, max_steps, 10, 25) == pytest.approx(expect)
    # At a save step (25) its own save is still ahead of the line: counted. At the last step too.
    assert sc.eta_s(25, 100, 10, 25) - sc.eta_s(26, 100, 10, 25) == pytest.approx(np.mean(times[-4:]) + 3.0)
    assert sc.eta_s(100, 100, 10, 25) == pytest.approx(3.0)
    clock.advance(2.0)
    assert sc.step_done(10)["perf/step_time_s"] == pytest.approx(2.0)   # eval and save not billed
    # downstream evaluations every 20 steps add theirs; a resumed clock, seeded with the durations
    # its checkpoint recorded, counts evaluations and saves before it has timed one itself
    with sc.excluded("downstream"):
        clock.advance(11.0)
    downstream = sum(1 for s in range(11, 101) if s % 20 == 0)
    assert sc.eta_s(10, 100, 10, 25, 20) == pytest.approx(sc.eta_s(10, 100, 10, 25) + 11.0 * downstream)
    resumed = metrics.StepClock(TOKENS, {"writeup": 1e9}, 1, peak, window=4, clock=clock)
    resumed.last.update({"eval": 7.0, "save": 3.0})
    run_steps(resumed, clock, [50.0])   # the compiling step alone: no ETA from it
    assert math.isnan(resumed.eta_s(9, 100, 10, 25))
    run_steps(resumed, clock, [2.0])
    assert resumed.eta_s(9, 100, 10, 25) == pytest.approx(2.0 * 91 + 7.0 * evals + 3.0 * saves)


@pytest.mark.parametrize("step,max_steps", [(0, 1), (0, 200), (3, 6), (7, 7), (49, 201), (99, 100)])
@pytest.mark.parametrize("intervals", [(1,), (3,), (50,), (50, 100), (3, 4), (7, 1000)])
def test_events_left_against_brute_force(step, max_steps, intervals):
    expect = sum(1 for s in range(step + 1, max_steps + 1)
                 if any(s % i == 0 for i in intervals) or s == max_steps)
    assert metrics._events_left(step, max_steps, *intervals) == expect


def test_progress_line_shows_the_window_and_jsonl_keeps_raw(tmp_path, capsys):
    import json
    w = metrics.MetricsWriter(str(tmp_path))
    w.write(5, {"train/loss": 3.0, "perf/tokens_per_s": 100.0, "perf/tokens_per_s_smoothed": 800.0,
                "perf/mfu_writeup": 0.1, "perf/mfu_writeup_smoothed": 0.4}, eta_s=math.nan)
    w.close()
    line = capsys.readouterr().err.strip()
    assert line == "step       5 | loss 3.0000 | 800 tok/s | MFU 40.0%"   # no ETA when unknown
    assert json.loads(open(tmp_path / "metrics.jsonl").readline())["perf/tokens_per_s"] == 100.0


def _record(path, level):
    return std_logging.LogRecord("absl", level, path, 1, "msg", None, None)


def test_log_filter_keeps_ours_and_warnings():
    ours = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(metrics.__file__))),
                        "olmo3", "checkpoint.py")
    library = "/usr/lib/python3/site-packages/orbax/checkpoint/checkpoint_manager.py"
    f = logs._OursOrWarnings()
    assert logs.is_ours(ours) and not logs.is_ours(library)
    assert f.filter(_record(ours, std_logging.INFO))
    assert not f.filter(_record(library, std_logging.INFO))
    assert f.filter(_record(library, std_logging.WARNING)) and f.filter(_record(library, std_logging.ERROR))


def _raised(raiser: str, error: str, caller: str):
    """exc_info of `error` raised by a function compiled as file `raiser`, called from one compiled as
    file `caller`: a traceback whose frames' files are known."""
    names = {}
    exec(compile(f"def inner():\n    raise {error}('bad input')\n", raiser, "exec"), names)
    exec(compile("def outer(f):\n    f()\n", caller, "exec"), names)
    try:
        names["outer"](names["inner"])
    except Exception:
        return sys.exc_info()


def test_orbax_copy_of_our_bad_input_is_dropped_and_no_other_error():
    """Orbax logs an error of its writer thread with the traceback, and hands it to the main thread.
    Dropped: only a ValueError (a bad input, which cli.py reports as one line) whose innermost frame
    is ours (convert.py's lazy tensors). Kept: any other error, and a ValueError a library raised."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(metrics.__file__)))
    ours, numpy_file = os.path.join(root, "olmo3", "hf.py"), "/usr/lib/python3/site-packages/numpy/x.py"
    orbax = "/usr/lib/python3/site-packages/orbax/checkpoint/_src/futures/future.py"

    def kept(exc_info):
        return logs._OursOrWarnings().filter(std_logging.LogRecord("absl", std_logging.ERROR, orbax, 1, "failed",
                                                                   None, exc_info))
    assert not kept(_raised(ours, "ValueError", orbax))
    assert kept(_raised(ours, "OSError", orbax))                # a disk error: Orbax's record is the report
    assert kept(_raised(numpy_file, "ValueError", ours))        # innermost frame not ours
    assert kept(None)


def test_processes_other_than_0_log_warnings_only(monkeypatch):
    """OLMo-core's default (LogFilterType.rank0_only): INFO from process 0 only, warnings and
    errors from every process; nothing filtered under --verbosity."""
    handler = absl_logging.get_absl_handler()
    monkeypatch.setattr(handler, "filters", list(handler.filters))   # restored after the test
    ours = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(metrics.__file__))), "train.py")
    keeps = lambda level: all(f.filter(_record(ours, level)) for f in handler.filters)
    assert not logs.quiet_other_processes(0) and keeps(std_logging.INFO)
    monkeypatch.setattr(logs, "library_logs_requested", lambda: True)
    assert not logs.quiet_other_processes(1) and keeps(std_logging.INFO)
    monkeypatch.setattr(logs, "library_logs_requested", lambda: False)
    assert logs.quiet_other_processes(1)
    assert not keeps(std_logging.INFO) and not keeps(std_logging.DEBUG)
    assert keeps(std_logging.WARNING) and keeps(std_logging.ERROR)


def test_progress_line_of_an_evaluation_only_step(tmp_path, capsys):
    # --eval_at_start logs the starting model's held-out metrics as step 0, before any train step:
    # no loss, throughput or MFU exists yet, so none is printed (once: "loss nan | 0 tok/s | MFU nan%")
    w = metrics.MetricsWriter(str(tmp_path))
    w.write(0, {"eval/heldout/loss": 0.6931, "eval/heldout/rewards/accuracy": 0.0})
    w.write(10, {"train/loss": 0.5, "perf/tokens_per_s": 80.0, "perf/mfu_writeup": 0.25,
                 "train/rewards/accuracy": 0.875, "train/rewards/margin": 1.25, "eval/heldout/loss": 0.625})
    w.close()
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["step       0 | held-out heldout 0.693",
                     "step      10 | loss 0.5000 | 80 tok/s | MFU 25.0% | acc 0.875 margin 1.2500 | held-out heldout 0.625"]


def test_tensorboard_events_are_written_without_importing_torch(tmp_path):
    # A fresh process where torch is installed (the test extras): writing TensorBoard events
    # must not import it (olmo3.metrics._import_tensorboardx), and torch must still import after.
    # The oracle for the event file is TensorBoard's own Event proto, as tensorboardX ships it.
    import struct
    import subprocess
    import sys
    pytest.importorskip("torch")
    event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")
    # Nor boto3 and google.cloud.storage (tensorboardX's s3:// / gs:// writers), when installed.
    code = ("import sys; from olmo3 import metrics; w = metrics.MetricsWriter(sys.argv[1]); "
            "w.write(7, {'train/loss': 2.5, 'perf/tokens_per_s': 100.0}); w.close(); "
            "print(any(m in sys.modules for m in ('torch', 'boto3', 'google.cloud.storage'))); "
            "import torch; print(torch.__name__)")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["False", "torch"]
    (name,) = os.listdir(tmp_path / "tb")
    data = (tmp_path / "tb" / name).read_bytes()
    events, i = [], 0
    while i < len(data):   # TFRecord framing: u64 length, u32 crc, payload, u32 crc
        (n,) = struct.unpack("<Q", data[i:i + 8])
        events.append(event_pb2.Event.FromString(data[i + 12:i + 12 + n]))
        i += 12 + n + 4
    scalars = {(e.step, v.tag): v.simple_value for e in events for v in e.summary.value}
    assert scalars == {(7, "train/loss"): 2.5, (7, "perf/tokens_per_s"): 100.0}


def _events(path):
    """TensorBoard events of one file (TFRecord framing: u64 length, u32 crc, payload, u32 crc)."""
    import struct
    event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")
    data, events, i = open(path, "rb").read(), [], 0
    while i + 12 <= len(data):
        (n,) = struct.unpack("<Q", data[i:i + 8])
        if i + 12 + n > len(data):
            break   # a record cut short
        events.append(event_pb2.Event.FromString(data[i + 12:i + 12 + n]))
        i += 12 + n + 4
    return events


def test_a_torn_metrics_line_is_dropped_before_appending_and_skipped_when_read(tmp_path):
    """A writer killed mid-line leaves a fragment without its newline: the resumed run's first row
    was glued onto it and the file could not be read from there on (read_metrics, eval.py
    --compare). Now the writer cuts the fragment off, and a reader skips it."""
    from olmo3.comparison import read_metrics
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 6, "train/loss": 2.0}\n{"step": 7, "train/lo')
    assert read_metrics(str(tmp_path)) == {6: {"step": 6, "train/loss": 2.0}}
    w = metrics.MetricsWriter(str(tmp_path))
    w.write(5, {"train/loss": 2.5})
    w.close()
    assert path.read_text() == '{"step": 6, "train/loss": 2.0}\n{"step": 5, "train/loss": 2.5}\n'
    path.write_text("x" * 70000 + "\n" + "y" * 70000)   # the last newline more than 64 KiB back
    assert metrics.drop_torn_tail(str(path)) == 70000 and path.read_text() == "x" * 70000 + "\n"
    assert metrics.drop_torn_tail(str(path)) == 0
    path.write_text("no newline at all")
    assert metrics.drop_torn_tail(str(path)) == 17 and path.read_text() == ""
    path.write_text('{"step": 1}\n{"step": 2, bad}\n{"step": 3}\n')   # not at the end: still an error
    with pytest.raises(ValueError, match="metrics.jsonl:2: not JSON"):
        read_metrics(str(tmp_path))


def test_read_metrics_streams_and_keeps_only_the_asked_metrics(tmp_path):
    """eval.py --compare reads train/loss alone: the log is streamed and the other metrics are never
    held (a stage-1 run's ~1 GB metrics.jsonl parsed whole is ~2.5 GB of Python objects)."""
    import tracemalloc

    from olmo3.comparison import read_metrics
    rng = np.random.default_rng(0)
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(1, 4001):
            rec = {"step": step, "train/loss": float(rng.random())}
            rec.update({f"optim/layer{i}/grad_norm": float(rng.random()) for i in range(40)})
            f.write(json.dumps(rec) + "\n")
        f.write(json.dumps({"step": 4000, "train/loss": 9.0}) + "\n")   # a resumed run's line wins
    size = os.path.getsize(tmp_path / "metrics.jsonl")
    tracemalloc.start()
    got = read_metrics(str(tmp_path), keys=("train/loss",))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(got) == 4000 and got[4000] == {"train/loss": 9.0} and set(got[1]) == {"train/loss"}
    assert peak < size / 3, (peak, size)   # 0.17x here; parsed whole, 2.5x the file
    assert read_metrics(str(tmp_path))[1]["optim/layer3/grad_norm"] > 0   # all metrics by default
    # a resumed run's line of owed evaluations at its restart step: merged into the step's values,
    # and with keys=("train/loss",) it keeps none of them, so it must leave the step's loss alone
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4000, "eval/all/loss": 3.0}) + "\n")
    assert read_metrics(str(tmp_path), keys=("train/loss",))[4000] == {"train/loss": 9.0}
    assert read_metrics(str(tmp_path))[4000]["train/loss"] == 9.0 and read_metrics(str(tmp_path))[4000]["eval/all/loss"] == 3.0


def test_tensorboard_points_are_on_disk_when_written(tmp_path):
    """A run killed after a checkpoint must not lose the TensorBoard points before it, which the
    resumed run does not log again: each step is on disk once write() returns, as its
    metrics.jsonl line is (tensorboardX's SummaryWriter flushed its queue every 120 s)."""
    w = metrics.MetricsWriter(str(tmp_path))
    w.write(1, {"train/loss": 3.0})
    w.write(2, {"train/loss": 2.5, "optim/step_skipped": False})
    (name,) = os.listdir(tmp_path / "tb")
    scalars = {(e.step, v.tag): v.simple_value for e in _events(tmp_path / "tb" / name) for v in e.summary.value}
    assert scalars == {(1, "train/loss"): 3.0, (2, "train/loss"): 2.5, (2, "optim/step_skipped"): 0.0}
    w.close()


def test_a_resumed_writer_purges_the_points_after_the_checkpoint(tmp_path):
    """A resume from checkpoint 4 logs steps 5.. again; the earlier attempt may have logged them
    too. The new event file starts with a purge marker at step 5, so TensorBoard shows the
    resumed run's points only (tensorboardX's purge_step)."""
    metrics.MetricsWriter(str(tmp_path)).close()
    (first,) = os.listdir(tmp_path / "tb")
    time.sleep(1.1)   # event files are named by the second they were opened in
    metrics.MetricsWriter(str(tmp_path), purge_step=5).close()
    (new,) = set(os.listdir(tmp_path / "tb")) - {first}
    assert any(e.step == 5 and e.session_log.status == e.session_log.START for e in _events(tmp_path / "tb" / new))
    assert not any(e.HasField("session_log") for e in _events(tmp_path / "tb" / first))


def test_cpu_model_tells_families_apart():
    """Virtual machines shorten /proc/cpuinfo's model name to a brand; the family / model numbers
    and the matmul instruction sets tell the CPUs that bench.py rows come from apart."""
    from olmo3 import metrics
    x86 = "processor\t: {p}\nvendor_id\t: {v}\ncpu family\t: {f}\nmodel\t\t: {m}\nmodel name\t: {n}\nflags\t\t: {fl}\n"
    spr = x86.format(p=0, v="GenuineIntel", f=6, m=143, n="Intel(R) Xeon(R) Processor", fl="fpu avx2 avx512f amx_tile")
    skx = x86.format(p=0, v="GenuineIntel", f=6, m=85, n="Intel(R) Xeon(R) Processor", fl="fpu avx2 avx512f")
    zen3 = x86.format(p=0, v="AuthenticAMD", f=25, m=1, n="AMD EPYC", fl="fpu avx2")
    zen5 = x86.format(p=0, v="AuthenticAMD", f=26, m=2, n="AMD EPYC", fl="fpu avx2 avx512f avx512_bf16")
    assert metrics.cpu_model(spr + "\n" + spr.replace(": 0", ": 1", 1)) == \
        "Intel(R) Xeon(R) Processor (family 6 model 143; avx2 avx512f amx_tile)"
    assert metrics.cpu_model(skx) == "Intel(R) Xeon(R) Processor (family 6 model 85; avx2 avx512f)"
    assert metrics.cpu_model(zen3) == "AMD EPYC (family 25 model 1; avx2)"
    assert metrics.cpu_model(zen5) == "AMD EPYC (family 26 model 2; avx2 avx512f avx512_bf16)"
    graviton3 = ("processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd sve bf16 i8mm\nCPU implementer\t: 0x41\n"
                 "CPU architecture: 8\nCPU variant\t: 0x1\nCPU part\t: 0xd40\nCPU revision\t: 1\n")
    assert metrics.cpu_model(graviton3).endswith("(implementer 0x41 part 0xd40; asimd sve bf16 i8mm)")


def test_cpu_mfu_is_the_hosts():
    """On a CPU the host devices share the cores the measured one-device matmul already uses:
    one peak per process, not per host device (8 here, conftest), and the line says so."""
    import jax

    from olmo3 import metrics
    assert jax.device_count() == 8 and metrics.peak_units(jax.device_count()) == 1
    peak = metrics.PeakFlops(2.0, device_kind="cpu")
    assert peak.describe() == "peak 2 TFLOP/s per host (--peak_tflops)"


def test_benign_warnings_top_level_scripts_and_the_cpp_log_level(monkeypatch):
    """Library warnings in BENIGN_WARNINGS are dropped (others kept, ours always); a file beside
    the __main__ script (train.py, eval.py) is ours, one elsewhere is not; quiet_library_logs
    sets XLA's C++ level to WARNING unless the environment chose one, and changes nothing under
    --verbosity."""
    library = "/usr/lib/python3/site-packages/orbax/checkpoint/checkpoint_manager.py"
    ours = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(metrics.__file__))), "olmo3", "checkpoint.py")
    f = logs._OursOrWarnings()

    def record(path, msg):
        return std_logging.LogRecord("absl", std_logging.WARNING, path, 1, msg, None, None)
    for benign in ("Given directory is read only=/runs/a/checkpoints", "Type handler registry overriding type x"):
        assert not f.filter(record(library, benign)) and f.filter(record(ours, benign))
    assert f.filter(record(library, "Given a directory that is not read only"))
    for package in ("olmo3", "data", "benchmarks"):   # every package of ours keeps its INFO lines
        path = os.path.join(os.path.dirname(os.path.dirname(ours)), package, "x.py")
        assert logs.is_ours(path) and f.filter(std_logging.LogRecord("absl", std_logging.INFO, path, 1, "m", None, None))
    assert not f.filter(std_logging.LogRecord("absl", std_logging.INFO, library, 1, "m", None, None))
    monkeypatch.setattr(sys.modules["__main__"], "__file__", "/work/scripts/train.py", raising=False)
    assert logs.is_ours("/work/scripts/eval.py") and not logs.is_ours("/work/other/eval.py")
    assert not logs.is_ours("/work/scripts/.venv/lib/python3.11/site-packages/orbax/x.py")   # below it: a library
    handler = absl_logging.get_absl_handler()
    monkeypatch.setattr(handler, "filters", list(handler.filters))   # restored after the test
    if flags.FLAGS.is_parsed():
        monkeypatch.setattr(flags.FLAGS, "showprefixforinfo", flags.FLAGS.showprefixforinfo)
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    monkeypatch.setattr(logs, "library_logs_requested", lambda: True)
    assert not logs.quiet_library_logs() and "TF_CPP_MIN_LOG_LEVEL" not in os.environ
    monkeypatch.setattr(logs, "library_logs_requested", lambda: False)
    assert logs.quiet_library_logs() and os.environ["TF_CPP_MIN_LOG_LEVEL"] == "1"
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    assert logs.quiet_library_logs() and os.environ["TF_CPP_MIN_LOG_LEVEL"] == "0"


def test_host_peak_rss_is_the_kernels_high_water_mark_in_gb():
    """mem/host_peak_rss_gb: getrusage's ru_maxrss is in KiB on Linux; the kernel's VmHWM (kB) is
    the reference. A wrong unit was a 1024x error that nothing checked."""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("no /proc (not Linux)")
    got = metrics.memory_bytes()["mem/host_peak_rss_gb"]
    with open("/proc/self/status") as f:
        hwm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    assert got == pytest.approx(hwm_kb / 2**20, rel=0.05)


def _after_an_excluded(kind: str, seconds: float):
    """A StepClock past its compile step and one more, then `seconds` of `kind` (eval, downstream)."""
    clock = FakeClock()
    sc = metrics.StepClock(TOKENS, {"writeup": 1e9}, 1, metrics.PeakFlops(1.0, device_kind="cpu", clock=clock),
                           window=4, clock=clock)
    run_steps(sc, clock, [30.0, 2.0])
    with sc.excluded(kind):
        clock.advance(seconds)
    return sc, clock


def test_excluded_time_is_billed_to_no_step_and_only_once():
    """An evaluation's time leaves the one step it fell in, not every later step too (their step
    times fell toward 0 and tokens/s and MFU grew without bound); a measured peak's re-measurements
    likewise."""
    sc, clock = _after_an_excluded("eval", 7.0)
    out = run_steps(sc, clock, [2.0, 3.0, 4.0], start=2)
    assert [m["perf/step_time_s"] for m in out] == pytest.approx([2.0, 3.0, 4.0])
    clock = FakeClock()
    peak = metrics.PeakFlops(device_kind="cpu", measure=FakeMeasure(clock, [1e15], cost=0.5), clock=clock,
                             early_steps=3)
    sc = metrics.StepClock(TOKENS, {"writeup": 1e9}, 1, peak, clock=clock)
    assert [m["perf/step_time_s"] for m in run_steps(sc, clock, [10.0] * 6)] == pytest.approx([10.0] * 6)


def test_downstream_eta_at_a_downstream_step_counts_only_those_still_ahead():
    """At step 20 with downstream evaluations every 20 steps to 100, four are ahead (40 ... 100):
    the one that just ran is not counted again."""
    sc, _ = _after_an_excluded("downstream", 11.0)
    assert sc.eta_s(20, 100, 1000, 1000, 20) - sc.eta_s(20, 100, 1000, 1000) == pytest.approx(4 * 11.0)


def test_jsonl_skips_blank_lines_and_refuses_non_objects(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1}\n\n   \n{"step": 2}\n')
    assert metrics.read_jsonl(str(p)) == [{"step": 1}, {"step": 2}]
    p.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match="m.jsonl:2: a JSON list, not an object"):
        metrics.read_jsonl(str(p))


def test_an_eta_over_a_day_shows_its_days():
    assert metrics._hms(2 * 86400 + 3 * 3600 + 4 * 60 + 5.0) == "2d 03:04:05"
    assert metrics._hms(59.0) == "00:00:59"
