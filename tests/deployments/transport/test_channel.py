"""The direct worker channel (deployments/transport/channel.py, wire.py): replies, errors, authentication, concurrency,
dead peers."""

import asyncio
import dataclasses
import multiprocessing
import os
import socket
import threading
import time

import numpy as np
import pytest

from deployments.transport.channel import ChannelRelay, ChannelSender, ChannelServer
from deployments.transport.client import AsyncChannels
from deployments.transport.wire import ChannelClosed, Endpoint, RelayFailed


class Boom(ValueError):
    pass


def _server(**extra):
    def fail():
        raise Boom("bad input")

    handlers = {"echo": lambda *a: a, "probs": lambda n: {"probs": np.arange(n, dtype=np.float32)}, "fail": fail}
    return ChannelServer({**handlers, **extra}, "127.0.0.1", bind_host="127.0.0.1")


def test_replies_and_the_methods_own_errors_come_back():
    server = _server()
    channels = AsyncChannels()

    async def run():
        assert await channels.call(server.endpoint, "echo", 1, [2, 3], "x") == (1, [2, 3], "x")
        out = await channels.call(server.endpoint, "probs", 5)
        np.testing.assert_array_equal(out["probs"], np.arange(5, dtype=np.float32))
        with pytest.raises(Boom, match="bad input"):  # the worker's exception, with its type
            await channels.call(server.endpoint, "fail")
        with pytest.raises(AttributeError, match="no method"):
            await channels.call(server.endpoint, "nope")
        assert await channels.call(server.endpoint, "echo", 4) == (4,)  # the connection survived the errors
        return len(channels._idle[server.endpoint])

    assert asyncio.run(run()) == 1, "sequential calls reuse one connection"
    server.close()


def test_a_client_on_the_workers_machine_connects_by_unix_socket_and_any_other_by_tcp():
    server = _server()
    channels = AsyncChannels()
    remote = dataclasses.replace(server.endpoint, boot_id="another machine")
    astray = dataclasses.replace(server.endpoint, unix_name="\0specserve-channel-nobody-listens")

    async def run():
        families = {}
        for name, endpoint in (("local", server.endpoint), ("remote", remote), ("astray", astray)):
            assert await channels.call(endpoint, "echo", name) == (name,)
            families[name] = channels._idle[endpoint][0]._transport.get_extra_info("socket").family
        return families

    assert server.endpoint.unix_name is not None, "Linux: the worker listens on a Unix socket too"
    assert asyncio.run(run()) == {"local": socket.AF_UNIX, "remote": socket.AF_INET, "astray": socket.AF_INET}
    sender = ChannelSender(server.endpoint)  # a worker's sender (tensor-parallel peers, the relay) alike
    assert sender._sock.family == socket.AF_UNIX
    sender.close()
    server.close()


def test_frames_of_megabytes_cross_whole_both_ways_and_through_a_chain():
    big = np.random.default_rng(0).random(3 << 18, dtype=np.float32)  # 3 MB: more than a socket buffer may hold
    last = _server(plus_one=lambda y: y + 1)
    first = _first(ChannelRelay())
    channels = AsyncChannels()

    async def run():
        (echoed,) = await channels.call(last.endpoint, "echo", big)
        chained = await channels.chain(first.endpoint, last.endpoint, "double", big)
        return echoed, chained

    echoed, chained = asyncio.run(run())
    np.testing.assert_array_equal(echoed, big)
    np.testing.assert_array_equal(chained, 2 * big + 1)
    first.close()
    last.close()


def test_a_client_without_the_secret_is_refused_before_anything_runs():
    calls = []
    server = _server(record=lambda: calls.append(1))
    impostors = [dataclasses.replace(server.endpoint, secret=b"x" * 32),  # by Unix socket
                 Endpoint(server.endpoint.host, server.endpoint.port, b"x" * 32)]  # by TCP

    async def run(impostor):
        with pytest.raises(ChannelClosed):
            await AsyncChannels().call(impostor, "record")

    for impostor in impostors:
        asyncio.run(run(impostor))
    assert calls == [] and server.refused == 2
    server.close()


