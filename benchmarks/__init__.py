"""The benchmarks: one module per ``make bench-*`` target, run from the checkout's root as
``python -m benchmarks.bench_<name>``. What they share lives in :mod:`benchmarks.base`; no benchmark
imports another, and none edits ``sys.path`` (``tests/test_house_limits.py``). ``gpu_check.py`` is the
exception that stays a standalone script: it runs on a GPU machine without the venv.
"""
