#!/usr/bin/env python3
"""Deterministic stand-in for a coding agent: writes the files of one task of the phase.

Usage: build.py WORKTREE TASK_ID (the handoff prompt arrives on stdin). Each run takes about a
second, so the tasks of one wave visibly overlap; it prints when it started and finished, which
lands in the task's summary-<ID>.md on the session branch. Tasks that build on earlier ones
check that troupe gave them what they need: the files of earlier waves in their worktree, the
earlier tasks' summaries in the prompt, and the pre_analysis output filled into the prompt.
"""
import pathlib
import sys
import time

started = time.time()
prompt = sys.stdin.read()
root = pathlib.Path(sys.argv[1])
task = sys.argv[2]

FILES = {
    "IMPL-101": {
        "textkit/words.py": (
            '"""Words of a text."""\n\n\n'
            "def words(text):\n"
            '    """The lower-cased words of `text`."""\n'
            "    return text.lower().split()\n\n\n"
            "def word_count(text):\n"
            '    """How many words `text` has."""\n'
            "    return len(words(text))\n"
        ),
    },
    "IMPL-102": {
        "textkit/chars.py": (
            '"""Characters of a text."""\n\n'
            "from collections import Counter\n\n\n"
            "def char_freq(text):\n"
            '    """How often each non-space character occurs."""\n'
            "    return Counter(c for c in text.lower() if not c.isspace())\n"
        ),
    },
    "IMPL-103": {
        "textkit/report.py": (
            '"""A one-line report on a text."""\n\n'
            "from textkit.chars import char_freq\n"
            "from textkit.words import word_count\n\n\n"
            "def report(text):\n"
            '    """Word count and the most common character."""\n'
            "    freq = char_freq(text)\n"
            '    top = min(freq, key=lambda c: (-freq[c], c)) if freq else ""\n'
            '    return f"words={word_count(text)} top={top}"\n'
        ),
    },
    "IMPL-104": {
        "textkit/slug.py": (
            '"""URL slugs."""\n\n'
            "from textkit.words import words\n\n\n"
            "def slugify(text):\n"
            '    """`Hello, World!` -> `hello-world`."""\n'
            '    cleaned = ("".join(c for c in w if c.isalnum()) for w in words(text))\n'
            '    return "-".join(w for w in cleaned if w)\n'
        ),
    },
    "IMPL-105": {
        "textkit/cli.py": (
            '"""`python3 -m textkit.cli TEXT...`: the report and the slug of a text."""\n\n'
            "import sys\n\n"
            "from textkit.report import report\n"
            "from textkit.slug import slugify\n\n\n"
            "def main(argv=None):\n"
            '    text = " ".join(sys.argv[1:] if argv is None else argv)\n'
            "    print(report(text))\n"
            "    print(slugify(text))\n"
            "    return 0\n\n\n"
            'if __name__ == "__main__":\n'
            "    sys.exit(main())\n"
        ),
    },
    "IMPL-106": {
        "tests/test_textkit.py": (
            "import unittest\n\n"
            "from textkit.chars import char_freq\n"
            "from textkit.report import report\n"
            "from textkit.slug import slugify\n"
            "from textkit.words import word_count\n\n\n"
            "class TextkitTest(unittest.TestCase):\n"
            "    def test_word_count(self):\n"
            '        self.assertEqual(word_count("a b  c"), 3)\n\n'
            "    def test_char_freq(self):\n"
            '        self.assertEqual(char_freq("aab")["a"], 2)\n\n'
            "    def test_report(self):\n"
            '        self.assertEqual(report("see the tree"), "words=3 top=e")\n\n'
            "    def test_slugify(self):\n"
            '        self.assertEqual(slugify("Hello, World!"), "hello-world")\n'
        ),
    },
}

NEEDS = {
    # Files that earlier waves must have integrated before this task's worktree was made.
    "IMPL-103": ["textkit/words.py", "textkit/chars.py"],
    "IMPL-104": ["textkit/words.py"],
    "IMPL-105": ["textkit/report.py", "textkit/slug.py"],
    "IMPL-106": ["textkit/report.py", "textkit/slug.py"],
}
for path in NEEDS.get(task, []):
    if not (root / path).is_file():
        sys.exit(f"{path} is missing: its wave must run after the task that writes it")
if task in ("IMPL-105", "IMPL-106"):
    for earlier in ("IMPL-103", "IMPL-104"):
        if f"- {earlier}: " not in prompt:
            sys.exit(f"the prompt lacks the summary of {earlier}")
if task == "IMPL-103" and "def word_count(text):" not in prompt:
    sys.exit("the prompt lacks the pre_analysis output [words_api]")

if task not in FILES:
    sys.exit(f"unknown task {task}")
for path, text in FILES[task].items():
    target = root / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
time.sleep(1.0)
print(f"{task} started={started:.3f} finished={time.time():.3f}")
