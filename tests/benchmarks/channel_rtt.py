"""Round-trip latency of one small data-plane message between two processes: the runtime's channel
(gloo) against a plain TCP socket, side by side.

Every token of a single-stream decode crosses S + 1 such hops (coordinator -> stage 0 -> ... ->
coordinator), so their latency is on the critical path (`launch --json`'s `handoffs`,
pipeline/measure/handoffs.py). Per repeat, three settings, each in a fresh pair of processes:
- `channel`: workers/channel.py `Channel.send` / `recv` of a FORWARD message carrying one hidden
  row ([1, hidden] bfloat16, inlined in the 16 KB frame), as a stage sends it;
- `send-queue`: the same, sent through `SendQueue` in its send-thread mode (a background thread
  per destination sends and waits; what CPU stages did before posted sends);
- `posted`: the same through `SendQueue` as the stages and the coordinator send on CPU: posted to
  gloo by the caller, which waits for old sends only to make room ([Note: posted sends] in
  workers/send_queue.py);
- `socket`: the same 16 KB frame over a TCP_NODELAY socket on 127.0.0.1, no framing code.

    python tests/benchmarks/channel_rtt.py [--round-trips 400] [--repeats 3] [--hidden 576] [--gap-ms 0]
        [--out tests/benchmarks/results/channel_rtt.json]

--gap-ms pauses before each timed round trip, as a decode step does between two hops: the code
of a hop then runs with cold caches, as in a real run (on the 2-vCPU VM this project measures on,
a 16 KB encode takes ~45 us back to back and ~300 us after 10 ms of anything else).
Ratios of medians; a quiet machine gives the meaningful numbers.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

from launcher.backends.ports import free_port
from pipeline.engine.wire import DEFAULT_FRAME_BYTES, Message, MessageKind
from pipeline.speculation.items import Item, ItemKind
from workers.channel import Channel, DataPlaneGroup
from workers.send_queue import SendQueue

SETTINGS = ("channel", "send-queue", "posted", "socket")
WARM_UP = 50
ITEM = Item(seq_id=0, slot=0, start=200, num_tokens=1, kind=ItemKind.DECODE)  # one decode step's item


def _channel_side(rank: int, port: int, setting: str, n: int, hidden: int, gap_s: float, out) -> None:
    torch.set_num_threads(1)
    group = DataPlaneGroup(master_addr="127.0.0.1", master_port=port, rank=rank, world_size=2, timeout_s=60)
    channel = Channel(group, timeout_s=60)
    sends = SendQueue(channel, posted=setting == "posted")
    send = channel.send if setting == "channel" else sends.send
    x = torch.randn(1, hidden, dtype=torch.bfloat16)
    times = []
    for _ in range(n + WARM_UP):
        if rank == 0:
            time.sleep(gap_s)
            start = time.perf_counter()
            send(Message(MessageKind.FORWARD, [ITEM], {"x": x}), 1)
            channel.recv(1)
            times.append(time.perf_counter() - start)
        else:
            got = channel.recv(0)
            send(Message(MessageKind.FORWARD, got.items, {"x": got.tensors["x"]}), 0)
    sends.flush()
    group.close()
    if rank == 0:
        out.send(times[WARM_UP:])


def _recv_exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("peer closed")
        got += k
    return buf


def _socket_echo(port: int, n: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(n + WARM_UP):
            sock.sendall(_recv_exactly(sock, DEFAULT_FRAME_BYTES))


def _socket_times(ctx, n: int, gap_s: float) -> list[float]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        peer = ctx.Process(target=_socket_echo, args=(listener.getsockname()[1], n))
        peer.start()
        conn, _ = listener.accept()
    frame, times = bytes(DEFAULT_FRAME_BYTES), []
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(n + WARM_UP):
            time.sleep(gap_s)
            start = time.perf_counter()
            conn.sendall(frame)
            _recv_exactly(conn, DEFAULT_FRAME_BYTES)
            times.append(time.perf_counter() - start)
    peer.join()
    return times[WARM_UP:]


def round_trips(setting: str, n: int, hidden: int, gap_s: float = 0.0) -> list[float]:
    """`n` timed round trips (s) of `setting` (one of SETTINGS), after WARM_UP untimed ones, each
    after a pause of `gap_s` seconds."""
    ctx = mp.get_context("spawn")
    if setting == "socket":
        return _socket_times(ctx, n, gap_s)
    mine, theirs = ctx.Pipe()
    port = free_port("127.0.0.1")
    sides = [ctx.Process(target=_channel_side, args=(r, port, setting, n, hidden, gap_s, theirs))
             for r in range(2)]
    for p in sides:
        p.start()
    times = mine.recv()
    for p in sides:
        p.join()
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--round-trips", type=int, default=400)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hidden", type=int, default=576, help="hidden size of the row sent (default 576: SmolLM2-135M)")
    p.add_argument("--gap-ms", type=float, default=0.0, help="pause before each timed round trip (default 0)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "channel_rtt.json"))
    args = p.parse_args(argv)
    if args.round_trips < 1 or args.repeats < 1 or args.hidden < 1 or args.gap_ms < 0:
        print("error: --round-trips, --repeats and --hidden must be >= 1, --gap-ms >= 0", file=sys.stderr)
        return 2
    repeats = []
    for i in range(args.repeats):
        med = {s: statistics.median(round_trips(s, args.round_trips, args.hidden, args.gap_ms / 1e3)) * 1e6 for s in SETTINGS}
        repeats.append({f"{s}_us": round(v, 1) for s, v in med.items()})
        print(f"repeat {i + 1}: " + ", ".join(f"{s} {v:.0f} us" for s, v in med.items()), flush=True)
    medians = {s: statistics.median(r[f"{s}_us"] for r in repeats) for s in SETTINGS}
    print("median round trip: " + ", ".join(f"{s} {v:.0f} us" for s, v in medians.items())
          + f"; channel / socket {medians['channel'] / medians['socket']:.1f}x")
    report = {"benchmark": "channel_rtt",
              "command": " ".join(["python", "tests/benchmarks/channel_rtt.py", *(sys.argv[1:] if argv is None else argv)]),
              "round_trips": args.round_trips, "hidden": args.hidden, "gap_ms": args.gap_ms, "frame_bytes": DEFAULT_FRAME_BYTES,
              "threads_per_process": 1, "cpu_count": mp.cpu_count(), "repeats": repeats, "median_us": medians}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
