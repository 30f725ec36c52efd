#!/usr/bin/env python3
"""Deterministic stand-in for a coding agent: implements IMPL-002 (summary report).

Needs IMPL-001's median(); troupe starts this task's worktree from the session branch, which
already holds IMPL-001's commit.
"""
import pathlib
import sys

sys.stdin.read()
root = pathlib.Path(sys.argv[1])

if "def median(" not in (root / "stats" / "core.py").read_text():
    sys.exit("stats.core.median is missing: IMPL-001 must be integrated first")

(root / "stats" / "report.py").write_text(
    '"""Human-readable summaries of a sample."""\n\n'
    "from stats.core import mean, median\n\n\n"
    "def summary(values):\n"
    '    """Return a one-line summary: count, mean and median."""\n'
    '    return f"n={len(values)} mean={mean(values):g} median={median(values):g}"\n'
)
(root / "tests" / "test_report.py").write_text(
    "from stats.report import summary\n\n\n"
    "def test_summary_names_count_mean_and_median():\n"
    # The expectation is wrong on purpose (the median of 1, 2, 3, 10 is 2.5): agents make
    # mistakes like this, and TESTRUN-001's fix loop is there to catch and repair them.
    '    assert summary([1, 2, 3, 10]) == "n=4 mean=4 median=2"\n'
)
print("added stats.report.summary() and its test")
