"""The sandbox against what an attacker would try. Each attack must end as a failed sample with a reason, leave
nothing behind on the host, and leave this (the evaluator's) process alive. Each test fails if the layer that
contains its attack is removed (named in each docstring)."""

import os
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from lifecycle.tasks.eval.code import sandbox
from lifecycle.tasks.eval.code.sandbox import SandboxLimits, run_program, slot_uid
from lifecycle.tasks.eval.code.score import score_samples

ROOT = Path(__file__).resolve().parents[2]
FAST = SandboxLimits(timeout_s=10)  # for programs that end by themselves: room for a slow start on a busy machine
SHORT = SandboxLimits(timeout_s=1.5)  # for programs that run until killed


def run(source: str, limits: SandboxLimits = FAST, tmp_root=None):
    r = run_program(source, limits, 0, str(tmp_root) if tmp_root else None)
    assert not r.passed, f"the attack passed: {r.reason}\n{r.stdout[-2000:]}"
    return r


def test_honest_programs_pass_and_fail_and_the_directory_goes(tmp_path):
    ok = run_program("import math\nassert math.gcd(12, 18) == 6\nopen('scratch.txt', 'w').write('x')", FAST, 0,
                     str(tmp_path))
    assert ok.passed and ok.reason == "passed", ok.stderr
    assert run("assert 1 + 1 == 3", tmp_root=tmp_path).reason == "exception: AssertionError"
    assert run("import sys\nsys.exit(0)").reason.startswith("exited with status 0 without the harness's pass mark")
    assert list(tmp_path.iterdir()) == []  # throwaway directories removed
    held = ok.held
    assert held["network"].startswith("new network namespace"), held
    assert held["filesystem"].startswith("private mount namespace"), held
    assert held["user"].startswith("uid "), held
    assert held["ipc"].startswith("new IPC namespace"), held
    assert held["processes"].startswith("new PID namespace"), held
    assert held["user namespaces"].startswith("blocked"), held


def test_reading_ssh_keys_the_project_and_the_environment(monkeypatch):
    """Contained by: the private mount namespace (/root and the project covered, a /proc that shows only its own
    processes), the unprivileged uid, the environment of PATH/LANG/HOME/TMPDIR only."""
    secret = uuid.uuid4().hex
    monkeypatch.setenv("LIFECYCLE_TEST_SECRET", secret)
    ssh = Path("/root/.ssh") if os.getuid() == 0 else Path.home() / ".ssh"
    made_dir = not ssh.exists()
    ssh.mkdir(mode=0o700, exist_ok=True)
    key = ssh / f"lifecycle-test-{secret[:8]}"
    key.write_text(f"-----BEGIN OPENSSH PRIVATE KEY----- {secret}\n")
    try:
        for path in (key, ROOT / "pyproject.toml", Path.home() / ".ssh" / key.name):
            r = run(f"print(open({str(path)!r}).read())")
            assert r.reason.startswith("exception: FileNotFoundError"), r.reason
            assert secret not in r.stdout and "[project]" not in r.stdout
        r = run("import os, sys\nprint(dict(os.environ))\nprint(open(f'/proc/{os.getppid()}/environ').read())")
        assert r.reason.startswith("exception: FileNotFoundError"), r.reason  # the evaluator: not in its /proc
        assert secret not in r.stdout + r.stderr
        assert "'HOME': '/tmp/sandbox'" in r.stdout
    finally:
        key.unlink()
        if made_dir:
            ssh.rmdir()


def test_other_processes_command_lines():
    """Contained by: the fresh /proc with hidepid=invisible (a server's command line may hold a password)."""
    secret = uuid.uuid4().hex
    other = subprocess.Popen(["sleep", "60", secret])
    try:
        r = run(f"import os\nprint(sorted(p for p in os.listdir('/proc') if p.isdigit()))\n"
                f"print(open('/proc/{other.pid}/cmdline').read())")
        assert r.reason.startswith("exception: FileNotFoundError"), r.reason
        assert secret not in r.stdout and str(other.pid) not in r.stdout and str(os.getpid()) not in r.stdout
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("target", ["/tmp", "/var/tmp", "/dev/shm", "/root", str(ROOT)])
def test_writing_outside_its_directory(target):
    """Contained by: the root-owned tmpfs over the world-writable directories and hidden paths, and the uid."""
    path = Path(target) / f"lifecycle-escape-{uuid.uuid4().hex[:8]}"
    try:
        r = run(f"open({str(path)!r}, 'w').write('escaped')")
        assert r.reason.startswith(("exception: PermissionError", "exception: FileNotFoundError",
                                    "exception: OSError: [Errno 30] Read-only file system")), r.reason
        assert not path.exists()
    finally:
        path.unlink(missing_ok=True)


