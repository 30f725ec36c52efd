#!/usr/bin/env python3
"""Deterministic stand-in for a coding agent: implements IMPL-001 (median).

troupe runs it as an argv vector with the task's handoff prompt on stdin and the task's git
worktree as its working directory (also passed as argv[1]). It edits files; troupe commits.
"""
import pathlib
import sys

sys.stdin.read()  # the handoff prompt; a real agent would read it
root = pathlib.Path(sys.argv[1])

core = root / "stats" / "core.py"
source = core.read_text()
if "def median(" not in source:
    source += '''

def median(values):
    """Return the middle value of a non-empty sequence (the mean of the two middle ones
    when its length is even)."""
    if not values:
        raise ValueError("median() needs at least one value")
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2
'''
    core.write_text(source)

init = root / "stats" / "__init__.py"
init.write_text(
    '"""Small statistics helpers used by the troupe quickstart."""\n\n'
    "from stats.core import mean, median\n\n"
    '__all__ = ["mean", "median"]\n'
)

tests = root / "tests" / "test_median.py"
tests.write_text(
    "import pytest\n\n"
    "from stats.core import median\n\n\n"
    "def test_median_of_odd_length():\n"
    "    assert median([3, 1, 2]) == 2\n\n\n"
    "def test_median_of_even_length():\n"
    "    assert median([4, 1, 3, 2]) == 2.5\n\n\n"
    "def test_median_rejects_empty_input():\n"
    "    with pytest.raises(ValueError):\n"
    "        median([])\n"
)
print("added median() and its tests")
