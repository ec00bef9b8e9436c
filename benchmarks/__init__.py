"""Benchmarks: training throughput and MFU against transformers+torch (bench.py), the data
pipeline (bench_data.py), remote token reads (bench_remote.py) and Splash block sparsity
(bench_splash.py). Scripts, not tests: run `python benchmarks/bench.py ...` or
`python -m benchmarks.bench ...` from the repository root."""
