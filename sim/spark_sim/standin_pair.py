"""The engine stand-in as the two ranks of a node pair (Phase 4-alt: TP=2 over two nodes).

torch.distributed's rendezvous as the runbook meets it, over the pair's link:
- the worker (rank 1, `--headless`) says vLLM's headless milestone, then connects to
  --master-addr:--master-port, retrying until the store's timeout; past it, torch's client
  error ("The client socket has timed out ... while trying to connect to (ADDR, PORT)"), exit 1;
- the head (rank 0) holds the store on --master-port (every address, as torch's server does) and
  waits for the worker; past the timeout, torch's server error ("Timed out after N seconds waiting
  for clients. 1/2 clients joined."), exit 1. A port already taken: torch's EADDRINUSE, exit 1.
- once joined, the connection stands for NCCL between the ranks: when one rank goes away the
  other reports the NCCL watchdog's collective timeout and exits (the worker down is the pair down).

The store's timeout is torch's 600 s on a GB10; here the GPU state's `rendezvous_timeout_s`
(default 20 s), so a failed pair deploy in the simulator ends in seconds. Stdlib only: copied into
the image beside vllm_standin.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from standin_startup import VERSION, api, die, engine, engine_traceback, plain

RENDEZVOUS_TIMEOUT_S = 20.0
NCCL = "2.30.4"  # the runbook's image: "NCCL 2.30.4"
WORLD = 2


def timeout_of(gpu_data: dict) -> float:
    return float(gpu_data.get("rendezvous_timeout_s") or RENDEZVOUS_TIMEOUT_S)


def is_pair(args: argparse.Namespace) -> bool:
    return args.nnodes > 1


def _hello(args: argparse.Namespace, rank: int) -> bytes:
    return (json.dumps({"rank": rank, "world": args.nnodes, "tp": args.tensor_parallel_size,
                        "model": args.model}) + "\n").encode()


def _process_group(args: argparse.Namespace, rank: int) -> None:
    engine(f"world_size={WORLD} rank={rank} local_rank=0 distributed_init_method=tcp://{args.master_addr}:"
           f"{args.master_port} backend=nccl", "parallel_state.py:1165")
    plain(f"NCCL INFO NCCL version {NCCL}+cuda13.0")


def _nccl_gone(rank: int, peer: int) -> None:
    """What the surviving rank prints when the other one went away mid-collective, then exits."""
    plain(f"[rank{rank}]:[E ProcessGroupNCCL.cpp:632] [Rank {rank}] Watchdog caught collective operation timeout: "
          f"WorkNCCL(SeqNum=21, OpType=ALLREDUCE, NumelIn=12288, NumelOut=12288, Timeout(ms)=600000) ran for "
          f"600042 milliseconds before timing out.")
    plain(f"[rank{rank}]:[E ProcessGroupNCCL.cpp:1810] [PG ID 0 PG GUID 0(default_pg) Rank {rank}] rank {peer} is "
          "gone: to avoid data inconsistency, we are taking the entire process down.")
    die(1)


class Link:
    """The joined rendezvous: one TCP connection standing for the ranks' NCCL communicator."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rank: int) -> None:
        self.reader, self.writer, self.rank = reader, writer, rank
        self.server: asyncio.AbstractServer | None = None  # the head's store, held while it lives

    async def watch(self) -> None:
        """Return never: when the other rank goes away, report it and exit."""
        try:
            while await self.reader.read(4096):
                pass
        except (ConnectionError, OSError):
            pass
        _nccl_gone(self.rank, 1 - self.rank)


async def head_rendezvous(args: argparse.Namespace, timeout_s: float) -> Link:
    """Rank 0: hold the store on the master port until the worker joined (or exit as torch does)."""
    joined: asyncio.Future[Link] = asyncio.get_running_loop().create_future()

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = json.loads(await asyncio.wait_for(reader.readline(), 5))
        except (ValueError, asyncio.TimeoutError, ConnectionError, AttributeError):
            writer.close()  # not a rank (a port probe, say)
            return
        if joined.done() or hello.get("rank") != 1:
            writer.close()
            return
        writer.write(_hello(args, 0))
        await writer.drain()
        joined.set_result(Link(reader, writer, 0))

    try:
        server = await asyncio.start_server(client, "0.0.0.0", args.master_port)
    except OSError:
        engine_traceback(
            [("/usr/local/lib/python3.12/dist-packages/vllm/distributed/utils.py", 504,
              "stateless_init_torch_distributed_process_group", "store = TCPStore(")],
            f"torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
            f"address. port: {args.master_port}, useIpv6: false, code: -98, name: EADDRINUSE, message: address "
            "already in use")
        die(1)
    engine(f"Waiting for {WORLD - 1} more rank(s) of the process group at port {args.master_port} "
           f"(--master-addr {args.master_addr})", "parallel_state.py:1150")
    started = time.monotonic()
    try:
        link = await asyncio.wait_for(joined, timeout_s)
    except asyncio.TimeoutError:
        server.close()
        engine_traceback(
            [("/usr/local/lib/python3.12/dist-packages/vllm/distributed/parallel_state.py", 1171,
              "init_distributed_environment", "torch.distributed.init_process_group("),
             ("/usr/local/lib/python3.12/dist-packages/torch/distributed/rendezvous.py", 189,
              "_create_c10d_store", "return TCPStore(")],
            f"torch.distributed.DistStoreError: Timed out after {int(time.monotonic() - started) + 1} seconds "
            f"waiting for clients. 1/{WORLD} clients joined.")
        die(1)
    # torch's store keeps listening for the process's life (later ranks are turned away here).
    link.server = server
    _process_group(args, 0)
    return link


async def worker(args: argparse.Namespace, timeout_s: float, boot) -> None:
    """Rank 1 (--headless): the milestone, the rendezvous, its shard's start-up (`boot`), then
    stand by the head until it goes away or the container is stopped."""
    head = f"{args.master_addr}:{args.master_port}"
    api(f"Launching vLLM (v{VERSION}) headless multiproc executor, with head node address {head} for "
        "torch.distributed process group.", "serve.py:221")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(args.master_addr, args.master_port), 2)
            writer.write(_hello(args, 1))
            await writer.drain()
            if json.loads(await asyncio.wait_for(reader.readline(), 5)).get("rank") == 0:
                break
            writer.close()
        except (OSError, ValueError, asyncio.TimeoutError):
            pass
        if time.monotonic() >= deadline:
            plain(f"[W socket.cpp:755] [c10d] The client socket has failed to connect to [{args.master_addr}]:"
                  f"{args.master_port} (errno: 110 - Connection timed out).")
            plain(f"torch.distributed.DistNetworkError: The client socket has timed out after "
                  f"{int(timeout_s * 1000)}ms while trying to connect to ({args.master_addr}, {args.master_port}).")
            die(1)
        await asyncio.sleep(0.5)
    _process_group(args, 1)
    link = Link(reader, writer, 1)
    watching = asyncio.ensure_future(link.watch())
    await boot()
    engine("Worker rank 1 ready: serving the head's requests over NCCL", "multiproc_executor.py:540")
    await watching
