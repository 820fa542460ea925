#!/usr/bin/env bash
# What only the tests need beyond a node's packages: Debian's Chromium, which the browser
# tests drive through Playwright (the pip package brings the driver, not a browser), and
# pg_dump, which the secrets test reads the database's dump with.
set -euo pipefail
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium fonts-dejavu-core)
command -v pg_dump >/dev/null 2>&1 || need+=(postgresql-client)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "the tests need Debian's ${need[*]}, and installing them needs root" >&2
    exit 1
  fi
  echo "installing: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
