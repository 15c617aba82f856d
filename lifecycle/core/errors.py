"""The one exception type for a failure its message fully explains (a user's mistake: a missing or unreadable file,
a bad argument, a refused path; or the environment: a port in use, a server that does not answer): `lifecycle`
prints it as one line and exits 2 (lifecycle/cli.py `main`). Any layer may raise it."""


class UsageError(Exception):
    """What the command was given or found is wrong; the message says what, naming the file, argument or URI."""
