"""The one exception type for a failure its message fully explains (a user's mistake: a missing or unreadable file,
a bad argument, a refused path; or the environment: a port in use, a server that does not answer): `lifecycle`
prints it as one line and exits 2 (lifecycle/cli.py `main`). Any layer may raise it."""


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
