"""Benchmark harness: batching policies measured on the real pipeline.

`mmpipe bench` (or benchmarks/run_bench.py) runs it; runner.py says what it does, phase by
phase. Nothing here is imported by the stages.
"""
