#!/usr/bin/env bash
# graphile-worker side by side with the coordinator's S1/S2 (docs/performance.md §1.2, §6),
# against the same PostgreSQL.
#
#   export TOOLS=$PWD/target/tools && source scripts/setup/20-postgres.sh
#   bench/graphile-worker/run.sh                 # JOBS=2000 CONCURRENCY=8 SAMPLES=300 OURS=1
#
# Installs graphile-worker (GRAPHILE_VERSION, default 0.18.0) from npm into
# $TOOLS/graphile-worker (nothing is committed), then in a fresh database:
#   burn-down: JOBS no-op jobs inserted in one statement, drained by one worker process with
#              CONCURRENCY (batching off: the library's defaults, no local queue, no batched
#              completion), jobs/s from the first job start to the last completion;
#   latency:   SAMPLES sequential add_job -> task start times with an idle worker (LISTEN/NOTIFY).
# With OURS=1 it then runs the coordinator's S1/S2 bench on the same server with the same job
# count and concurrency, for the table in docs/performance.md.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
: "${TOOLS:?export TOOLS=$ROOT/target/tools}"
: "${TROUPE_TEST_DATABASE_URL:?source scripts/setup/20-postgres.sh first}"
VERSION=${GRAPHILE_VERSION:-0.18.0}
JOBS=${JOBS:-2000}
CONCURRENCY=${CONCURRENCY:-8}
SAMPLES=${SAMPLES:-300}
OURS=${OURS:-1}
DIR="$TOOLS/graphile-worker"

if [ ! -f "$DIR/node_modules/graphile-worker/package.json" ] ||
  [ "$(node -p "require('$DIR/node_modules/graphile-worker/package.json').version")" != "$VERSION" ]; then
  mkdir -p "$DIR"
  (cd "$DIR" && [ -f package.json ] || echo '{"private": true}' > package.json)
  npm install --prefix "$DIR" --no-audit --no-fund --loglevel=error "graphile-worker@$VERSION" >&2
fi

# A fresh database next to the test database, dropped at the end.
DB="gw_bench_$$"
BASE_URL=${TROUPE_TEST_DATABASE_URL%/*}
ADMIN_URL="$BASE_URL/postgres"
URL="$BASE_URL/$DB"
node -e '
const { Client } = require(process.argv[1] + "/node_modules/pg");
(async () => { const c = new Client({ connectionString: process.argv[2] }); await c.connect();
  await c.query("CREATE DATABASE " + process.argv[3]); await c.end(); })().catch((e) => { console.error(e); process.exit(1); });
' "$DIR" "$ADMIN_URL" "$DB"
cleanup() {
  node -e '
const { Client } = require(process.argv[1] + "/node_modules/pg");
(async () => { const c = new Client({ connectionString: process.argv[2] }); await c.connect();
  await c.query("DROP DATABASE IF EXISTS " + process.argv[3] + " WITH (FORCE)"); await c.end(); })().catch(() => {});
' "$DIR" "$ADMIN_URL" "$DB" || true
}
trap cleanup EXIT

NODE_PATH="$DIR/node_modules" node "$HERE/bench.js" "$URL" "$JOBS" "$CONCURRENCY" "$SAMPLES"

if [ "$OURS" = 1 ]; then
  echo "troupe coordinator, same PostgreSQL (release build):"
  (cd "$ROOT" && cargo bench -q -p troupe-coordinator --bench throughput -- \
    --db postgres --tasks "$JOBS" --workers "$CONCURRENCY" --batch 1 --samples "$SAMPLES")
  # The same burn-down with each CompleteTask also claiming the worker's next task.
  (cd "$ROOT" && cargo bench -q -p troupe-coordinator --bench throughput -- \
    --db postgres --tasks "$JOBS" --workers "$CONCURRENCY" --batch 1 --claim-next --only s1)
fi
