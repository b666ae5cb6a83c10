"""Redis CPU per admit, script calls sent alone, in one pipeline per event-loop turn, and
merged into one call: ``python tests/bench_script_batcher.py [--cluster] [--concurrency 1 8 32]``.

Admits of one pool go out ``--concurrency`` at a time (``asyncio.gather``, as a frontend's
handlers make them) through :class:`Scripts` without its batcher, with it but each admit a
call of its own (``merge=False``), and with it as the roles run it (the turn's admits merged
into calls of up to 16; ``limiter/script_batcher.py``), on a private redis-server or, with ``--cluster``, on a
local 3-master Redis Cluster through the roles' cluster client. Per admit it reports the
main-thread CPU of the server that holds the pool (``INFO cpu``: the script and its
request's I/O) and the client's wall time. Blocks of 128 admits are measured; between
them a claim (not measured) empties the queue, so that the wait estimate never sheds one.
The three ways alternate ``--rounds`` times; the best and the median round are printed. Not
collected by pytest (no ``test_`` prefix); docs/benchmarks.md quotes its output.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from limiter.bench.redis_budget import main_thread_cpu_us
from limiter.config import RedisConfig, demo_config
from limiter.keys import PoolKeys
from limiter.localstack.redis_server import LocalRedisCluster, RedisServer
from limiter.redis_conn import open_redis
from limiter.scripts import Scripts, policy_document
from tests.support.helpers import admit

BLOCK = 128  # admits measured between two claims


def main_thread_cpu_s(node: Any) -> float:
    return main_thread_cpu_us(node.info("cpu")) / 1e6


WAYS = {"alone": {"batch": False}, "pipelined": {"merge": False}, "merged": {}}


async def one_round(client: Any, node_of: Any, way: str, concurrency: int, admits: int,
                    name: str) -> tuple[float, float, float]:
    """(server CPU us per admit, client wall us per admit, admits per round trip)."""
    scripts = Scripts(client, **WAYS[way])
    await scripts.load_all()
    keys = PoolKeys(name)
    cfg = demo_config()
    await scripts.init_pool(keys, policy_document(cfg, cfg.pool("tiny")))
    await client.zadd(keys.frontends, {"fe1": 4102444800000})  # alive: claim takes its requests
    node = node_of(keys.policy)
    b = scripts.batcher
    done, cpu_s, wall_s, calls, trips = 0, 0.0, 0.0, 0, 0
    while done < admits:
        c0, t0 = main_thread_cpu_s(node), time.perf_counter()
        # the admits' own calls and round trips: not the claim below, nor the pool's setup
        k0, r0 = (b.calls + b.merged, b.round_trips) if b else (0, 0)
        for _ in range(BLOCK // concurrency):
            await asyncio.gather(*(admit(scripts, keys, request_id=f"r{done + i}")
                                   for i in range(concurrency)))
            done += concurrency
        cpu_s, wall_s = cpu_s + main_thread_cpu_s(node) - c0, wall_s + time.perf_counter() - t0
        if b:
            calls, trips = calls + b.calls + b.merged - k0, trips + b.round_trips - r0
        await scripts.claim(keys, "w1", 1024)
    per_trip = calls / trips if trips else 1.0
    return cpu_s / done * 1e6, wall_s / done * 1e6, per_trip


async def measure(url: str, cluster: bool, node_of: Any, concurrency: int, admits: int,
                  rounds: int) -> dict[str, list[tuple[float, float, float]]]:
    client = open_redis(RedisConfig(url=url, cluster=cluster), pool_wait_s=5)
    out: dict[str, list[tuple[float, float, float]]] = {way: [] for way in WAYS}
    try:
        for r in range(rounds):
            for way in list(WAYS)[::1 if r % 2 == 0 else -1]:
                out[way].append(await one_round(client, node_of, way, concurrency, admits,
                                                f"bench{concurrency}-{r}-{way}"))
    finally:
        await client.aclose()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", action="store_true", help="a local 3-master Redis Cluster")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32],
                    help="admits made at once (each a divisor of 128)")
    ap.add_argument("--admits", type=int, default=1024, help="admits per round (a multiple of 128)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of each way, alternating")
    args = ap.parse_args()
    for c in args.concurrency:
        if c < 1 or BLOCK % c:
            ap.error(f"--concurrency {c}: must divide {BLOCK}")
    if args.admits < BLOCK or args.admits % BLOCK:
        ap.error(f"--admits {args.admits}: must be a positive multiple of {BLOCK}")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.cluster:
        cluster = LocalRedisCluster().start()
        url, node_of, stop = cluster.url, (lambda key: cluster.owner(key).client()), cluster.stop
    else:
        server = RedisServer().start()
        url, node_of, stop = server.url, (lambda key: server.client()), server.stop
    try:
        print(f"{'a 3-master cluster' if args.cluster else 'one redis-server'}, {args.admits} admits a "
              f"round, {args.rounds} rounds each way; server CPU and client wall time per admit, us")
        for c in args.concurrency:
            res = asyncio.run(measure(url, args.cluster, node_of, c, args.admits, args.rounds))
            for way in WAYS:
                cpu = sorted(x[0] for x in res[way])
                wall = statistics.median(x[1] for x in res[way])
                trip = statistics.median(x[2] for x in res[way])
                print(f"concurrency {c:>2} {way:<9}: server CPU best {cpu[0]:6.1f} median "
                      f"{statistics.median(cpu):6.1f}; client wall median {wall:6.1f}; "
                      f"{trip:4.1f} admits a round trip")
    finally:
        stop()


if __name__ == "__main__":
    main()
