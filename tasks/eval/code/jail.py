"""The child side of the sandbox: run as `python -I -S jail.py SPEC_JSON` by `sandbox.run_program`, it closes
the doors it can, then runs the untrusted program in its own (already limited, unprivileged) process.

This file imports only the standard library and nothing of `lifecycle` (it runs under the base interpreter,
without the project's virtual environment on the path). In order (each where the kernel allows it; the `held`
dict written to the report pipe says which did):

1. new network (`CLONE_NEWNET`: only a loopback device, and it is down), IPC (`CLONE_NEWIPC`: SysV shared memory,
   semaphores and message queues die with the sample; shared memory capped at the address-space limit) and mount
   (`CLONE_NEWNS`) namespaces;
2. in the mount namespace, a new root that shows only what a program needs (`pivot_root`): /usr read-only (and
   /bin, /lib, /lib64, /sbin as the host has them), /etc/ld.so.cache, the interpreter's prefix read-only, /dev
   with null, zero, full, random and urandom, and the throwaway directory at /tmp/sandbox on a tmpfs of
   `disk_bytes` (the program's cwd, HOME and TMPDIR). No work dir, input root, home or other path of the host is
   there, wherever it lies; the new root is read-only;
3. a new PID namespace whose init (a process of this file, root) mounts a /proc with hidepid=invisible, reaps
   every process the program leaves behind (no `<defunct>`), and whose death kills all of them (the evaluator kills
   it at the wall-time limit);
4. resource limits (CPU seconds, address space, processes, file size, open files, no core files);
5. when root: drop to the sandbox's uid/gid (no supplementary groups), so the program cannot read what only root
   may, cannot signal the evaluator (EPERM), and is counted by RLIMIT_NPROC (root is exempt from it);
6. no_new_privs and a seccomp filter that refuses new user namespaces (`unshare`/`clone` with `CLONE_NEWUSER`:
   EPERM; `clone3`, whose flags a filter cannot read: ENOSYS, so the C library falls back to `clone`);
7. a clean environment (PATH, LANG, HOME, TMPDIR) and the program run as `__main__`.

The harness's verdict (`passed`) is written to the report pipe only after the program's last statement returns.
"""

import ctypes
import json
import os
import resource
import signal
import struct
import sys

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = (0x00020000, 0x08000000, 0x10000000,
                                                                        0x20000000, 0x40000000)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 0x1, 0x2, 0x4, 0x8, 0x20
MS_BIND, MS_REC, MS_PRIVATE, MNT_DETACH = 0x1000, 0x4000, 0x40000, 0x2
INSIDE = "/tmp/sandbox"  # where the throwaway directory appears inside the new root
DEVICES = ("null", "zero", "full", "random", "urandom")
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 38, 22, 2
# (audit arch, clone, unshare, clone3) per machine: the syscall numbers the seccomp filter checks
SYSCALLS = {"x86_64": (0xC000003E, 56, 272, 435), "aarch64": (0xC00000B7, 220, 97, 435)}

_libc = ctypes.CDLL(None, use_errno=True)