def test_calls_from_connections_and_other_threads_all_run_on_the_model_thread_in_turn():
    inside, overlaps, threads = [0], [0], set()

    def work(i):
        threads.add(threading.get_ident())
        inside[0] += 1
        overlaps[0] = max(overlaps[0], inside[0])
        time.sleep(0.05)
        inside[0] -= 1
        return i

    server = _server(work=work)
    channels = AsyncChannels()

    async def over_the_channel():
        return await asyncio.gather(*(channels.call(server.endpoint, "work", i) for i in range(3)))

    from_ray_method = threading.Thread(target=lambda: server.call(work, 99))  # as a Ray method would
    from_ray_method.start()
    assert asyncio.run(over_the_channel()) == [0, 1, 2]
    from_ray_method.join(10)
    assert len(channels._idle[server.endpoint]) == 3, "concurrent calls each had a connection"
    assert overlaps[0] == 1, "one at a time"
    assert threads == {server._thread.ident}, "all on the model thread"
    assert server.call(lambda: threading.get_ident()) == server._thread.ident
    server.close()
    with pytest.raises(ChannelClosed):  # not a wait for a thread that has stopped
        server.call(lambda: None)


def test_a_call_cancelled_mid_way_never_hands_its_late_reply_to_the_next_call():
    release = threading.Event()
    server = _server(slow=lambda: (release.wait(10), "late")[1])
    channels = AsyncChannels()

    async def run():
        task = asyncio.ensure_future(channels.call(server.endpoint, "slow"))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        return await channels.call(server.endpoint, "echo", "fresh")

    assert asyncio.run(run()) == ("fresh",)
    server.close()


def test_one_way_sends_arrive_in_order():
    seen, done = [], threading.Event()

    def record(i):
        seen.append(i)
        if i == 199:
            done.set()

    server = _server(record=record)
    sender = ChannelSender(server.endpoint)
    for i in range(200):
        sender.send("record", i)
    assert done.wait(60)
    assert seen == list(range(200))
    sender.close()
    server.close()


def _serve_in_process(queue, ready_to_die, inside):
    """A worker process whose `hang` sets `inside` and never answers; it exits once `ready_to_die` is set."""
    server = ChannelServer({"hang": lambda *a: (inside.set(), time.sleep(3600), "never")[2], "echo": lambda x: x},
                           "127.0.0.1", bind_host="127.0.0.1")
    queue.put(server.endpoint)
    ready_to_die.wait(60)
    os._exit(1)


def test_a_worker_dying_mid_call_ends_the_call_at_once():
    ctx = multiprocessing.get_context("spawn")
    queue, die, inside = ctx.Queue(), ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_serve_in_process, args=(queue, die, inside), daemon=True)
    proc.start()
    endpoint = queue.get(timeout=60)
    channels = AsyncChannels()

    async def run():
        assert await channels.call(endpoint, "echo", 7) == 7
        task = asyncio.ensure_future(channels.call(endpoint, "hang"))
        assert await asyncio.get_running_loop().run_in_executor(None, inside.wait, 60), "the call never arrived"
        die.set()  # the process exits while the call is inside it (`hang` never answers: only its end ends the call)
        with pytest.raises(ChannelClosed):
            await asyncio.wait_for(task, 60)

    asyncio.run(run())
    proc.join(10)
    assert endpoint not in channels._idle, "connections to a dead worker are dropped"


