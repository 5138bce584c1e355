#!/bin/sh
# Registers the namespace Ballast runs in (BALLAST_TEMPORAL_NAMESPACE): the plain Temporal
# server image, unlike the dev server, starts with none. Idempotent.
set -eu

ADDRESS="${TEMPORAL_ADDRESS:-temporal:7233}"
# Dial the IPv4 address: the CLI may otherwise try an IPv6 record the server does not bind.
HOST="${ADDRESS%:*}"
IPV4="$(getent ahostsv4 "$HOST" 2>/dev/null | awk 'NR == 1 { print $1 }')" || true
[ -n "$IPV4" ] && ADDRESS="$IPV4:${ADDRESS##*:}"
NAMESPACE="${NAMESPACE:-default}"
RETENTION="${RETENTION:-72h}"

attempt=0
until temporal operator cluster health --address "$ADDRESS"; do
  attempt=$((attempt + 1))
  if [ "$attempt" -ge 60 ]; then
    echo "temporal at $ADDRESS is not serving after $attempt attempts" >&2
    exit 1
  fi
  sleep 2
done

if temporal operator namespace describe --address "$ADDRESS" --namespace "$NAMESPACE" >/dev/null 2>&1; then
  echo "namespace $NAMESPACE exists"
else
  temporal operator namespace create --address "$ADDRESS" --namespace "$NAMESPACE" --retention "$RETENTION"
  echo "namespace $NAMESPACE created"
fi
