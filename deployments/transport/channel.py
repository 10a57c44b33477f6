"""A direct, authenticated request/reply channel to a model worker: the round's hot path.

Ray places, owns, health-checks and kills the model workers; the per-round calls (draft, verify, release) travel
here instead of as Ray actor calls. Measured on this project's 2-core VM (bench/RESULTS.md): while a worker's torch
threads hold both cores, a Ray actor call costs several times what a blocking socket read by a worker thread
does, beyond the worker's compute; a speculative round is one chained call through both workers (below).

The wire (frames, the handshake, endpoints, socket set-up) is deployments/transport/wire.py: a request is (method,
args, reply), and `reply` says where the reply goes: REPLY, ONE_WAY, ERRORS_ONLY, or a connection id of this server
(that connection's client gets it: a chained call, below).

Chained calls (`transport.client.AsyncChannels.chain`, the router's side): the router asks the draft worker to draft
and hand its drafts straight to the target worker, which verifies and answers on the router's own connection to it.
A round then wakes three processes in turn instead of four (router -> draft -> target -> router, against router ->
draft -> router -> target -> router), and the router's Python between the two calls is gone: bench/RESULTS.md has
the figures.

The server side is the worker's one model thread (`ChannelServer`): it serves every connection, and runs the
worker's other model work (from Ray methods) in turn, so calls from several routers and from Ray methods never
interleave inside a model.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import pickle
import queue
import secrets
import selectors
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future

from deployments.transport.wire import (
    BOOT_ID,
    CHALLENGE_BYTES,
    ERRORS_ONLY,
    FRAME_LENGTH,
    ONE_WAY,
    ChannelClosed,
    Endpoint,
    RelayFailed,
    Route,
    connect_local,
    digest,
    frame_of,
    read_exact,
    reply_frame,
    send_frame,
    tune_socket,
    unix_server,
)

logger = logging.getLogger(__name__)


class ChannelServer:
    """Serves `handlers` (method name -> callable) to authenticated clients, and is the worker's model thread.

    One thread, "model", waits on all client connections at once and runs each request where it lands; `call(fn,
    ...)` from any other thread (Ray methods: set-up, releases, cost measurement) queues `fn` to run there too. So
    everything that touches the model runs on one thread, in turn: no lock, and one team of OpenMP compute threads
    per process (a thread that hands requests to another costs two more wake-ups per call; threads that each run
    torch's CPU kernels start parallel regions of their own, measured slower here: bench/RESULTS.md).

    Binds all interfaces on a free port, and an abstract Unix socket for clients on the same machine; `endpoint`
    advertises both, with `advertise_host` (the worker's node address). A handshake runs on an accept thread, the
    same on either socket; a client stalling mid-frame for `FRAME_TIMEOUT_S` loses its connection.
    """

    FRAME_TIMEOUT_S = 30.0

    def __init__(self, handlers: dict[str, Callable], advertise_host: str, bind_host: str = "0.0.0.0") -> None:
        self.handlers = dict(handlers)
        self.secret = secrets.token_bytes(32)
        self._sock = socket.create_server((bind_host, 0), backlog=64)
        self._unix, unix_name = unix_server()
        self.endpoint = Endpoint(advertise_host, self._sock.getsockname()[1], self.secret, unix_name,
                                 BOOT_ID if unix_name else None)
        self.refused = 0  # connections that failed the handshake
        self._closed = False
        self._ids = itertools.count(1)
        self._conns: dict[int, socket.socket] = {}  # authenticated connections by id (the model thread's)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # (fn, args, future or None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._loop, name="model", daemon=True)
        self._thread.start()
        for listening in (self._sock, self._unix):
            if listening is not None:
                threading.Thread(target=self._accept, args=(listening,), name="channel-accept", daemon=True).start()

    def call(self, fn: Callable, *args):
        """Run `fn(*args)` on the model thread and return its result (at once when already there)."""
        if threading.get_ident() == self._thread.ident:
            return fn(*args)
        if self._closed:
            raise ChannelClosed("the worker's model thread has stopped")
        future: Future = Future()
        self._submit(fn, args, future)
        return future.result()

    def later(self, fn: Callable, *args) -> None:
        """Queue `fn(*args)` to run on the model thread once it is free (after the reply it is sending now)."""
        if not self._closed:
            self._submit(fn, args, None)

    def close(self) -> None:
        self._closed = True
        self._submit(lambda: None, (), None)  # wakes the loop, which then ends
        for listening in (self._sock, self._unix):
            if listening is None:
                continue
            try:
                listening.shutdown(socket.SHUT_RDWR)  # wakes the accept thread; new connections are refused
            except OSError:
                pass
            listening.close()
        try:
            self._wake_w.close()
        except OSError:
            pass

    def _submit(self, fn: Callable, args: tuple, future: Future | None) -> None:
        self._jobs.put((fn, args, future))
        try:
            self._wake_w.send(b"x")
        except OSError:  # closed
            pass

    def _accept(self, listening: socket.socket) -> None:
        while not self._closed:
            try:
                conn, _ = listening.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._handshake, args=(conn,), name="channel-handshake", daemon=True).start()

    def _handshake(self, conn: socket.socket) -> None:
        try:
            tune_socket(conn)
            challenge = secrets.token_bytes(CHALLENGE_BYTES)
            conn.sendall(challenge)
            conn.settimeout(10.0)  # a peer that never answers the challenge does not hold a thread for long
            answer = read_exact(conn, hashlib.sha256().digest_size)
        except (ChannelClosed, OSError):
            conn.close()
            return
        if not hmac.compare_digest(answer, digest(self.secret, challenge)):
            self.refused += 1
            logger.warning("channel: a connection failed the handshake and was closed")
            conn.close()
            return
        conn_id = next(self._ids)
        try:
            conn.sendall(FRAME_LENGTH.pack(conn_id))
        except OSError:
            conn.close()
            return
        conn.settimeout(self.FRAME_TIMEOUT_S)  # bounds a frame's read once it has started arriving
        self._submit(self._register, (conn_id, conn), None)

    def _register(self, conn_id: int, conn: socket.socket) -> None:
        self._conns[conn_id] = conn
        self._selector.register(conn, selectors.EVENT_READ, conn_id)

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
            (length,) = FRAME_LENGTH.unpack(read_exact(conn, FRAME_LENGTH.size))
            method, args, reply = pickle.loads(read_exact(conn, length))
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
        if isinstance(reply, int):  # a chained call's last step: the reply goes to the caller's own connection
            conn = self._conns.get(reply)
            if conn is None:  # that caller went away meanwhile
                logger.info("channel: the connection chained call %s answers on is gone", method)
                return
        elif reply == ONE_WAY or (reply == ERRORS_ONLY and result[0]):
            if not result[0]:
                logger.error("channel: one-way call %s failed: %r", method, result[1])
            return
        try:
            send_frame(conn, reply_frame(*result))
        except OSError:
            self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        try:
            key = self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        else:
            self._conns.pop(key.data, None)
        conn.close()


class ChannelSender:
    """A blocking client that sends one-way calls in order over one connection (tensor-parallel rank 0 -> its
    peers: the only sender, so every peer sees rank 0's order)."""

    def __init__(self, endpoint: Endpoint, timeout_s: float = 30.0) -> None:
        self.endpoint = endpoint
        self._sock = connect_local(endpoint, timeout_s) or socket.create_connection((endpoint.host, endpoint.port),
                                                                                     timeout=timeout_s)
        tune_socket(self._sock)
        challenge = read_exact(self._sock, CHALLENGE_BYTES)
        self._sock.sendall(digest(endpoint.secret, challenge))
        read_exact(self._sock, FRAME_LENGTH.size)  # the connection's id: the handshake passed
        self._sock.settimeout(None)

    def send(self, method: str, *args, reply: str | int = ONE_WAY) -> None:
        """Send a call whose reply, if any, goes elsewhere (`reply`: ONE_WAY, or a connection id at the receiver)."""
        try:
            send_frame(self._sock, frame_of((method, args, reply)))
        except OSError as exc:
            raise ChannelClosed(f"{self.endpoint}: {exc}", self.endpoint) from exc

    def close(self) -> None:
        self._sock.close()


class ChannelRelay:
    """A worker's senders to other workers, for the chained calls it passes on (one connection per endpoint, made
    on first use; used from the model thread only). Any failure to send is RelayFailed, and that connection is
    dropped (the next call reconnects)."""

    KEPT = 64  # endpoints remembered; replaced replicas' old endpoints age out
    CONNECT_TIMEOUT_S = 2.0  # a connection within a cluster takes milliseconds; a firewall that drops it stalls
    # the model thread this long, once: the router then stops chaining through this pair of workers

    def __init__(self) -> None:
        self._senders: OrderedDict[tuple, ChannelSender] = OrderedDict()  # by Endpoint.wire(), most recent last

    def send(self, route: Route, method: str, *args) -> None:
        endpoint, conn_id = route
        sender = self._senders.get(endpoint)
        try:
            if sender is None:
                sender = self._senders[endpoint] = ChannelSender(Endpoint(*endpoint), timeout_s=self.CONNECT_TIMEOUT_S)
            sender.send(method, *args, reply=conn_id)
        except (OSError, ChannelClosed) as exc:
            self._senders.pop(endpoint, None)
            if sender is not None:
                sender.close()
            raise RelayFailed(f"could not pass {method} on to {Endpoint(*endpoint)}: {exc!r}") from exc
        # kept in the table while the call is on its way (the answer can reach the caller before this line runs)
        self._senders.move_to_end(endpoint)
        while len(self._senders) > self.KEPT:
            self._senders.pop(next(iter(self._senders))).close()

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()
