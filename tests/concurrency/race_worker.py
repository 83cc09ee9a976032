"""One OS process of the race tests (run as ``python -m tests.concurrency.race_worker``).

``start``: starts runs of the given keys, each inside a transaction that also
bumps the key's gauge row; ``complete``: finishes in-flight runs, each inside a
transaction that also lowers the gauge. Because every change to the set of runs
in flight commits together with the same change to the gauge, the gauge's
``hwm`` is the exact high-water mark of runs in flight, observed in the database.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path


def _setup(db_name: str) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    import django
    from django.conf import settings

    django.setup()
    settings.DATABASES["default"]["NAME"] = db_name


def _wait_for(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {path}")
        time.sleep(0.005)


def start(args: argparse.Namespace, workdir: Path) -> dict[str, int]:
    from django.db import connection, transaction

    from durable import Concurrency, ConcurrencyLimitError, Engine

    engine = Engine(dispatch=lambda engine, run_id: None)
    keys = args.keys.split(",")
    admitted = refused = 0
    rng = random.Random(args.seed)
    for _ in range(args.n):
        key = rng.choice(keys)
        try:
            with transaction.atomic():
                engine.start("test.add", {"a": 1, "b": 2}, concurrency=Concurrency(key=key, limit=args.limit))
                with connection.cursor() as cursor:
                    cursor.execute(
                        "UPDATE race_gauge SET cur = cur + 1, hwm = GREATEST(hwm, cur + 1) WHERE key = %s",
                        [key],
                    )
        except ConcurrencyLimitError:
            refused += 1
        else:
            admitted += 1
    return {"admitted": admitted, "refused": refused}


def complete(args: argparse.Namespace, workdir: Path) -> dict[str, int]:
    from django.db import connection, transaction

    from durable import DEFAULT_CONCURRENCY_STATUSES
    from durable.models import RunTag

    tags = [f"concurrency:{k}" for k in args.keys.split(",")]
    completed = 0
    stop = workdir / "stop"
    rng = random.Random(args.seed)
    while not stop.exists():
        tag = rng.choice(tags)
        candidates = list(
            RunTag.objects.filter(tag=tag, status__in=DEFAULT_CONCURRENCY_STATUSES).values_list("run__run_id", flat=True)[:8]
        )
        if not candidates:
            time.sleep(0.001)
            continue
        run_id = rng.choice(candidates)
        with transaction.atomic():
            from durable import engine

            if engine.store.transition(run_id, from_statuses=DEFAULT_CONCURRENCY_STATUSES, to="completed"):
                with connection.cursor() as cursor:
                    cursor.execute("UPDATE race_gauge SET cur = cur - 1 WHERE key = %s", [tag.split(":", 1)[1]])
                completed += 1
        time.sleep(args.pace)  # pacing, so that starters fill the key between completions
    return {"completed": completed}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["start", "complete"])
    parser.add_argument("--db", required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--keys", required=True)
    parser.add_argument("--n", type=int, default=50)
    parser.add_argument("--limit", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pace", type=float, default=0.01, help="seconds between two completions")
    args = parser.parse_args()
    workdir = Path(args.dir)
    _setup(args.db)
    import tests.workflows  # noqa: F401  (registers test.add)

    (workdir / f"ready-{args.name}").touch()
    _wait_for(workdir / "go")
    result = (start if args.role == "start" else complete)(args, workdir)
    (workdir / f"result-{args.name}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
