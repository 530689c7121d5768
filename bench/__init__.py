"""Benchmarks: each `bench/bench_*.py` module has a `main()` that prints ratios against a baseline
measured in the same run. `python -m bench` (or `make bench`) runs them all."""
