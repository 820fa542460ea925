#!/usr/bin/env bash
# What the microvm launcher needs on a node: QEMU (qemu-system-x86, qemu-utils) from Debian, and
# a guest kernel: Debian's cloud kernel package (linux-image-cloud-amd64), fetched with
# `apt-get download` and unpacked with `dpkg-deb -x`, never installed as the host's kernel. The
# kernel and the few modules the guest needs (virtio_mmio, virtio_blk, virtio_console,
# virtio_net, ext4, overlay, vsock's virtio transport (loaded only where the node uses vsock)
# and what they depend on) go to /usr/local/lib/hangar/microvm, outside
# git and any data directory, like runsc. The initramfs is built by the launcher from source in
# the repo (runtime/launchers/microvm/guest/), so it is not made here.
# Idempotent: does nothing when the kernel is there. HANGAR_SKIP_MICROVM=1 skips it.
set -euo pipefail
dest=${HANGAR_MICROVM_DIR:-/usr/local/lib/hangar/microvm}
[ "${HANGAR_SKIP_MICROVM:-}" = 1 ] && exit 0
[ "$(uname -m)" = x86_64 ] || exit 0  # the guest kernel fetched here is amd64's
need=()
command -v qemu-system-x86_64 >/dev/null 2>&1 || need+=(qemu-system-x86)
command -v qemu-img >/dev/null 2>&1 || need+=(qemu-utils)
command -v depmod >/dev/null 2>&1 || need+=(kmod)  # depmod: what each guest module needs
# A kernel unpacked before vsock's modules were in the list is unpacked again (from the cached .deb).
installed() { [ -s "$dest/vmlinuz" ] && [ -s "$dest/modules.list" ] && grep -q vsock "$dest/modules.list"; }
if installed && command -v qemu-system-x86_64 >/dev/null && command -v qemu-img >/dev/null; then exit 0; fi
if [ "$(id -u)" != 0 ]; then echo "installing QEMU and the microVM kernel into $dest needs root" >&2; exit 1; fi
export DEBIAN_FRONTEND=noninteractive
# Not fatal: without QEMU or the kernel the node leaves the microvm runtime out (and says why).
give_up() { echo "warning: $1; the microvm runtime stays off on this node" >&2; exit 0; }
if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}"
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null 2>&1 || {
    apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; } ||
    give_up "could not install ${need[*]}"
fi
installed && exit 0
work=/var/cache/hangar/microvm  # the .deb stays here: a rerun unpacks it again without fetching
mkdir -p "$work"
rm -rf "$work/x"
trap 'rm -rf "$work/x"' EXIT
echo "fetching the microVM guest kernel (linux-image-cloud-amd64)"
# The meta package names the versioned image package; download that one.
pkg=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null | sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*\)$/\1/p' | head -1)
if [ -z "$pkg" ]; then
  apt-get update -qq || true
  pkg=$(apt-cache depends linux-image-cloud-amd64 | sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*\)$/\1/p' | head -1)
fi
[ -n "$pkg" ] || give_up "cannot find the package linux-image-cloud-amd64 depends on"
[ -n "$(ls "$work"/"$pkg"_*.deb 2>/dev/null)" ] ||
  (cd "$work" && apt-get download -q -o APT::Sandbox::User=root "$pkg" >/dev/null) ||
  give_up "could not fetch $pkg"
dpkg-deb -x "$(ls "$work"/"$pkg"_*.deb | tail -1)" "$work/x"
kver=$(basename "$(ls -d "$work"/x/lib/modules/*)")
mods="$work/x/lib/modules/$kver"
depmod -b "$work/x" "$kver"  # the package's postinst would have; modules.dep says what needs what
mkdir -p "$dest.new/modules"
cp "$work/x/boot/vmlinuz-$kver" "$dest.new/vmlinuz"
# Each module the guest needs, after what it depends on (modules.dep order), decompressed
# (the initramfs's init loads them with finit_module, which takes plain .ko files).
: > "$dest.new/modules.list"
add() {
  local name=$1 path deps
  path=$(grep -E "(^|/)$name\.ko(\.xz|\.zst)?:" "$mods/modules.dep" | head -1 | cut -d: -f1) || true
  [ -n "$path" ] || return 0  # built into the kernel
  deps=$(grep -E "^$path:" "$mods/modules.dep" | cut -d: -f2)
  for dep in $deps; do add "$(basename "$dep" | sed -E 's/\.ko(\.xz|\.zst)?$//')"; done
  local base; base=$(basename "$path" | sed -E 's/\.ko(\.xz|\.zst)?$//')
  grep -qx "$base.ko" "$dest.new/modules.list" && return 0
  case "$path" in
    *.xz) xz -dc "$mods/$path" > "$dest.new/modules/$base.ko" ;;
    *.zst) zstd -qdc "$mods/$path" > "$dest.new/modules/$base.ko" ;;
    *) cp "$mods/$path" "$dest.new/modules/$base.ko" ;;
  esac
  echo "$base.ko" >> "$dest.new/modules.list"
}
for m in virtio_mmio virtio_blk virtio_console virtio_net ext4 overlay vmw_vsock_virtio_transport; do add "$m"; done
echo "$kver" > "$dest.new/version"
rm -rf "$dest.old"; [ -e "$dest" ] && mv "$dest" "$dest.old"
mv "$dest.new" "$dest" && rm -rf "$dest.old"
echo "microVM kernel $kver in $dest ($(wc -l < "$dest/modules.list") modules)"
