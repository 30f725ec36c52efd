"""Regenerates the README's pictures of a live session from real runs of the real binaries.

Run by scripts/pictures.sh (which builds them and this script's venv: rich, pillow,
websocket-client). It starts `troupe up` on
free ports with its web view, SQLite under target/pictures/.troupe, and the scripted model server
(shared/modelserver's `serve` example) as the model of troupe's own `agent` backend; then runs
one session of five tasks on a copy of the test-runner's pytest fixture:

  IMPL-1    an `agent` task: one model call, then the agent's `sleep` tool keeps it running
  TEST-1    pytest with coverage; its two failing tests are fixed one per fix iteration by a
            slow `command` fixer
  IMPL-3    a quick `command` task
  REVIEW-1  the validator reviews IMPL-1
  IMPL-2    waits at an approval gate until the others are done

and writes, from what tmux and headless Chromium show:

  docs/img/live-view.svg      `troupe run` on a 100-column terminal while IMPL-1 reports tokens
                              and TEST-1 is in its first fix iteration
  docs/img/gate-web.png       the session's page while IMPL-2 waits, with Approve and Reject
  docs/img/gate-terminal.svg  `troupe check`, then `troupe approve` with a note, in a shell
  docs/img/report.svg         `troupe report` of the finished session, with a price table,
                              its Markdown drawn by rich's renderer (`python -m rich.markdown`)
  docs/img/quickstart-graph.svg  `troupe graph --format svg` of examples/quickstart, run on the
                              same server
  docs/img/web-view.png       the quickstart's page in the web view once it has finished

Terminal screens are read with `tmux capture-pane -e` and turned into SVG by rich
(`Text.from_ansi`, `Console.save_svg`). Every child is an argv vector; everything started here
is stopped at the end, however the script ends.
"""

import base64
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from PIL import Image
from rich.console import CONSOLE_SVG_FORMAT, Console
from rich.text import Text

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests/e2e/browser"))
import cdp  # noqa: E402  (the web-view test's Chromium driver)

TROUPE = ROOT / "target/debug/troupe"
MODEL_SERVER = ROOT / "target/debug/examples/serve"
FIXTURE = ROOT / "services/test-runner/tests/fixtures/pytest-proj"
IMG = ROOT / "docs/img"
# A short working directory: the screens show paths relative to it.
WORK = ROOT / "target/pictures"
COLUMNS = 100

# The fixer (the views test's): takes its time, so the screen can show the iteration before
# it, then applies one of its `path old new` edits per iteration.
FIXER = ROOT / "tests/e2e/fixtures/slow_fix.py"

CHANGELOG = "# Changelog\n\n## 1.0.1\n\n- divide() returns a float.\n"

PRICES = """[scripted-model]
input_per_mtok = 3.0
output_per_mtok = 15.0
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(argv, **kwargs):
    return subprocess.run(argv, check=True, capture_output=True, text=True, **kwargs)


def git_repo(path):
    shutil.copytree(FIXTURE, path, ignore=shutil.ignore_patterns("scenarios", "__pycache__"))
    run(["git", "init", "-q", "-b", "main"], cwd=path)
    run(["git", "add", "-A"], cwd=path)
    run(["git", "-c", "user.name=demo", "-c", "user.email=demo@example.com",
         "commit", "-q", "-m", "calc 1.0.0"], cwd=path)


def plan():
    fix = ["python3", "{plan_dir}/fixer.py", "20", "{worktree}",
           "tests/test_mathops.py", "divide(10, 4) == 2\n", "divide(10, 4) == 2.5\n",
           "tests/test_strings.py",
           "    user = parse_user('{\"age\": 3}')\n    assert user[\"age\"] == 3",
           "    import pytest\n\n    with pytest.raises(KeyError):\n"
           "        parse_user('{\"age\": 3}')"]
    bump = ["python3", "-c", "import pathlib, sys; p = pathlib.Path(sys.argv[1], 'pyproject.toml');"
            " p.write_text(p.read_text().replace('1.0.0', '1.0.1'))", "{worktree}"]
    release = ["python3", "-c", "import pathlib, sys; pathlib.Path(sys.argv[1], 'VERSION')"
               ".write_text('1.0.1\\n')", "{worktree}"]
    return {
        "name": "calc",
        "repos": {"calc": {"path": "calc"}},
        "tasks": [
            {"id": "IMPL-1", "title": "Write the changelog for 1.0.1",
             "description": "Create CHANGELOG.md with the 1.0.1 entry.",
             "files": [{"path": "CHANGELOG.md", "action": "create", "change": "1.0.1"}],
             "agent": {"backend": "agent"}},
            {"id": "TEST-1", "title": "Run the tests with coverage, fix them",
             "test": {"framework": "pytest", "coverage_target": 50,
                      "fix": {"agent": {"backend": "command", "command": fix},
                              "max_iterations": 3, "scope": "tests"}}},
            {"id": "IMPL-3", "title": "Bump the version to 1.0.1",
             "agent": {"backend": "command", "command": bump}},
            {"id": "REVIEW-1", "title": "Review the changelog", "depends_on": ["IMPL-1"]},
            {"id": "IMPL-2", "title": "Tag the release",
             "depends_on": ["TEST-1", "REVIEW-1", "IMPL-3"],
             "approval": "tests green and changelog reviewed?",
             "agent": {"backend": "command", "command": release}},
        ],
    }


class Tmux:
    """A tmux server on its own socket, so nothing touches a user's sessions."""

    def __init__(self, env):
        self.socket = f"troupe-pictures-{os.getpid()}"
        self.env = env

    def __call__(self, *args):
        return run(["tmux", "-L", self.socket, "-f", "/dev/null", *args], env=self.env).stdout

    def start(self, name, argv, rows, columns=COLUMNS):
        self("new-session", "-d", "-s", name, "-x", str(columns), "-y", str(rows), "-c",
             str(WORK), "--", *argv, ";", "set-option", "-t", name, "remain-on-exit", "on")

    def screen(self, name, colours=False):
        return self("capture-pane", "-p", *(["-e"] if colours else []), "-t", name)

    def shell(self, name, rows, columns=COLUMNS):
        """An interactive bash with a plain prompt, for commands typed as a person would."""
        self.start(name, ["env", "PS1=$ ", "bash", "--norc", "--noprofile", "-i"], rows, columns)

    def type(self, name, line):
        """Types `line` into the shell `name` and waits for its next prompt."""
        prompts = self.prompts(name)
        self("send-keys", "-t", name, "-l", line)
        self("send-keys", "-t", name, "Enter")
        eventually(line, 60, lambda: self.prompts(name) > prompts
                   and self.screen(name).rstrip().endswith("$"))

    def prompts(self, name):
        return sum(1 for l in self.screen(name).splitlines() if l == "$" or l.startswith("$ "))

    def stop(self):
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


