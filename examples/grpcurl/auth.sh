#!/usr/bin/env bash
# grpcurl against a troupe that requires credentials, exactly as docs/security.md
# shows it. Start it with the files of examples/auth/make-certs.sh:
#
#   examples/auth/make-certs.sh /tmp/troupe-auth
#   A=/tmp/troupe-auth
#   troupe up --listen 127.0.0.1:7443 --data-dir /tmp/secure-up --auth-tokens-file $A/tokens \
#     --tls-cert $A/server.pem --tls-key $A/server-key.pem --tls-ca $A/ca.pem --tls-client-ca $A/ca.pem &
#   examples/grpcurl/auth.sh
#
# UP and A override the address and the folder. Stops at the first unexpected answer.
set -euo pipefail
UP=${UP:-127.0.0.1:7443}
A=${A:-/tmp/troupe-auth}
show() { printf '\n$ %s\n' "$*" >&2; }
# expect_code CODE COMMAND...: the command must fail with that gRPC code.
expect_code() {
  local code=$1 out
  shift
  if out=$("$@" 2>&1); then
    echo "expected $code, but it succeeded: $out" >&2
    exit 1
  fi
  grep -q "Code: $code" <<<"$out" || { echo "expected $code, got: $out" >&2; exit 1; }
  echo "refused as expected: $code" >&2
}

# Health and reflection need no credentials (reflection can be closed: --reflection).
show grpcurl -cacert "$A/ca.pem" "$UP" list
grpcurl -cacert "$A/ca.pem" "$UP" list
grpcurl -cacert "$A/ca.pem" -d '{"service": "troupe.v1.Coordinator"}' "$UP" grpc.health.v1.Health/Check

# A bearer token: the `client` scope may read and drive sessions.
show grpcurl -cacert "$A/ca.pem" -H "authorization: Bearer \$(cat $A/client.token)" ... ListSessions
grpcurl -cacert "$A/ca.pem" -H "authorization: Bearer $(cat "$A/client.token")" \
  -d '{"limit": 5}' "$UP" troupe.v1.Coordinator/ListSessions
grpcurl -cacert "$A/ca.pem" -H "authorization: Bearer $(cat "$A/client.token")" \
  -d '{}' "$UP" troupe.v1.Executor/ListBackends

# A client certificate: its O= names its scopes (client.pem is O=client, admin.pem O=admin).
show grpcurl -cacert "$A/ca.pem" -cert "$A/client.pem" -key "$A/client-key.pem" ... ListSessions
grpcurl -cacert "$A/ca.pem" -cert "$A/client.pem" -key "$A/client-key.pem" \
  -d '{"limit": 5}' "$UP" troupe.v1.Coordinator/ListSessions

# The worker protocol needs `worker` (or `admin`).
grpcurl -cacert "$A/ca.pem" -cert "$A/admin.pem" -key "$A/admin-key.pem" \
  -d '{"workerId": "by-hand", "roles": ["ROLE_EXECUTOR"], "maxTasks": 1}' "$UP" troupe.v1.Coordinator/ClaimTasks

# Refusals: no credentials, and the wrong scope.
show grpcurl -cacert "$A/ca.pem" -d '{}' "$UP" troupe.v1.Coordinator/ListSessions
expect_code Unauthenticated grpcurl -cacert "$A/ca.pem" -d '{}' "$UP" troupe.v1.Coordinator/ListSessions
show grpcurl -cacert "$A/ca.pem" -H "authorization: Bearer \$(cat $A/worker.token)" ... CreateSession
expect_code PermissionDenied grpcurl -cacert "$A/ca.pem" -H "authorization: Bearer $(cat "$A/worker.token")" \
  -d '{}' "$UP" troupe.v1.Coordinator/CreateSession
expect_code PermissionDenied grpcurl -cacert "$A/ca.pem" -cert "$A/client.pem" -key "$A/client-key.pem" \
  -d '{}' "$UP" troupe.v1.Coordinator/ClaimTasks
echo "auth tour complete" >&2
