"""The worker channel's wire: frames, the handshake's digest, endpoints, socket set-up (deployments/transport/channel.py
has the server, the one-way sender and the relay; deployments/transport/client.py the router's client).

Wire format: after the handshake, frames of an 8-byte big-endian length and a pickle (protocol 5). A request is
(method, args, reply); a reply is (ok, value), value being the result or the exception the method raised. `reply`
says where the reply goes: REPLY (back on this connection), ONE_WAY (nowhere), ERRORS_ONLY (back here only if the
method raised), or a connection id of the server (that connection's client gets it: a chained call).
Handshake: the server sends a 32-byte random challenge, the client answers HMAC-SHA256(secret, challenge), and the
server sends the connection's id (8 bytes); a wrong answer closes the connection before any pickle is read.

Each worker makes its own secret, which reaches the router only through Ray (the lease). The channel is
authenticated, not encrypted (like Ray's own traffic without TLS): token ids and probabilities cross the network in
the clear. Between processes on one machine it runs over an abstract Unix socket instead of TCP (`Endpoint`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import pickle
import secrets
import socket
import struct
from dataclasses import dataclass

logger = logging.getLogger(__name__)

FRAME_LENGTH = struct.Struct("!Q")
CHALLENGE_BYTES = 32

REPLY, ONE_WAY, ERRORS_ONLY = "reply", "one-way", "errors-only"  # a request's reply modes; an int: a connection id


class ChannelClosed(ConnectionError):
    """The worker at the other end is gone (or refused us): the connection closed before a reply came.
    `endpoint` names it (None where unknown)."""

    def __init__(self, message: str, endpoint: "Endpoint | None" = None) -> None:
        super().__init__(message)
        self.endpoint = endpoint


class RelayFailed(ConnectionError):
    """A worker could not pass a chained call on to the next worker (it is unreachable from here)."""


@dataclass(frozen=True)
class Endpoint:
    """Where a worker's channel listens and the secret its clients prove they know. A client on the same machine
    (`boot_id`) connects to the abstract Unix socket `unix_name` first, and to host:port when that fails (another
    network namespace, say); bench/RESULTS.md: a Unix socket's round trip costs less than TCP's on localhost."""

    host: str
    port: int
    secret: bytes
    unix_name: str | None = None
    boot_id: str | None = None

    def local_name(self) -> str | None:
        """The Unix socket to try first, when this process runs on the endpoint's machine."""
        if self.unix_name and self.boot_id and self.boot_id == BOOT_ID:
            return self.unix_name
        return None

    def __repr__(self) -> str:  # never print the secret
        return f"Endpoint({self.host}:{self.port})"

    def wire(self) -> tuple:
        return (self.host, self.port, self.secret, self.unix_name, self.boot_id)


# Where a chained call's last step replies: (the last worker's Endpoint.wire(), the caller's connection id there).
# Plain tuples, like the round's calls (workers.DraftCall.wire): the first worker unpickles it with cold caches.
Route = tuple[tuple, int]


def digest(secret: bytes, challenge: bytes) -> bytes:
    return hmac.new(secret, challenge, hashlib.sha256).digest()


def frame_of(obj) -> list[bytes]:
    """A frame as [header, body]: sent as two buffers, never concatenated (a sampled round's probabilities make
    frames of megabytes)."""
    data = pickle.dumps(obj, protocol=5)
    return [FRAME_LENGTH.pack(len(data)), data]


def reply_frame(ok: bool, value) -> list[bytes]:
    try:
        return frame_of((ok, value))
    except Exception:  # an exception that does not pickle still reaches the caller, as text
        return frame_of((False, RuntimeError(f"{type(value).__name__}: {value}")))


def send_frame(sock: socket.socket, frame: list[bytes]) -> None:
    header, body = frame
    sent = sock.sendmsg(frame)
    if sent < len(header):
        sock.sendall(header[sent:])
        sent = len(header)
    if sent < len(header) + len(body):
        with memoryview(body) as view:
            sock.sendall(view[sent - len(header):])


def read_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ChannelClosed("connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


SOCKET_BUFFER_BYTES = 4 << 20  # a sampled round's reply (probabilities) fits, so no sender waits on its reader


def tune_socket(sock: socket.socket) -> None:
    """Per-connection settings: no Nagle delay (TCP), and buffers that hold a whole frame (the kernel caps them at
    net.core.wmem_max / rmem_max)."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        except OSError:
            pass


def _boot_id() -> str | None:
    """This machine's boot id (Linux): processes that share it share a kernel, so a Unix socket may reach them."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


BOOT_ID = _boot_id()


def unix_server() -> tuple[socket.socket | None, str | None]:
    """A listening Unix socket in Linux's abstract namespace (no file to leave behind; any process in this network
    namespace may connect, and the handshake's secret decides), and its name; (None, None) elsewhere."""
    if BOOT_ID is None or not hasattr(socket, "AF_UNIX"):
        return None, None
    name = f"\0specserve-channel-{secrets.token_hex(8)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(name)
        sock.listen(64)
    except OSError as exc:
        sock.close()
        logger.warning("channel: no Unix socket (%s); local clients use TCP", exc)
        return None, None
    return sock, name


def connect_local(endpoint: Endpoint, timeout_s: float | None) -> socket.socket | None:
    """A connected Unix socket to `endpoint` when it is on this machine and reachable so, else None."""
    name = endpoint.local_name()
    if name is None:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(name)
    except OSError:  # another network namespace on the same kernel: TCP it is
        sock.close()
        return None
    return sock
