"""Writing into run folders without following links.

A run folder may come from someone else (copied, unpacked, shared), and an entry in it that is
a symbolic link would make a write land outside it. So a run refuses a folder that holds a link
(`refuse_links`, before it writes anything), and each writer replaces or creates its entry
itself instead of opening what the name points to: files through a fresh temporary name and a
rename (`atomic_write`), an appended log with `O_NOFOLLOW` (`open_append`), folders written
under a fresh name and renamed into place (`fresh_dir`, `replace_dir`). A rename replaces a
link itself, never its target.

Knows nothing about what a run writes; `runtime/run_state.py` does.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def links_in(folder: Path) -> list[Path]:
    """Every symbolic link inside `folder` (not `folder` itself), without following any."""
    found = []
    for root, dirs, files in os.walk(folder, followlinks=False):
        for name in dirs + files:
            if os.path.islink(os.path.join(root, name)):
                found.append(Path(root, name))
    return sorted(found)


def refuse_links(folder: Path) -> None:
    """Raise a one-line ValueError naming the first link inside `folder` and where it points."""
    links = links_in(folder)
    if links:
        more = f" (and {len(links) - 1} more)" if len(links) > 1 else ""
        raise ValueError(f"{links[0]} is a symbolic link (to {os.readlink(links[0])}){more}: rlfusion never writes "
                         f"through links in a run folder; replace it with a real file or folder, or remove it")


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write `path` through `write(file)` on a temporary file in the same folder, then rename
    it over `path`: readers (and a run killed mid-write) see the old file or the new one, and a
    link at `path` is replaced, not written through."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def save_figure(fig, path: Path, dpi: int) -> None:
    """A matplotlib figure as a PNG at `path`, written atomically."""
    atomic_write(path, lambda f: fig.savefig(f, dpi=dpi, format="png"))


def open_append(path: Path, **kwargs) -> IO:
    """`path` opened for appending (created if missing); a link there raises OSError (ELOOP)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    return os.fdopen(fd, "a", **kwargs)


def fresh_dir(parent: Path, name: str) -> Path:
    """A new, empty folder `parent/.NAME.<random>.tmp` (mkdtemp: never an existing entry)."""
    return Path(tempfile.mkdtemp(dir=parent, prefix=f".{name}.", suffix=".tmp"))


def replace_dir(tmp: Path, path: Path, keep_old: Path | None = None) -> None:
    """Put the finished folder `tmp` at `path`. An old folder there moves to `keep_old` (or a
    fresh name) until the new one is in place, so a kill between the renames leaves one whole;
    a link there is removed, not followed."""
    old = keep_old or path.with_name(f".{path.name}.old")
    _remove(old)
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        path.rename(old)
    tmp.rename(path)
    _remove(old)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)
