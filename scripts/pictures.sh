#!/usr/bin/env bash
# Regenerates the pictures of README.md and docs/watching.md (docs/img: live-view.svg,
# gate-web.png, gate-terminal.svg, report.svg, quickstart-graph.svg, web-view.png) from real runs
# of the real binaries; scripts/pictures.py says how. Needs tmux and chromium
# (scripts/setup/25-system-tools.sh) and PyPI (the test venvs, and rich, pillow and
# websocket-client for the pictures). Takes two to four minutes; not part of scripts/test.
set -euo pipefail
cd "$(dirname "$0")/.."
for tool in tmux chromium git python3; do
  command -v "$tool" >/dev/null || { echo "pictures: $tool is missing" >&2; exit 1; }
done
cargo build -p troupe --bin troupe -p troupe-modelserver --example serve
venv=target/tools/pictures-venv
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  'rich==15.0.0' 'pillow==13.0.0' websocket-client
exec "$venv/bin/python" scripts/pictures.py
