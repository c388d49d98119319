#!/bin/bash
# The compose node service: `murmur node run ARGS...` with $MURMUR_TOKEN, or, when that is unset,
# the token the coordinator service wrote to the shared `join` volume (waiting for it a while).
# With no MURMUR_COORDINATOR either, the address comes from the same volume (/join/listening.json).
set -euo pipefail

if [ -z "${MURMUR_TOKEN:-}" ]; then
    wait_s=${MURMUR_TOKEN_WAIT_S:-300}
    for _ in $(seq "$wait_s"); do
        [ -s /join/token ] && break
        sleep 1
    done
    if [ ! -s /join/token ]; then
        echo "error: no MURMUR_TOKEN set and no /join/token after ${wait_s}s; is the coordinator service up?" >&2
        exit 1
    fi
    MURMUR_TOKEN=$(cat /join/token)
    export MURMUR_TOKEN
fi
if [ -z "${MURMUR_COORDINATOR:-}" ]; then
    MURMUR_COORDINATOR=$(python3 -c 'import json; print(json.load(open("/join/listening.json"))["address"])')
    export MURMUR_COORDINATOR
fi
if [ -z "${MURMUR_NAME:-}" ]; then
    # A name for `murmur admin` and the status page: the container's id as `docker ps` shows it,
    # read from where the engine mounts the container's /etc/hostname (the hostname itself is the
    # host's under host networking, as in the loopback tests). MURMUR_NAME overrides it.
    id=$(sed -n 's|.*/containers/\([0-9a-f]\{12\}\)[0-9a-f]*/hostname .*|\1|p' /proc/self/mountinfo | head -1)
    if [ -n "$id" ]; then
        MURMUR_NAME="node-$id"
        export MURMUR_NAME
    fi
fi
exec murmur node run "$@"
