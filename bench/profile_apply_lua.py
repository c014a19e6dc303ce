"""Where Redis's time per flush goes inside ``apply.lua`` (issue 11).

Runs the subscriber's flush shape on one partition, ``--flushes`` times: a batch lease, ``--messages``
BATCH_RELEASED ops, a start note for every tenth message of the previous flush and the SETTLED ops
of the previous flush's messages (the steady state of callback mode), then the partition's floor (the
commit point, past the settled messages: their ZADDs are left out, as the engine's flushes do). The
ops are sent as the subscriber sends them: grouped into command runs (``_core.command_runs``). Each
of two scripts gets the same flushes on keys of its own:

* ``apply.lua`` itself;
* ``no calls``: the same header check and MessagePack unpacking, without the HSET / HDEL / ZADD calls
  (with the round trip and the transfer of the arguments, the floor of any script that takes the
  runs this way).

It prints the median wall time of an EVALSHA per flush as the client sees it and Redis's own
``usec_per_call`` of each command.

    PYTHONPATH=. .venv/bin/python bench/profile_apply_lua.py [--messages 500] [--flushes 300]
        [--redis-url redis://...]   (default: the bench stack's Redis)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from bench.common import bench_stack
from ordering_layer._core import command_runs
from ordering_layer.state.store import cascades_key, partition_keys

SCRIPT = Path(__file__).resolve().parent.parent / "ordering_layer" / "state" / "lua" / "apply.lua"
_CALL = "    redis.call(run[2], KEYS[run[1]], unpack(args, first, math.min(first + CHUNK - 1, #args)))\n"


def variants() -> dict[str, str]:
    """The script and its cut-down copy (see the module's text)."""
    source = SCRIPT.read_text()
    if _CALL not in source:
        raise SystemExit("apply.lua changed shape: update this script's cut")
    return {"apply.lua": source, "no calls": source.replace(_CALL, "")}


def flushes(messages: int, count: int) -> list[list[str | bytes]]:
    """The arguments after the epoch of ``count`` steady-state flushes of ``messages`` messages each."""
    packed: list[list[str | bytes]] = []
    base = messages  # the first flush settles the offsets of a flush before it
    for _ in range(count):
        ops = [f"b,0,{10**12};"]
        ops += [f"q,{base + i},1;" for i in range(messages)]
        ops += [f"s,{base - messages + i},1;" for i in range(0, messages, 10)]
        ops += [f"a,{base - messages + i},0;" for i in range(messages)]
        ops.append(f"f,0,{base};")
        header, runs = command_runs("".join(ops))
        packed.append([header, *runs])
        base += messages
    return packed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=500)
    parser.add_argument("--flushes", type=int, default=300)
    parser.add_argument("--redis-url", default=None)
    args = parser.parse_args()
    work = flushes(args.messages, args.flushes)
    with bench_stack() as endpoints:
        client = redis.Redis.from_url(args.redis_url or endpoints.redis_url)  # one server: not a cluster
        for name, source in variants().items():
            sha = client.execute_command("SCRIPT", "LOAD", source)
            subscription = f"profile-apply-{time.time_ns()}"
            keys = [*partition_keys(subscription, 0), cascades_key(subscription, 0)]
            client.set(keys[0], 1)
            client.config_resetstat()
            times = []
            for packed in work:
                start = time.perf_counter()
                client.execute_command("EVALSHA", sha, len(keys), *keys, 1, *packed)
                times.append(time.perf_counter() - start)
            stats = client.info("commandstats")
            calls = ", ".join(f"{command[8:]} {value['usec_per_call']:.0f} us x {value['calls'] / len(work):.1f}"
                              for command, value in sorted(stats.items(), key=lambda kv: -kv[1]["usec"])
                              if command not in ("cmdstat_config|resetstat", "cmdstat_info"))
            print(f"{name}: {statistics.median(times) * 1e3:.3f} ms per flush of {args.messages} messages "
                  f"(median of {len(work)}); per flush: {calls}")
            client.delete(*keys)


if __name__ == "__main__":
    main()
