"""`lifecycle`, the console script: `lifecycle run` goes to the work dir's warm runner when one is up (`lifecycle up`
started it, or a cold run left it beside the embedded Prefect server); everything else, and every run the runner
declines, runs in this process (`lifecycle.cli.main`).

The warm-start machinery is flows/startup/ (its README says what it saves; a newcomer can skip it). This module only
plugs the CLI into it: `child` is the run a warm runner forks, and `python -m lifecycle.launch --serve WORKDIR`
(`--serve-embedded`) starts a runner that imports what `preload` imports.
"""

from __future__ import annotations

import time

LAUNCHED = time.time()  # the command's start, for a run's `timing.command_start` when the runner runs it

import json
import os
import signal
import socket
import sys
from pathlib import Path


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] in (["--serve"], ["--serve-embedded"]) and len(argv) == 2:
        serve(argv[1], embedded=argv[0] == "--serve-embedded")
        return
    if argv[:1] == ["run"]:
        from lifecycle.flows.startup.client import WARM_ENV, handoff

        rc = handoff(argv, LAUNCHED) if os.environ.get(WARM_ENV, "1") != "0" else None
        if rc is not None:
            sys.exit(rc)
    from lifecycle.cli import main as cli_main

    sys.exit(cli_main())


def preload() -> None:
    """Import what a run imports before its first stage and during its tail."""
    import lifecycle.cli  # noqa: F401  the config, the stages' config models
    import lifecycle.flows.pipeline  # noqa: F401  Prefect, the flow, the stages
    from lifecycle.lineage import charts, tracking  # noqa: F401

    charts.preload()
    tracking.preload_client()


def _become_the_command(msg: dict, fds: list[int]) -> None:
    """Take the client's stdio (`fds`), cwd, environment and arguments, and the signal handling of a new process."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)  # inheritable: the run's own processes write to the command's stdio, as cold
    for fd in fds:
        os.close(fd)
    os.chdir(msg["cwd"])
    os.environ.clear()
    os.environ.update(msg["env"])
    sys.argv = [msg["argv0"], *msg["argv"]]
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=stream.isatty())
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)


def child(workdir: Path, conn: socket.socket, msg: dict, fds: list[int]) -> int:
    """The forked run: the client's stdio, cwd, environment and arguments, then `lifecycle.cli.main`."""
    import threading

    from lifecycle.flows.startup.client import Quiet, run_target

    _become_the_command(msg, fds)
    import lifecycle.cli as cli
    from lifecycle.config import ConfigError, load_config

    try:
        config, sets = run_target(msg["argv"])
        named = Path(load_config(config, sets).workdir)
    except (Quiet, ConfigError):
        named = workdir  # the CLI reports it, as it would cold
    if named != workdir:
        conn.sendall(json.dumps({"declined": f"the config names the work dir {named}, not {workdir}"}).encode() + b"\n")
        return 0
    conn.settimeout(None)
    conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")

    def watch() -> None:  # the client is gone (killed): stop as on SIGTERM
        try:
            gone = conn.recv(1) == b""
        except OSError:
            gone = True
        if gone:
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="lifecycle-client-watch", daemon=True).start()
    try:
        rc = cli.main(msg["argv"], command_start=msg["launched"], launch="warm")
    except SystemExit as e:  # argparse's own errors
        rc = e.code if isinstance(e.code, int) else 2
    except BaseException:
        import traceback

        traceback.print_exc()
        rc = 1
    cli.finish_run()
    try:
        conn.sendall(json.dumps({"exit": rc}).encode() + b"\n")
    except OSError:
        pass
    return rc


def serve(workdir: str, embedded: bool = False) -> None:
    from lifecycle.flows.startup.warm_runner import Runner

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    Runner(Path(workdir).resolve(), embedded, preload=preload, run_child=child).serve_forever()


if __name__ == "__main__":
    main()
