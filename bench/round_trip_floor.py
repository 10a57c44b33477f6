"""The floor of a speculative round's orchestration on this machine, without Ray or the app: three processes on
localhost sockets, with 2-thread torch compute standing in for the draft and target passes.

- star (what the Router does): router -> draft -> router -> target -> router, four wake-ups per round;
- chain: router -> target ("expect a verify"), router -> draft -> target -> router, three on the critical path.

Overhead per round = round wall time - the two computes (each timed where it runs). Compare with the app's
`orchestration_ms_per_round` (GET /stats; bench.serve_bench). Prints medians and means, writes JSON.
`--transport unix` uses Unix domain sockets instead of TCP on localhost (processes on one node could).

    python -m bench.round_trip_floor --rounds 40 --repeats 3 [--transport unix]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pickle
import selectors
import socket
import struct
import tempfile
import time
from pathlib import Path

import torch

_LENGTH = struct.Struct("!Q")


def _connect(address: int | str) -> socket.socket:
    """A TCP port on localhost, or a Unix socket's path."""
    if isinstance(address, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(address)
        return sock
    sock = socket.create_connection(("127.0.0.1", address))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _listen(transport: str) -> tuple[socket.socket, int | str]:
    if transport == "unix":
        path = tempfile.mktemp(prefix="specserve-floor-", suffix=".sock")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen()
        return server, path
    server = socket.create_server(("127.0.0.1", 0))
    return server, server.getsockname()[1]


def _send(sock: socket.socket, obj) -> None:
    data = pickle.dumps(obj, protocol=5)
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _recv(sock: socket.socket):
    def exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf

    (n,) = _LENGTH.unpack(exact(_LENGTH.size))
    return pickle.loads(exact(n))


def _compute(ms: float, w, x) -> float:  # w: [1024, 1024], x: [1024, 4]
    """About `ms` of 2-thread matrix products; returns the seconds spent."""
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1000 < ms:
        x = torch.mm(w, x)
    return time.perf_counter() - start


def _node(role: str, transport: str, ports: mp.Queue, target_port: mp.Queue | None) -> None:
    torch.set_num_threads(2)
    w, x = torch.randn(1024, 1024) / 32, torch.randn(1024, 4)
    server, address = _listen(transport)
    ports.put(address)
    to_target = _connect(target_port.get()) if role == "draft" else None
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ)
    pending = None  # target, chain mode: (router connection, verify ms) until the draft's tokens come
    while True:
        for key, _ in selector.select():
            if key.fileobj is server:
                conn, _ = server.accept()
                if transport == "tcp":
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                selector.register(conn, selectors.EVENT_READ)
                continue
            conn = key.fileobj
            try:
                kind, *rest = _recv(conn)
            except EOFError:
                selector.unregister(conn)
                continue
            if kind == "stop":
                return
            if kind == "propose":  # draft, star: answer the router
                _send(conn, (_compute(rest[0], w, x), [1, 2, 3]))
            elif kind == "propose_to_target":  # draft, chain: hand the tokens to the target
                _send(to_target, ("tokens", _compute(rest[0], w, x), [1, 2, 3]))
            elif kind == "verify":  # target, star
                _send(conn, (_compute(rest[0], w, x), 0.0))
            elif kind == "expect":  # target, chain: the router's half of the verify
                pending = (conn, rest[0])
            elif kind == "tokens":  # target, chain: the draft's half; answer the router
                router, ms = pending
                pending = None
                _send(router, (_compute(ms, w, x), rest[0]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--draft-ms", type=float, default=35.0)
    ap.add_argument("--verify-ms", type=float, default=30.0)
    ap.add_argument("--transport", choices=["tcp", "unix"], default="tcp")
    ap.add_argument("--out", default=None, help="default: bench/results/round_trip_floor[_unix].json")
    args = ap.parse_args()
    mp.set_start_method("spawn")
    draft_port, target_port, target_port_for_draft = mp.Queue(), mp.Queue(), mp.Queue()
    mp.Process(target=_node, args=("target", args.transport, target_port, None), daemon=True).start()
    port = target_port.get()
    target_port_for_draft.put(port)
    mp.Process(target=_node, args=("draft", args.transport, draft_port, target_port_for_draft), daemon=True).start()
    draft, target = _connect(draft_port.get()), _connect(port)

    def star() -> float:
        start = time.perf_counter()
        _send(draft, ("propose", args.draft_ms))
        draft_s, _ = _recv(draft)
        _send(target, ("verify", args.verify_ms))
        verify_s, _ = _recv(target)
        return time.perf_counter() - start - draft_s - verify_s

    def chain() -> float:
        start = time.perf_counter()
        _send(target, ("expect", args.verify_ms))
        _send(draft, ("propose_to_target", args.draft_ms))
        verify_s, draft_s = _recv(target)
        return time.perf_counter() - start - draft_s - verify_s

    star(), chain()  # warm-up
    results: dict[str, list[dict]] = {"star": [], "chain": []}
    for _ in range(args.repeats):
        for name, round_ in (("star", star), ("chain", chain)):
            ms = sorted(1000 * round_() for _ in range(args.rounds))
            cell = {"median_ms": ms[len(ms) // 2], "mean_ms": sum(ms) / len(ms)}
            results[name].append(cell)
            print(f"{name:5s} overhead per round: median {cell['median_ms']:.3f} ms, mean {cell['mean_ms']:.3f} ms",
                  flush=True)
    for sock in (draft, target):
        _send(sock, ("stop",))
    out = {"rounds": args.rounds, "draft_ms": args.draft_ms, "verify_ms": args.verify_ms,
           "transport": args.transport, **results}
    path = Path(args.out or f"bench/results/round_trip_floor{'_unix' if args.transport == 'unix' else ''}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
