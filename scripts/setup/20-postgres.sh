#!/usr/bin/env bash
# Sourced by scripts/test (or `source scripts/setup/20-postgres.sh` by hand). Starts a throwaway
# PostgreSQL cluster for the coordinator's PostgreSQL tests from Debian's postgresql-15 server
# binaries, and exports TROUPE_TEST_DATABASE_URL. Idempotent: a running cluster is reused.
#
# - data in $TOOLS/pg/data, log in $TOOLS/pg/log, socket + port file in $TOOLS/pg/run
# - TCP on 127.0.0.1 on a free port (remembered in $TOOLS/pg/port), trust authentication
# - the server never runs as root: as root it runs as the system user `troupe-pg`
# Each run gets a fresh database `troupe_test_<pid>`; tests create a schema each, so they run in
# parallel, and so do concurrent runs.
# Without the binaries the variable stays unset (the PostgreSQL tests fail under CI=true).
pg_setup() {
  local bin=${TROUPE_PG_BIN:-/usr/lib/postgresql/15/bin}
  local root="${TOOLS:?TOOLS must be set}/pg"
  local data="$root/data" run="$root/run" log="$root/log"
  if [ ! -x "$bin/pg_ctl" ]; then
    echo "postgres: $bin/pg_ctl not found (apt-get install postgresql-15); PostgreSQL tests need TROUPE_TEST_DATABASE_URL" >&2
    return 0
  fi
  local as=()
  if [ "$(id -u)" = 0 ]; then
    if ! id troupe-pg >/dev/null 2>&1; then
      useradd --system --no-create-home --shell /usr/sbin/nologin troupe-pg
    fi
    as=(runuser -u troupe-pg --)
  fi
  mkdir -p "$root" "$run"
  # The server user must reach its directories: open the path down to $root for traversal.
  if [ "${#as[@]}" -gt 0 ]; then
    local dir=$root
    while [ "$dir" != / ]; do
      chmod o+x "$dir" 2>/dev/null || true
      dir=$(dirname "$dir")
    done
    chown troupe-pg "$root" "$run"
  fi
  if [ ! -f "$data/PG_VERSION" ]; then
    "${as[@]}" "$bin/initdb" --pgdata="$data" --username=postgres --auth=trust \
      --encoding=UTF8 --no-instructions >/dev/null
  fi
  local port
  if "${as[@]}" "$bin/pg_ctl" status --pgdata="$data" >/dev/null 2>&1; then
    port=$(cat "$root/port")
  else
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    echo "$port" >"$root/port"
    "${as[@]}" "$bin/pg_ctl" start --pgdata="$data" --log="$log" --wait --timeout=60 \
      --options="-c listen_addresses=127.0.0.1 -c port=$port -c unix_socket_directories=$run -c max_connections=400 -c shared_buffers=64MB" \
      >/dev/null
  fi
  local deadline=$((SECONDS + 60))
  until "$bin/pg_isready" --host=127.0.0.1 --port="$port" --quiet; do
    if [ $SECONDS -ge $deadline ]; then
      echo "postgres: not ready after 60 s; see $log" >&2
      return 1
    fi
    sleep 0.2
  done
  # A fresh database per run, named after this shell's pid: tests leave their schemas behind, so
  # the databases of runs whose shell has exited are dropped; a concurrent run's is left alone.
  local psql=("$bin/psql" --quiet --tuples-only --no-align --host=127.0.0.1 --port="$port" --username=postgres --dbname=postgres)
  local name stale
  for name in $(PGOPTIONS="-c client_min_messages=warning" "${psql[@]}" \
    --command="SELECT datname FROM pg_database WHERE datname LIKE 'troupe\_test%'"); do
    stale=${name#troupe_test}
    stale=${stale#_}
    if [ -z "$stale" ] || ! kill -0 "$stale" 2>/dev/null; then
      PGOPTIONS="-c client_min_messages=warning" "${psql[@]}" \
        --command="DROP DATABASE IF EXISTS \"$name\" WITH (FORCE)" >/dev/null
    fi
  done
  local db="troupe_test_$$"
  PGOPTIONS="-c client_min_messages=warning" "${psql[@]}" \
    --command="DROP DATABASE IF EXISTS $db WITH (FORCE)" \
    --command="CREATE DATABASE $db" >/dev/null
  export TROUPE_TEST_DATABASE_URL="postgres://postgres@127.0.0.1:$port/$db"
  echo "postgres: $TROUPE_TEST_DATABASE_URL (data $data)"
}
pg_setup
