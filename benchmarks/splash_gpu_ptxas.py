"""Compile olmo3/splash_gpu.py's Triton kernels for sm_90 on a machine without a GPU.

    python benchmarks/splash_gpu_ptxas.py --dump=/tmp/ttir               # project env (jax)
    pip install triton   # in a separate venv: it must not shadow anything the project uses
    /path/to/venv/bin/python benchmarks/splash_gpu_ptxas.py --compile=/tmp/ttir

--dump lowers forward + gradient for CUDA (bf16 and fp32; head_dim 64, 128, 256; window and
segment ids; 8 heads on 2 kv heads, seq 4096) and writes each kernel's Triton IR with its
num_warps / num_stages. --compile runs Triton's compiler (TTIR -> TTGIR -> PTX, target sm_90)
and its bundled ptxas, and prints shared memory, registers per thread and spills per kernel.
It checks what the export cannot: that the IR is valid Triton, fits shared memory and does
not spill. It is not the compiler XLA uses on a GPU (jaxlib bundles its own Triton).
"""
import json
import os
import subprocess
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from olmo3 import atomic, cli  # noqa: E402  (absl only: the triton venv needs no jax)

flags.DEFINE_string("dump", None, "Write the kernels' Triton IR to this folder (needs jax).")
flags.DEFINE_string("compile", None, "Compile the IR in this folder (needs triton).")
F = flags.FLAGS
CONFIGS = [("bf16", 64), ("bf16", 128), ("bf16", 256), ("f32", 128)]


def dump(folder):
    import jax
    import jax.export  # `import jax` does not load it in JAX 0.6
    import jax.numpy as jnp
    from jax._src.pallas.triton import lowering
    from olmo3 import splash_gpu

    os.makedirs(folder, exist_ok=True)
    original, state = lowering.lower_jaxpr_to_triton_module, {}

    def capture(*args, **kwargs):                     # called once per pallas_call
        result = original(*args, **kwargs)
        state["n"] += 1
        sizes = state["sizes"]
        warps, stages = ((sizes.fwd_warps, sizes.fwd_stages) if state["n"] == 1
                         else (sizes.bwd_warps, sizes.bwd_stages))
        stem = os.path.join(folder, f"{state['tag']}_{('fwd', 'dq', 'dkv')[state['n'] - 1]}")
        atomic.write_text(stem + ".ttir", result.module.operation.get_asm(enable_debug_info=False))
        atomic.write_json(stem + ".json", {"num_warps": warps, "num_stages": stages})
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    for name, head_dim in CONFIGS:
        dtype = {"bf16": jnp.bfloat16, "f32": jnp.float32}[name]
        state.update(n=0, tag=f"{name}_d{head_dim}", sizes=splash_gpu.block_sizes(head_dim, dtype))
        q = jax.ShapeDtypeStruct((8, 4096, head_dim), dtype)
        kv = jax.ShapeDtypeStruct((2, 4096, head_dim), dtype)
        seg = jax.ShapeDtypeStruct((4096,), jnp.int32)
        fwd = lambda q, k, v, s: splash_gpu.splash_attention(q, k, v, window=1024, segment_ids=s)
        grad = jax.grad(lambda *a: fwd(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
        with splash_gpu.target_gpu("NVIDIA H100"):   # sm_90 (JAX >= 0.11 needs it named on a CPU host)
            jax.export.export(jax.jit(grad), platforms=["cuda"], disabled_checks=[
                jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(q, kv, kv, seg)
        print(f"{state['tag']}: {state['n']} kernels written to {folder}")


def compile_all(folder):
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError as e:
        raise app.UsageError(f"--compile needs triton ({e}): pip install triton in a separate venv (it must not "
                             "shadow the project's packages) and run this script with that venv's python") from None
    if not any(f.endswith(".ttir") for f in os.listdir(folder)):
        raise app.UsageError(f"--compile={folder} holds no .ttir kernels; write them with --dump={folder} first")

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "ptxas-blackwell")   # the bundled ptxas that reads Triton 3.9's PTX
    print(f"triton {triton.__version__}, target sm_90")
    print(f"{'kernel':<14} {'warps':>5} {'stages':>6} {'smem KiB':>8}  ptxas")
    for name in sorted(f for f in os.listdir(folder) if f.endswith(".ttir")):
        path = os.path.join(folder, name)
        with open(path[:-5] + ".json") as f:
            options = json.load(f)
        kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32), options=options)
        ptx = path[:-5] + ".ptx"
        atomic.write_text(ptx, kernel.asm["ptx"])
        out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", ptx, "-o", os.devnull],
                             capture_output=True, text=True)
        info = [line.split("info    : ")[-1].strip() for line in out.stderr.splitlines()
                if "Used" in line or "spill" in line]
        print(f"{name[:-5]:<14} {options['num_warps']:>5} {options['num_stages']:>6} "
              f"{kernel.metadata.shared / 1024:>8.1f}  {'; '.join(info)}")


def main(_):
    if not (F.dump or F.compile):
        raise app.UsageError("pass --dump=FOLDER and/or --compile=FOLDER")
    if F.dump:
        atomic.check_writable(F.dump, "--dump")
    if F.compile and not os.path.isdir(F.compile):
        raise app.UsageError(f"--compile={F.compile} is not a directory; write the kernels there with --dump first")
    if F.dump:
        dump(F.dump)
    if F.compile:
        compile_all(F.compile)


if __name__ == "__main__":
    cli.run(main)   # a bad flag: one line, exit 2
