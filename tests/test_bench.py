"""Smoke test of bench.py's whole code path (ours + transformers/torch, --steps=1) on a toy config.

Not a timing test: it checks that the real step and the reference both run, that the FLOP count
behind the reported TFLOP/s is the write-up convention computed here by hand, and the exact
format of the machine-readable last line. And that the torch reference is like for like: its
parameter and compute dtypes, its device (and so its float8 emulation), its untimed steps and
its document masks (its logits against ours, weights copied over).
"""
import json
import math
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAST = re.compile(r"^tokens_per_s=(\S+) torch_tokens_per_s=(\S+) ratio=(\S+) "
                  r"mfu_measured=(\S+) mfu_nominal=(\S+)$")
D, L, H, HD, MLP, V, B, T = 64, 4, 2, 32, 128, 512, 2, 64


TOY = [f"--d_model={D}", f"--n_layers={L}", f"--n_heads={H}", f"--n_kv_heads={H}", f"--head_dim={HD}",
       f"--mlp_hidden={MLP}", "--window=16", f"--vocab_size={V}", f"--batch={B}", f"--seq_len={T}"]


def bench(*extra):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench.py"), "--model=tiny", *TOY,
           "--loss_chunk=48", "--remat=none", "--steps=1", "--warmup=1", "--matmul_n=128", *extra]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


def json_from(code, *args, devices=None, timeout=120):
    """The JSON last line of `code` run as a script with ROOT and `args` as its arguments, in a
    fresh process on the CPU (with `devices` host devices)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    out = subprocess.run([sys.executable, "-c", code, ROOT, *args], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_bench(*extra):
    out = bench(*extra)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()


def test_bench_smoke_with_torch():
    """Both frameworks with float8 linears (the stage-3 recipe): ours, and torchao's on the torch
    model's 7 projections per layer, its LM head left alone as OLMo-core leaves it."""
    lines = run_bench("--compare_torch", "--torch_attention=eager", "--torch_threads=1", "--float8")
    assert f"torch: torchao Float8Linear on {7 * L} linears (emulated)" in lines
    assert any(line.startswith("config:") and "float8=True" in line for line in lines)
    m = LAST.match(lines[-1])
    assert m, f"last line not machine-readable: {lines[-1]!r}"
    tps, ttps, ratio, mfu, mfu_nominal = map(float, m.groups())
    assert tps > 0 and ttps > 0 and 0 < mfu < 2
    assert ratio == pytest.approx(tps / ttps, rel=1e-3)
    assert mfu_nominal != mfu_nominal  # nan: a CPU has no nominal peak
    assert "x2" in lines[0]            # the step ran sharded over both host devices
    # Write-up FLOPs by hand: 6 x (params without the input embedding) + 6 x seq x q_dim per layer.
    per_layer = 4 * D * H * HD + 2 * H * HD + 3 * D * MLP + 2 * D
    flops_per_token = 6 * (L * per_layer + D + D * V) + 6 * T * H * HD * L
    achieved = next(l for l in lines if l.startswith("ours  writeup FLOPs:"))
    tflops = float(re.search(r"FLOPs: (\S+) TFLOP/s", achieved).group(1))
    # The host's FLOP/s, not per host device: the 2 host devices share the cores, and the matmul
    # peak (one host device) already uses all of them; torch's FLOP/s is the host's too.
    assert tflops * 1e12 == pytest.approx(tps * flops_per_token, rel=2e-3)
    theirs = next(l for l in lines if l.startswith("torch writeup FLOPs:"))
    assert tflops / float(re.search(r"FLOPs: (\S+) TFLOP/s", theirs).group(1)) == pytest.approx(ratio, rel=2e-3)
    peak = float(re.search(r"^peak: median of \d+ interleaved measurements (\S+) TFLOP/s",
                           "\n".join(lines), re.M).group(1))
    assert mfu == pytest.approx(tflops / peak, rel=2e-3, abs=1e-4)


# bench.py's main with its steps, the torch reference's and the matmul peaks scripted (no model is
# built or timed): every figure it prints is then exact arithmetic on those seconds, checked below
# against the same arithmetic written out from the definitions (tokens / median step, FLOPs by hand).
SCRIPTED = textwrap.dedent(r"""
    import json, os, sys, types
    root, platform, scale, eager_probe, argv = (sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]),
                                                sys.argv[5:])
    sys.path[:0] = [root, root + "/benchmarks"]
    import jax
    import bench
    from olmo3 import metrics
    clock = types.SimpleNamespace(wall=0.0, cpu=0.0)   # only the scripted steps advance it
    bench.time = types.SimpleNamespace(perf_counter=lambda: clock.wall, process_time=lambda: clock.cpu)
    calls = []

    def scripted(name, seconds):
        it = iter(seconds)

        def step():
            dt = next(it) * scale
            clock.wall, clock.cpu = clock.wall + dt, clock.cpu + dt / 2
            calls.append(name)
            return 2.0
        return step

    peaks = iter([1.0, 3.0, 2.0, 5.0])   # the first, then one after each timed step
    metrics.measure_matmul_peak = lambda n, dtype, repeats=5: next(peaks) / scale * 1e9
    # Warmup steps that would wreck a median if timed (compiles), then the timed ones.
    bench.build_ours = lambda config, tokens: (scripted("ours", [100.0, 50.0, 0.3, 0.1, 0.2]), 4)
    torch_s = {"eager": [9.0, 9.0, eager_probe, 0.5, 0.4, 0.6], "sdpa": [7.0, 7.0, 1.0, 0.5, 0.4, 0.6]}
    bench.build_torch = lambda config, tokens, impl, device=None: scripted("torch " + impl, torch_s[impl])
    if platform == "gpu":   # JAX on NVIDIA H100 SXMs; build_ours says the step ran on 4 of them
        jax.devices = lambda *a: [types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")]
    bench.F(["bench", *argv])
    bench.main([])
    print(json.dumps({"calls": calls, "preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")}))
""")


