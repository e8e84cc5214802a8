#!/usr/bin/env bash
# Run a command with a Docker engine: the one that answers, else a dockerd
# started here (as root) and stopped when the command ends. Without any, the
# command still runs (the Docker tests then skip, saying why) after a loud note.
set -uo pipefail

started=""
stop_started() {
  if [ -n "$started" ]; then
    kill "$started" 2>/dev/null
    wait "$started" 2>/dev/null
    echo "with_docker: stopped the dockerd started for this run"
  fi
}
trap stop_started EXIT

if ! docker info >/dev/null 2>&1; then
  if command -v dockerd >/dev/null && [ "$(id -u)" = 0 ]; then
    log=$(mktemp -t dockerd.XXXXXX.log)
    dockerd >"$log" 2>&1 &
    started=$!
    for _ in $(seq 1 60); do
      docker info >/dev/null 2>&1 && break
      kill -0 "$started" 2>/dev/null || break
      sleep 0.5
    done
  fi
fi
if ! docker info >/dev/null 2>&1; then
  echo "################################################################" >&2
  echo "#  NO DOCKER ENGINE: the compose stack tests are SKIPPED.       #" >&2
  echo "#  Install docker.io, docker-compose and debootstrap, as root,  #" >&2
  echo "#  to run them (see README, Development).                       #" >&2
  echo "################################################################" >&2
fi
"$@"