def _first(relay: ChannelRelay, unreachable: Endpoint | None = None):
    """A chain's first worker: `double` passes 2x on to the route's `plus_one`; the others fail one way or another
    (`astray` passes its call to `unreachable` instead of the route's worker)."""
    def double(x, route):
        relay.send(route, "plus_one", 2 * x)

    def fail_here(x, route):
        raise Boom("failed before passing on")

    def pass_on(method):
        return lambda x, route: relay.send(route, method)

    def astray(x, route):
        relay.send((unreachable.wire(), route[1]), "plus_one", x)

    return ChannelServer({"double": double, "fail_here": fail_here, "fail_there": pass_on("fail"),
                          "hang_there": pass_on("hang"), "astray": astray},
                         "127.0.0.1", bind_host="127.0.0.1")


def test_a_chained_call_is_answered_by_its_last_worker_on_the_callers_own_connection():
    last = _server(plus_one=lambda y: y + 1)
    relay = ChannelRelay()
    first = _first(relay)
    channels = AsyncChannels()

    async def run():
        results = [await channels.chain(first.endpoint, last.endpoint, "double", x) for x in range(4)]
        both = await asyncio.gather(channels.chain(first.endpoint, last.endpoint, "double", 10),
                                    channels.call(last.endpoint, "plus_one", 100))
        return results, both, {e: len(c) for e, c in channels._idle.items()}

    results, both, idle = asyncio.run(run())
    assert results == [1, 3, 5, 7] and both == [21, 101]
    assert idle == {first.endpoint: 1, last.endpoint: 2}, "sequential chains reuse one connection to each worker"
    assert len(relay._senders) == 1, "the first worker reuses its connection to the last"
    for server in (first, last):
        server.close()


def test_a_chained_calls_errors_come_back_from_whichever_worker_raised():
    last = _server(plus_one=lambda y: y + 1)
    gone = _server()
    gone.close()
    first = _first(ChannelRelay(), unreachable=gone.endpoint)
    channels = AsyncChannels()

    async def run():
        with pytest.raises(Boom, match="failed before passing on"):
            await channels.chain(first.endpoint, last.endpoint, "fail_here", 1)
        with pytest.raises(Boom, match="bad input"):
            await channels.chain(first.endpoint, last.endpoint, "fail_there", 1)
        with pytest.raises(RelayFailed):  # the last worker is unreachable from the first: the first says so
            await channels.chain(first.endpoint, last.endpoint, "astray", 1)
        result = await channels.chain(first.endpoint, last.endpoint, "double", 2)
        return result, {e: len(c) for e, c in channels._idle.items()}

    result, idle = asyncio.run(run())
    assert result == 5, "the workers serve on after the failures"
    assert idle == {first.endpoint: 1, last.endpoint: 1}, "after the failures, fresh connections, reused again"
    first.close()
    last.close()


def test_a_worker_dying_mid_chain_ends_the_call_naming_it():
    ctx = multiprocessing.get_context("spawn")
    in_process = _server(plus_one=lambda y: y + 1)
    relay = ChannelRelay()
    first = _first(relay)
    channels = AsyncChannels()
    for role in ("first", "last"):
        queue, die, inside = ctx.Queue(), ctx.Event(), ctx.Event()
        proc = ctx.Process(target=_serve_in_process, args=(queue, die, inside), daemon=True)
        proc.start()
        dying = queue.get(timeout=60)
        # the dying process is the chain's first worker (it hangs in its handler), or its last (the first passes a
        # call on to its `hang`)
        head, tail, method = (dying, in_process.endpoint, "hang") if role == "first" else \
            (first.endpoint, dying, "hang_there")

        async def run():
            task = asyncio.ensure_future(channels.chain(head, tail, method, 1))
            assert await asyncio.get_running_loop().run_in_executor(None, inside.wait, 60), "the chain never arrived"
            die.set()  # while the chain's call is inside the dying process
            with pytest.raises(ChannelClosed) as info:
                await asyncio.wait_for(task, 60)
            return info.value.endpoint

        assert asyncio.run(run()) == dying, role
        proc.join(10)
        assert dying not in channels._idle
    first.close()
    in_process.close()
