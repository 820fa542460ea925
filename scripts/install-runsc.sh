#!/usr/bin/env bash
# gVisor's runsc from Debian 13 (trixie), for Debian 12 nodes: Debian 12's runsc (20221219)
# answers statx() with EINVAL (so `ls -l /path` and `stat` fail in Debian images) and always
# compresses checkpoints. The package is fetched by apt from trixie's own index, verified
# against the Debian archive keys the machine already trusts; the machine's apt sources and
# installed packages are left alone. The binary (static) goes to /usr/local/lib/hangar/runsc,
# which Hangar prefers to the runsc on PATH (HANGAR_RUNSC overrides both).
# Idempotent: does nothing when that binary is there and runs. HANGAR_SKIP_NEWER_RUNSC=1 skips it.
set -euo pipefail
dest=/usr/local/lib/hangar/runsc
[ "${HANGAR_SKIP_NEWER_RUNSC:-}" = 1 ] && exit 0
if [ -x "$dest" ] && "$dest" --version >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" != 0 ]; then echo "installing runsc into $dest needs root" >&2; exit 1; fi
. /etc/os-release
if [ "${VERSION_CODENAME:-}" != bookworm ]; then
  exit 0  # Debian 13 and later ship this runsc (or newer) themselves
fi
work=/var/cache/hangar/apt-trixie
mkdir -p "$work/lists/partial" "$work/archives/partial" "$work/parts" "$work/deb"
# The machine's own Debian mirror (deb822 or one-line sources), else deb.debian.org.
mirror=$(cat /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list 2>/dev/null \
  | sed -n -e 's/^URIs: *\(http[^ ]*\/debian\)\/*$/\1/p' -e 's/^deb  *\(\[[^]]*\]  *\)\{0,1\}\(http[^ ]*\/debian\)\/*  *bookworm .*/\2/p' \
  | head -1 || true)
cat > "$work/parts/trixie.sources" <<SRC
Types: deb
URIs: ${mirror:-http://deb.debian.org/debian}
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
apt_opts=(-q -o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$work/parts"
          -o "Dir::State::Lists=$work/lists" -o "Dir::Cache::Archives=$work/archives"
          -o APT::Sandbox::User=root)
echo "fetching runsc from Debian 13 (trixie)"
if ! { apt-get "${apt_opts[@]}" update >/dev/null &&
       (cd "$work/deb" && rm -f runsc_*.deb && apt-get "${apt_opts[@]}" download runsc/trixie >/dev/null); }; then
  # Not fatal: Debian 12's runsc runs everything but statx (see the README's Known limits).
  echo "warning: could not fetch runsc from trixie; Hangar will use $(command -v runsc || echo runsc)" >&2
  exit 0
fi
rm -rf "$work/x" && dpkg-deb -x "$work"/deb/runsc_*.deb "$work/x"
install -D -m 0755 "$work/x/usr/bin/runsc" "$dest.new" && mv -f "$dest.new" "$dest"
rm -rf "$work/x" "$work/lists"
"$dest" --version | sed -n 1p
