# Sourced by scripts/test. pnpm and yarn come through Node's corepack, which the test-runner's
# install tests drive (a pnpm workspace). Corepack verifies the npm registry's package
# signatures, and the registry this machine reaches serves packuments without them ("No
# compatible signature found in package metadata"), so the check is switched off for the
# tests; corepack's downloads are cached under target/tools/corepack.
export COREPACK_HOME="${TOOLS:?TOOLS must be set}/corepack"
export COREPACK_INTEGRITY_KEYS=0
export COREPACK_ENABLE_DOWNLOAD_PROMPT=0
# Yarn 2+ otherwise downloads from repo.yarnpkg.com, which a machine that reaches only the
# package registries cannot resolve; with a registry set, corepack takes it from npm's
# `@yarnpkg/cli-dist`.
if [ -z "${COREPACK_NPM_REGISTRY:-}" ]; then
  COREPACK_NPM_REGISTRY="$(npm config get registry 2>/dev/null | sed 's:/*$::')"
  export COREPACK_NPM_REGISTRY="${COREPACK_NPM_REGISTRY:-https://registry.npmjs.org}"
fi
if ! command -v corepack >/dev/null 2>&1; then
  echo "corepack (shipped with Node.js) is required for the test-runner's pnpm tests" >&2
  return 1
fi
corepack pnpm@9.15.9 --version >/dev/null
# The yarn workspace tests: classic and berry (its fixture names the npm registry).
corepack yarn@1.22.22 --version >/dev/null
corepack yarn@4.5.3 --version >/dev/null
