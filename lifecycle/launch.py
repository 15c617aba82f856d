"""`lifecycle`, the console script: `lifecycle run` goes to the work dir's warm runner when `lifecycle up` started
one; everything else, and every run the runner declines, runs in this process (`lifecycle.cli.main`).

A run in a new process spends ~4 s importing Prefect, MLflow, pyarrow, numba and the stages before its first stage
can start, and that is most of a recurring run's fixed overhead against running servers (issue 25: <= 3 s from the
command to the first stage plus from the last stage to the exit). So `lifecycle up` starts a third process beside
its Prefect and MLflow servers, the runner (`python -m lifecycle.launch --serve WORKDIR`). It imports all of that
once, with the environment a run against those servers has (`prepare_environment`), then waits on a Unix socket
(`runner_socket`: `<workdir>/.servers/runner.sock`, mode 0600, and only the same user: SO_PEERCRED). For each
`lifecycle run` it forks a child, which takes this process's stdin, stdout and stderr (passed over the socket), its
working directory, environment and arguments, and runs `lifecycle.cli.main` on them: the same code path as a cold
run (work-dir lock, log capture, summary, JSON line, exit code), minus the imports.

This process stays the run's face. It prints nothing of its own, forwards SIGINT, SIGTERM and SIGHUP to the child,
and exits with the child's exit code. If it is killed (SIGKILL), the child sees the socket close and stops as on
SIGTERM: the flow is cancelled and nothing is committed half-way.

The runner declines, and this process then runs the command itself, cold, when:
- the config names another work dir (the runner checks with the real config loader);
- the environment that shapes what gets imported differs from the runner's (`SHAPING_PREFIXES`), or the working
  directory holds Prefect settings files the runner's did not (`prefect.toml`, `.env`);
- the project's code changed since the runner started: it then replaces itself (exec, same pid, new code);
- the runner is not single-threaded (a fork would copy a lock another thread holds);
- `LIFECYCLE_WARM=0` is set.
With `-v`, this process says on stderr why a run went cold. `lifecycle down` stops the runner with the servers,
and a run in progress with it (SIGTERM: cancelled, resumable). `lifecycle up --no-runner` starts none.
"""

from __future__ import annotations

import time

LAUNCHED = time.time()  # the command's start, for a run's `timing.command_start` when the runner runs it

import json
import os
import signal
import socket
import struct
import sys
from pathlib import Path

WARM_ENV = "LIFECYCLE_WARM"
# environment variables read at import time by what the runner imports (Prefect's settings, MLflow, numba, torch,
# DeepSpeed, the interpreter) or by the project: a difference sends the run cold
SHAPING_PREFIXES = ("PREFECT_", "MLFLOW_", "LIFECYCLE_", "DS_", "OMP_", "MKL_", "CUDA_", "NCCL_", "TORCH", "NUMBA_",
                    "PYTHON", "XDG_", "HF_", "TOKENIZERS_")
SHAPING_KEYS = ("PATH", "HOME", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "DO_NOT_TRACK", "TZ")
PREFECT_FILES = ("prefect.toml", ".env")  # Prefect 3 reads its settings from these in the working directory
ACCEPT_TIMEOUT_S = 10.0  # a client that connects and sends nothing is dropped after this


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] in (["--serve"], ["--serve-embedded"]) and len(argv) == 2:
        serve(argv[1], embedded=argv[0] == "--serve-embedded")
        return
    if argv[:1] == ["run"] and os.environ.get(WARM_ENV, "1") != "0":
        rc = handoff(argv)
        if rc is not None:
            sys.exit(rc)
    from lifecycle.cli import main as cli_main

    sys.exit(cli_main())


# ------------------------------------------------------------------------------------------------ the client


class _Quiet(Exception):
    pass


def run_target(argv: list[str]) -> tuple[str, list[str]]:
    """(CONFIG, --set values) of `lifecycle run ...`, parsed as `lifecycle.cli` parses them; _Quiet when they do not
    parse (the full CLI then reports the problem)."""
    import argparse

    class P(argparse.ArgumentParser):
        def error(self, message):
            raise _Quiet(message)

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
        raise _Quiet("not a plain run")
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
    except (_Quiet, OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(wd, str) or ("://" in wd and not wd.startswith("file://")):
        return None
    return Path(wd.removeprefix("file://")).expanduser().resolve()


def shaping_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if (k.startswith(SHAPING_PREFIXES) or k in SHAPING_KEYS) and k != WARM_ENV}


def prefect_files(cwd: str | Path) -> dict[str, str | None]:
    out = {}
    for name in PREFECT_FILES:
        try:
            out[name] = (Path(cwd) / name).read_text(errors="replace")
        except OSError:
            out[name] = None
    return out


