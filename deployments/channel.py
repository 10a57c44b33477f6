"""A direct, authenticated request/reply channel to a model worker: the round's hot path.

Ray places, owns, health-checks and kills the model workers; the per-round calls (draft, verify, release) travel
here instead of as Ray actor calls. Measured on this project's 2-core VM (bench/RESULTS.md): while a worker's torch
threads hold both cores, a Ray actor call costs ~2.5 ms beyond the worker's compute, and a blocking socket read
by a worker thread ~0.35 ms; a speculative round makes two such calls.

Wire format: after the handshake, frames of an 8-byte big-endian length and a pickle (protocol 5). A request is
(method, args, wants_reply); a reply is (ok, value), value being the result or the exception the method raised.
Handshake: the server sends a 32-byte random challenge and the client answers HMAC-SHA256(secret, challenge); a
wrong answer closes the connection before any pickle is read. Each worker makes its own secret, which reaches the
router only through Ray (the lease). The channel is authenticated, not encrypted (like Ray's own traffic without
TLS): token ids and probabilities cross the network in the clear.

The server side is the worker's one model thread (`ChannelServer`): it serves every connection, and runs the
worker's other model work (from Ray methods) in turn, so calls from several routers and from Ray methods never
interleave inside a model.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import pickle
import queue
import secrets
import selectors
import socket
import struct
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct("!Q")
_CHALLENGE_BYTES = 32


class ChannelClosed(ConnectionError):
    """The worker at the other end is gone (or refused us): the connection closed before a reply came."""


@dataclass(frozen=True)
class Endpoint:
    """Where a worker's channel listens and the secret its clients prove they know."""

    host: str
    port: int
    secret: bytes

    def __repr__(self) -> str:  # never print the secret
        return f"Endpoint({self.host}:{self.port})"


def _digest(secret: bytes, challenge: bytes) -> bytes:
    return hmac.new(secret, challenge, hashlib.sha256).digest()


def _frame(obj) -> bytes:
    data = pickle.dumps(obj, protocol=5)
    return _LENGTH.pack(len(data)) + data


def _reply_frame(ok: bool, value) -> bytes:
    try:
        return _frame((ok, value))
    except Exception:  # an exception that does not pickle still reaches the caller, as text
        return _frame((False, RuntimeError(f"{type(value).__name__}: {value}")))


def _read_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ChannelClosed("connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _no_delay(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class ChannelServer:
    """Serves `handlers` (method name -> callable) to authenticated clients, and is the worker's model thread.

    One thread, "model", waits on all client connections at once and runs each request where it lands; `call(fn,
    ...)` from any other thread (Ray methods: set-up, releases, cost measurement) queues `fn` to run there too. So
    everything that touches the model runs on one thread, in turn: no lock, and one team of OpenMP compute threads
    per process (a thread that hands requests to another costs two more wake-ups per call; threads that each run
    torch's CPU kernels start parallel regions of their own, measured slower here: bench/RESULTS.md).

    Binds all interfaces on a free port; `endpoint` advertises `advertise_host` (the worker's node address). A
    handshake runs on an accept thread; a client stalling mid-frame for `FRAME_TIMEOUT_S` loses its connection.
    """

    FRAME_TIMEOUT_S = 30.0

    def __init__(self, handlers: dict[str, Callable], advertise_host: str, bind_host: str = "0.0.0.0") -> None:
        self.handlers = dict(handlers)
        self.secret = secrets.token_bytes(32)
        self._sock = socket.create_server((bind_host, 0), backlog=64)
        self.endpoint = Endpoint(advertise_host, self._sock.getsockname()[1], self.secret)
        self.refused = 0  # connections that failed the handshake
        self._closed = False
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # (fn, args, future or None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._loop, name="model", daemon=True)
        self._thread.start()
        threading.Thread(target=self._accept, name="channel-accept", daemon=True).start()

    def call(self, fn: Callable, *args):
        """Run `fn(*args)` on the model thread and return its result (at once when already there)."""
        if threading.get_ident() == self._thread.ident:
            return fn(*args)
        if self._closed:
            raise ChannelClosed("the worker's model thread has stopped")
        future: Future = Future()
        self._submit(fn, args, future)
        return future.result()

    def close(self) -> None:
        self._closed = True
        self._submit(lambda: None, (), None)  # wakes the loop, which then ends
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept thread; new connections are refused
        except OSError:
            pass
        for sock in (self._sock, self._wake_w):
            try:
                sock.close()
            except OSError:
                pass

    def _submit(self, fn: Callable, args: tuple, future: Future | None) -> None:
        self._jobs.put((fn, args, future))
        try:
            self._wake_w.send(b"x")
        except OSError:  # closed
            pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._handshake, args=(conn,), name="channel-handshake", daemon=True).start()

    def _handshake(self, conn: socket.socket) -> None:
        try:
            _no_delay(conn)
            challenge = secrets.token_bytes(_CHALLENGE_BYTES)
            conn.sendall(challenge)
            conn.settimeout(10.0)  # a peer that never answers the challenge does not hold a thread for long
            answer = _read_exact(conn, hashlib.sha256().digest_size)
        except (ChannelClosed, OSError):
            conn.close()
            return
        if not hmac.compare_digest(answer, _digest(self.secret, challenge)):
            self.refused += 1
            logger.warning("channel: a connection failed the handshake and was closed")
            conn.close()
            return
        conn.settimeout(self.FRAME_TIMEOUT_S)  # bounds a frame's read once it has started arriving
        self._submit(self._selector.register, (conn, selectors.EVENT_READ), None)

    def _loop(self) -> None:
        while not self._closed:
            for key, _ in self._selector.select():
                if key.fileobj is self._wake_r:
                    self._run_jobs()
                else:
                    self._serve_frame(key.fileobj)

    def _run_jobs(self) -> None:
        try:
            self._wake_r.recv(4096)
        except OSError:
            pass
        while True:
            try:
                fn, args, future = self._jobs.get_nowait()
            except queue.Empty:
                return
            try:
                result = fn(*args)
            except BaseException as exc:
                if future is None:
                    logger.exception("channel: a queued job failed")
                else:
                    future.set_exception(exc)
            else:
                if future is not None:
                    future.set_result(result)

    def _serve_frame(self, conn: socket.socket) -> None:
        try:
            (length,) = _LENGTH.unpack(_read_exact(conn, _LENGTH.size))
            method, args, wants_reply = pickle.loads(_read_exact(conn, length))
        except (ChannelClosed, OSError, pickle.UnpicklingError, ValueError, EOFError):
            self._drop(conn)  # the client went away (or stalled mid-frame)
            return
        try:
            handler = self.handlers[method]
        except KeyError:
            result = (False, AttributeError(f"the channel has no method {method!r}"))
        else:
            try:
                result = (True, handler(*args))
            except Exception as exc:
                result = (False, exc)
        if wants_reply:
            try:
                conn.sendall(_reply_frame(*result))
            except OSError:
                self._drop(conn)
        elif not result[0]:
            logger.error("channel: one-way call %s failed: %r", method, result[1])

    def _drop(self, conn: socket.socket) -> None:
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()


