#!/usr/bin/env bash
# Debian packages Hangar's node needs; installs only what is missing (idempotent, quiet when done).
set -euo pipefail
need=()
have() { command -v "$1" >/dev/null 2>&1; }
have runsc || need+=(runsc)
[ -x /bin/busybox ] || need+=(busybox-static)
have redis-server || need+=(redis-server)
have gcc || need+=(gcc)
[ -e /usr/lib/x86_64-linux-gnu/libc.a ] || [ -e /usr/lib/aarch64-linux-gnu/libc.a ] || need+=(libc6-dev)
have skopeo || need+=(skopeo)
have umoci || need+=(umoci)
have mmdebstrap || need+=(mmdebstrap)
have docker-registry || need+=(docker-registry)
python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
have ps || need+=(procps)
have mkfs.ext4 || need+=(e2fsprogs)
have nft || need+=(nftables)
have ip || need+=(iproute2)
have unshare || need+=(util-linux)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "Hangar needs these Debian packages, and installing them needs root: ${need[*]}" >&2
    exit 1
  fi
  echo "installing: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
