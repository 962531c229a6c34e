"""The trust boundary of ``cache_dir`` and AOT files: who may have written what this process unpickles.

Cache entries and AOT files are pickles: loading one runs code its writer chose, and a checksum
inside the same file proves integrity, not authorship. So the library loads them only from paths
that no other user can write: every directory from ``/`` down, and the file, must be owned by this
user or root and not writable by group or others (a directory with the sticky bit, like ``/tmp``,
is fine: others cannot rename or replace what they do not own). That holds for the path as given
and as it resolves: every symlink on the way, and every directory its target passes through. ``PB_TRUST_CACHE_DIR=1`` in the
environment, or ``trust=True`` where an API offers it, turns the check off for a path the user
vouches for (a shared volume whose writers they trust).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator

TRUST_ENV = "PB_TRUST_CACHE_DIR"


class UntrustedPathError(PermissionError):
    """A cache directory, cache entry or AOT file that another user could have written."""


def trust_from_env() -> bool:
    """True when the user opted out of the ownership checks with ``PB_TRUST_CACHE_DIR=1``."""
    return os.environ.get(TRUST_ENV, "") == "1"


def _problem(st: os.stat_result) -> str | None:
    uid = os.geteuid()
    if st.st_uid not in (uid, 0):
        return f"is owned by uid {st.st_uid} (this process runs as uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
        who = "group and others" if st.st_mode & stat.S_IWGRP and st.st_mode & stat.S_IWOTH else (
            "its group" if st.st_mode & stat.S_IWGRP else "others")
        return f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


_MAX_LINKS = 40  # as the kernel: a longer chain of symlinks does not resolve (ELOOP)


def _walk(path: str, links: int = 0) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry the kernel passes through to reach ``path``, with its ``lstat``: each component of
    the path as given, and for every symlink met, the components of its target, recursively.

    A component that does not exist ends the walk (nothing below it exists either). ``..`` goes
    to the parent of what was reached, as the kernel does (not the lexical parent).
    """
    current = "/"
    yield current, os.lstat(current)
    absolute = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    for part in absolute.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            current = os.path.dirname(current)
            continue
        current = os.path.join(current, part)
        try:
            st = os.lstat(current)
        except (FileNotFoundError, NotADirectoryError):  # not created yet (or cannot be: a later write says so)
            return
        yield current, st
        if stat.S_ISLNK(st.st_mode):
            if links >= _MAX_LINKS:
                return
            yield from _walk(os.path.join(os.path.dirname(current), os.readlink(current)), links + 1)
            current = os.path.realpath(current)  # later components lie below the link's target


def _link_problem(st: os.stat_result) -> str | None:
    """A symlink's own mode means nothing; its owner may point it elsewhere."""
    uid = os.geteuid()
    return None if st.st_uid in (uid, 0) else f"is a symlink owned by uid {st.st_uid} (this process runs as uid {uid})"


def check_trusted(path: str | os.PathLike[str], what: str, *, trust: bool = False) -> None:
    """Raise :class:`UntrustedPathError` (a ``PermissionError``) unless only this user or root can have
    written ``path``.

    Checks every entry the path passes through as given and as it resolves: each directory from
    ``/`` down, each symlink met (its owner) and the components of its target, ``path`` itself
    included when it exists. A symlink in a directory others can write could be pointed elsewhere at
    any time, so the directory holding it counts even where the target is private. Components not
    created yet are not checked: check again once they are (:class:`~.cache.PieceCache` does before
    it writes or first reads).
    """
    if trust or trust_from_env() or not hasattr(os, "geteuid"):  # no POSIX owners: nothing to check
        return
    given = os.fspath(path)
    resolved = os.path.realpath(given)
    seen: set[str] = set()
    for component, st in (*_walk(given), *_walk(resolved)):
        if component in seen:
            continue
        seen.add(component)
        problem = _link_problem(st) if stat.S_ISLNK(st.st_mode) else _problem(st)
        if problem is not None:
            where = "" if component in (given, resolved) else f" (through {component})"
            raise UntrustedPathError(
                f"refusing {what} {str(path)!r}{where}: {component} {problem}. Its files are unpickled, which runs "
                f"code, so they are loaded only from paths no other user can write. Fix the owner or mode "
                f"(chmod go-w), use a private directory, or set {TRUST_ENV}=1 if you trust every writer")


def check_trusted_file(fd: int, path: str | os.PathLike[str], what: str, *, trust: bool = False) -> None:
    """:func:`check_trusted` for an open file (its owner and mode as opened, not as named later)."""
    if trust or trust_from_env() or not hasattr(os, "geteuid"):
        return
    problem = _problem(os.fstat(fd))
    if problem is not None:
        raise UntrustedPathError(f"refusing {what} {str(path)!r}: it {problem}. Its contents are unpickled, which runs "
                              f"code; set {TRUST_ENV}=1 if you trust every writer")
