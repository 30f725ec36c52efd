# Sourced by scripts/test. Installs the coding-agent CLIs the executor's backend tests drive
# (versions measured in docs/agent-clis.md) into $TOOLS/npm, once; later runs only check them.
# First install: about 60 s here (about 1.4 GB on disk: codex, claude and opencode ship native
# binaries); later runs take well under a second. Exports PATH so `codex`, `claude`, `gemini`,
# `qwen` and `opencode` resolve to these copies.
TROUPE_AGENT_CLIS=(
  "@openai/codex@0.169.0"
  "@anthropic-ai/claude-code@2.1.330"
  "@google/gemini-cli@0.61.0"
  "@qwen-code/qwen-code@0.24.4"
  "opencode-ai@1.18.33"
)
TROUPE_NPM_PREFIX="${TOOLS:?TOOLS must be set}/npm"
TROUPE_AGENT_CLIS_STAMP="$TROUPE_NPM_PREFIX/.installed-$(printf '%s\n' "${TROUPE_AGENT_CLIS[@]}" | cksum | cut -d' ' -f1)"
if [ ! -f "$TROUPE_AGENT_CLIS_STAMP" ]; then
  mkdir -p "$TROUPE_NPM_PREFIX"
  npm install --global --prefix "$TROUPE_NPM_PREFIX" --no-audit --no-fund --loglevel=error \
    "${TROUPE_AGENT_CLIS[@]}"
  # qwen ships its ripgrep without the exec bit (agent-clis.md §1); fix it rather than fall back.
  find "$TROUPE_NPM_PREFIX/lib/node_modules/@qwen-code" -path '*ripgrep*' -name rg -type f \
    -exec chmod +x {} + 2>/dev/null || true
  touch "$TROUPE_AGENT_CLIS_STAMP"
fi
export PATH="$TROUPE_NPM_PREFIX/bin:$PATH"
for cli in codex claude gemini qwen opencode; do
  command -v "$cli" >/dev/null 2>&1 || { echo "agent CLI \`$cli\` is missing from $TROUPE_NPM_PREFIX/bin" >&2; return 1; }
done
unset TROUPE_AGENT_CLIS TROUPE_NPM_PREFIX TROUPE_AGENT_CLIS_STAMP cli
