#!/usr/bin/env bash
# What only the tests need beyond a node's packages: Debian's Chromium, which the browser
# tests drive through Playwright (the pip package brings the driver, not a browser).
set -euo pipefail
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ]; then
    echo "the browser tests need Debian's chromium package, and installing it needs root" >&2
    exit 1
  fi
  echo "installing: chromium"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
fi