def scripted_bench(platform, *flags, scale=1.0, eager_probe=2.0):
    """SCRIPTED's run; the last line of stdout is {"calls": the steps in order, "preallocate": JAX's
    GPU preallocation setting at the end}."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_PREALLOCATE"}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", SCRIPTED, ROOT, platform, str(scale), str(eager_probe), "--model=tiny",
                           *TOY, "--steps=3", "--warmup=2", "--notune_cpu", "--notune_gpu",
                           f"--max_position_embeddings={T}", *flags],   # seq_len may equal it
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_bench_figures_from_scripted_steps(platform):
    """Ours: warmup 100 s and 50 s (untimed), then 0.3, 0.1, 0.2 s: median 0.2 s, not the best
    0.1 or the mean. torch: eager's one probe step (2 s) loses to sdpa's (1 s), then 0.5, 0.4,
    0.6: median 0.5. Matmul peaks 1, 3, 2, 5 (x 1e9 / scale): median 2.5. On a CPU the FLOP/s is
    the host's; on a GPU per device (4 here) against the H100 SXM's dense bf16 989 TFLOP/s."""
    scale = 1.0 if platform == "cpu" else 1e-7   # a GPU-sized step: MFU of the datasheet peak in percent
    out = scripted_bench(platform, "--compare_torch", scale=scale)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    calls = json.loads(lines[-1])["calls"]
    assert calls == (["ours"] * 2 + ["torch eager"] * 3 + ["torch sdpa"] * 3 + ["ours", "torch sdpa"] * 3)
    assert "torch: timing attn_implementation=sdpa" in lines
    from olmo3 import metrics   # DESIGN §7: a CPU figure names the CPU
    assert (f"device: cpu cpu ({metrics.cpu_model()}) x2 |" if platform == "cpu"
            else "device: gpu NVIDIA H100 80GB HBM3 x2 |") in lines[0], lines[0]
    tokens = B * T
    med, tmed, peak = 0.2 * scale, 0.5 * scale, 2.5e9 / scale
    per_layer = 4 * D * H * HD + 2 * H * HD + 3 * D * MLP + 2 * D
    dense = 6 * (L * per_layer + D + D * V)
    i, j = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
    keys = {"sliding": ((j <= i) & (i - j < 16)).sum() / T, "full": (j <= i).sum() / T}   # window 16
    flops = {"writeup": dense + 6 * T * H * HD * L,
             "sliding": dense + 12 * H * HD * (3 * keys["sliding"] + keys["full"])}   # 3 sliding + 1 full
    devices = 1 if platform == "cpu" else 4
    nominal = float("nan") if platform == "cpu" else 989e12
    for c in ("writeup", "sliding"):
        line = next(l for l in lines if l.startswith(f"ours  {c:>7s} FLOPs:"))
        rate = flops[c] * tokens / med / devices
        assert float(re.search(r"FLOPs: (\S+) TFLOP/s", line).group(1)) * 1e12 == pytest.approx(rate, rel=1e-3)
        mfu_pct = float(re.search(r"MFU ([\d.]+)% of measured", line).group(1))
        assert mfu_pct == pytest.approx(100 * rate / peak, abs=0.05)
        assert ("of nominal" in line) == (platform == "gpu")
    # torch: one process on one device, its FLOP/s against the same peak
    line = next(l for l in lines if l.startswith("torch writeup FLOPs:"))
    torch_rate = flops["writeup"] * tokens / tmed
    assert float(re.search(r"FLOPs: (\S+) TFLOP/s", line).group(1)) * 1e12 == pytest.approx(torch_rate, rel=1e-3)
    assert float(re.search(r"MFU ([\d.]+)% of measured", line).group(1)) == pytest.approx(100 * torch_rate / peak,
                                                                                         abs=0.05)
    assert f"ours/torch: {tmed / med:.2f}x tokens/s, {tmed / med:.2f}x tokens/CPU-second" in line   # 2.50x, not 0.40x
    m = LAST.match(lines[-2])
    assert m, lines[-2]
    tps, ttps, ratio, mfu, mfu_nominal = map(float, m.groups())
    assert tps == pytest.approx(tokens / med, rel=1e-5) and ttps == pytest.approx(tokens / tmed, rel=1e-5)
    assert ratio == pytest.approx(tmed / med, rel=1e-4)
    assert mfu == pytest.approx(flops["writeup"] * tokens / med / devices / peak, abs=1e-4)
    assert mfu_nominal == pytest.approx(flops["writeup"] * tokens / med / devices / nominal, abs=1e-4, nan_ok=True)
    # gpu_check.py's bench rows read these figures back from bench.py's output
    from benchmarks import gpu_check
    text = "\n".join(lines[:-1])
    r = gpu_check.parse_bench(text, text + out.stderr)
    assert r["step_s"] == pytest.approx(med, abs=5e-4) and r["tokens_per_s"] == tps
    assert r["mfu_sliding_measured"] == pytest.approx(flops["sliding"] * tokens / med / devices / peak, abs=5e-4)
    assert r["mfu_sliding_nominal"] == pytest.approx(flops["sliding"] * tokens / med / devices / nominal, abs=5e-4,
                                                     nan_ok=True)
    steps = next(l for l in lines if l.startswith("ours : step"))
    per_cpu_s = float(re.search(r"\| ([\d,.]+) tokens/CPU-second", steps).group(1).replace(",", ""))
    assert per_cpu_s == pytest.approx(tokens / (med / 2), rel=1e-5)   # CPU seconds: half the wall ones


def test_bench_without_torch_against_a_given_peak():
    """No --compare_torch: torch is never built, its figures and the ratio are nan on the last line,
    and JAX keeps its default GPU memory preallocation. --peak_tflops=0.001 (no CPU has a table
    entry) is the nominal peak: against it the MFU is 2.5x the one against the measured 2.5 GFLOP/s."""
    out = scripted_bench("cpu", "--peak_tflops=0.001")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert json.loads(lines[-1]) == {"calls": ["ours"] * 5, "preallocate": None}
    assert not any(line.startswith("torch") for line in lines), lines
    tps, ttps, ratio, mfu, mfu_nominal = map(float, LAST.match(lines[-2]).groups())
    assert tps == pytest.approx(B * T / 0.2, rel=1e-5) and math.isnan(ttps) and math.isnan(ratio)
    assert mfu_nominal == pytest.approx(mfu * 2.5, abs=3e-4)
    assert all("of nominal" in line for line in lines if re.match(r"ours +(writeup|sliding) FLOPs:", line))


def test_bench_torch_flags_pick_what_is_timed():
    """--torch_attention=auto times the implementation whose probe step was faster (eager's 0.5 s
    against sdpa's 1 s), not the one built last; --torch_attention=eager builds and times eager only,
    on --torch_threads threads. With --compare_torch JAX allocates GPU memory as it needs it, so that
    torch on the same GPU has room. Steps of 0.6 s: 128 / 0.6 = 213.33 tokens/s, fractions kept."""
    out = scripted_bench("cpu", "--compare_torch", eager_probe=0.5)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert json.loads(lines[-1])["calls"] == (["ours"] * 2 + ["torch eager"] * 3 + ["torch sdpa"] * 3
                                              + ["ours", "torch eager"] * 3)
    assert "torch: timing attn_implementation=eager" in lines
    out = scripted_bench("cpu", "--compare_torch", "--torch_attention=eager", "--torch_threads=3", scale=3.0)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert json.loads(lines[-1]) == {"calls": ["ours"] * 2 + ["torch eager"] * 2 + ["ours", "torch eager"] * 3,
                                     "preallocate": "false"}
    assert any(re.match(r"torch: attn_implementation=eager\b.*, 3 threads$", line) for line in lines), lines
    tps, ttps = map(float, LAST.match(lines[-2]).groups()[:2])
    assert tps == pytest.approx(B * T / 0.6, abs=0.006) and ttps == pytest.approx(B * T / 1.5, abs=0.006)


@pytest.mark.parametrize("flags,says", [
    # It would time our compile (torch always had an untimed step).
    (["--warmup=0"], "--warmup must be >= 1"),
    # torch's autocast cannot compute wider than its parameters: no like-for-like reference.
    (["--peak_tflops=nan"], "--peak_tflops must be finite and > 0"),
    (["--doc_len=0"], "--doc_len must be >= 1"),   # not "one document per instance"
    (["--param_dtype=bfloat16", "--compute_dtype=float32"], "--compare_torch with --param_dtype=bfloat16 "
                                                            "--compute_dtype=float32")])
def test_bench_refuses_unfair_comparisons(flags, says):
    out = bench("--compare_torch", *flags)
    assert out.returncode == 2, out.stdout[-2000:]
    assert says in out.stderr.strip().splitlines()[-1] and "Traceback" not in out.stderr, out.stderr


def test_bench_rejects_bad_seq_len():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench.py"), "--model=tiny",
                          "--seq_len=100000", "--steps=1"], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "--seq_len=100000 exceeds the model's max_position_embeddings" in out.stderr


@pytest.mark.parametrize("value,nan_step", [("nan", 1), ("nan", 4), ("inf", 4), ("-inf", 4)])
def test_bench_stops_on_a_non_finite_loss(value, nan_step):
    """A benchmark step whose loss is NaN, in the warmup (step 1) or timed (step 4, the second
    timed after 2 warmup steps): it went unseen in the warmup, and timed it ended bench.py with a
    FloatingPointError traceback (exit 1); now cli.NonFiniteError, one line, exit 3, at once. An
    infinite loss (a bf16 overflow) alike."""
    code = textwrap.dedent(r'''
        import sys
        sys.path[:0] = [sys.argv[1], sys.argv[1] + "/benchmarks"]
        value, nan_step, sys.argv = float(sys.argv[2]), int(sys.argv[3]), ["bench.py", *sys.argv[4:]]
        import bench
        from olmo3 import cli
        calls = []
        def build_ours(config, tokens):
            def step():
                calls.append(1)
                print("step", len(calls), flush=True)
                return value if len(calls) == nan_step else 2.0
            return step, 1
        bench.build_ours = build_ours
        cli.run(bench.main)
    ''')
    out = subprocess.run([sys.executable, "-c", code, ROOT, value, str(nan_step), *TOY, "--matmul_n=64", "--warmup=2",
                          "--steps=3"], env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 3 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert f"non-finite loss {value} in the benchmark step" in out.stderr.strip().splitlines()[-1]
    assert out.stdout.count("step ") == nan_step and not any(LAST.match(line) for line in out.stdout.splitlines())


def test_profile_step_trace_dir_the_profiler_cannot_use(tmp_path):
    """--trace_dir whose plugins/ is a file: the profiler failed there after the build, the warmup
    and the traced step (FAILED_PRECONDITION, a traceback)."""
    (tmp_path / "plugins").write_text("")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "profile_step.py"),
                          f"--trace_dir={tmp_path}"], env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert f"{tmp_path / 'plugins'} is not a directory" in out.stderr.strip().splitlines()[-1]


def test_profile_step_names_the_phases(tmp_path):
    """benchmarks/profile_step.py: one traced step of the same toy config, its thunks summed by phase."""
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")   # one host device
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "profile_step.py"), "--model=tiny", f"--d_model={D}",
           f"--n_layers={L}", f"--n_heads={H}", f"--n_kv_heads={H}", f"--head_dim={HD}",
           f"--mlp_hidden={MLP}", "--window=16", f"--vocab_size={V}", f"--batch={B}", f"--seq_len={T}",
           "--remat=none", "--noscan_layers", "--warmup=1", "--top=3", f"--trace_dir={tmp_path}"]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = dict(re.findall(r"^(layers forward|layers backward|lm_head \+ cross entropy)\s+(\S+)\s+\S+$",
                           out.stdout, re.M))
    assert set(rows) == {"layers forward", "layers backward", "lm_head + cross entropy"}, out.stdout
    assert all(float(ms) > 0 for ms in rows.values())   # each phase ran matmuls
    assert len(re.findall(r"^\s+\S+\s+\S+", out.stdout.split("ops (ms, summed over calls):")[1], re.M)) == 3
    traces = list(tmp_path.rglob("*.trace.json.gz"))   # moved whole into plugins/profile/<run>/
    assert traces and all(t.parent.parent == tmp_path / "plugins" / "profile" for t in traces)
    assert sorted(os.listdir(tmp_path)) == ["plugins"]   # the temporary directory it was written to is gone


# The torch reference as bench.py builds it, for one set of flags: one training step through a spy
# on Olmo3ForCausalLM.forward, then what that step ran (dtypes, device, float8 emulation) and, with
# --doc_len, its logits against ours (olmo3.hf.from_hf of its weights, our document masks).
PROBE = textwrap.dedent(r'''
    import json, sys
    root, mode, impls, argv = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4:]
    sys.path[:0] = [root, root + "/benchmarks"]
    import jax, numpy as np, torch, transformers
    if mode == "fake_cuda":   # a host where torch has CUDA but JAX computes on the CPU
        torch.cuda.is_available = lambda: True
    import bench
    bench.F(["bench", *argv])
    cfg, F = bench.config_from_flags(), bench.F
    seen, report = {}, {}
    forward = transformers.Olmo3ForCausalLM.forward

    def spy(self, **kw):
        dev = kw["input_ids"].device.type
        seen.update(model=self, inputs=kw, params=sorted({str(p.dtype) for p in self.parameters()}),
                    devices=sorted({p.device.type for p in self.parameters()}, ) + [dev],
                    autocast=str(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else None,
                    emulate=sorted({m.config.emulate for m in self.modules() if type(m).__name__ == "Float8Linear"}))
        out = forward(self, **kw)
        seen["logits"] = str(out.logits.dtype)
        return out

    transformers.Olmo3ForCausalLM.forward = spy
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (F.batch, F.seq_len), dtype=np.int32)
    for impl in impls:
        bench.build_torch(cfg, tokens, impl)()
        r = report[impl] = {k: seen[k] for k in ("params", "devices", "autocast", "emulate", "logits")}
        if mode == "logits":   # against ours, the weights copied over
            model, kw = seen["model"], {k: v for k, v in seen["inputs"].items() if k != "labels"}
            with torch.no_grad():
                theirs = model(**kw).logits.float().numpy()
                plain = model(input_ids=kw["input_ids"]).logits.float().numpy()   # no document masks
            from olmo3 import hf
            ours_model = hf.from_hf(dict(model.state_dict()), cfg)
            seg = np.broadcast_to(np.arange(F.seq_len, dtype=np.int32) // (F.doc_len or F.seq_len), tokens.shape)
            ours = np.asarray(jax.vmap(lambda t, s: ours_model(t, segment_ids=s))(tokens, seg))
            r.update(err=float(np.abs(theirs - ours).max()), err_unmasked=float(np.abs(plain - ours).max()))
    if mode == "fake_cuda":   # and where JAX computes on the GPU too
        jax.default_backend = lambda: "gpu"
        report["device_if_jax_on_gpu"] = bench.torch_device()
    print(json.dumps(report))
''')


def probe_torch(impls, *flags, mode="cpu"):
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", PROBE, ROOT, mode, impls, "--model=tiny", *TOY,
                          "--torch_threads=1", *flags], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("param_dtype,compute_dtype", [("float32", "bfloat16"), ("bfloat16", "bfloat16")])
def test_torch_reference_runs_our_dtypes(param_dtype, compute_dtype):
    """Its parameters in our parameter dtype, its forward in our compute dtype (autocast where
    they differ): the matmul peak both MFUs divide by is measured in that compute dtype."""
    r = probe_torch("eager", f"--param_dtype={param_dtype}", f"--compute_dtype={compute_dtype}")["eager"]
    assert r["params"] == [f"torch.{param_dtype}"]
    assert r["autocast"] == (f"torch.{compute_dtype}" if param_dtype != compute_dtype else None)
    assert r["logits"] == f"torch.{compute_dtype}"


def test_torch_reference_on_our_device():
    """On a host whose torch has CUDA while JAX computes on the CPU, the reference runs on the CPU
    with float8 emulated; with JAX on the GPU it would run on cuda."""
    r = probe_torch("eager", "--float8", mode="fake_cuda")
    assert r["eager"]["devices"] == ["cpu", "cpu"] and r["eager"]["emulate"] == [True]
    assert r["device_if_jax_on_gpu"] == "cuda"


@pytest.mark.parametrize("doc_len", [24, None])
def test_torch_reference_masks_documents(doc_len):
    """--doc_len: the reference's logits equal ours, window and document masks alike (documents of
    24 tokens, a 16-token window), in both of transformers' attention implementations. Without it
    transformers builds the masks itself, from the config bench.py gives it (sliding_window,
    layer_types): equal too."""
    r = probe_torch("eager,sdpa", *([f"--doc_len={doc_len}"] if doc_len else []), mode="logits")
    for impl in ("eager", "sdpa"):
        assert r[impl]["err"] < 1e-4, r
        if doc_len:
            assert r[impl]["err_unmasked"] > 1e-2, r   # the documents change the logits here


def test_torch_reference_float8_is_real_on_cuda():
    """--float8 with the reference on cuda: torchao's real float8 GEMMs (emulate=False); emulated
    (upcast) on the CPU only. Emulated on an H100, torch would time upcast matmuls against our
    float8 ones (test_torch_reference_on_our_device sees the CPU case)."""
    code = textwrap.dedent(r'''
        import json, sys
        sys.path[:0] = [sys.argv[1], sys.argv[1] + "/benchmarks"]
        import numpy as np, torch, torchao.float8 as f8
        import bench
        bench.F(["bench", *sys.argv[2:]])
        cfg, seen = bench.config_from_flags(), []

        class Stop(Exception):
            pass

        def convert(model, config, module_filter_fn):   # what build_torch asks torchao for; then stop
            seen.append(config.emulate)
            raise Stop
        f8.convert_to_float8_training = convert
        to = torch.nn.Module.to
        torch.nn.Module.to = lambda self, *a, **kw: to(self, dtype=kw.get("dtype"))   # no GPU here: stay put
        for device in ("cuda", "cpu"):
            try:
                bench.build_torch(cfg, np.zeros((2, 64), np.int32), "eager", device)
            except Stop:
                pass
        print(json.dumps(seen))
    ''')
    assert json_from(code, "--model=tiny", *TOY, "--float8") == [False, True]


def test_torch_reference_step_is_ours():
    """The reference step is the recipe's on our parameters: backward, the global grad norm clipped
    to 1.0, then AdamW (lr 3e-4, betas 0.9 / 0.95, eps 1e-8, weight decay 0.1), as our SkipStepAdamW
    step; its LM head untied, as ours (a tied head or no clip is less work per step, and flatters
    torch's tokens/s)."""
    code = textwrap.dedent(r'''
        import json, sys
        sys.path[:0] = [sys.argv[1], sys.argv[1] + "/benchmarks"]
        import numpy as np, torch
        import bench
        bench.F(["bench", *sys.argv[2:]])
        cfg, seen = bench.config_from_flags(), {}
        clip, step = torch.nn.utils.clip_grad_norm_, torch.optim.AdamW.step
        def spy_clip(params, max_norm, *a, **kw):
            seen["clip"] = max_norm
            return clip(params, max_norm, *a, **kw)
        def spy_step(self, *a, **kw):
            seen["adamw"] = {k: self.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")}
            seen["clipped_first"] = "clip" in seen
            theirs = sum(p.numel() for g in self.param_groups for p in g["params"])
            seen["params_beyond_ours"] = theirs - cfg.num_params()
            return step(self, *a, **kw)
        torch.nn.utils.clip_grad_norm_, torch.optim.AdamW.step = spy_clip, spy_step
        tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 64), dtype=np.int32)
        bench.build_torch(cfg, tokens, "eager", "cpu")()
        print(json.dumps(seen))
    ''')
    seen = json_from(code, "--model=tiny", *TOY)
    assert seen == {"clip": 1.0, "clipped_first": True, "params_beyond_ours": 0,
                    "adamw": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}}, seen


