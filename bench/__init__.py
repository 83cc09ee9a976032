"""Machinery of ``python -m bench``: scratch databases, worker processes, sections.

It lives beside the ``durable`` package, not in it: it is a development tool run
from a checkout, and it drives benchmark-only packages (procrastinate, dbos:
``pip install -e '.[bench]'``). Nothing here is imported by durable itself.

Modules:

- ``scratch``: create and drop the throw-away databases.
- ``starters``: one "start" per system (durable, raw psycopg, procrastinate, DBOS).
- ``worker``: the code a spawned benchmark process runs.
- ``pool``: the parent's handle on those processes.
- ``sections``: sections (a), (b), (c).
- ``queueing``: sections (d) slot hand-off latency and (e) ``GROUP_ROUND_ROBIN`` admission.
- ``celery_worker``: the real Celery worker subprocess of (d).
- ``handoff``: the workflow that worker runs (it imports the module).
- ``report``: the table and the targets block.
- ``runner``: puts them together for ``__main__`` (``python -m bench``).
"""
