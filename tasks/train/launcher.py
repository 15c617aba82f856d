"""Starting a launch's ranks, which DeepSpeed's launcher would do: on this host one process per rank, in one process
group that the supervisor owns, each with the environment DeepSpeed's per-node launcher would give it
(`local_rank_envs`, `Launch.start_local`); across hosts DeepSpeed's runner with a hostfile (`launcher_cmd`,
`launch_args`, `Launch.start_launcher`). `Launch.poll` and `Launch.stop` do what the per-node launcher did for the
ranks it started: a rank that exits non-zero stops the others and fails the launch naming it.

No torch here: the supervisor never imports it.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from lifecycle.core.procs import SUPERVISOR_SILENCE_ENV
from lifecycle.tasks.train.config import LaunchConfig, TrainConfig

log = logging.getLogger(__name__)
LOCAL_HOSTS = {"localhost", "127.0.0.1", socket.gethostname()}
# which network interface the collectives use, where a node has several (or a hostname that resolves to none of
# them): set on the launching node, they reach the ranks of every node through .deepspeed_env; and how long those
# ranks wait on a silent supervisor (lifecycle.core.procs.watch_parent_run)
FORWARDED_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME", SUPERVISOR_SILENCE_ENV)


def rank_threads(configured: int | None, ranks: int) -> int:
    """Threads per local rank (OMP_NUM_THREADS): `train.launch.threads_per_rank`, else this host's cores // ranks."""
    return configured or max(1, (os.cpu_count() or 1) // ranks)


def local_rank_envs(env: dict, ranks: int, master_port: int, master_addr: str = "127.0.0.1") -> list[dict]:
    """Each local rank's environment, exactly as DeepSpeed's per-node launcher (deepspeed/launcher/launch.py, 0.19)
    sets it for the world `{localhost: [0, ..., ranks - 1]}` at node rank 0: the accelerator's visible devices
    (CUDA_VISIBLE_DEVICES for DeepSpeed's CPU and CUDA accelerators alike), MASTER_ADDR, MASTER_PORT, WORLD_SIZE,
    CROSS_RANK, CROSS_SIZE, LOCAL_SIZE, then RANK and LOCAL_RANK per rank; and, because the launcher's own
    `import deepspeed` put it in the environment it copies, PYTORCH_NVML_BASED_CUDA_CHECK=1 unless set. It sets no
    thread variable unless it binds cores (we do not): OMP_NUM_THREADS comes in `env`.
    tests/train/test_supervise.py compares this with what the launcher gives."""
    node = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1", **env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(ranks))),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port), "WORLD_SIZE": str(ranks), "CROSS_RANK": "0", "CROSS_SIZE": "1",
            "LOCAL_SIZE": str(ranks)}
    return [{**node, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(ranks)]


class RankFailed(RuntimeError):
    """A rank (or the launcher) exited with a non-zero code; the others were stopped."""


class Launch:
    """The processes of one launch, all in one process group that this process owns: the local ranks started
    directly (`start_local`), or DeepSpeed's launcher with everything it starts (`start_launcher`, the hostfile
    path). Each dies with the thread that started it (PR_SET_PDEATHSIG) and, from the trainer's first lines, with
    the supervisor (`watch_parent_run` kills the group). Stdin is /dev/null; stdout and stderr go to `log`.

    What DeepSpeed's per-node launcher did for the ranks it started, `poll` and `stop` do now: a rank that exits
    non-zero stops the others (SIGTERM to the group, SIGKILL after `term_timeout`; the launcher gave 30 s) and fails
    the launch naming it; the supervisor's ^C/SIGTERM stops them the same way (run_train calls `stop`)."""

    def __init__(self, procs: list[tuple[str, subprocess.Popen]], log):
        self.procs, self.log, self.pgid = procs, log, procs[0][1].pid
        self.reported: set[str] = set()

    @classmethod
    def start_local(cls, cmd: list[str], envs: list[dict], cwd: Path, log) -> "Launch":
        """One process per rank, `cmd` with `envs[r]`; rank 0 leads a new process group, the others join it (a new
        group, not a session: a group can only be joined inside its session). A terminal's ^C reaches only the
        foreground group, so only the supervisor, which then stops the ranks."""
        from lifecycle.core.procs import die_with_parent

        procs: list[tuple[str, subprocess.Popen]] = []
        try:
            for r, env in enumerate(envs):
                p = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, process_group=procs[0][1].pid if procs else 0,
                                     preexec_fn=die_with_parent)
                procs.append((f"rank {r}", p))
        except BaseException:
            if procs:
                cls(procs, log).stop()
            raise
        return cls(procs, log)

    @classmethod
    def start_launcher(cls, cmd: list[str], env: dict, cwd: Path, log) -> "Launch":
        """DeepSpeed's launcher in its own session: its ranks are its children, in its group."""
        from lifecycle.core.procs import die_with_parent

        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True, preexec_fn=die_with_parent)
        return cls([("deepspeed", p)], log)

    @property
    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.procs}

    def poll(self) -> bool:
        """True once every process has exited 0. A non-zero exit stops the rest and raises RankFailed."""
        codes = {name: p.poll() for name, p in self.procs}
        for name, code in codes.items():
            if code is not None and name not in self.reported:
                self.reported.add(name)
                self._say(f"{name} (pid {self.pids[name]}) exited with code {code}")
        failed = [(name, code) for name, code in codes.items() if code not in (None, 0)]
        if failed:
            name, code = failed[0]
            others = [n for n, c in codes.items() if c is None]
            self.stop()
            raise RankFailed(f"{name} exited with code {code}"
                             + (f"; stopped {', '.join(others)}" if others else ""))
        return all(code == 0 for code in codes.values())

    def stop(self, term_timeout: float = 15, kill_timeout: float = 10) -> None:
        """SIGTERM the group, SIGKILL what is left after `term_timeout`, and collect every exit."""
        from lifecycle.core.procs import stop_group

        stop_group(self.pgid, term_timeout=term_timeout, kill_timeout=kill_timeout)
        for _, p in self.procs:
            try:
                p.wait(timeout=0.1)
            except subprocess.TimeoutExpired:  # left the group (setsid) and survived SIGKILL of it: not ours now
                log.warning("process %d of the launch is still running after stopping group %d", p.pid, self.pgid)

    def _say(self, line: str) -> None:
        self.log.write(f"[supervisor] {line}\n".encode())
        self.log.flush()