def _call(fn, *args) -> None:
    if fn(*args) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def _mount(src: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _call(_libc.mount, src.encode(), target.encode(), fstype.encode() if fstype else None, flags,
          data.encode() if data else None)


def _bind_ro(src: str, target: str) -> None:
    """Bind `src` read-only at `target` (made as an empty file or directory of the new root)."""
    if os.path.isdir(src):
        os.makedirs(target, 0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
        open(target, "w").close()
    _mount(src, target, None, MS_BIND | MS_REC)
    _mount("none", target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _cap_shared_memory(limit: int) -> None:
    """SysV shared memory of the new IPC namespace: at most the address-space limit in all."""
    for name, value in (("shmmax", limit), ("shmall", limit // os.sysconf("SC_PAGE_SIZE"))):
        with open(f"/proc/sys/kernel/{name}", "w") as f:
            f.write(str(value))


def _unshare(held: dict, flag: int, key: str, what: str) -> bool:
    try:
        _call(_libc.unshare, flag)
    except OSError as e:
        held[key] = f"NOT isolated: unshare failed: {e.strerror}"
        return False
    held[key] = what
    return True


def _new_root(spec: dict, new: str) -> None:
    """Build the root the program sees under `new` (a fresh tmpfs), with the sample's tmpfs at INSIDE."""
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=256k,mode=0755")
    for top in ("bin", "lib", "lib64", "lib32", "libx32", "sbin"):
        if os.path.islink(f"/{top}"):
            os.symlink(os.readlink(f"/{top}"), f"{new}/{top}")
        elif os.path.isdir(f"/{top}"):
            _bind_ro(f"/{top}", f"{new}/{top}")
    _bind_ro("/usr", f"{new}/usr")
    if os.path.exists("/etc/ld.so.cache"):
        _bind_ro("/etc/ld.so.cache", f"{new}/etc/ld.so.cache")
    for path in spec["keep"]:  # the interpreter's prefix, where it lies outside /usr
        if not os.path.isdir(f"{new}{path}"):
            _bind_ro(path, f"{new}{path}")
    for path in spec["hide"]:  # the project, a work dir, ... where it lies under what is shown
        if os.path.isdir(f"{new}{path}"):
            _mount("tmpfs", f"{new}{path}", "tmpfs", MS_NOSUID | MS_NODEV, "size=4k,mode=0755")
    os.makedirs(f"{new}/dev", 0o755)
    _mount("tmpfs", f"{new}/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for dev in DEVICES:
        open(f"{new}/dev/{dev}", "w").close()
        _mount(f"/dev/{dev}", f"{new}/dev/{dev}", None, MS_BIND)
    os.makedirs(f"{new}{INSIDE}", 0o755)
    os.makedirs(f"{new}/proc", 0o555)
    lim = spec["limits"]
    _mount("tmpfs", f"{new}{INSIDE}", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={lim['disk_bytes']},nr_inodes={lim['disk_files']},mode=0700")
    with open(os.path.join(spec["dir"], "program.py"), "rb") as src, open(f"{new}{INSIDE}/program.py", "wb") as dst:
        dst.write(src.read())


def _namespaces(spec: dict, held: dict) -> str:
    """Enter new net, IPC and mount namespaces and the new root; returns the directory the program runs in."""
    _unshare(held, CLONE_NEWNET, "network", "new network namespace (no interfaces up)")
    if _unshare(held, CLONE_NEWIPC, "ipc", "new IPC namespace (SysV objects die with the sample)"):
        _cap_shared_memory(spec["limits"]["memory_bytes"])
    if not _unshare(held, CLONE_NEWNS, "filesystem", ""):
        return spec["dir"]
    _mount("none", "/", None, MS_REC | MS_PRIVATE)
    new = os.path.join(spec["dir"], "root")
    os.mkdir(new, 0o700)
    _new_root(spec, new)
    os.chdir(new)
    os.mkdir("old", 0o700)
    _call(_libc.syscall, 155 if os.uname().machine == "x86_64" else 41, b".", b"old")  # pivot_root(".", "old")
    os.chdir("/")
    _call(_libc.umount2, b"/old", MNT_DETACH)
    os.rmdir("/old")
    held["filesystem"] = (f"private mount namespace, a new root: /usr, the interpreter and /dev read-only, "
                          f"{INSIDE} a tmpfs of "
                          f"{spec['limits']['disk_bytes'] >> 20} MiB; nothing else of the host")
    return INSIDE


def _limits(spec: dict, held: dict) -> None:
    lim = spec["limits"]
    for name, value in (("RLIMIT_CPU", lim["cpu_s"]), ("RLIMIT_AS", lim["memory_bytes"]),
                        ("RLIMIT_NPROC", lim["nproc"]), ("RLIMIT_FSIZE", lim["file_bytes"]),
                        ("RLIMIT_NOFILE", lim["open_files"]), ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))
    held["limits"] = (f"cpu {lim['cpu_s']} s, address space {lim['memory_bytes'] >> 20} MiB, processes "
                      f"{lim['nproc']}, file size {lim['file_bytes'] >> 20} MiB, open files {lim['open_files']}")


def _drop(spec: dict, held: dict) -> None:
    if os.getuid() != 0:
        held["user"] = f"NOT changed: the evaluator is not root, the program runs as uid {os.getuid()}"
        return
    uid, gid = spec["uid"], spec["gid"]
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)  # real, effective and saved: no way back
    held["user"] = f"uid {uid}, gid {gid}, no supplementary groups"


def _prctl(option: int, *args: int) -> None:
    """prctl with every argument an unsigned long (its unused ones must be 0, not a register's leftovers)."""
    full = (list(args) + [0, 0, 0, 0])[:4]
    _call(_libc.prctl, ctypes.c_int(option), *(ctypes.c_ulong(a) for a in full))


def _bpf(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def _no_user_namespaces(held: dict) -> None:
    """no_new_privs, then a seccomp filter: unshare/clone with CLONE_NEWUSER -> EPERM, clone3 -> ENOSYS; a call
    of another ABI (x32, 32-bit) is killed, since its numbers differ."""
    nums = SYSCALLS.get(os.uname().machine)
    if nums is None:
        held["user namespaces"] = f"NOT blocked: no seccomp filter for {os.uname().machine}"
        return
    arch, clone, unshare, clone3 = nums
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|{JEQ,JGE,JSET}|K, BPF_RET|K
    allow, kill, eperm, enosys = 0x7FFF0000, 0x80000000, 0x00050000 | 1, 0x00050000 | 38
    x32 = [_bpf(jge, 0x40000000, 0, 1), _bpf(ret, kill)] if arch == 0xC000003E else []
    prog = [_bpf(ld, 4), _bpf(jeq, arch, 1, 0), _bpf(ret, kill),  # seccomp_data.arch: another ABI is killed
            _bpf(ld, 0), *x32,  # seccomp_data.nr (x32's numbers carry bit 30)
            _bpf(jeq, clone3, 0, 1), _bpf(ret, enosys),
            _bpf(jeq, clone, 1, 0), _bpf(jeq, unshare, 0, 3),
            _bpf(ld, 16),  # args[0], its low 32 bits: the flags of both calls
            _bpf(jset, CLONE_NEWUSER, 0, 1), _bpf(ret, eperm),
            _bpf(ret, allow)]
    code = b"".join(prog)
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(buf))
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    fbuf = ctypes.create_string_buffer(fprog, len(fprog))
    _prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fbuf))
    held["user namespaces"] = "blocked (seccomp: unshare/clone with CLONE_NEWUSER refused), no_new_privs"


def _run_program(spec: dict, held: dict, where: str, report) -> None:
    os.chdir(where)
    if os.getuid() == 0:  # the sample's directory belongs to the sandbox user
        os.chown(".", spec["uid"], spec["gid"])
        os.chown("program.py", spec["uid"], spec["gid"])
    _limits(spec, held)
    _drop(spec, held)
    _no_user_namespaces(held)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": where, "TMPDIR": where}
    os.environ.clear()
    os.environ.update(env)
    held["environment"] = "only " + ", ".join(sorted(env))
    report.write(json.dumps({"held": held}) + "\n")
    report.flush()
    with open("program.py", encoding="utf-8") as f:
        source = f.read()
    sys.argv = ["program.py"]
    sys.path.insert(0, where)
    code = compile(source, "program.py", "exec")
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    report.write(json.dumps({"verdict": "passed"}) + "\n")
    report.flush()


def _init(report, status_w: int) -> bool:
    """PID 1 of the sample's PID namespace: mount its /proc, start the program's process, reap every process
    until that one ends, pass its exit code on (status_w) and exit, which kills whatever the program left running.
    Returns (True) only in the program's process."""
    os.setsid()  # its own group: a kill of the program's parent's group reaches root's init only (EPERM)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible")
    _mount("none", "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    child = os.fork()
    if child == 0:
        os.close(status_w)
        os.setsid()
        return True
    report.close()
    while True:
        pid, status = os.wait()
        if pid == child:
            os.write(status_w, str(os.waitstatus_to_exitcode(status)).encode())
            os._exit(0)


def _reraise(code: int) -> None:
    """Exit as the program did: with its status, or killed by its signal (SIGXCPU, SIGKILL, ...)."""
    if code >= 0:
        os._exit(code)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
    os._exit(128 - code)


def main() -> None:
    spec = json.loads(sys.argv[1])
    report = os.fdopen(spec["report_fd"], "w")
    held: dict = {}
    where = _namespaces(spec, held)
    if where != INSIDE:
        held["processes"] = "NOT isolated: no PID namespace without the private mount namespace"
    elif _unshare(held, CLONE_NEWPID, "processes", "new PID namespace; its init reaps what the program leaves"):
        status_r, status_w = os.pipe()
        init = os.fork()
        if init != 0:
            os.close(status_w)
            report.close()
            os.waitpid(init, 0)
            status = os.read(status_r, 32)
            _reraise(int(status) if status else -signal.SIGKILL)
        os.close(status_r)
        _init(report, status_w)
    _run_program(spec, held, where, report)


if __name__ == "__main__":
    main()
