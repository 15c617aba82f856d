"""The one exception type a command raises for a user's mistake (a missing or unreadable file, a bad argument,
a refused path): `lifecycle` prints it as one line and exits 2 (lifecycle/cli.py `main`). Any layer may raise it."""


class UsageError(Exception):
    """What the user gave the command is wrong; the message says what and names the file or argument."""
