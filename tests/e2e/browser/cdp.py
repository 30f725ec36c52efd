"""Drives headless Chromium over the DevTools protocol for the web-view tests.

Starts `chromium` headless with a private profile, opens one page and answers commands, one
JSON object per line on stdin, with one JSON object per line on stdout:
  {"cmd": "goto", "url": U}                   load U and wait for its load event
  {"cmd": "eval", "js": E}                    the value of expression E
  {"cmd": "wait", "js": E, "timeout": S}      poll E until truthy (its value), or fail after S s
  {"cmd": "screenshot", "path": P}            a PNG of the page
  {"cmd": "quit"}
Answers are {"ok": true, "value": ...} or {"ok": false, "error": "..."}.
"""

import base64
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import websocket  # websocket-client, installed by scripts/setup/10-python-tools.sh


def die_with_parent():
    """Chromium gets SIGKILL when this driver dies, however it dies (PR_SET_PDEATHSIG)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


class Page:
    def __init__(self, chromium):
        # A loaded CI machine has been seen to leave a first Chromium without its DevTools port
        # for over 30 s; a fresh profile (three tries fit in the test's 180 s wait for an answer) and a second or third try get past it.
        errors = []
        for attempt in range(3):
            try:
                port = self.launch(chromium, deadline=45)
                break
            except RuntimeError as err:
                errors.append(f"try {attempt + 1}: {err}")
                self.close()
        else:
            raise RuntimeError("chromium did not open its DevTools port:\n" + "\n".join(errors))
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list"))
        page = next(t for t in targets if t["type"] == "page")
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60)
        self.next_id = 0
        self.call("Page.enable")
        self.call("Runtime.enable")

    def launch(self, chromium, deadline):
        """Starts Chromium with a fresh profile; its DevTools port, or why there is none."""
        self.profile = tempfile.mkdtemp(prefix="troupe-cdp-")
        stderr_path = os.path.join(self.profile, "chromium.stderr")
        with open(stderr_path, "wb") as stderr:
            self.browser = subprocess.Popen(
                [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--remote-debugging-port=0", "--remote-allow-origins=*",
                 "--window-size=1280,1600", f"--user-data-dir={self.profile}", "about:blank"],
                stdout=subprocess.DEVNULL, stderr=stderr,
                start_new_session=True, preexec_fn=die_with_parent)
        port_file = os.path.join(self.profile, "DevToolsActivePort")
        started = time.time()
        while not os.path.exists(port_file) or os.path.getsize(port_file) == 0:
            code = self.browser.poll()
            if code is not None or time.time() > started + deadline:
                with open(stderr_path, errors="replace") as stderr:
                    tail = stderr.read()[-2000:]
                how = f"exited with {code}" if code is not None else f"no port after {deadline} s"
                raise RuntimeError(f"{how}; its stderr ends:\n{tail}")
            time.sleep(0.1)
        return open(port_file).read().split()[0]

    def call(self, method, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def wait_event(self, method, timeout=30):
        self.ws.settimeout(timeout)
        try:
            while True:
                message = json.loads(self.ws.recv())
                if message.get("method") == method:
                    return message
        finally:
            self.ws.settimeout(60)

    def evaluate(self, js):
        result = self.call("Runtime.evaluate", expression=js, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(result["exceptionDetails"].get("text", "exception"))
        return result["result"].get("value")

    def handle(self, command):
        cmd = command["cmd"]
        if cmd == "goto":
            self.call("Page.navigate", url=command["url"])
            self.wait_event("Page.loadEventFired")
            return None
        if cmd == "eval":
            return self.evaluate(command["js"])
        if cmd == "wait":
            deadline = time.time() + command.get("timeout", 30)
            while True:
                value = self.evaluate(command["js"])
                if value:
                    return value
                if time.time() > deadline:
                    raise RuntimeError(f"timed out waiting for {command['js']}")
                time.sleep(0.2)
        if cmd == "screenshot":
            shot = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
            with open(command["path"], "wb") as out:
                out.write(base64.b64decode(shot["data"]))
            return command["path"]
        raise RuntimeError(f"unknown command {cmd}")

    def close(self):
        # The whole group: the browser and the zygote, GPU and renderer processes it started.
        try:
            os.killpg(self.browser.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.browser.wait()
        shutil.rmtree(self.profile, ignore_errors=True)


def main():
    page = Page(sys.argv[1] if len(sys.argv) > 1 else "chromium")
    try:
        for line in sys.stdin:
            command = json.loads(line)
            if command["cmd"] == "quit":
                break
            try:
                answer = {"ok": True, "value": page.handle(command)}
            except Exception as err:  # the test prints it
                answer = {"ok": False, "error": str(err)}
            print(json.dumps(answer), flush=True)
    finally:
        page.close()


if __name__ == "__main__":
    main()