def test_our_step_gets_the_flags():
    """--micro_batch, --loss_chunk, --mesh and --doc_len reach the step bench.py builds (a spy on
    sharding.make_train_step and global_batch; no step is run): 4 instances on data:2, 1 per device
    per microbatch: 2 microbatches; documents of 24 tokens: ids 0 x 24, 1 x 24, 2 x 16."""
    code = textwrap.dedent(r'''
        import json, sys
        sys.path[:0] = [sys.argv[1], sys.argv[1] + "/benchmarks"]
        import numpy as np
        import bench
        from olmo3 import sharding
        bench.F(["bench", *sys.argv[2:]])
        cfg, F, seen = bench.config_from_flags(), bench.F, {}
        make, put = sharding.make_train_step, sharding.global_batch
        def spy_make(optimizer, mesh, specs, **kw):
            seen.update(mesh=dict(mesh.shape), microbatches=kw["microbatches"], chunk=kw["chunk"],
                        use_segments=kw["use_segments"])
            return make(optimizer, mesh, specs, **kw)
        def spy_batch(batch, mesh):
            seen["segment_ids"] = np.asarray(batch["segment_ids"])[0].tolist()
            return put(batch, mesh)
        sharding.make_train_step, sharding.global_batch = spy_make, spy_batch
        tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (F.batch, F.seq_len), dtype=np.int32)
        seen["n_devices"] = bench.build_ours(cfg, tokens)[1]
        print(json.dumps(seen))
    ''')
    assert json_from(code, "--model=tiny", *TOY, "--batch=4", "--micro_batch=1", "--loss_chunk=32", "--mesh=data:2",
                     "--doc_len=24", devices=2) == {
        "mesh": {"data": 2, "fsdp": 1}, "microbatches": 2, "chunk": 32, "use_segments": True, "n_devices": 2,
        "segment_ids": [0] * 24 + [1] * 24 + [2] * 16}


