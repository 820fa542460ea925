"""The local side of directory uploads and downloads, shared by the sync and async files:
walking a local tree, reading a file a piece at a time, and where a remote entry lands."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path, PurePosixPath

from ._errors import HangarError

# Files travel this much at a time: a directory of any size is never held in memory.
CHUNK = 256 * 1024
# Told the bytes just moved, as they move (a progress bar adds them up).
Progress = Callable[[int], None]


def local_tree(src: str | os.PathLike[str]) -> tuple[list[tuple[str, Path]], list[str]]:
    """The files under ``src`` (relative POSIX path, local path), and its empty directories
    (relative paths), sorted. Symlinks to files are uploaded as the file; symlinked
    directories are not followed."""
    root = Path(src)
    if not root.is_dir():
        raise HangarError(f"{root} is not a directory")
    files: list[tuple[str, Path]] = []
    empty: list[str] = []
    for here, dirs, names in os.walk(root):
        dirs.sort()
        rel_here = Path(here).relative_to(root).as_posix()
        for name in sorted(names):
            path = Path(here, name)
            if path.is_file():
                files.append((name if rel_here == "." else f"{rel_here}/{name}", path))
        if not dirs and not names and rel_here != ".":
            empty.append(rel_here)
    return files, empty


def file_chunks(path: Path, progress: Progress | None = None) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            yield chunk
            if progress is not None:  # once the transport has taken it
                progress(len(chunk))


async def afile_chunks(path: Path, progress: Progress | None = None) -> AsyncIterator[bytes]:
    # Local reads are short next to the network; they run on the loop, a piece at a time.
    for chunk in file_chunks(path, progress):
        yield chunk


def local_target(dest: str | os.PathLike[str], rel: str) -> Path:
    """Where the remote entry at ``rel`` (relative to the downloaded directory) goes under
    ``dest``; a name that would leave it is refused."""
    parts = PurePosixPath(rel).parts
    if any(p in ("..", "") or "/" in p or os.sep in p for p in parts) or PurePosixPath(rel).is_absolute():
        raise HangarError(f"refusing to write {rel!r} outside {dest}")
    return Path(dest, *parts)
