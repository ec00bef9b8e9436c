"""Smoke test of bench.py's whole code path (ours + transformers/torch, --steps=1) on a toy config.

Not a timing test: it checks that the real step and the reference both run, that the FLOP count
behind the reported TFLOP/s is the write-up convention computed here by hand, and the exact
format of the machine-readable last line.
"""
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAST = re.compile(r"^tokens_per_s=(\S+) torch_tokens_per_s=(\S+) ratio=(\S+) "
                  r"mfu_measured=(\S+) mfu_nominal=(\S+)$")
D, L, H, HD, MLP, V, B, T = 64, 4, 2, 32, 128, 512, 2, 64


def run_bench(*extra):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench.py"), "--model=tiny", f"--d_model={D}",
           f"--n_layers={L}", f"--n_heads={H}", f"--n_kv_heads={H}", f"--head_dim={HD}",
           f"--mlp_hidden={MLP}", "--window=16", f"--vocab_size={V}", f"--batch={B}",
           f"--seq_len={T}", "--loss_chunk=48", "--remat=none", "--steps=1", "--warmup=1",
           "--matmul_n=128", *extra]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
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
    assert tflops * 1e12 == pytest.approx(tps * flops_per_token / 2, rel=2e-3)  # per device, 2 devices


def test_bench_rejects_bad_seq_len():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench.py"), "--model=tiny",
                          "--seq_len=100000", "--steps=1"], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "--seq_len=100000 exceeds max_position_embeddings" in out.stderr


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
    assert list(tmp_path.rglob("*.trace.json.gz"))
