"""Benchmarks: each compares against a baseline measured side by side in the same run.

Run one with `python -m experiments.benchmarks.NAME`; its last line is one JSON object.
"""