def read_hostfile(path: str | Path) -> dict[str, int]:
    """{host: slots} of a DeepSpeed hostfile, validated line by line (DeepSpeed's own parser names neither
    the file nor the line, and accepts trailing garbage after `slots=N`)."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"train.launch.hostfile {path}: cannot read it ({e.strerror})") from None
    hosts: dict[str, int] = {}
    for n, raw in enumerate(lines, start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("slots=") or not parts[1][6:].isdigit() or int(parts[1][6:]) < 1:
            raise ValueError(f"hostfile {path}, line {n}: expected '<host> slots=<ranks >= 1>', got {raw.strip()!r}")
        if parts[0] in hosts:
            raise ValueError(f"hostfile {path}, line {n}: host {parts[0]!r} is listed twice")
        hosts[parts[0]] = int(parts[1][6:])
    if not hosts:
        raise ValueError(f"hostfile {path}: no '<host> slots=<ranks>' line")
    return hosts


def select_hosts(hosts: dict[str, int], cfg: LaunchConfig) -> dict[str, int]:
    """{host: ranks} that the launcher's `--include`/`--exclude`/`--num_nodes` leave of a hostfile (the
    selection rules of deepspeed/launcher/runner.py), so the world size is checked before anything starts."""
    def parse(spec: str) -> dict[str, int | None]:  # "node1@node2:0,2" -> {node1: None (all), node2: 2}
        out = {}
        for part in spec.split("@"):
            host, _, slots = part.partition(":")
            if host not in hosts:
                raise ValueError(f"host {host!r} of {spec!r} is not in hostfile {cfg.hostfile}")
            out[host] = len(slots.split(",")) if slots else None
        return out

    if cfg.include:
        return {h: n or hosts[h] for h, n in parse(cfg.include).items()}
    if cfg.exclude:
        drop = parse(cfg.exclude)
        left = {h: hosts[h] - (drop[h] or hosts[h]) if h in drop else hosts[h] for h in hosts}
        return {h: n for h, n in left.items() if n > 0}
    return dict(list(hosts.items())[: cfg.num_nodes or len(hosts)])


def launcher_cmd(cfg: TrainConfig, port: int, run_dir: Path, threads: int) -> list[str]:
    """The `deepspeed` runner command before the module, for a hostfile launch (multi-node, or a hostfile's single
    host). Ranks on this machine only (no hostfile) are started by `run_train` itself (`Launch.start_local`, with
    the environment DeepSpeed's per-node launcher would give them): neither the runner nor the per-node launcher,
    whose interpreters import torch and DeepSpeed only to compute that environment (most of the launch overhead:
    docs/benchmarks.md, issue 24, `bench/launch_overhead.py`)."""
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or shutil.which("deepspeed")
    if launcher is None:
        raise RuntimeError(f"the deepspeed launcher is neither next to {sys.executable} nor on PATH")
    return [launcher, *launch_args(cfg, port, run_dir, threads)]


def launch_args(cfg: TrainConfig, port: int, run_dir: Path, threads: int) -> list[str]:
    """Arguments of the `deepspeed` launcher before the module: `--num_gpus` local ranks, or the hostfile
    with its host selection. With a hostfile, the rank environment that the launcher does not forward over
    ssh itself (it forwards PYTHON* variables) is written to `<run_dir>/.deepspeed_env`, which it reads
    from its working directory: the accelerator, the threads per rank and `FORWARDED_ENV`."""
    hl = cfg.launch
    if hl.hostfile is None:
        return ["--num_gpus", str(cfg.batch.num_ranks), "--master_port", str(port)]
    chosen = select_hosts(read_hostfile(hl.hostfile), hl)
    if sum(chosen.values()) != cfg.batch.num_ranks:
        raise ValueError(f"hostfile {hl.hostfile} gives {sum(chosen.values())} ranks "
                         f"({', '.join(f'{h}: {n}' for h, n in chosen.items())}) but "
                         f"train.batch.num_ranks={cfg.batch.num_ranks}")
    args = ["--hostfile", str(Path(hl.hostfile).resolve()), "--master_port", str(port), "--launcher", hl.launcher]
    one_host = len(chosen) == 1
    master = hl.master_addr or ("127.0.0.1" if one_host and next(iter(chosen)) in LOCAL_HOSTS else None)
    if master:
        args += ["--master_addr", master]
    if one_host:  # DeepSpeed starts a single host's ranks locally, but would still try ssh to it first
        args.append("--no_ssh_check")
    for flag, value in (("--num_nodes", hl.num_nodes), ("--include", hl.include), ("--exclude", hl.exclude)):
        if value:
            args += [flag, str(value)]
    forwarded = "".join(f"{k}={os.environ[k]}\n" for k in FORWARDED_ENV if os.environ.get(k))
    (run_dir / ".deepspeed_env").write_text(f"DS_ACCELERATOR={cfg.engine.accelerator}\nOMP_NUM_THREADS={threads}\n"
                                           + forwarded)
    return args