def test_socket_to_a_listener_on_localhost():
    """Contained by: the new network namespace (its loopback is down, and it is not the host's)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        r = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'leak')")
        assert r.reason.startswith("exception: OSError: [Errno 101] Network is unreachable"), r.reason
        listener.settimeout(0.2)
        with pytest.raises(TimeoutError):
            listener.accept()


def test_fork_bomb_that_leaves_its_process_group():
    """Contained by: RLIMIT_NPROC (counts the sandbox uid's processes), the wall-time kill of the process group,
    and the sweep of every process of the slot's uid (children that called setsid are not in the group)."""
    uid = slot_uid(SHORT, 0)
    bomb = "import os\nwhile True:\n    try:\n        if os.fork() == 0:\n            os.setsid()\n" \
           "    except OSError:\n        pass\n"
    try:
        t0 = time.monotonic()
        r = run(bomb, SHORT)
        assert r.reason.startswith("timeout"), r.reason
        assert time.monotonic() - t0 < 10
        assert sandbox._uid_procs(uid) == [], "processes of the sandbox uid survived"
    finally:
        for pid in sandbox._uid_procs(uid):
            os.kill(pid, 9)


def test_allocating_10_gb():
    """Contained by: RLIMIT_AS."""
    r = run("x = bytearray(10 * 2**30)\nx[-1] = 1")
    assert r.reason.startswith("memory: MemoryError"), r.reason


def test_infinite_loop():
    """Contained by: the wall-time kill (RLIMIT_CPU is the backstop)."""
    t0 = time.monotonic()
    r = run("while True:\n    pass", SandboxLimits(timeout_s=1.0))
    assert r.reason.startswith("timeout: still running after 1 s"), r.reason
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("attack", ["os.kill(os.getppid(), signal.SIGKILL)",
                                    "os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)",
                                    "os.kill(-1, signal.SIGKILL)"])
def test_killing_its_parent(attack):
    """Contained by: the PID namespace (its parent is the namespace's init, root's: EPERM; that init leads its own
    group, pid 1, so killpg of it is kill(-1)) and kill(-1) reaches nothing: no other process is in the namespace,
    so a program running beside it in the other slot is untouched."""
    program = f"import os, signal\ndef check(candidate):\n    {attack}\n    raise RuntimeError('the kill returned')\n"
    honest = "import time\ndef check(candidate):\n    time.sleep(0.5)\n"
    problems = {"attack": {"task_id": "attack", "prompt": "", "test": program, "entry_point": "None"},
                "honest": {"task_id": "honest", "prompt": "", "test": honest, "entry_point": "None"}}
    samples = [{"task_id": "honest", "completion": ""}, {"task_id": "attack", "completion": ""}]
    report = score_samples(samples, problems, [1], FAST, workers=2)
    honest_r, attack_r = report["results"]
    assert honest_r["passed"], honest_r
    assert not attack_r["passed"]
    # Linux's kill(-1) spares the caller and the namespace's init: nothing is left to signal, ESRCH
    expected = "exception: PermissionError" if "os.kill(os.getppid()" in attack else "exception: ProcessLookupError"
    assert attack_r["reason"].startswith(expected), attack_r
    os.kill(os.getpid(), 0)  # still here


def test_printing_1_gb():
    """Contained by: the output cap (the child is killed once stdout+stderr pass it; nothing buffers 1 GB)."""
    t0 = time.monotonic()
    r = run("import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * 2**20)")
    assert r.reason.startswith("output: more than"), r.reason
    assert len(r.stdout) <= FAST.output_bytes + 65536
    assert time.monotonic() - t0 < 5


def test_writing_a_huge_file():
    """Contained by: RLIMIT_FSIZE (Python ignores SIGXFSZ, so the write fails with EFBIG)."""
    r = run("with open('big', 'wb') as f:\n    f.write(b'x' * (32 << 20))")
    assert "File too large" in r.reason or r.reason.startswith("file size"), r.reason


def test_closing_its_pipes_and_scribbling_on_the_report():
    """A program that closes stdout/stderr still meets the wall-time kill; junk written to the harness's report
    pipe (it can find the fd) voids the verdict instead of crashing the evaluator."""
    r = run("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)", SHORT)
    assert r.reason.startswith("timeout"), r.reason
    r = run("import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'{junk\\n')\n"
            "    except OSError:\n        pass")
    assert r.reason.startswith("exited with status 0 without the harness's pass mark"), r.reason


# Issue 44, 2: what the sandbox leaked to the host (each fails on 8c6205f)
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="the namespaces and the slot uid need root")
SHM = """import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
for _ in range(4):
    shmid = libc.shmget(0, 16 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    assert shmid >= 0, ctypes.get_errno()
    addr = libc.shmat(shmid, None, 0)
    ctypes.memset(addr, 1, 16 << 20)
    libc.shmdt(ctypes.c_void_p(addr))
"""


def _sysv(kind: str = "shm") -> list[list[str]]:
    with open(f"/proc/sysvipc/{kind}") as f:
        return [line.split() for line in f][1:]


@needs_root
def test_sysv_shared_memory_dies_with_the_sample():
    """Contained by: the sample's own IPC namespace (RLIMIT_AS does not bound segments left unattached); the
    program passes (it may use shared memory), and no segment it made is left in the host's namespace."""
    before = {row[1] for row in _sysv()}
    try:
        r = run_program(SHM, FAST, 0)
        assert r.passed, r.stderr
        assert {row[1] for row in _sysv()} == before, "a segment outlived the sample"
    finally:
        sandbox.remove_ipc(slot_uid(FAST, 0))


