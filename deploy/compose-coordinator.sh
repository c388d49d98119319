#!/bin/bash
# The compose coordinator service: `murmur coordinator serve ARGS...`, and once it listens, the
# run and a join token, so `docker compose up` trains with no manual step:
#   - the run from $MURMUR_RUN_TOML (default /run/run.toml) and $MURMUR_DATA/manifest.json, unless
#     the ledger already has one (a restarted coordinator keeps its run);
#   - a join token for $MURMUR_TOKEN_USES nodes (default 16) in /join/token, unless one is there;
#     the node service reads it from the shared `join` volume, with /join/listening.json (the
#     addresses the coordinator bound, which may have been port 0).
# SIGTERM goes to the coordinator, which stops cleanly; this script exits with its status.
set -euo pipefail

RUN_TOML=${MURMUR_RUN_TOML_IN_CONTAINER:-/run/run.toml}
USES=${MURMUR_TOKEN_USES:-16}
FIFO=$(mktemp -u /tmp/serve.XXXXXX)
mkfifo "$FIFO"
murmur coordinator serve "$@" > "$FIFO" &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null || true' TERM INT
exec 3< "$FIFO"
rm -f "$FIFO"
# The first stdout line is the listening record: {"event": "listening", "address": ..., ...}.
if ! read -r listening <&3; then
    wait "$pid" || exit $?
    exit 1
fi
cat <&3 &  # keep draining the coordinator's stdout
# Where it listens, for nodes started with no MURMUR_COORDINATOR (ports may be 0: the kernel's pick).
printf '%s\n' "$listening" > /join/listening.json.new && mv /join/listening.json.new /join/listening.json
field() { python3 -c 'import json, sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$listening" "$1"; }
admin() {
    murmur admin "$@" --coordinator "$(field address)" --admin-key "$(field admin_key_file)" \
        --ca-cert "$(field ca_cert_file)"
}
if ! admin runs show >/dev/null 2>&1; then
    admin runs create --config "$RUN_TOML" --manifest "${MURMUR_DATA:-/data/run}/manifest.json"
fi
if [ ! -s /join/token ]; then
    admin tokens create --uses "$USES" --ttl 30d --note compose --output json \
        | python3 -c 'import json, sys; print(json.load(sys.stdin)["token"])' > /join/token.new
    mv /join/token.new /join/token
    echo "join token for $USES node(s) written to /join/token" >&2
fi
set +e
wait "$pid"
rc=$?
if kill -0 "$pid" 2>/dev/null; then  # the wait was cut short by our trap: wait for the real exit
    wait "$pid"
    rc=$?
fi
exit $rc