def svg_format():
    # rich's template names a web font on a CDN; a picture should load nothing from outside.
    return re.sub(r"@font-face \{\{.*?\}\}\s*", "", CONSOLE_SVG_FORMAT, flags=re.S)


def save_svg(ansi, path, title, skip=0):
    """The screen `ansi` as an SVG, less its first `skip` lines and its blank last ones."""
    (WORK / f"{path.stem}.ansi").write_text(ansi)
    lines = ansi.rstrip("\n").split("\n")[skip:]
    while lines and not lines[-1].strip():
        lines.pop()
    width = max([COLUMNS, *(Text.from_ansi(line).cell_len for line in lines)])
    console = Console(record=True, width=width, force_terminal=True, color_system="256",
                      file=open(os.devnull, "w"))
    console.print(Text.from_ansi("\n".join(lines)), crop=True, overflow="crop", no_wrap=True)
    console.save_svg(str(path), title=title, code_format=svg_format())
    print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size} bytes)")


def eventually(what, timeout, probe):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


def web_get(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.read().decode()
    except OSError:
        return None


def shoot(page, path, width, selector):
    """A PNG of the page at `width` CSS pixels, from the top to the bottom of `selector`."""
    page.call("Emulation.setDeviceMetricsOverride", width=width, height=900,
              deviceScaleFactor=1, mobile=False)
    bottom = page.evaluate(
        f"document.querySelector('{selector}').getBoundingClientRect().bottom + window.scrollY")
    shot = page.call("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                     clip={"x": 0, "y": 0, "width": width, "height": bottom + 16, "scale": 1})
    # A 256-colour palette (as pngquant would make) keeps a page of flat colours and text small.
    image = Image.open(io.BytesIO(base64.b64decode(shot["data"]))).convert("RGB")
    image.quantize(colors=256, dither=Image.Dither.NONE).save(path, optimize=True)
    print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size} bytes)")