class ChannelSender:
    """A blocking client that sends one-way calls in order over one connection (tensor-parallel rank 0 -> its
    peers: the only sender, so every peer sees rank 0's order)."""

    def __init__(self, endpoint: Endpoint, timeout_s: float = 30.0) -> None:
        self.endpoint = endpoint
        self._sock = socket.create_connection((endpoint.host, endpoint.port), timeout=timeout_s)
        _no_delay(self._sock)
        challenge = _read_exact(self._sock, _CHALLENGE_BYTES)
        self._sock.sendall(_digest(endpoint.secret, challenge))
        self._sock.settimeout(None)

    def send(self, method: str, *args) -> None:
        try:
            self._sock.sendall(_frame((method, args, False)))
        except OSError as exc:
            raise ChannelClosed(f"{self.endpoint}: {exc}") from exc

    def close(self) -> None:
        self._sock.close()


class _AsyncConnection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, endpoint: Endpoint) -> "_AsyncConnection":
        reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            _no_delay(sock)
        challenge = await reader.readexactly(_CHALLENGE_BYTES)
        writer.write(_digest(endpoint.secret, challenge))
        return cls(reader, writer)

    async def request(self, method: str, args: tuple):
        self.writer.write(_frame((method, args, True)))
        (length,) = _LENGTH.unpack(await self.reader.readexactly(_LENGTH.size))
        return pickle.loads(await self.reader.readexactly(length))

    def close(self) -> None:
        self.writer.close()


class AsyncChannels:
    """The router's connections to workers' channels: a few per endpoint, reused across calls.

    A call takes an idle connection (or opens one), so concurrent calls to one worker each have their own; a call
    that fails or is cancelled mid-way closes its connection instead of returning it.
    """

    def __init__(self) -> None:
        self._idle: dict[Endpoint, list[_AsyncConnection]] = {}

    async def call(self, endpoint: Endpoint, method: str, *args):
        idle = self._idle.get(endpoint)
        conn = idle.pop() if idle else None
        try:
            if conn is None:
                conn = await _AsyncConnection.open(endpoint)
            ok, value = await conn.request(method, args)
        except (OSError, EOFError, asyncio.IncompleteReadError) as exc:
            if conn is not None:
                conn.close()
            self.forget(endpoint)  # its other idle connections lead to the same dead worker
            raise ChannelClosed(f"{endpoint}: {exc!r}") from exc
        except BaseException:  # cancelled mid-call: the reply may still come, so this connection is done
            if conn is not None:
                conn.close()
            raise
        self._idle.setdefault(endpoint, []).append(conn)
        if not ok:
            raise value
        return value

    def forget(self, endpoint: Endpoint) -> None:
        for conn in self._idle.pop(endpoint, []):
            conn.close()

    def close(self) -> None:
        for endpoint in list(self._idle):
            self.forget(endpoint)
