"""One OS process of the strategy race tests (``python -m tests.concurrency.strategy_worker``).

``start``: starts ``test.noop`` runs under per-start quotas of one strategy, on a
key drawn at random from ``--keys`` (plus ``--global-key`` when given, a second key
every start shares). ``complete``: releases ``--releases`` pending runs of those keys
that have queued runs (or fewer, if the ``stop`` file appears first) through the
engine: ``engine.execute``, or ``engine.cancel`` every ``--cancel-every``-th time, so
that each release hands its slot to a queued run as in production. Fewer releases
than starts leave a queue.

Nothing here measures: the test's trigger on ``durable_runtag`` does (see
``test_strategy_race``). Each process writes what it did to ``result-<name>.json``.
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


def _quotas(args: argparse.Namespace, key: str) -> list[Any]:
    from durable import Concurrency, Strategy

    strategy = Strategy(args.strategy)
    quotas = [Concurrency(key=key, limit=args.limit, strategy=strategy, max_queued=args.max_queued)]
    if args.global_key:
        quotas.append(Concurrency(key=args.global_key, limit=args.global_limit, strategy=strategy))
    return quotas


def _engine() -> Any:
    from durable import Engine

    # Nothing is sent anywhere: completers find pending runs in the database.
    return Engine(dispatch=lambda engine, run: None)


def start(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from durable import DurableError

    engine = _engine()
    keys = args.keys.split(",")
    rng = random.Random(args.seed)
    created: collections.Counter[str] = collections.Counter()
    errors: collections.Counter[str] = collections.Counter()
    for i in range(args.n):
        try:
            handle = engine.start("test.noop", {"by": args.name, "i": i}, concurrency=_quotas(args, rng.choice(keys)))
        except DurableError as exc:
            errors[type(exc).__name__] += 1
        else:
            assert handle.created
            created[handle.status] += 1
    return {"starts": args.n, "created": dict(created), "errors": dict(errors)}


def complete(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from durable import RunStatus
    from durable.exceptions import RunTerminalError
    from durable.models import RunTag

    engine = _engine()
    tags = [f"concurrency:{k}" for k in args.keys.split(",")]
    rng = random.Random(args.seed)
    stop = workdir / "stop"
    executed = cancelled = 0
    while executed + cancelled < args.releases and not stop.exists():
        # Release only runs of keys with a queue, so that every release has a slot to hand on.
        queued = set(RunTag.objects.filter(tag__in=tags, status=RunStatus.QUEUED).values_list("tag", flat=True))
        candidates = list(
            RunTag.objects.filter(tag__in=queued, status=RunStatus.PENDING).values_list("run__run_id", flat=True)[:16]
        )
        if not candidates:
            time.sleep(0.001)
            continue
        run_id = rng.choice(candidates)
        if args.cancel_every and (executed + cancelled + 1) % args.cancel_every == 0:
            try:
                engine.cancel(run_id)
            except RunTerminalError:
                continue  # another completer got there first
            cancelled += 1
        else:
            engine.execute(run_id)  # a no-op when another completer claimed it first
            executed += 1
    return {"executed": executed, "cancelled": cancelled}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["start", "complete"])
    parser.add_argument("--db", required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--keys", required=True)
    parser.add_argument("--strategy", default="group_round_robin")
    parser.add_argument("--limit", type=int, default=5)
    parser.add_argument("--max-queued", type=int, default=None)
    parser.add_argument("--global-key", default="")
    parser.add_argument("--global-limit", type=int, default=5)
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--releases", type=int, default=25, help="how many runs a completer releases")
    parser.add_argument("--cancel-every", type=int, default=0, help="cancel instead of execute every k-th time")
    args = parser.parse_args()
    workdir = Path(args.dir)
    race_worker._setup(args.db)
    import tests.workflows  # noqa: F401  (registers test.noop)

    (workdir / f"ready-{args.name}").touch()
    race_worker._wait_for(workdir / "go")
    result = (start if args.role == "start" else complete)(args, workdir)
    (workdir / f"result-{args.name}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
