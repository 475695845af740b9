#!/usr/bin/env bash
# Writes a throw-away CA and one server certificate for the compose services into DIR:
#   ca.pem, server.pem, server-key.pem   (the layout deploy/docker-compose.tls.yml mounts)
# The certificate names every service the containers dial plus localhost/127.0.0.1 for the
# host-side checks. For tests only: the files are world-readable so the containers' non-root
# user can read them.
#
#   bash deploy/ci/tls-certs.sh DIR
set -euo pipefail
dir=${1:?usage: tls-certs.sh DIR}
mkdir -p "$dir"
cd "$dir"
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=pdplane test CA" \
  -keyout ca-key.pem -out ca.pem 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=pdplane" \
  -keyout server-key.pem -out server.csr 2>/dev/null
printf 'subjectAltName=%s\n' \
  "DNS:registry,DNS:scheduler,DNS:gateway,DNS:prefill,DNS:decode,DNS:localhost,IP:127.0.0.1" \
  >san.ext
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca-key.pem -CAcreateserial -days 2 \
  -extfile san.ext -out server.pem 2>/dev/null
rm -f server.csr san.ext ca.srl ca-key.pem
chmod 0644 ./*.pem
