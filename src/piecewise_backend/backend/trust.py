"""The trust boundary of ``cache_dir`` and AOT files: who may have written what this process unpickles.

Cache entries and AOT files are pickles: loading one runs code its writer chose, and a checksum
inside the same file proves integrity, not authorship. So the library loads them only from paths
that no other user can write: every directory from ``/`` down, and the file, must be owned by this
user or root and not writable by group or others (a directory with the sticky bit, like ``/tmp``,
is fine: others cannot rename or replace what they do not own). ``PB_TRUST_CACHE_DIR=1`` in the
environment, or ``trust=True`` where an API offers it, turns the check off for a path the user
vouches for (a shared volume whose writers they trust).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

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


def check_trusted(path: str | os.PathLike[str], what: str, *, trust: bool = False) -> None:
    """Raise :class:`UntrustedPathError` (a ``PermissionError``) unless only this user or root can have
    written ``path``.

    Checks every existing component of the resolved path, ``path`` itself included when it exists.
    """
    if trust or trust_from_env() or not hasattr(os, "geteuid"):  # no POSIX owners: nothing to check
        return
    resolved = Path(os.path.realpath(path))
    for component in (resolved, *resolved.parents):
        try:
            st = os.stat(component)
        except (FileNotFoundError, NotADirectoryError):  # not created yet (or cannot be: a later write says so)
            continue
        problem = _problem(st)
        if problem is not None:
            where = "" if component == resolved else f" (through {component})"
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
