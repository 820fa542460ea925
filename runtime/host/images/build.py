"""Building root filesystems on the node: a tiny one from Debian's static busybox (seconds),
and Debian ones with mmdebstrap (``base``, ``minimal``: minutes, needs the mirror)."""

from __future__ import annotations

import os
import posixpath
import re
import shutil
import stat
import struct
import subprocess

from .base import (
    ImageError,
    ImageInfo,
    Progress,
    Store,
    emit,
    empty_config,
    mounts_under,
    rmtree,
    run_streaming,
    tree_digest,
    validate_name,
)

BUSYBOX_PATH = "/bin/busybox"
BASE_PACKAGES = (
    "bash",
    "coreutils",
    "git",
    "curl",
    "ca-certificates",
    "python3",
    "nodejs",
    "npm",
    "procps",
    "less",
    "openssh-client",
    "openssh-sftp-server",
    "xz-utils",
)
# A small Debian image for workspaces whose agent needs no Node.js: a shell, git, and what the
# SSH gateway's scp/sftp run inside the sandbox.
MINIMAL_PACKAGES = (
    "bash", "coreutils", "git", "ca-certificates", "openssh-client", "openssh-sftp-server", "procps"
)  # fmt: skip
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _elf_is_dynamic(path: str) -> bool:
    """True when the ELF file has a PT_INTERP header (needs a dynamic loader)."""
    with open(path, "rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF":
            return False
        endian = "<" if head[5] == 1 else ">"
        if head[4] == 2:
            (phoff,) = struct.unpack_from(endian + "Q", head, 0x20)
            phentsize, phnum = struct.unpack_from(endian + "HH", head, 0x36)
        else:
            (phoff,) = struct.unpack_from(endian + "I", head, 0x1C)
            phentsize, phnum = struct.unpack_from(endian + "HH", head, 0x2A)
        f.seek(phoff)
        for _ in range(min(phnum, 256)):
            entry = f.read(phentsize)
            if len(entry) < 4:
                break
            if struct.unpack_from(endian + "I", entry, 0)[0] == 3:  # PT_INTERP
                return True
    return False


def build_busybox(store: Store, name: str = "busybox", progress: Progress = None) -> ImageInfo:
    """A tiny image from Debian's static busybox: /bin/busybox plus a link per applet."""
    validate_name(name)
    if not os.path.isfile(BUSYBOX_PATH):
        raise ImageError(f"{BUSYBOX_PATH} is missing: apt-get install busybox-static")
    if _elf_is_dynamic(BUSYBOX_PATH):
        raise ImageError(
            f"{BUSYBOX_PATH} is dynamically linked (the 'busybox' package); apt-get install busybox-static"
        )
    source = "busybox-static"
    try:
        version = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", "busybox-static"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if version.returncode == 0 and version.stdout.strip():
            source = f"busybox-static {version.stdout.strip()}"
    except (OSError, subprocess.SubprocessError):
        pass
    listing = subprocess.run([BUSYBOX_PATH, "--list-full"], capture_output=True, text=True)
    if listing.returncode == 0 and listing.stdout.strip():
        applets = [line.strip() for line in listing.stdout.splitlines() if line.strip()]
    else:
        listing = subprocess.run([BUSYBOX_PATH, "--list"], capture_output=True, text=True)
        if listing.returncode != 0:
            raise ImageError(f"{BUSYBOX_PATH} --list failed: {listing.stderr.strip()}")
        applets = [f"bin/{line.strip()}" for line in listing.stdout.splitlines() if line.strip()]

    emit(progress, f"building {name} from {source} ({len(applets)} applets)")
    with store.building() as tmp:
        root = tmp / "rootfs"
        root.mkdir(mode=0o755)
        dirs = {
            "proc": 0o555,
            "sys": 0o555,
            "dev": 0o755,
            "tmp": 0o1777,
            "etc": 0o755,
            "root": 0o700,
            "home": 0o755,
            "bin": 0o755,
            "usr": 0o755,
            "usr/bin": 0o755,
            "usr/sbin": 0o755,
            "sbin": 0o755,
            "var": 0o755,
            "var/tmp": 0o1777,
            "run": 0o755,
        }
        for rel in dirs:
            (root / rel).mkdir()
        shutil.copyfile(BUSYBOX_PATH, root / "bin/busybox")
        os.chmod(root / "bin/busybox", 0o755)
        for applet_path in applets:
            rel = applet_path.strip("/")
            applet = posixpath.basename(rel)
            if not applet or applet == "busybox" or ".." in rel.split("/"):
                continue
            link = root / "bin" / applet
            if not os.path.lexists(link):
                os.symlink("busybox", link)
            directory = posixpath.dirname(rel)
            if directory not in ("", "bin"):  # "" is "linuxrc", for initrds: /bin only
                (root / directory).mkdir(parents=True, exist_ok=True)
                link = root / rel
                if not os.path.lexists(link):
                    os.symlink(posixpath.relpath("bin/busybox", directory), link)
        files = {
            "etc/passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
            "etc/group": "root:x:0:\nnogroup:x:65534:\n",
            "etc/hostname": "hangar\n",
            "etc/hosts": "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n",
        }
        for rel, text in files.items():
            (root / rel).write_text(text, encoding="ascii")
            os.chmod(root / rel, 0o644)
        for rel, mode in dirs.items():
            os.chmod(root / rel, mode)
        if os.geteuid() == 0:
            for dirpath, dirnames, filenames in os.walk(root):
                for entry in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
                    os.lchown(entry, 0, 0)
        digest = tree_digest(root)
        config = empty_config(env=[f"PATH={DEFAULT_PATH}", "HOME=/root"], cmd=["/bin/sh"], working_dir="/")
        info = store.commit(tmp, digest, source, config, name)
    emit(progress, f"{name}: {digest}")
    return info


def build_base(
    store: Store,
    name: str = "base",
    progress: Progress = None,
    suite: str = "bookworm",
    mirror: str | None = None,
    packages_list: tuple[str, ...] = BASE_PACKAGES,
) -> ImageInfo:
    """A Debian image (minbase + a dev toolset) via mmdebstrap; needs the mirror, takes minutes."""
    validate_name(name)
    if shutil.which("mmdebstrap") is None:
        raise ImageError("mmdebstrap is not installed: apt-get install mmdebstrap")
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]*", suite):
        raise ImageError(f"invalid suite {suite!r}")
    packages = ",".join(packages_list)
    with store.building() as tmp:
        root = tmp / "rootfs"
        cmd = ["mmdebstrap", "--variant=minbase", f"--include={packages}", suite, str(root)]
        if mirror:
            cmd.append(mirror)
        emit(progress, "$ " + " ".join(cmd))
        run_streaming(cmd, progress, "mmdebstrap", "apt-get install mmdebstrap")
        emit(progress, "cleaning apt lists and caches")
        for rel in ("var/lib/apt/lists", "var/cache/apt/archives", "var/cache/apt"):
            directory = root / rel
            if not directory.is_dir():
                continue
            for entry in directory.iterdir():
                if entry.is_file() or entry.is_symlink():
                    if entry.name != "lock":
                        entry.unlink()
                elif entry.is_dir() and entry.name == "partial":
                    for sub in entry.iterdir():
                        rmtree(sub)
        if mounts_under(str(root)):
            raise ImageError(f"mmdebstrap left filesystems mounted under {root}")
        # Device nodes are not kept in the store (the sandbox runtime provides /dev).
        for dirpath, _dirnames, filenames in os.walk(root / "dev"):
            for n in filenames:
                p = os.path.join(dirpath, n)
                if stat.S_ISCHR(os.lstat(p).st_mode) or stat.S_ISBLK(os.lstat(p).st_mode):
                    os.unlink(p)
        os.chmod(root, 0o755)
        emit(progress, "computing digest")
        digest = tree_digest(root)
        source = f"mmdebstrap {suite} minbase +{packages}" + (f" from {mirror}" if mirror else "")
        config = empty_config(
            env=[f"PATH={DEFAULT_PATH}", "HOME=/root", "LANG=C.UTF-8"],
            cmd=["/bin/bash"],
            working_dir="/",
        )
        info = store.commit(tmp, digest, source, config, name)
    emit(progress, f"{name}: {digest} ({info.size_bytes / 1e6:.0f} MB)")
    return info
