#!/usr/bin/env bash
# Makes everything a secured troupe needs, for trying it out: a CA, a server certificate
# (localhost, 127.0.0.1; O=worker, so the worker services can present it as their client
# certificate too), client certificates for O=client and O=admin, and three random bearer
# tokens with the tokens file the servers read. Needs openssl. Keys never leave DIR.
#
#   examples/auth/make-certs.sh /tmp/troupe-auth
#
# TROUPE_CERT_SANS replaces the server certificate's names (default DNS:localhost,IP:127.0.0.1),
# for a cluster: docs/kubernetes.md.
set -euo pipefail
DIR=${1:?usage: make-certs.sh DIR}
mkdir -p "$DIR"
cd "$DIR"
umask 077

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 \
  -subj "/CN=troupe-ca" -keyout ca-key.pem -out ca.pem \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null

# issue NAME SUBJECT EXTENSIONS: a key and a certificate signed by the CA.
issue() {
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "$2" \
    -keyout "$1-key.pem" -out "$1.csr" 2>/dev/null
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca-key.pem -CAcreateserial -days 30 \
    -out "$1.pem" -extfile <(printf '%b\n' "$3") 2>/dev/null
  rm "$1.csr"
}
issue server "/CN=troupe/O=worker" \
  "subjectAltName=${TROUPE_CERT_SANS:-DNS:localhost,IP:127.0.0.1}\nextendedKeyUsage=serverAuth,clientAuth"
issue client "/CN=alice/O=client" "extendedKeyUsage=clientAuth"
issue admin "/CN=root/O=admin" "extendedKeyUsage=clientAuth"

# One token per scope: `<scope>.token` for a client's --token-file, `tokens` for the servers.
: > tokens
for scope in worker client admin; do
  token=$(openssl rand -hex 32)
  printf '%s\n' "$token" > "$scope.token"
  printf '%s:%s\n' "$scope" "$token" >> tokens
done
echo "made ca.pem, server.pem, client.pem, admin.pem (with keys), tokens and {worker,client,admin}.token in $DIR" >&2
