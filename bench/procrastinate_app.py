"""Procrastinate's side of section (g): an app whose worker runs the no-op job.

``procrastinate --app=bench.procrastinate_app.app worker`` runs it in a process of
its own (``bench.throughput``). The connection string comes from the environment
variable ``DURABLE_BENCH_CONNINFO`` (the scratch database); nothing of Django or
durable is imported here.
"""

from __future__ import annotations

import os

import procrastinate

JOB_NAME = "bench_g_noop"

app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=os.environ.get("DURABLE_BENCH_CONNINFO", "")))


@app.task(name=JOB_NAME)
def noop(round: str) -> None:
    return None
