#!/usr/bin/env bash
# The tests talk to a real Postgres and Redis on 127.0.0.1. Start them if they are not running
# (installing them first on a machine that has neither).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive

if ! (exec 3<>/dev/tcp/127.0.0.1/5432) 2>/dev/null; then
  if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq postgresql >/dev/null
  fi
  ver=$(ls /etc/postgresql | sort -V | tail -1)
  hba=/etc/postgresql/$ver/main/pg_hba.conf
  # Tests connect as postgres over TCP without a password, as CI's server allows.
  if ! grep -q '^host all all 127.0.0.1/32 trust' "$hba"; then
    sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
  fi
  pg_ctlcluster --skip-systemctl-redirect "$ver" main start || pg_ctlcluster "$ver" main start
  for _ in $(seq 50); do (exec 3<>/dev/tcp/127.0.0.1/5432) 2>/dev/null && break; sleep 0.2; done
fi

if ! (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; then
  command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; }
  mkdir -p /var/lib/redis
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no --dir /var/lib/redis
  for _ in $(seq 50); do (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null && break; sleep 0.2; done
fi
