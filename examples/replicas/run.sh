#!/bin/sh
# Start every process of the Procfile beside this script; stop them all on Ctrl-C or TERM.
#   SAGA_SIDECAR_DB=postgresql://saga:PASSWORD@127.0.0.1:5432/saga sh examples/replicas/run.sh
set -u
: "${SAGA_SIDECAR_DB:?set SAGA_SIDECAR_DB=postgresql://USER:PASSWORD@HOST:PORT/DB}"
export SAGA_SIDECAR_DB
here=$(dirname "$0")
pids=""
stop() {
    trap - INT TERM
    [ -n "$pids" ] && kill $pids 2>/dev/null
    wait
    exit 0
}
trap stop INT TERM
while IFS= read -r line; do
    case "$line" in '' | '#'*) continue ;; esac
    name=${line%%:*}
    command=${line#*:}
    echo "starting $name:$command" >&2
    sh -c "exec $command" &
    pids="$pids $!"
done < "$here/Procfile"
wait
