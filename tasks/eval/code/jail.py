"""The child side of the sandbox: run as `python -I -S jail.py SPEC_JSON` by `sandbox.run_program`, it closes
the doors it can, then runs the untrusted program in its own (already limited, unprivileged) process.

This file imports only the standard library and nothing of `lifecycle` (it runs under the base interpreter,
without the project's virtual environment on the path). In order:

1. new network namespace (`unshare(CLONE_NEWNET)`: only a loopback device, and it is down) and a new mount
   namespace (`CLONE_NEWNS`), each where the kernel allows it;
2. in the mount namespace: an empty root-owned tmpfs over every world-writable directory (/tmp, /var/tmp,
   /dev/shm, /run/lock, /dev/mqueue) and over every hidden path (the project, the evaluator's home, /root,
   /home), with the interpreter's own prefix bound back read-only where it lies under one; the throwaway
   directory bind-mounted at /tmp/sandbox (the program's cwd, HOME and TMPDIR); a fresh /proc with
   hidepid=invisible (the program sees no process but its own, so no other command line);
3. resource limits (CPU seconds, address space, processes, file size, open files, no core files);
4. when root: drop to the sandbox's uid/gid (no supplementary groups), so the program cannot read what only root
   may, cannot signal the evaluator (EPERM), and is counted by RLIMIT_NPROC (root is exempt from it);
5. a clean environment (PATH, LANG, HOME, TMPDIR) and the program run as `__main__`.

What held is written as one JSON line to the report pipe before the program starts; the harness's verdict (`passed`) is
written there only after the program's last statement returns.
"""

import ctypes
import json
import os
import resource
import sys

CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 0x1, 0x2, 0x4, 0x8, 0x20
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue")
INSIDE = "/tmp/sandbox"  # where the throwaway directory appears inside a private mount namespace

_libc = ctypes.CDLL(None, use_errno=True)


def _call(fn, *args) -> None:
    if fn(*args) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def _mount(src: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    _call(_libc.mount, src.encode(), target.encode(), fstype.encode() if fstype else None, flags,
          data.encode() if data else None)


def _namespaces(spec: dict, held: dict) -> str:
    """Enter new net and mount namespaces where allowed; returns the directory the program runs in."""
    workdir = spec["dir"]
    try:
        _call(_libc.unshare, CLONE_NEWNET)
        held["network"] = "new network namespace (no interfaces up)"
    except OSError as e:
        held["network"] = f"NOT isolated: unshare(CLONE_NEWNET) failed: {e.strerror}"
    try:
        _call(_libc.unshare, CLONE_NEWNS)
        _mount("none", "/", None, MS_REC | MS_PRIVATE, None)
    except OSError as e:
        held["filesystem"] = f"NOT isolated: private mount namespace failed: {e.strerror}"
        return workdir
    # fds opened inside the new namespace (a bind source must be a mount of it) before /tmp etc. are covered
    dir_fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)
    # the interpreter's prefix (standard library) may lie under a hidden path (pyenv under /root): keep an fd
    # to it, cover the path, then bind it back read-only at the same place
    keep = [(k, os.open(k, os.O_RDONLY | os.O_DIRECTORY)) for k in spec["keep"]]
    covered = []
    for path in list(WORLD_WRITABLE) + spec["hide"]:
        if os.path.isdir(path) and not os.path.islink(path):
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
            covered.append(path)
    for path, fd in keep:
        if not os.path.isdir(path):
            os.makedirs(path, 0o755)
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None)
            _mount("none", path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
            covered.append(f"(bound back read-only: {path})")
        os.close(fd)
    os.mkdir(INSIDE, 0o755)
    # the throwaway directory: hidden under the new /tmp by now, so bind it from the fd opened before
    _mount(f"/proc/self/fd/{dir_fd}", INSIDE, None, MS_BIND, None)
    os.close(dir_fd)
    # a fresh /proc that shows a non-root uid only its own processes: other processes' command lines (a server's
    # --backend-store-uri with a password) stay unreadable; mounted last, the binds above read /proc/self/fd
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible")
    held["filesystem"] = ("private mount namespace: empty root-owned tmpfs over " + ", ".join(covered)
                          + "; /proc with hidepid=invisible")
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


def main() -> None:
    spec = json.loads(sys.argv[1])
    report = os.fdopen(spec["report_fd"], "w")
    held: dict = {}
    where = _namespaces(spec, held)
    os.chdir(where)
    if os.getuid() == 0:  # the bind-mounted directory belongs to the sandbox user
        os.chown(".", spec["uid"], spec["gid"])
    _limits(spec, held)
    _drop(spec, held)
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


if __name__ == "__main__":
    main()
