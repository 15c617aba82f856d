"""The one exception type for a failure its message fully explains (a user's mistake: a missing or unreadable file,
a bad argument, a refused path; or the environment: a port in use, a server that does not answer): `lifecycle`
prints it as one line and exits 2 (lifecycle/cli.py `main`). Any layer may raise it.

`without_sql` and `disk_full_hint` shape a failed run's one line (lifecycle/cli.py `cmd_run`)."""

import re


class UsageError(Exception):
    """What the command was given or found is wrong; the message says what, naming the file, argument or URI."""


def exception_chain(e: BaseException | None):
    """`e`, then what it was raised from or during (`__cause__`, else `__context__`), each once."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def one_line(text: str) -> str:
    """A multi-line message (a config with several invalid fields, a DuckDB error) as one line."""
    lines = [" ".join(ln.split()) for ln in str(text).splitlines() if ln.strip()]
    if not lines:
        return ""
    head, rest = lines[0], lines[1:]
    return head + (" " if head.endswith(":") else "; ") + "; ".join(rest) if rest else head


_SQL_DETAIL = re.compile(r"\s*\[SQL: .*?(\(Background on this error at: [^)]*\)|$)", re.S)
_AUTOFLUSH = re.compile(r"\(raised as a result of Query-invoked autoflush[^)]*\);?\s*")  # SQLAlchemy's aside
FULL_BELOW = 64 << 20  # a file system with less free space than this counts as full


def without_sql(text: str) -> str:
    """SQLAlchemy's message without the statement, its parameters, its help link (a disk-full INSERT into the
    MLflow store printed the whole row) and its autoflush aside."""
    return _AUTOFLUSH.sub("", _SQL_DETAIL.sub("", text)).rstrip("; ")


def disk_full_hint(e: BaseException, workdir: str) -> str:
    """`; <workdir>'s file system is full ...` when the failure, or anything in its chain, is a full disk (ENOSPC,
    SQLite's `database or disk is full`), or the work dir's file system has under 64 MiB free: a full disk shows up
    as many other errors (a server that exits in its start-up, a store that cannot flush)."""
    import errno
    import shutil

    full = any((isinstance(c, OSError) and c.errno == errno.ENOSPC) or "disk is full" in str(c)
               for c in exception_chain(e))
    try:
        free = shutil.disk_usage(workdir).free
    except OSError:
        free = None
    if not full and (free is None or free >= FULL_BELOW):
        return ""
    space = f"{free:,} bytes free" if free is not None else "no space"
    return (f"; the file system of {workdir} is full ({space}): free space there and rerun, the committed stages "
            "and checkpoints are reused")
