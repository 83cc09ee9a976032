"""Machinery of ``python -m bench``: scratch databases, worker processes, sections.

It lives beside the ``durable`` package, not in it: it is a development tool run
from a checkout, and it drives benchmark-only packages (procrastinate, dbos:
``pip install -e '.[bench]'``). Nothing here is imported by durable itself.

Modules:

- ``scratch``: create and drop the throw-away databases.
- ``starters``: one "start" per system (durable's dispatch and its no-op shortcut, raw psycopg,
  procrastinate, DBOS).
- ``worker``: the code a spawned benchmark process runs.
- ``pool``: the parent's handle on those processes.
- ``sections``: sections (a), (b), (c).
- ``queueing``: sections (d) slot hand-off latency and (e) ``GROUP_ROUND_ROBIN`` admission.
- ``dispatching``: section (f) dispatch to first step, against a bare Celery task.
- ``throughput``: section (g) one-step runs per second by one Celery worker, against procrastinate's worker.
- ``celery_worker``: the real Celery worker subprocess of (d), (f) and (g).
- ``handoff``: the workflow (d)'s worker runs (it imports the module).
- ``firststep``: the ``DurableWorkflow`` dispatched in (a) and (f), and (f)'s bare task.
- ``noop``: the one-step workflow of (g); ``procrastinate_app``: procrastinate's app and no-op job of (g).
- ``broker``: the parent's view of the Redis broker (reach it, a queue's length, purge).
- ``report``: the table and the targets block.
- ``runner``: puts them together for ``__main__`` (``python -m bench``).
"""