def main():
    for binary in (TROUPE, MODEL_SERVER):
        if not binary.exists():
            sys.exit(f"{binary} is missing: run scripts/pictures.sh, which builds it")
    if WORK.exists():
        shutil.rmtree(WORK)
    WORK.mkdir(parents=True)
    IMG.mkdir(exist_ok=True)
    git_repo(WORK / "calc")
    shutil.copy(FIXER, WORK / "fixer.py")
    (WORK / "plan.json").write_text(json.dumps(plan(), indent=2))
    (WORK / "prices.toml").write_text(PRICES)

    children = []
    tmux = None
    page = None
    try:
        model = subprocess.Popen([str(MODEL_SERVER), "CHANGELOG.md", "CHANGELOG.md", CHANGELOG,
                                  "60"], stdout=subprocess.PIPE, text=True,
                                 start_new_session=True)
        children.append(model)
        model_url = model.stdout.readline().strip()
        # The key is checked by nobody; it only has to differ from words on the screen, which
        # troupe's redaction of secrets would mask.
        (WORK / "executor.toml").write_text(
            "fallback = []\nretries = 0\n[backends.agent]\nmodel = \"scripted-model\"\n"
            f"endpoint = \"{model_url}/v1\"\napi_key = \"demo-key-0123456789\"\n"
            "timeout_seconds = 180\nallow_commands = [\"sleep\"]\n")

        api, web = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TROUPE_")}
        env.pop("RUST_LOG", None)
        # The shells find troupe, and the python of this script's venv (rich).
        env.update({"TROUPE_CONNECT": f"http://{api}", "TERM": "xterm-256color",
                    "PATH": f"{TROUPE.parent}:{Path(sys.executable).parent}:{env['PATH']}"})
        # The test-runner builds TEST-1's venv from the fixture's requirements-dev.txt (PyPI).
        up_env = dict(env, TROUPE_EXECUTOR_CONFIG=str(WORK / "executor.toml"))
        log = open(WORK / "up.log", "w")
        up = subprocess.Popen([str(TROUPE), "up", "--listen", api, "--web-listen", web,
                               "--data-dir", ".troupe"], cwd=WORK, env=up_env,
                              stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                              start_new_session=True)
        children.append(up)
        eventually("troupe up's web view", 60, lambda: web_get(f"http://{web}/"))

        tmux = Tmux(env)
        tmux.start("run", ["troupe", "run", "plan.json"], 24)
        session = eventually("the session", 60, lambda: (re.findall(
            r'href="/sessions/([^"/]+)"', web_get(f"http://{web}/") or "") or [None])[0])
        print(f"session {session}")

        # 1. The live view: IMPL-1 with its tokens, TEST-1 in fix iteration 1, in one frame.
        def live():
            screen = tmux.screen("run")
            if " out tokens" in screen and "tests: fix iteration 1/" in screen:
                return tmux.screen("run", colours=True)
            return None
        # Less the header, whose repo line names this machine's path to the repository.
        save_svg(eventually("tokens and a fix iteration on one screen", 240, live),
                 IMG / "live-view.svg", "troupe run plan.json", skip=2)

        # 2. The gate: the web view while IMPL-2 waits, then check and approve in a shell.
        page = cdp.Page("chromium")
        page.call("Page.navigate", url=f"http://{web}/sessions/{session}")
        page.wait_event("Page.loadEventFired")
        eventually("IMPL-2 waiting with its buttons", 240, lambda: page.evaluate(
            "(() => { const row = document.querySelector('tr[data-task=\"IMPL-2\"]');"
            " return row && row.dataset.state === 'waiting_approval'"
            " && !!row.querySelector('form.gate'); })()"))
        time.sleep(1)
        shoot(page, IMG / "gate-web.png", 1000, "#tasks")

        tmux.shell("gate", 40)
        eventually("a prompt", 30, lambda: tmux.prompts("gate") == 1)
        tmux.type("gate", f"troupe check {session}")
        tmux.type("gate", f"troupe approve {session} IMPL-2 --note 'green and reviewed: ship it'")
        save_svg(tmux.screen("gate", colours=True), IMG / "gate-terminal.svg",
                 "troupe check, troupe approve")

        # 3. The report of the finished session.
        eventually("the session to finish", 240, lambda: tmux(
            "display-message", "-p", "-t", "run", "#{pane_dead}").strip() == "1")
        # The report is Markdown; rich's renderer draws its tables (130 columns: the task table).
        tmux.shell("report", 60, 130)
        eventually("a prompt", 30, lambda: tmux.prompts("report") == 1)
        tmux.type("report", f"troupe report {session} --prices prices.toml"
                            " | python -m rich.markdown -")
        save_svg(tmux.screen("report", colours=True), IMG / "report.svg", "troupe report")

        # 4. The quickstart: its DAG as `troupe graph --format svg` draws it, and its page in
        # the web view once it has finished.
        quickstart = run([str(TROUPE), "run", str(ROOT / "examples/quickstart"), "--plain"],
                         cwd=WORK, env=env, timeout=600).stdout
        session = re.match(r"session (\S+) ", quickstart).group(1)
        graph = IMG / "quickstart-graph.svg"
        graph.write_text(run([str(TROUPE), "graph", session, "--format", "svg"], env=env).stdout)
        print(f"wrote {graph.relative_to(ROOT)} ({graph.stat().st_size} bytes)")
        page.call("Page.navigate", url=f"http://{web}/sessions/{session}")
        page.wait_event("Page.loadEventFired")
        eventually("the quickstart's page", 30, lambda: page.evaluate(
            "document.querySelector('#session-state').dataset.state === 'completed'"))
        shoot(page, IMG / "web-view.png", 1000, "#tasks")
    finally:
        if page is not None:
            page.close()
            shutil.rmtree(page.profile, ignore_errors=True)
        if tmux is not None:
            tmux.stop()
        for child in reversed(children):
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGTERM)
                try:
                    child.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(child.pid, signal.SIGKILL)
                    child.wait()


if __name__ == "__main__":
    main()
