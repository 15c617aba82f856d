"""The warm runner's socket protocol: one length-prefixed JSON message each way, the command's stdio passed along
as file descriptors (SCM_RIGHTS)."""

from __future__ import annotations

import json
import os
import socket
import struct
from pathlib import Path

ACCEPT_TIMEOUT_S = 10.0  # a client that connects and sends nothing is dropped after this


def send_msg(sock: socket.socket, obj: dict, fds: list[int] = ()) -> None:
    """One length-prefixed JSON message, with file descriptors (SCM_RIGHTS) when given."""
    data = json.dumps(obj).encode()
    frame = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(sock, [frame], list(fds))
    else:
        sock.sendall(frame)


def recv_msg(sock: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
    for fd in fds:  # SCM_RIGHTS descriptors arrive inheritable: an exec (the runner's restart) must not keep them
        os.set_inheritable(fd, False)
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        more = sock.recv(1 << 16)
        if not more:
            for fd in fds:
                os.close(fd)
            raise ConnectionError("the message ended early")
        data += more
    return json.loads(data[4:4 + struct.unpack("!I", data[:4])[0]]), list(fds)


def ping_runner(path: Path, timeout: float = 2) -> bool:
    """True when a runner answers on `path`."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(path))
            send_msg(s, {"ping": True})
            return "pong" in json.loads(s.makefile("rb").readline() or b"{}")
    except (OSError, ValueError):
        return False