@needs_root
def test_the_slot_uids_ipc_objects_are_removed():
    """The backstop: SysV objects the slot uid owns in the host's namespace are removed (and no one else's)."""
    uid = slot_uid(FAST, 5)
    pid = os.fork()
    if pid == 0:  # made as the slot uid, in this namespace
        try:
            import ctypes
            os.setgid(uid)
            os.setuid(uid)
            libc = ctypes.CDLL(None)
            ok = libc.shmget(0, 4096, 0o1600) >= 0 and libc.semget(0, 1, 0o1600) >= 0 and libc.msgget(0, 0o1600) >= 0
            os._exit(0 if ok else 1)
        finally:
            os._exit(2)
    assert os.waitpid(pid, 0)[1] == 0
    mine = [kind for kind in ("shm", "sem", "msg") for row in _sysv(kind) if str(uid) in row]
    assert sorted(mine) == ["msg", "sem", "shm"]
    assert sandbox.remove_ipc(uid) == 3
    assert not [row for kind in ("shm", "sem", "msg") for row in _sysv(kind) if str(uid) in row]


@needs_root
def test_filling_the_disk_with_many_files(tmp_path):
    """Contained by: the tmpfs of `disk_bytes` (RLIMIT_FSIZE caps one file, not their number): 20 files of
    16 MiB reserved 320 MiB of the host's disk on 8c6205f."""
    program = ("import os\nfor i in range(20):\n    fd = os.open(f'f{i}', os.O_CREAT | os.O_WRONLY)\n"
               "    os.posix_fallocate(fd, 0, (16 << 20) - 1)\n    os.close(fd)")
    r = run(program, SandboxLimits(timeout_s=10, disk_bytes=32 << 20), tmp_root=tmp_path)
    assert r.reason.startswith("exception: OSError: [Errno 28] No space left on device"), r.reason
    assert list(tmp_path.iterdir()) == []


@needs_root
@pytest.mark.parametrize("call", ["libc.unshare(CLONE_NEWUSER)",
                                  "libc.syscall(56, CLONE_NEWUSER | 17, 0, 0, 0, 0)",  # clone(): x86_64's number
                                  "libc.syscall(435, ctypes.byref(args), ctypes.sizeof(args))"])  # clone3()
def test_creating_a_user_namespace(call):
    """Contained by: the seccomp filter (unshare/clone with CLONE_NEWUSER: EPERM; clone3: ENOSYS)."""
    if os.uname().machine != "x86_64" and "56" in call:
        pytest.skip("clone's syscall number here is x86_64's")
    program = ("import ctypes, os\nCLONE_NEWUSER = 0x10000000\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               "args = (ctypes.c_uint64 * 11)(CLONE_NEWUSER, 0, 0, 0, 17)\n"
               f"r = {call}\n"
               "if r == 0:\n    os._exit(0)  # the child of a clone that worked\n"
               "if r < 0:\n    raise PermissionError(os.strerror(ctypes.get_errno()))\n"
               "os.waitpid(r, 0)\n")
    r = run(program)
    assert r.reason in ("exception: PermissionError: Operation not permitted",
                        "exception: PermissionError: Function not implemented"), r.reason


@needs_root
def test_reading_a_work_dir_outside_the_known_places():
    """Contained by: the new root, which shows only /usr, the interpreter and /dev (8c6205f hid a fixed list, and
    a work dir such as /shared/runs/demo was readable)."""
    top = Path(f"/var/lib/lifecycle-test-{uuid.uuid4().hex[:8]}")
    secret = top / "runs" / "demo" / "tombstones.parquet"
    secret.parent.mkdir(parents=True)
    secret.write_text("a private document")
    secret.chmod(0o644)
    top.chmod(0o755)
    try:
        r = run(f"print(open({str(secret)!r}).read())")
        assert r.reason.startswith("exception: FileNotFoundError"), r.reason
        assert "private" not in r.stdout
        r = run_program("import os\nprint(' '.join(os.listdir('/')))\nprint(' '.join(os.listdir('/etc')))", FAST)
        top_level, etc = (set(line.split()) for line in r.stdout.splitlines())
        assert top_level <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "root", "sbin", "tmp",
                             "usr"}, top_level
        assert etc <= {"ld.so.cache"}, etc
    finally:
        secret.unlink()
        for d in (secret.parent, secret.parent.parent, top):
            d.rmdir()


def _zombies_of(uid: int) -> list[int]:
    return [pid for pid, owner, state, _ in sandbox.proc_table() if owner == uid and state == "Z"]


@needs_root
def test_killed_children_are_reaped():
    """Contained by: the PID namespace, whose init reaps (8c6205f left the killed children <defunct> under a pid 1
    that does not reap)."""
    uid = slot_uid(SHORT, 0)
    before = set(_zombies_of(uid))
    r = run("import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        os.setsid()\n"
            "        time.sleep(60)\ntime.sleep(60)", SHORT)
    assert r.reason.startswith("timeout"), r.reason
    time.sleep(0.3)
    assert set(_zombies_of(uid)) - before == set(), "killed children left <defunct>"
