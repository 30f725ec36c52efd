# Sourced by scripts/test. Installs node_modules for the test-runner's Jest and Vitest fixture
# projects (services/test-runner/tests/fixtures/*-proj: Jest 30, Jest 30 with ts-jest, Jest 22,
# Vitest 4 and 1) from their committed package.json and package-lock.json. Idempotent: a
# project is skipped when its tool binary exists and the stamp
# (a hash of package.json + package-lock.json) matches what was installed. Uses the normal npm
# cache (~/.npm), so a reinstall on a warm machine fetches no tarballs.
# `npm ci` is tried first and `npm install` is the fallback: npm 11 rejects some lockfiles it
# wrote itself with EUSAGE (test-frameworks.md §5.9).
# Hash of what decides the install (the lockfile may not exist before the first install).
troupe_fixture_hash() {
  { cat "$1/package.json"; cat "$1/package-lock.json" 2>/dev/null || true; } | sha256sum | cut -d' ' -f1
}
troupe_node_fixtures() {
  local root="$PWD/services/test-runner/tests/fixtures" dir tool stamp want
  if ! command -v npm >/dev/null 2>&1; then
    echo "npm is required for the test-runner's Jest/Vitest fixtures" >&2
    return 1
  fi
  for dir in jest-proj:jest vitest-proj:vitest jest22-proj:jest vitest1-proj:vitest jest-ts-proj:jest; do
    tool="${dir#*:}"
    dir="$root/${dir%%:*}"
    want="$(troupe_fixture_hash "$dir")"
    stamp="$dir/node_modules/.troupe-stamp"
    if [ -x "$dir/node_modules/.bin/$tool" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
      echo "$(basename "$dir"): node_modules up to date"
      continue
    fi
    echo "$(basename "$dir"): installing node_modules"
    if [ -f "$dir/package-lock.json" ] \
      && (cd "$dir" && npm ci --prefer-offline --no-audit --no-fund --loglevel=error) >"$dir.npm-ci.log" 2>&1; then
      :
    else
      if grep -q EUSAGE "$dir.npm-ci.log" 2>/dev/null; then
        echo "$(basename "$dir"): npm ci refused its own lockfile (EUSAGE); using npm install"
      elif [ -s "$dir.npm-ci.log" ]; then
        tail -5 "$dir.npm-ci.log"
      fi
      (cd "$dir" && npm install --prefer-offline --no-audit --no-fund --loglevel=error) || return 1
      # npm install may have rewritten the lockfile; the stamp must describe what is there now.
      want="$(troupe_fixture_hash "$dir")"
    fi
    rm -f "$dir.npm-ci.log"
    printf '%s\n' "$want" >"$stamp"
  done
}
troupe_node_fixtures
