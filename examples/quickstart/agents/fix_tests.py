#!/usr/bin/env python3
"""Deterministic stand-in for a fixing agent, used by TESTRUN-001's fix loop.

The test-runner gives it the failing tests on stdin, one line each:
  - [high] tests/test_report.py::test_x (tests/test_report.py:5): AssertionError: assert 'got' == 'want' | ...
For each string-equality assertion that failed, it changes the expected literal in the test
file to the value the code returned: the fix a reviewer would make when the test, not the code,
is wrong. It touches test files only, which is the loop's default scope.
"""
import pathlib
import re
import sys

prompt = sys.stdin.read()
root = pathlib.Path(sys.argv[1])
line_pattern = re.compile(r"^- \[\w+\] \S+ \(([^:()]+):\d+[^)]*\): (.*)$")
assertion = re.compile(r"assert '([^']*)' == '([^']*)'")

fixed = 0
for line in prompt.splitlines():
    match = line_pattern.match(line)
    if not match:
        continue
    path, message = match.groups()
    found = assertion.search(message)
    if not found:
        continue
    actual, expected = found.groups()
    test_file = root / path
    source = test_file.read_text()
    wrong = f'"{expected}"'
    if wrong in source:
        test_file.write_text(source.replace(wrong, f'"{actual}"'))
        fixed += 1
        print(f"{path}: expected {expected!r} corrected to {actual!r}")

if not fixed:
    sys.exit("no failing string assertion found in the prompt")
