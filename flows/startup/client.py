"""The `lifecycle` command's side of a warm run: hand `lifecycle run ...` to the work dir's warm runner
(flows/startup/warm_runner.py) and wait for its exit code; None from `handoff` means "run it here, cold".

This process stays the run's face. It prints nothing of its own (with `-v`, why a run went cold), forwards SIGINT,
SIGTERM and SIGHUP to the forked run, and exits with its exit code. If it is killed (SIGKILL), the run sees the
socket close and stops as on SIGTERM: the flow is cancelled and nothing is committed half-way.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path

from lifecycle.flows.startup.messages import ACCEPT_TIMEOUT_S, send_msg
from lifecycle.flows.startup.state import EMBEDDED_RUNNER, runner_socket

WARM_ENV = "LIFECYCLE_WARM"


class Quiet(Exception):
    """`lifecycle run`'s arguments do not parse as a plain run: the full CLI reports the problem, cold."""


def run_target(argv: list[str]) -> tuple[str, list[str]]:
    """(CONFIG, --set values) of `lifecycle run ...`, parsed as `lifecycle.cli` parses them; `Quiet` when they do
    not parse (the full CLI then reports the problem)."""
    import argparse

    class P(argparse.ArgumentParser):
        def error(self, message):
            raise Quiet(message)

    from lifecycle.core.paths import DEFAULT_CONFIG

    p = P(add_help=False)
    p.add_argument("command")
    p.add_argument("config", nargs="?", default=DEFAULT_CONFIG)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--until")
    for flag in ("--json", "-v", "--verbose", "--wait", "-h", "--help"):
        p.add_argument(flag, action="store_true")
    args, extra = p.parse_known_args(argv)
    if extra or args.help or args.h:
        raise Quiet("not a plain run")
    return args.config, args.set


def peek_workdir(argv: list[str]) -> Path | None:
    """The work dir `lifecycle run argv` names, read from the YAML and --set without validating the config (the
    runner validates: a wrong guess only means a cold run). None when it cannot tell."""
    import yaml

    try:
        config, sets = run_target(argv)
        data = yaml.safe_load(Path(config).read_text()) or {}
        wd = data.get("workdir") if isinstance(data, dict) else None
        for item in sets:
            key, _, raw = item.partition("=")
            if key.strip() == "workdir":
                wd = yaml.safe_load(raw)
    except (Quiet, OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(wd, str) or ("://" in wd and not wd.startswith("file://")):
        return None
    return Path(wd.removeprefix("file://")).expanduser().resolve()


def handoff(argv: list[str], launched: float) -> int | None:
    """Run `lifecycle argv` (a `run`) in the work dir's runner and return its exit code; None to run it here.
    `launched`: when the command started (the run's `timing.command_start`)."""
    verbose = "-v" in argv or "--verbose" in argv
    wd = peek_workdir(argv)
    if wd is None:
        return None
    path = runner_socket(wd)  # `up`'s runner, else the one a cold run left beside the embedded server
    if not path.exists() and not (path := runner_socket(wd, EMBEDDED_RUNNER)).exists():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(ACCEPT_TIMEOUT_S)
        sock.connect(str(path))
        send_msg(sock, {"argv": argv, "argv0": sys.argv[0], "cwd": os.getcwd(), "env": dict(os.environ),
                        "launched": launched}, [0, 1, 2])
        reply = sock.makefile("rb")
        first = json.loads(reply.readline() or b"{}")
    except (OSError, ValueError) as e:  # no runner behind the socket (a stale file), or it did not answer
        sock.close()
        if verbose:
            print(f"lifecycle: the runner at {path} did not take the run ({type(e).__name__}: {e}); running here",
                  file=sys.stderr)
        return None
    if "pid" not in first:
        sock.close()
        if verbose:
            print(f"lifecycle: the runner declined the run ({first.get('declined', 'no reason given')}); "
                  "running here", file=sys.stderr)
        return None
    return _wait_for(first["pid"], sock, reply, path, wd)


def _wait_for(pid: int, sock: socket.socket, reply, path: Path, wd: Path) -> int:
    """Forward this process's signals to the forked run `pid` and return its exit code when it ends."""
    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    sock.settimeout(None)
    line = reply.readline()
    try:
        return int(json.loads(line)["exit"])
    except (ValueError, KeyError, TypeError):
        print(f"lifecycle run: the run's process (pid {pid}, forked by the runner at {path}) ended without an exit "
              f"status; its log is under {wd / 'logs'}", file=sys.stderr)
        return 1