def handoff(argv: list[str]) -> int | None:
    """Run `lifecycle argv` (a `run`) in the work dir's runner and return its exit code; None to run it here."""
    verbose = "-v" in argv or "--verbose" in argv
    wd = peek_workdir(argv)
    if wd is None:
        return None
    from lifecycle.flows.servers import EMBEDDED_RUNNER, runner_socket, send_msg

    path = runner_socket(wd)  # `up`'s runner, else the one a cold run left beside the embedded server
    if not path.exists() and not (path := runner_socket(wd, EMBEDDED_RUNNER)).exists():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(ACCEPT_TIMEOUT_S)
        sock.connect(str(path))
        send_msg(sock, {"argv": argv, "argv0": sys.argv[0], "cwd": os.getcwd(), "env": dict(os.environ),
                     "launched": LAUNCHED}, [0, 1, 2])
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
    pid = first["pid"]

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


# ------------------------------------------------------------------------------------------------ the runner


def code_stamp() -> tuple:
    """(path, mtime, size) of every module of the project's four folders: a change means the runner is stale."""
    import lifecycle
    import lifecycle.flows
    import lifecycle.lineage
    import lifecycle.tasks

    out = []
    for pkg in (lifecycle, lifecycle.flows, lifecycle.lineage, lifecycle.tasks):
        for root in pkg.__path__:
            for d, dirs, files in os.walk(root):
                dirs[:] = [x for x in dirs if x != "__pycache__"]
                for f in files:
                    if f.endswith(".py"):
                        st = os.stat(os.path.join(d, f))
                        out.append((os.path.join(d, f), st.st_mtime_ns, st.st_size))
    return tuple(sorted(out))


def preload() -> None:
    """Import what a run imports before its first stage and during its tail."""
    import lifecycle.cli  # noqa: F401  the config, the stages' config models
    import lifecycle.flows.pipeline  # noqa: F401  Prefect, the flow, the stages
    from lifecycle.lineage import charts, tracking  # noqa: F401

    charts.preload()
    tracking.preload_client()


