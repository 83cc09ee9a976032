"""One OS process of the burst race tests (``python -m tests.concurrency.burst_worker``).

``start``: ``--n`` starts of ``test.noop``, each on a tenant key drawn at random from
``--keys`` with ``Concurrency(limit=--limit, burst=Burst(pool=--pool, up_to=--up-to))``;
every ``--direct-every``-th start instead takes the tenant key without a burst plus
the pool as a quota of its own (it locks the pool before the tenant key, the other
order); with ``--atomic`` each start runs inside ``transaction.atomic()`` (where a start
that finds its pool busy may give up: ``PoolBusyError``, counted as ``pool_busy``).
``complete``: executes pending runs of those keys until the ``stop`` file appears
(or ``--releases`` of them), so that borrowed runs finish and free their pool slots.

Nothing here measures: the test's trigger on ``durable_runtag`` does. Each process
writes what it did to ``result-<name>.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from tests.concurrency import race_worker


def _engine() -> Any:
    from durable import Engine

    return Engine(dispatch=lambda engine, run: None)  # completers find pending runs in the database


#: How many times a direct start is tried before it counts as refused.
DIRECT_TRIES = 40


def _start_once(engine: Any, args: argparse.Namespace, i: int, quotas: list[Any], kind: str, *, atomic: bool) -> str:
    """One start: ``created:<kind>:own|borrowed`` or ``refused:<kind>:<source>``."""
    from django.db import transaction

    from durable import ConcurrencyLimitError
    from durable.exceptions import PoolBusyError

    try:
        if atomic:
            with transaction.atomic():
                handle = engine.start("test.noop", {"by": args.name, "i": i}, concurrency=quotas)
        else:
            handle = engine.start("test.noop", {"by": args.name, "i": i}, concurrency=quotas)
    except ConcurrencyLimitError as exc:
        return f"refused:{kind}:{exc.source}"
    except PoolBusyError:  # inside a transaction, the pool stayed busy through every attempt
        return f"refused:{kind}:pool_busy"
    borrowed = any(tag.startswith("borrowed:") for tag in handle.record.tags)
    return f"created:{kind}:{'borrowed' if borrowed else 'own'}"


def start(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from durable import Burst, Concurrency

    engine = _engine()
    keys = args.keys.split(",")
    rng = random.Random(args.seed)
    created: collections.Counter[str] = collections.Counter()
    refused: collections.Counter[str] = collections.Counter()
    for i in range(args.n):
        key = rng.choice(keys)
        if args.direct_every and (i + 1) % args.direct_every == 0:
            quotas = [Concurrency(key=key, limit=args.limit), Concurrency(key=args.pool, limit=args.pool_limit)]
            kind = "direct"
        else:
            quotas = [Concurrency(key=key, limit=args.limit, burst=Burst(pool=args.pool, up_to=args.up_to))]
            kind = "burst"
        # A direct start (the pool taken in key order, as a quota of its own) is tried a few
        # times while the completers free slots: the race must admit some, whatever the timing.
        tries = DIRECT_TRIES if kind == "direct" else 1
        for attempt in range(tries):
            outcome = _start_once(engine, args, i, quotas, kind, atomic=args.atomic)
            if outcome.startswith("created:") or attempt == tries - 1:
                break
            time.sleep(0.005)
        counter, _, label = outcome.partition(":")
        (created if counter == "created" else refused)[label] += 1
    return {"starts": args.n, "created": dict(created), "refused": dict(refused)}


def complete(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from durable import RunStatus
    from durable.models import RunTag

    engine = _engine()
    tags = [f"concurrency:{k}" for k in args.keys.split(",")]
    rng = random.Random(args.seed)
    stop = workdir / "stop"
    executed = 0
    while executed < args.releases and not stop.exists():
        pending = RunTag.objects.filter(tag__in=tags, status=RunStatus.PENDING)
        candidates = list(pending.values_list("run__run_id", flat=True)[:32])
        if not candidates:
            time.sleep(0.001)
            continue
        engine.execute(rng.choice(candidates))  # a no-op when another completer claimed it first
        executed += 1
    return {"executed": executed}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["start", "complete"])
    parser.add_argument("--db", required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--keys", required=True)
    parser.add_argument("--pool", required=True)
    parser.add_argument("--pool-limit", type=int, required=True)
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--up-to", type=int, default=8)
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--direct-every", type=int, default=0)
    parser.add_argument("--atomic", action="store_true")
    parser.add_argument("--releases", type=int, default=1000)
    args = parser.parse_args()
    workdir = Path(args.dir)
    race_worker._setup(args.db)
    from django.conf import settings

    settings.DURABLE = {**getattr(settings, "DURABLE", {}), "POOLS": {args.pool: args.pool_limit}}
    import tests.workflows  # noqa: F401  (registers test.noop)

    (workdir / f"ready-{args.name}").touch()
    race_worker._wait_for(workdir / "go")
    result = (start if args.role == "start" else complete)(args, workdir)
    (workdir / f"result-{args.name}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
