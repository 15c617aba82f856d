"""Finding collect's input files: a `**` glob that survives symlink loops, and file names that are not UTF-8.

- A local `**` pattern is walked with `walk_glob`: symlinked directories are followed (as `glob` does), but each
  directory only once, by the first spelling met in sorted order, so a symlink loop cannot multiply a file (Python's
  `glob` follows a loop 40 levels deep, and two loops in one directory make 2**40 spellings). Matching is `glob`'s:
  `**` spans zero or more directories, and a wildcard never matches a name starting with `.`.
- A file name whose bytes are not UTF-8 arrives from the OS as a `surrogateescape` string: it opens fine, but it
  cannot be written to JSON or Parquet. `shown(path)` is the name as stored everywhere (manifest, `source`,
  `source_id`, reject details): each undecodable byte written as `\\xNN` (`backslashreplace`). The raw bytes stay
  recoverable from the manifest input's `path_bytes` (hex; `raw_name`).
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
from functools import lru_cache


def shown(path: str) -> str:
    """`path` as valid UTF-8 text: unchanged when it is, else each undecodable byte escaped as `\\xNN`."""
    try:
        path.encode("utf-8")
        return path
    except UnicodeEncodeError:
        return os.fsencode(path).decode("utf-8", "backslashreplace")


def path_bytes(path: str) -> str | None:
    """Hex of the raw bytes of a path that `shown` had to escape; None for a UTF-8 path."""
    return None if shown(path) == path else os.fsencode(path).hex()


def raw_name(shown_path: str, hex_bytes: str | None) -> str:
    """The path to open (a `surrogateescape` string) from the stored form (`shown`, `path_bytes`)."""
    return shown_path if hex_bytes is None else os.fsdecode(bytes.fromhex(hex_bytes))


@lru_cache(maxsize=256)
def _component(pat: str) -> re.Pattern:
    return re.compile(fnmatch.translate(pat))


def _match(parts: tuple[str, ...], pats: tuple[str, ...]) -> bool:
    """Whether the path components `parts` match the pattern components `pats` as `glob(recursive=True)` does."""
    if not pats:
        return not parts
    head, rest = pats[0], pats[1:]
    if head == "**":
        # zero or more non-hidden directories, then the rest
        for i in range(len(parts) + 1):
            if _match(parts[i:], rest):
                return True
            if i < len(parts) and parts[i].startswith("."):
                return False
        return False
    if not parts:
        return False
    name = parts[0]
    if glob.has_magic(head):
        if name.startswith(".") and not head.startswith("."):
            return False
        if not _component(head).match(name):
            return False
    elif name != head:
        return False
    return _match(parts[1:], rest)


def walk_glob(pattern: str) -> list[str]:
    """The files a local `**` pattern matches, sorted, spelled as `glob.glob` spells them, each directory visited
    once (by (st_dev, st_ino)): a symlink loop adds no file."""
    pats = pattern.split("/")
    fixed = 0
    while fixed < len(pats) - 1 and not glob.has_magic(pats[fixed]):
        fixed += 1
    root = "/".join(pats[:fixed]) or ("/" if pattern.startswith("/") else "")
    rest = tuple(p for p in pats[fixed:] if p)  # `a//b` and a trailing `/` are glob's `a/b`
    start = root or os.curdir
    seen: set[tuple[int, int]] = set()
    found = []
    for dirpath, dirnames, filenames in os.walk(start, followlinks=True):
        try:
            st = os.stat(dirpath)
        except OSError:
            dirnames[:] = []
            continue
        if (st.st_dev, st.st_ino) in seen:  # met before under another spelling (a loop or a second link)
            dirnames[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirnames.sort()
        rel = os.path.relpath(dirpath, start)
        base = () if rel == os.curdir else tuple(rel.split(os.sep))
        if "**" not in rest and len(base) >= len(rest):  # deeper than a `**`-free pattern reaches
            dirnames[:] = []
        for name in filenames:
            if _match((*base, name), rest):
                full = os.path.join(dirpath, name) if root else os.path.join(*base, name)
                if os.path.isfile(full):
                    found.append(full)
        # symlinks to files appear in filenames; broken ones are skipped by isfile, as glob's is_file filter does
    return sorted(found)


def remote_problem(pattern: str, e: Exception) -> str:
    """One line for a remote pattern that could not be listed (no credentials, a wrong endpoint, no bucket),
    naming the pattern and, for s3://, where the client reads its settings from."""
    hint = ""
    if pattern.startswith(("s3://", "s3a://")):
        hint = (" (s3 credentials come from the environment: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                "AWS_PROFILE; an S3-compatible server's URL from AWS_ENDPOINT_URL)")
    detail = " ".join(str(e).split()) or type(e).__name__
    return f"collect.inputs: cannot list {shown(pattern)!r}: {type(e).__name__}: {detail}{hint}"

