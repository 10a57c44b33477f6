"""The router's side of the worker channel (deployments/transport/wire.py has the wire format,
deployments/transport/channel.py the workers' side): one asyncio connection per call in flight, reused across calls, and
chained calls (draft worker
-> target worker -> router) on two connections at once."""

from __future__ import annotations

import asyncio
import pickle

from deployments.transport.wire import (
    CHALLENGE_BYTES,
    ERRORS_ONLY,
    FRAME_LENGTH,
    REPLY,
    ChannelClosed,
    Endpoint,
    connect_local,
    digest,
    frame_of,
    tune_socket,
)


class _Connection(asyncio.Protocol):
    """The router's end of one connection: frames in, at most one call awaiting a reply at a time.

    `expect(future)` makes the next frame (or the connection's loss) the future's result, as (this connection,
    (ok, value)) or (this connection, None); a chained call hands one future to two connections and learns which
    answered first.
    """

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.conn_id: int | None = None  # the server's id for this connection, once the handshake passed
        self.lost = False
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._answered = False  # the handshake's challenge is answered
        self._waiter: asyncio.Future | None = None

    @classmethod
    async def open(cls, endpoint: Endpoint) -> "_Connection":
        loop = asyncio.get_running_loop()
        local = connect_local(endpoint, 0.0)  # non-blocking: a full backlog fails at once, and TCP is tried
        if local is not None:
            transport, conn = await loop.create_unix_connection(lambda: cls(endpoint), sock=local)
        else:
            transport, conn = await loop.create_connection(lambda: cls(endpoint), endpoint.host, endpoint.port)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            tune_socket(sock)
        try:
            await conn._ready
        except BaseException:
            transport.close()
            raise
        return conn

    def connection_made(self, transport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        if self.conn_id is None:  # the handshake: a challenge, our answer, then the connection's id
            if not self._answered and len(buffer) >= CHALLENGE_BYTES:
                self._transport.write(digest(self.endpoint.secret, bytes(buffer[:CHALLENGE_BYTES])))
                del buffer[:CHALLENGE_BYTES]
                self._answered = True
            if self._answered and len(buffer) >= FRAME_LENGTH.size:
                (self.conn_id,) = FRAME_LENGTH.unpack_from(buffer)
                del buffer[:FRAME_LENGTH.size]
                self._ready.set_result(None)
            return
        while len(buffer) >= FRAME_LENGTH.size:
            (length,) = FRAME_LENGTH.unpack_from(buffer)
            end = FRAME_LENGTH.size + length
            if len(buffer) < end:
                return
            with memoryview(buffer) as view:
                frame = pickle.loads(view[FRAME_LENGTH.size:end])
            del buffer[:end]
            waiter, self._waiter = self._waiter, None
            if waiter is None or waiter.done():  # nobody asked: a protocol error; this connection is done
                self.close()
                return
            waiter.set_result((self, frame))

    def connection_lost(self, exc) -> None:
        self.lost = True
        if not self._ready.done():
            self._ready.set_exception(ChannelClosed(f"{self.endpoint}: closed during the handshake (refused?)",
                                                   self.endpoint))
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result((self, None))

    def expect(self, waiter: asyncio.Future | None) -> None:
        if self.lost and waiter is not None:
            waiter.set_result((self, None))
        else:
            self._waiter = waiter

    def send(self, method: str, args: tuple, reply: str | int) -> None:
        self._transport.writelines(frame_of((method, args, reply)))

    def close(self) -> None:
        self._waiter = None
        if self._transport is not None:
            self._transport.close()


class AsyncChannels:
    """The router's connections to workers' channels: a few per endpoint, reused across calls.

    A call takes an idle connection (or opens one), so concurrent calls to one worker each have their own; a call
    that fails or is cancelled mid-way closes its connections instead of returning them.
    """

    def __init__(self) -> None:
        self._idle: dict[Endpoint, list[_Connection]] = {}

    async def _take(self, endpoint: Endpoint) -> _Connection:
        idle = self._idle.get(endpoint)
        while idle:
            conn = idle.pop()
            if not conn.lost:
                return conn
        try:
            return await _Connection.open(endpoint)
        except OSError as exc:
            self.forget(endpoint)
            raise ChannelClosed(f"{endpoint}: {exc!r}", endpoint) from exc

    def _give_back(self, *conns: _Connection) -> None:
        for conn in conns:
            self._idle.setdefault(conn.endpoint, []).append(conn)

    async def call(self, endpoint: Endpoint, method: str, *args):
        """`method(*args)` at the worker; its exception is raised here, and a lost worker is ChannelClosed."""
        conn = await self._take(endpoint)
        waiter = asyncio.get_running_loop().create_future()
        conn.expect(waiter)
        try:
            conn.send(method, args, REPLY)
            _, frame = await waiter
        except BaseException:  # cancelled mid-call: the reply may still come, so this connection is done
            conn.close()
            raise
        if frame is None:
            self.forget(endpoint)  # its other idle connections lead to the same dead worker
            raise ChannelClosed(f"{endpoint}: connection closed", endpoint)
        self._give_back(conn)
        ok, value = frame
        if not ok:
            raise value
        return value

    async def chain(self, first: Endpoint, last: Endpoint, method: str, *args):
        """A chained call: `method(*args, route)` at `first`, whose handler passes its work on to `last` with
        `ChannelRelay.send(route, ...)`. Returns the last step's result.

        The worker at `first` answers only if its handler raised. A worker's exception is raised here; a lost
        connection to either worker is ChannelClosed naming it. After a failure both connections are closed, since a
        late frame might still come on either.
        """
        to_last = await self._take(last)
        try:
            to_first = await self._take(first)
        except BaseException:
            self._give_back(to_last)
            raise
        # one future: the last worker's reply, or the first one's failure, whichever comes
        answer = asyncio.get_running_loop().create_future()
        to_first.expect(answer)
        to_last.expect(answer)
        try:
            to_first.send(method, (*args, (last.wire(), to_last.conn_id)), ERRORS_ONLY)
            conn, frame = await answer
        except BaseException:
            to_first.close()
            to_last.close()
            raise
        if conn is to_last and frame is not None and frame[0]:
            to_first.expect(None)  # a frame there now would be a protocol error
            self._give_back(to_first, to_last)
            return frame[1]
        to_first.close()
        to_last.close()
        if frame is None:
            self.forget(conn.endpoint)
            raise ChannelClosed(f"{conn.endpoint}: connection closed", conn.endpoint)
        raise frame[1]

    def forget(self, endpoint: Endpoint) -> None:
        for conn in self._idle.pop(endpoint, []):
            conn.close()

    def close(self) -> None:
        for endpoint in list(self._idle):
            self.forget(endpoint)
