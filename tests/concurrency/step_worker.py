"""One OS process of the step-quota race (``python -m tests.concurrency.step_worker``).

Executes pending ``test.step_race`` runs, picked at random among the oldest, until
the ``stop`` file appears: as a worker would, with its own connection. A step
that finds the key full parks its run; the release that frees a slot makes the
waiter pending again, and some process here executes it. Nothing is sent
anywhere: pending runs are found in the database. Nothing here measures: the
step bodies count themselves (``tests.workflows.gauged``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from tests.concurrency import race_worker


def execute(args: argparse.Namespace, workdir: Path) -> dict[str, int]:
    from durable import Engine, RunStatus
    from durable.models import WorkflowRun

    engine = Engine(dispatch=lambda engine, run: None)
    rng = random.Random(args.seed)
    stop = workdir / "stop"
    executed = 0
    while not stop.exists():
        pending = WorkflowRun.objects.filter(workflow="test.step_race", status=RunStatus.PENDING)
        candidates = list(pending.order_by("id").values_list("run_id", flat=True)[:16])
        if not candidates:
            time.sleep(0.002)
            continue
        engine.execute(rng.choice(candidates))  # a no-op when another process claimed it first
        executed += 1
    return {"executed": executed}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    workdir = Path(args.dir)
    race_worker._setup(args.db)
    import tests.workflows  # noqa: F401  (registers test.step_race)

    (workdir / f"ready-{args.name}").touch()
    race_worker._wait_for(workdir / "go")
    result = execute(args, workdir)
    (workdir / f"result-{args.name}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
