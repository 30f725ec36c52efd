# Sourced by scripts/test. Tools the validator's syntax and lint checks call, for its tests:
# TypeScript (`tsc`) under $TOOLS/node; ruff, flake8 and PyYAML (YAML syntax checks) in the
# tools venv made by 10-python-tools.sh. Each install is skipped when already there.
if [ ! -x "$TOOLS/node/node_modules/.bin/tsc" ]; then
  npm install --silent --no-audit --no-fund --prefix "$TOOLS/node" typescript@5
fi
export PATH="$TOOLS/node/node_modules/.bin:$PATH"
if [ ! -x "$TOOLS/venv/bin/ruff" ] || [ ! -x "$TOOLS/venv/bin/flake8" ] \
  || ! "$TOOLS/venv/bin/python" -c 'import yaml' 2>/dev/null; then
  "$TOOLS/venv/bin/python" -m pip install --quiet --disable-pip-version-check ruff flake8 pyyaml
fi
tsc --version
"$TOOLS/venv/bin/ruff" --version