_PROFILE_TUNING = """
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/benchmarks"]
import profile_step
from olmo3 import runtime
seen = []
def tune_cpu(*args, **kw):   # its arguments; then stop
    seen.append(kw)
    raise SystemExit
def config_from_flags():   # reached untuned (--notune_cpu): stop before the step is built
    raise SystemExit
runtime.tune_cpu, profile_step.bench.config_from_flags = tune_cpu, config_from_flags
profile_step.F(["profile_step.py", *sys.argv[2:]])
try:
    profile_step.main(["profile_step.py"])
except SystemExit:
    pass
print(json.dumps(seen))
"""


@pytest.mark.parametrize("flags,want", [([], [{"dots": True}]), (["--compute_dtype=bfloat16"], [{"dots": False}]),
                                        (["--notune_cpu"], [])])
def test_profile_step_tunes_the_cpu_as_bench_does(flags, want):
    """profile_step.py traces "exactly the step bench.py times (same flags)": bench.py leaves
    YNNPACK's dots out in bf16 compute (olmo3/runtime.py) and tunes nothing under --notune_cpu;
    profile_step.py called tune_cpu() whatever the flags said."""
    out = subprocess.run([sys.executable, "-c", _PROFILE_TUNING, ROOT, *flags], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == want


def test_bench_splash_flop_report_against_a_dense_mask():
    """benchmarks/bench_splash.py's FLOP table at 7B heads (32 x 128, 24 sliding + 8 full layers),
    seq 2048, window 512: its shares against the dense mask counted tile by tile (1024-token
    tiles, 512-token compute chunks inside them; 256-token tiles, where the chunk is the tile),
    its TFLOP as 12 x pairs x heads x head_dim, and its exact-mask total against
    Config.train_flops_per_token's sliding-aware attention term."""
    import olmo3
    seq, window = 2048, 512
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_splash.py"), "--time_seq=0",
                          f"--seq={seq}", f"--window={window}", "--block=256", "--block=1024"],
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    i, j = np.meshgrid(np.arange(seq), np.arange(seq), indexing="ij")
    masks = {"causal": j <= i, "window": (j <= i) & (i - j < window)}
    share = {(m, b): masks[m].reshape(seq // b, b, seq // b, b).any(axis=(1, 3)).mean()
             for m in masks for b in (256, 512, 1024)}
    assert re.search(rf"causal {masks['causal'].mean():.4f}, window {masks['window'].mean():.4f}$", out.stdout, re.M)
    per_pair, dense_pairs = 12 * 32 * 128 / 1e12, seq * seq          # TFLOP per (query, key) pair, 32 layers
    for block, chunk in ((256, 256), (1024, 512)):
        row = re.search(rf"^\s+{block}\s+(\d+) \|(.*)\|(.*)\|(.*)\|(.*)$", out.stdout, re.M)
        assert row, out.stdout
        tiles, tile_share, chunk_share, tflop, executed = row.groups()
        assert int(tiles) == (seq // block) ** 2
        assert list(map(float, tile_share.split())) == pytest.approx(
            [share["causal", block], share["window", block]], abs=5e-5)
        assert list(map(float, chunk_share.split())) == pytest.approx(
            [share["causal", chunk], share["window", chunk]], abs=5e-5)
        dense, causal_blk, splash_tiles, chunks, skip = tflop.split()
        assert float(dense) == pytest.approx(32 * dense_pairs * per_pair, abs=0.006)
        assert float(causal_blk) == pytest.approx(32 * share["causal", block] * dense_pairs * per_pair, abs=0.006)
        model = {b: (24 * share["window", b] + 8 * share["causal", b]) * dense_pairs * per_pair for b in (block, chunk)}
        assert float(splash_tiles) == pytest.approx(model[block], abs=0.006)
        assert float(chunks) == pytest.approx(model[chunk], abs=0.006)
        saved = 1 - model[chunk] / (32 * dense_pairs * per_pair)
        assert float(skip.rstrip("%")) == pytest.approx(100 * saved, abs=0.6)
        # executed: + the two QK^T recomputations of the backward, 18 FLOPs per pair, not 12
        assert float(executed) == pytest.approx(model[chunk] * 18 / 12, abs=0.006)
    c = olmo3.Config.olmo3_7b(window=window)
    exact = seq * (c.train_flops_per_token(seq, "sliding") - 6 * c.num_params(False)) / 1e12
    exact_dense = (24 * masks["window"].sum() + 8 * masks["causal"].sum()) * per_pair
    assert exact == pytest.approx(exact_dense, rel=1e-9)
    got = float(re.search(r"exact-mask model FLOPs \(no tile waste\): (\S+) TFLOP", out.stdout).group(1))
    assert got == pytest.approx(exact, abs=0.006)


def test_downstream_cost_shapes_are_oe_tasks_batches():
    """benchmarks/downstream_cost.py costs the batches oe_tasks.score runs: a scorer that records
    each batch's shape is the reference. Lengths straddle the 128 multiples (128 and 256 exactly,
    129), with a last batch short of rows (padded to full rows, as _batch pads it)."""
    code = textwrap.dedent(r"""
        import json, sys
        sys.path[:0] = [sys.argv[1], sys.argv[1] + "/benchmarks"]
        import numpy as np
        import downstream_cost
        from olmo3 import oe_tasks
        lengths = [5, 300, 128, 129, 256, 40, 700, 127, 3, 260, 257]   # batches: 700..257, 256..127, 40..3
        rows = [oe_tasks.Row(query=list(range(1, n + 1)), ctx_len=n - 1, continuation=[n], choices=None, requests=[{}])
                for n in lengths]
        seen = []
        def score_fn(model, batch):
            seen.append(list(batch["tokens"].shape))
            return np.zeros(batch["tokens"].shape[0]), np.zeros((batch["tokens"].shape[0], 1))
        oe_tasks.score(score_fn, None, rows, batch_rows=4, pad_id=0)
        print(json.dumps([seen, [list(s) for s in downstream_cost.padded_shapes(rows, 4)]]))
    """)
    seen, costed = json_from(code)
    assert costed == seen == [[4, 768], [4, 256], [4, 128]]


@pytest.mark.parametrize("script, args, says", [
    ("bench_splash.py", ["--time_seq=0", "--block=16384"],
     "--block=16384 does not divide the sequence (8192)"),   # a ZeroDivisionError traceback
    ("bench_splash.py", ["--time_seq=100"], "--time_block=128 does not divide the sequence (100)"),   # the same
    ("bench_splash.py", ["--time_seq=0", "--time_window=999"],
     "--time_window applies to the interpret timing, which --time_seq=0 skips"),   # ignored
    ("bench_remote.py", ["--tokens_per_file=16", "--seq_len=64"],
     "--tokens_per_file=16 holds no instance of --seq_len=64 tokens"),   # it named a temporary file
    ("bench_remote.py", ["--workers="], "--workers must be one or more worker counts"),   # no loader rows
    ("downstream_cost.py", ["--tasks="], "--tasks must be one or more task labels"),      # a total of 0 tasks
    ("downstream_cost.py", ["--devices="], "--devices must be one or more device counts"),  # no cost lines
    ("bench.py", ["--compare_torch", "--torch_threads=0"], "--torch_threads must be >= 1"),  # 0: ignored
    ("bench.py", ["--steps=0"], "--steps must be >= 1"),   # a StatisticsError traceback after the warmup
    ("bench.py", ["--seq_len=1"], "--seq_len must be >= 2"),   # no target token
    ("bench.py", ["--compare_torch", "--torch_threads=-1"], "--torch_threads must be >= 1"),  # after our warmup
    ("profile_step.py", ["--doc_len=-3"], "--doc_len must be >= 1"),   # traced negative segment ids
    ("profile_step.py", ["--steps=7"], "--steps is bench.py's: profile_step.py traces one step"),   # ignored
    ("profile_step.py", ["--compare_torch"], "--compare_torch is bench.py's"),   # ignored
    ("profile_step.py", ["--attention=cudnn"], "cuDNN"),   # a traceback, exit 1
    # The full shapes on a CPU ran every row into its timeout (the kernel rows at 32 heads x 4096
    # in interpret mode, a 1.5B bench.py): 455 s for a table of FAILED rows.
    ("gpu_check.py", ["--only=kernel"], "no NVIDIA GPU for JAX here"),
])
def test_benchmark_bad_flags_are_one_line(script, args, says):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert says in out.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("script, args, lines", [
    ("bench_data.py", ["--prepare_workers=2", "--steps=3", "--loader_workers=0", "--loader_workers=2",
                       "--seq_len=64", "--global_batch=4"],
     [r"prepare stdlib, 2 process\(es\): [\d,]+ docs, [\d,]+ tokens in [\d.]+ s = [\d.]+M tokens/s wall",
      r"train split: [\d,]+ instances of 64 tokens",
      *(rf"loader seq_len=64 global_batch=4 workers={w} filter={f}: [\d.]+M tokens/s \(\d+ steps/s\)"
        for f in ("off", "on ") for w in (0, 2))]),
    ("bench_checkpoint.py", ["--tensors=2", "--mib=4", "--repeats=1", "--saves=1", "--devices_7b=64"],
     [r"finiteness check: 0\.01 GB in \d+ ms \(median of 1, min \d+\): [\d.]+ GB/s",
      r"checksums: 0\.01 GB in \d+ ms \(median of 1, min \d+\): [\d.]+ GB/s",
      r"save with both: median [\d.]+ s of \[[\d.]+\]", r"save without: median [\d.]+ s of \[[\d.]+\]",
      r"7B state 87\.6 GB = 1\.37 GB per device on 64 devices: finiteness check [\d.]+ s, checksums [\d.]+ s"]),
])
def test_data_and_checkpoint_benchmarks_run(script, args, lines):
    """The data and checkpoint benchmarks (README figures) still run against today's APIs, and
    print every figure line they promise, in order."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args], cwd=ROOT,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = [line for line in out.stdout.splitlines() if any(re.match(p, line) for p in lines)]
    assert len(got) == len(lines) and all(re.match(p, g) for p, g in zip(lines, got)), out.stdout


# The data and checkpoint benchmarks with their clocks scripted (the work itself runs, on toy
# sizes): every figure is arithmetic on the scripted seconds, checked against it written out.
SCRIPTED_CHECKPOINT = textwrap.dedent(r"""
    import sys, types
    sys.path[:0] = [sys.argv[1], sys.argv[1] + "/benchmarks"]
    import bench_checkpoint as b
    from olmo3 import checkpoint
    clock = types.SimpleNamespace(t=0.0)
    b.time = types.SimpleNamespace(perf_counter=lambda: clock.t)

    def costs(name, seconds):   # the first call compiles (untimed), then the --repeats timed ones
        real, it = getattr(checkpoint, name), iter(seconds)
        def f(flat):
            clock.t += next(it, 0.0)
            return real(flat)
        setattr(checkpoint, name, f)
    costs("nonfinite_tensors", [100.0, 0.3, 0.1, 0.2])
    costs("tensor_checksums", [50.0, 0.6, 0.2, 0.4])
    b.F(["bench_checkpoint", *sys.argv[2:]])
    b.main([])
""")

SCRIPTED_DATA = textwrap.dedent(r"""
    import sys, types
    import numpy as np
    root, tmp = sys.argv[1], sys.argv[2]
    sys.path[:0] = [root, root + "/benchmarks"]
    import bench_data as b
    import data
    clock = types.SimpleNamespace(t=0.0)
    b.time = types.SimpleNamespace(perf_counter=lambda: clock.t)
    b._cpu_seconds = lambda: clock.t / 4   # a quarter of the wall seconds on the CPU

    def prepare(corpus, out_dir, workers, progress):
        clock.t += 2.0
        return {"splits": {"train": {"tokens": 3_000_000, "documents": 70},
                           "heldout/code": {"tokens": 1_000_000, "documents": 30}}}
    b.prep.prepare = prepare
    np.arange(64 * 40, dtype=np.uint32).tofile(tmp + "/t.npy")
    b.data.open_split = lambda out_dir, split, seq_len: data.FSLDataset([tmp + "/t.npy"], seq_len)

    class Loader(data.Loader):   # the first batch of each loader: start-up, untimed
        def __next__(self):
            clock.t += 5e-7 if getattr(self, "started", False) else 100.0
            self.started = True
            return super().__next__()
    b.data.Loader = Loader
    b.FLAGS(["bench_data", *sys.argv[3:]])
    b.main([])
""")


def test_checkpoint_and_data_benchmark_figures_from_scripted_clocks(tmp_path):
    """bench_checkpoint: checks of 0.3, 0.1, 0.2 s (after a 100 s compile) are a median of 0.2 s,
    so 2 x 4 MiB = 0.0084 GB at 0.042 GB/s, and the 7B state's 87.6 GB over 64 devices takes
    1.368 GB / rate. bench_data: preparing 4M tokens (train and held-out) in 2 s is 2M tokens/s,
    8M per CPU-second; 3 loader steps of 4 x 64 tokens at 0.5 us each (after a 100 s start)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPTED_CHECKPOINT, ROOT, "--tensors=2", "--mib=4", "--repeats=3",
                          "--saves=1", "--devices_7b=64"], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    gb = 2 * 4 * 2**20 / 1e9
    per_device = 7_298_011_136 * 4 * 3 / 1e9 / 64   # fp32 parameters and both Adam moments (DESIGN §2)
    assert f"finiteness check: 0.01 GB in 200 ms (median of 3, min 100): {gb / 0.2:.2f} GB/s" in out.stdout
    assert f"checksums: 0.01 GB in 400 ms (median of 3, min 200): {gb / 0.4:.2f} GB/s" in out.stdout
    assert (f"7B state 87.6 GB = {per_device:.2f} GB per device on 64 devices: finiteness check "
            f"{per_device / (gb / 0.2):.2f} s, checksums {per_device / (gb / 0.4):.2f} s") in out.stdout, out.stdout
    out = subprocess.run([sys.executable, "-c", SCRIPTED_DATA, ROOT, str(tmp_path), "--prepare_workers=1", "--steps=3",
                          "--loader_workers=0", "--seq_len=64", "--global_batch=4"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("prepare stdlib, 1 process(es): 100 docs, 4,000,000 tokens in 2.00 s = 2.00M tokens/s wall (incl. "
            "process start-up and writes); 8.00M tokens per CPU-second") in out.stdout, out.stdout
    for f in ("off", "on "):
        assert (f"loader seq_len=64 global_batch=4 workers=0 filter={f}: {3 * 4 * 64 / 1.5e-6 / 1e6:.2f}M tokens/s "
                f"({3 / 1.5e-6:.0f} steps/s)") in out.stdout, out.stdout


def test_downstream_cost_figures_are_forward_flops_by_hand():
    """downstream_cost's total: each batch of its (rows, T) shapes (those oe_tasks.score runs,
    test above) costs rows x T x the 7B's forward FLOPs per token, a third of the write-up's
    training count (6 x non-embedding-and-head parameters + 6 x T x heads x head_dim x layers);
    seconds = FLOPs / (devices x MFU x peak)."""
    code = textwrap.dedent(r"""
        import json, sys
        sys.path[:0] = [sys.argv[1], sys.argv[1] + "/benchmarks"]
        import data, downstream_cost, olmo3
        from olmo3 import oe_tasks
        rows = oe_tasks.rows("copycolors_10way_fast", oe_tasks.load_requests("copycolors_10way_fast"),
                             data.tokenizer.encode, 8192)
        c = olmo3.Config.preset("olmo3_7b")
        print(json.dumps([downstream_cost.padded_shapes(rows, 8), [c.d_model, c.n_layers, c.n_heads, c.n_kv_heads,
                                                                   c.head_dim, c.mlp_hidden, c.vocab_size]]))
    """)
    shapes, (D, L, H, KV, HD, MLP, V) = json_from(code, timeout=300)
    per_layer = 2 * D * H * HD + 2 * D * KV * HD + 2 * H * HD + 3 * D * MLP + 2 * D   # q, o; k, v; qk-norm; MLP; norms
    flops = sum(r * T * (6 * (L * per_layer + D + D * V) + 6 * T * H * HD * L) / 3 for r, T in shapes)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "downstream_cost.py"),
                          "--tasks=copycolors_10way_fast", "--rows=8", "--devices=2", "--mfu=0.5",
                          "--peak_tflops=0.001"], env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"{sum(r * T for r, T in shapes):,} padded tokens, {flops / 1e15:.1f} PFLOP at 7B" in out.stdout
    seconds = float(re.search(r"2 devices at 50% of 0.001 TFLOP/s: +([\d.]+) s", out.stdout).group(1))
    assert seconds == pytest.approx(flops / (2 * 0.5 * 1e9), abs=0.06)