class Runner:
    """`up`'s runner, or (`embedded`) the one a cold run starts beside the work dir's embedded Prefect server
    (flows/servers.py `start_embedded_runner`), which lives as long as that server."""

    def __init__(self, workdir: Path, embedded: bool = False):
        self.workdir, self.embedded = workdir, embedded
        self.argv = [sys.executable, "-m", "lifecycle.launch", "--serve-embedded" if embedded else "--serve",
                     str(workdir)]
        self.started_env = dict(os.environ)  # as `up` (or the cold run) started it: before prepare_environment
        self.env = shaping_env(self.started_env)
        self.files = prefect_files(os.getcwd())
        from lifecycle.flows import servers

        self.server: dict | None = None  # embedded: the server this runner's imports were set up for
        if embedded:
            self.server = self.embedded_setup()
        else:
            deadline = time.time() + 180
            while servers.active(workdir) is None:  # `up` starts its servers and this runner at once
                if time.time() > deadline:
                    sys.exit(f"runner: the work dir's servers did not come up within 180 s ({workdir})")
                time.sleep(0.3)
            servers.prepare_environment(workdir)  # what `lifecycle run` sets before it imports Prefect
        preload()
        if embedded and not os.environ.get("MLFLOW_TRACKING_URI"):
            from lifecycle.lineage.tracking import preload_sqlite_store

            preload_sqlite_store()  # the work dir's SQLite store, as a cold embedded run preloads it
        self.stamp = code_stamp()
        self.stale = False
        self.path = servers.runner_socket(workdir, servers.EMBEDDED_RUNNER if embedded else servers.RUNNER)
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path.unlink(missing_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self.sock.bind(str(self.path))
        finally:
            os.umask(old)
        self.sock.listen(16)
        print(f"runner {os.getpid()}: ready on {self.path} ({len(sys.modules)} modules imported)", flush=True)

    def embedded_setup(self) -> dict:
        """One embedded runner per work dir (its lock, held for life), then the server's environment, set as a
        run sets it but without counting as a user of the server (whose idle timer must still run)."""
        import fcntl

        from lifecycle.flows import servers

        self.lock_fd = os.open(servers.state_dir(self.workdir) / f"{servers.EMBEDDED_RUNNER}.lock",
                               os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            sys.exit(f"runner: another embedded runner serves {self.workdir}")
        self.claim_entry()
        entry = servers._read_embedded(self.workdir)
        if not entry or not servers._alive(entry):
            sys.exit(f"runner: no embedded Prefect server is running for {self.workdir}")
        if servers.prepare_environment(self.workdir, hold=False) != "embedded":
            sys.exit(f"runner: `lifecycle up`'s servers run for {self.workdir}; they have their own runner")
        return servers._read_embedded(self.workdir) or entry

    def claim_entry(self) -> None:
        """Embedded: `embedded-runner.json` names this process (the lock holder), whoever wrote it last."""
        from lifecycle.flows import servers

        entry = servers.embedded_runner_entry(self.workdir)
        if not entry or entry.get("pid") != os.getpid():
            servers.write_embedded_runner_entry(self.workdir, os.getpid(), self.argv)

    def server_changed(self) -> str | None:
        """Embedded: why the server this runner was set up for is no longer the work dir's (None: it still is)."""
        from lifecycle.flows import servers

        if not self.embedded:
            return None
        now = servers._read_embedded(self.workdir)
        if not now or not servers._alive(now) or (now["pid"], now["url"]) != (self.server["pid"], self.server["url"]):
            return "the work dir's embedded Prefect server stopped or was replaced"
        if servers.active(self.workdir) is not None:
            return "`lifecycle up`'s servers now run for the work dir"
        return None

    def decline_reason(self, msg: dict) -> str | None:
        import threading

        if threading.active_count() != 1:
            return f"the runner has {threading.active_count()} threads; a fork is safe only with one"
        env = shaping_env(msg["env"])
        if env != self.env:
            diff = sorted(k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k))
            return f"the environment differs from the runner's in {', '.join(diff[:5])}"
        if prefect_files(msg["cwd"]) != self.files:
            return f"{msg['cwd']} holds Prefect settings files ({', '.join(PREFECT_FILES)}) the runner's did not"
        if code_stamp() != self.stamp:
            return "the project's code changed since the runner started (it restarts now)"
        if (changed := self.server_changed()) is not None:
            return f"{changed} (the runner exits now)"
        return None

    def serve_forever(self) -> None:
        import select

        while True:
            self.reap()
            if not select.select([self.sock], [], [], 1.0)[0]:
                if self.embedded:
                    if (changed := self.server_changed()) is not None:
                        self.exit(changed)
                    self.claim_entry()
                continue
            conn, _ = self.sock.accept()
            try:
                self.handle(conn)
            except Exception as e:  # one bad client never stops the runner
                print(f"runner: a connection failed: {type(e).__name__}: {e}", flush=True)
            finally:
                conn.close()
            if self.stale:
                self.restart()

    @staticmethod
    def reap() -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    def handle(self, conn: socket.socket) -> None:
        conn.settimeout(ACCEPT_TIMEOUT_S)
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
        if uid != os.getuid():
            return
        from lifecycle.flows.servers import recv_msg

        msg, fds = recv_msg(conn)
        try:
            if msg.get("ping"):
                conn.sendall(json.dumps({"pong": os.getpid()}).encode() + b"\n")
                return
            reason = self.decline_reason(msg)
            if reason:
                conn.sendall(json.dumps({"declined": reason}).encode() + b"\n")
                print(f"runner: declined a run: {reason}", flush=True)
                self.stale = reason.startswith("the project's code changed")
                if reason.endswith("(the runner exits now)"):
                    self.exit(reason)
                return
            pid = os.fork()
            if pid == 0:
                try:
                    self.sock.close()
                    if self.embedded:
                        os.close(self.lock_fd)  # a run outliving this runner must not keep the next one out
                    os._exit(child(self.workdir, conn, msg, fds))
                finally:
                    os._exit(70)
            print(f"runner: run {' '.join(msg['argv'][1:])!r} in pid {pid}", flush=True)
        finally:
            for fd in fds:
                os.close(fd)

    def restart(self) -> None:
        self.sock.close()
        self.path.unlink(missing_ok=True)
        sys.stdout.flush()
        os.execve(sys.executable, self.argv, self.started_env)

    def exit(self, why: str) -> None:
        """The embedded runner's end: its server is gone. Runs it forked go on (they hold their own files)."""
        from lifecycle.flows import servers

        print(f"runner: {why}; exiting", flush=True)
        self.sock.close()
        self.path.unlink(missing_ok=True)
        entry = servers.embedded_runner_entry(self.workdir)
        if entry and entry.get("pid") == os.getpid():
            (servers.state_dir(self.workdir) / f"{servers.EMBEDDED_RUNNER}.json").unlink(missing_ok=True)
        sys.exit(0)


def child(workdir: Path, conn: socket.socket, msg: dict, fds: list[int]) -> int:
    """The forked run: the client's stdio, cwd, environment and arguments, then `lifecycle.cli.main`."""
    import threading

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
    import lifecycle.cli as cli
    from lifecycle.config import ConfigError, load_config

    try:
        config, sets = run_target(msg["argv"])
        named = Path(load_config(config, sets).workdir)
    except (_Quiet, ConfigError):
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
    cli.COMMAND_START = msg["launched"]
    cli.LAUNCH = "warm"
    try:
        rc = cli.main(msg["argv"])
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
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    Runner(Path(workdir).resolve(), embedded).serve_forever()


if __name__ == "__main__":
    main()
