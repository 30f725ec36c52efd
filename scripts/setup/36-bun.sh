# Sourced by scripts/test. bun, for the test-runner's bun workspace test, from the npm
# registry's `bun` package (its platform binary is an optional dependency on the same
# registry) into target/tools/bun; on PATH for the tests.
troupe_bun() {
  local dir="${TOOLS:?TOOLS must be set}/bun" version=1.3.14
  if [ "$("$dir/node_modules/.bin/bun" --version 2>/dev/null)" != "$version" ]; then
    echo "installing bun $version into $dir"
    npm install --prefix "$dir" --no-audit --no-fund --loglevel=error "bun@$version" || return 1
  fi
  export PATH="$dir/node_modules/.bin:$PATH"
}
troupe_bun
