"""Two machines on one host: two network namespaces (each with a hostname of its own, through a UTS namespace)
joined by a bridge in a third, an sshd in each, and an `ssh` that logs in with a key made here. The file system is
the host's, so a work dir is the shared file system both nodes see, as NFS would be on real machines.

Only namespaces, links and processes made here are touched; `down` removes them all. Needs root (or
CAP_NET_ADMIN and CAP_SYS_ADMIN), iproute2, openssh-server and pdsh (deploy/system-packages.sh)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

SSHD = "/usr/sbin/sshd"
ADDRS = ("10.46.0.1", "10.46.0.2")


def why_no_two_nodes() -> str | None:
    """Why the namespaces cannot be made here (None: they can)."""
    for tool, pkg in (("/usr/sbin/sshd", "openssh-server"), ("/usr/bin/pdsh", "pdsh"), ("/usr/bin/ssh", "openssh-client")):
        if not os.path.exists(tool):
            return f"{tool} is missing (Debian's {pkg}: deploy/system-packages.sh)"
    if not shutil.which("ip") or not shutil.which("unshare"):
        return "ip (iproute2) or unshare (util-linux) is missing"
    probe = f"lc46probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class TwoNodes:
    """Nodes `names[0]` (10.46.0.1) and `names[1]` (10.46.0.2) on the bridge of namespace `switch`."""

    def __init__(self, folder: Path):
        tag = f"{os.getpid() % 100000}"
        self.dir = folder
        self.ns = (f"lc46n1-{tag}", f"lc46n2-{tag}")
        self.switch = f"lc46sw-{tag}"
        self.names = ("node1", "node2")  # each namespace's hostname (what `hostname` says on that node)
        self.addrs = ADDRS
        self.sshd: list[subprocess.Popen] = []
        self.bin = folder / "bin"  # `ssh` that uses this key and config, first on the launching node's PATH

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def up(self) -> "TwoNodes":
        self._ip("netns", "add", self.switch)
        self._ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        self._ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.ns, start=1):
            self._ip("netns", "add", ns)
            self._ip("link", "add", f"lc46p{i}-{ns[-5:]}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._ip("link", "set", f"lc46p{i}-{ns[-5:]}", "netns", self.switch)
            self._ip("-n", self.switch, "link", "set", f"lc46p{i}-{ns[-5:]}", "name", f"p{i}")
            self._ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            self._ip("-n", ns, "addr", "add", f"{self.addrs[i - 1]}/24", "dev", "eth0")
            self._ip("-n", ns, "link", "set", "eth0", "up")
            self._ip("-n", ns, "link", "set", "lo", "up")
        self._ssh_keys()
        for i in range(2):
            self.sshd.append(self.popen(i, [SSHD, "-D", "-e", "-f", str(self.dir / f"sshd{i}.conf")],
                                        log=self.dir / f"sshd{i}.log"))
        self._wait_ssh()
        return self

    def _ssh_keys(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.bin.mkdir(exist_ok=True)
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory (Debian's service makes it)
        for key in ("host_key", "id_ed25519"):
            if not (self.dir / key).exists():
                subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.dir / key)], check=True)
        shutil.copy(self.dir / "id_ed25519.pub", self.dir / "authorized_keys")
        for i, addr in enumerate(self.addrs):
            (self.dir / f"sshd{i}.conf").write_text(
                f"ListenAddress {addr}\nPort 22\nHostKey {self.dir / 'host_key'}\nPidFile {self.dir}/sshd{i}.pid\n"
                f"AuthorizedKeysFile {self.dir / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                "PrintMotd no\n")
        (self.dir / "ssh_config").write_text(
            f"Host *\n  IdentityFile {self.dir / 'id_ed25519'}\n  IdentitiesOnly yes\n  StrictHostKeyChecking no\n"
            "  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n  ConnectTimeout 5\n")
        wrapper = self.bin / "ssh"
        wrapper.write_text(f"#!/bin/sh\nexec /usr/bin/ssh -F {self.dir / 'ssh_config'} \"$@\"\n")
        wrapper.chmod(0o755)

    def _wait_ssh(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        for addr in self.addrs:
            while True:
                probe = self.run(0, [str(self.bin / "ssh"), addr, "hostname"], capture_output=True, text=True)
                if probe.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd on {addr} did not answer: {probe.stderr}")
                time.sleep(0.3)

    def wrap(self, i: int, cmd: list[str]) -> list[str]:
        """`cmd` on node i: in its network namespace, under its own hostname."""
        return ["ip", "netns", "exec", self.ns[i], "unshare", "--uts", "sh", "-c",
                f'hostname {self.names[i]} && exec "$@"', "node", *cmd]

    def run(self, i: int, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.wrap(i, cmd), **kw)

    def popen(self, i: int, cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        with open(log, "ab") as out:
            return subprocess.Popen(self.wrap(i, cmd), stdout=out, stderr=subprocess.STDOUT, env=env,
                                    stdin=subprocess.DEVNULL, start_new_session=True)

    def link(self, i: int, up: bool) -> None:
        """Node i's cable: its port on the bridge up or down."""
        self._ip("-n", self.switch, "link", "set", f"p{i + 1}", "up" if up else "down")

    def down(self) -> None:
        for p in self.sshd:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            p.wait(timeout=10)
        for ns in (*self.ns, self.switch):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
