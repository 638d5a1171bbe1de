"""Operator harnesses that measure the pipeline: benchmark, fault runs, overload runs.

Installed with the `[bench]` extra (matplotlib, psutil); nothing in the stages imports them.
"""
