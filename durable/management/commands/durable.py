"""``manage.py durable``: runs, show, cancel, retry, quotas and purge, for operators.

Cancel and retry go through the engine (``Engine.cancel`` / ``Engine.retry``), as
the admin's actions and the HTTP API do; the lists read the same querysets.
Bad input (an unknown run id, status or duration) is a ``CommandError`` and
changes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

import durable
from durable import exceptions, models, quotas, retention
from durable.concurrency import TAG_PREFIX
from durable.management.progress import Progress
from durable.runtime.engine import Engine
from durable.status import ALL_STATUSES, RETRYABLE_STATUSES

#: The columns ``runs`` reads (not the JSON ones, which can be large).
_LISTED = ("run_id", "workflow", "version", "namespace", "status", "attempt", "parent", "created_at", "started_at", "finished_at")
#: Keys read per query by ``quotas``.
_QUOTA_PAGE = 500


class Command(BaseCommand):
    help = "Inspect and operate durable's runs and quotas: runs, show, cancel, retry, quotas, purge."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="subcommand", required=True, title="subcommands", metavar="SUBCOMMAND")

        def subcommand(name: str, help: str) -> CommandParser:
            p = sub.add_parser(
                name, help=help, description=help, called_from_command_line=getattr(parser, "called_from_command_line", None)
            )
            p.add_argument(
                "--namespace",
                help="Work on this namespace only (default: the default engine's, every namespace unless SCOPE_READS is on).",
            )
            return p

        runs = subcommand("runs", "List runs, newest first.")
        runs.add_argument(
            "--status", action="append", default=[], help="Only runs in these statuses (comma separated or repeated)."
        )
        runs.add_argument("--workflow", help="Only runs of this workflow.")
        runs.add_argument("--key", help="Only runs holding or waiting for this concurrency key.")
        runs.add_argument("--tag", help="Only runs carrying this tag.")
        runs.add_argument("--older-than", help=f"Only runs created longer ago than this: {retention.DURATION_HELP}.")
        runs.add_argument("--newer-than", help="Only runs created more recently than this.")
        runs.add_argument("--limit", type=int, default=50, help="Show at most this many runs (default 50; 0: all).")
        runs.add_argument("--json", action="store_true", help="Print JSON instead of a table.")

        show = subcommand("show", "Show one run: its fields, tags and steps.")
        show.add_argument("run_id")
        show.add_argument("--json", action="store_true", help="Print JSON.")

        cancel = subcommand("cancel", "Cancel runs (a finished run is left as it is).")
        cancel.add_argument("run_ids", nargs="+", metavar="RUN")

        retry = subcommand("retry", "Start failed, dead or cancelled runs again, each under its quota.")
        retry.add_argument("run_ids", nargs="+", metavar="RUN")

        quota = subcommand("quotas", "List the concurrency keys with runs in flight or queued.")
        quota.add_argument("--full", action="store_true", help="Only the keys at or over their limit.")
        quota.add_argument("--all", action="store_true", help="Every known key, idle ones too.")
        quota.add_argument("--key", help="Only this key.")
        quota.add_argument("--json", action="store_true", help="Print JSON instead of a table.")

        purge = subcommand("purge", "Delete finished runs (with their steps, tags and signals) in batches.")
        purge.add_argument(
            "--older-than", required=True, help=f"Runs that finished longer ago than this: {retention.DURATION_HELP}."
        )
        purge.add_argument(
            "--status",
            action="append",
            default=[],
            help=f"Only these finished statuses (comma separated or repeated; default {','.join(retention.PURGEABLE_STATUSES)}).",
        )
        purge.add_argument("--batch-size", type=int, default=retention.BATCH_SIZE, help="Runs deleted per transaction.")
        purge.add_argument(
            "--pause-factor",
            type=float,
            default=retention.PAUSE_FACTOR,
            help="After each batch, pause this many times as long as the batch took (0: no pause; "
            f"default {retention.PAUSE_FACTOR:g}, which leaves the database at least half of the time).",
        )
        purge.add_argument("--dry-run", action="store_true", help="Count what would be deleted; delete nothing.")

    def handle(self, *args: Any, **options: Any) -> None:
        engine = durable.engine
        if options.get("namespace") is not None:
            engine = engine.in_namespace(options["namespace"], scope_reads=True)
        getattr(self, "_" + options["subcommand"])(engine, options)

    # -- runs ------------------------------------------------------------------------------
    def _runs(self, engine: Engine, options: dict[str, Any]) -> None:
        statuses = _statuses(options["status"], sorted(ALL_STATUSES))
        limit = options["limit"]
        if limit < 0:
            raise CommandError(f"--limit must be 0 or more, got {limit}.")
        qs = (
            _runs_of(engine)
            .with_statuses(statuses or None)
            .select_related("parent")
            .only(*_LISTED, *(f"parent__{name}" for name in _LISTED))
            .order_by("-created_at", "-id")
        )
        if options["workflow"]:
            qs = qs.filter(workflow=options["workflow"])
        if options["key"]:
            qs = qs.with_tag(TAG_PREFIX + options["key"])
        if options["tag"]:
            qs = qs.with_tag(options["tag"])
        now = timezone.now()
        if options["older_than"]:
            qs = qs.filter(created_at__lt=now - _duration(options["older_than"], "--older-than"))
        if options["newer_than"]:
            qs = qs.filter(created_at__gte=now - _duration(options["newer_than"], "--newer-than"))
        rows = list(qs[: limit + 1] if limit else qs)
        more = bool(limit) and len(rows) > limit
        rows = rows[:limit] if limit else rows
        if options["json"]:
            self._json([_run_summary(run) for run in rows])
            return
        self._table(
            ["RUN", "WORKFLOW", "STATUS", "NAMESPACE", "CREATED", "FINISHED"],
            [
                [r.run_id, f"{r.workflow}@{r.version}", r.status, r.namespace, _when(r.created_at), _when(r.finished_at)]
                for r in rows
            ],
        )
        if more:
            self.stdout.write(f"(the newest {limit} shown; --limit 0 shows all)")
        elif not rows:
            self.stdout.write("No runs match.")

    # -- show ------------------------------------------------------------------------------
    def _show(self, engine: Engine, options: dict[str, Any]) -> None:
        run = _runs_of(engine).select_related("parent").filter(run_id=options["run_id"]).first()
        if run is None:
            raise CommandError(f"No run has the id {options['run_id']!r}.")
        tags = sorted(run.tags.values_list("tag", flat=True))
        steps = list(run.steps.order_by("position"))
        if options["json"]:
            detail = {
                **_run_summary(run),
                "input": run.input,
                "output": run.output,
                "error": run.error,
                "tags": tags,
                "waiting_for": run.waiting_for,
                "wake_at": _iso(run.wake_at),
                "queue": run.queue,
                "worker": run.worker,
                "steps": [
                    {
                        "position": s.position,
                        "name": s.name,
                        "outcome": s.outcome,
                        "attempts": s.attempts,
                        "output": s.output,
                        "error": s.error,
                        "started_at": _iso(s.started_at),
                        "finished_at": _iso(s.finished_at),
                    }
                    for s in steps
                ],
            }
            self._json(detail)
            return
        fields = [
            ("run", run.run_id),
            ("workflow", f"{run.workflow} (version {run.version})"),
            ("status", run.status),
            ("namespace", run.namespace),
            ("attempt", str(run.attempt)),
            ("parent", run.parent.run_id if run.parent else ""),
            ("tags", ", ".join(tags)),
            ("waiting for", run.waiting_for + (f" until {_when(run.wake_at)}" if run.wake_at else "")),
            ("queue", run.queue),
            ("worker", run.worker),
            ("created", _when(run.created_at)),
            ("started", _when(run.started_at)),
            ("finished", _when(run.finished_at)),
            ("input", _compact(run.input)),
            ("output", _compact(run.output) if run.output is not None else ""),
            ("error", _compact(run.error) if run.error is not None else ""),
        ]
        for name, value in fields:
            if value:
                self.stdout.write(f"{name + ':':<13}{value}")
        self.stdout.write("")
        if steps:
            self._table(
                ["#", "STEP", "OUTCOME", "ATTEMPTS", "FINISHED", "RESULT"],
                [
                    [str(s.position), s.name, s.outcome, str(s.attempts), _when(s.finished_at), _compact(s.error or s.output, 60)]
                    for s in steps
                ],
            )
        else:
            self.stdout.write("No steps recorded.")

    # -- cancel and retry ------------------------------------------------------------------
    def _cancel(self, engine: Engine, options: dict[str, Any]) -> None:
        runs = self._named_runs(engine, options["run_ids"], "cancelled")
        cancelled, finished = [], []
        progress = self._progress("cancel", len(runs), options)
        for run_id, _ in runs:
            try:
                engine.cancel(run_id)
            except exceptions.RunTerminalError as exc:
                finished.append(f"{run_id} ({getattr(exc, 'status', 'finished')})")
            else:
                cancelled.append(run_id)
            progress.advance()
        progress.finish()
        self.stdout.write(f"Cancelled {_n(len(cancelled), 'run')}.")
        if finished:
            left = "was left as it was" if len(finished) == 1 else "were left as they were"
            self.stdout.write(f"{_n(len(finished), 'run')} had already finished and {left}: {', '.join(finished)}.")

    def _retry(self, engine: Engine, options: dict[str, Any]) -> None:
        runs = self._named_runs(engine, options["run_ids"], "retried")
        finished = [f"{run_id} ({status})" for run_id, status in runs if status not in RETRYABLE_STATUSES]
        if finished:
            raise CommandError(f"Only failed, dead or cancelled runs can be retried: {', '.join(finished)}. Nothing was retried.")
        retried, refused = [], []
        progress = self._progress("retry", len(runs), options)
        for run_id, _ in runs:
            try:
                engine.retry(run_id)
            except exceptions.DurableError as exc:
                # A full quota, an unregistered workflow version, a status changed meanwhile:
                # that run stays as it was, the others go on.
                refused.append(f"{run_id}: {exc}")
            else:
                retried.append(run_id)
            progress.advance()
        progress.finish()
        self.stdout.write(f"Retried {_n(len(retried), 'run')}: pending again.")
        if refused:
            for line in refused:
                self.stderr.write(f"Could not retry run {line}")
            raise CommandError(f"{len(refused)} of {len(runs)} runs were not retried (see above).")

    def _named_runs(self, engine: Engine, run_ids: Sequence[str], done: str) -> list[tuple[str, str]]:
        """``(run id, status)`` of each named run, in the order given (once each);
        a ``CommandError`` naming the unknown ones, before anything changes."""
        wanted = list(dict.fromkeys(run_ids))
        found: dict[str, str] = {}
        for start in range(0, len(wanted), 1000):
            chunk = [r for r in wanted[start : start + 1000] if 0 < len(r) <= 255 and "\x00" not in r]
            found.update(_runs_of(engine).filter(run_id__in=chunk).values_list("run_id", "status"))
        missing = [run_id for run_id in wanted if run_id not in found]
        if missing:
            shown = ", ".join(map(repr, missing[:20])) + (f" and {len(missing) - 20} more" if len(missing) > 20 else "")
            raise CommandError(f"No run has the id {shown}. Nothing was {done}.")
        return [(run_id, found[run_id]) for run_id in wanted]

    # -- quotas ----------------------------------------------------------------------------
    def _quotas(self, engine: Engine, options: dict[str, Any]) -> None:
        namespace = engine.read_namespace
        locks = quotas.visible_locks(namespace)
        if options["key"] is not None:
            locks = locks.filter(key=options["key"])
        infos: list[quotas.QuotaInfo] = []
        last: str | None = None
        while True:  # a page of keys at a time: each query reads those keys' tag rows only
            page = list((locks if last is None else locks.filter(key__gt=last))[:_QUOTA_PAGE])
            if not page:
                break
            last = page[-1].key
            for info in quotas.infos_for(page, namespace=namespace):
                at_limit = info.limit is not None and info.active >= info.limit
                if options["full"] and not at_limit:
                    continue
                if options["all"] or options["full"] or options["key"] is not None or info.active or info.queued:
                    infos.append(info)
        if options["key"] is not None and not infos:
            raise CommandError(f"No concurrency key {options['key']!r} is known.")
        if options["json"]:
            self._json([_quota(info) for info in infos])
            return
        now = timezone.now()
        self._table(
            ["KEY", "ACTIVE", "LIMIT", "QUEUED", "OLDEST IN FLIGHT", "OLDEST QUEUED"],
            [
                [
                    info.key,
                    str(info.active),
                    "-" if info.limit is None else str(info.limit),
                    str(info.queued),
                    _age(now, info.oldest_active_at),
                    _age(now, info.oldest_queued_at),
                ]
                for info in infos
            ],
        )
        if not infos:
            self.stdout.write(
                "No key is at its limit." if options["full"] else "No key has runs in flight or queued (--all lists every key)."
            )

    # -- purge -----------------------------------------------------------------------------
    def _purge(self, engine: Engine, options: dict[str, Any]) -> None:
        statuses = _statuses(options["status"], list(retention.PURGEABLE_STATUSES), what="finished status")
        statuses = [s for s in retention.PURGEABLE_STATUSES if s in statuses] or list(retention.PURGEABLE_STATUSES)
        age = _duration(options["older_than"], "--older-than")
        batch_size = options["batch_size"]
        if not 1 <= batch_size <= 50000:
            raise CommandError(f"--batch-size must be between 1 and 50000, got {batch_size}.")
        pause_factor = options["pause_factor"]
        if not 0 <= pause_factor <= 100:  # also refuses nan
            raise CommandError(f"--pause-factor must be between 0 and 100, got {pause_factor}.")
        cutoff = timezone.now() - age
        before = dict.fromkeys(statuses, cutoff)
        using = getattr(engine.store, "using", "default")
        namespace = engine.read_namespace
        counts = retention.count_purgeable(before, using=using, namespace=namespace)
        total = sum(counts.values())
        where = f"finished before {_when(cutoff)}" + (f" in namespace {namespace!r}" if namespace is not None else "")
        if options["dry_run"]:
            self.stdout.write(f"Would delete {_n(total, 'run')} {where}{_by_status(counts)}. Dry run: nothing was deleted.")
            return
        progress = self._progress("purge", total, options)
        deleted = retention.purge(
            before,
            using=using,
            namespace=namespace,
            batch_size=batch_size,
            pause_factor=pause_factor,
            on_batch=lambda _, n: progress.advance(n),
        )
        progress.finish()
        self.stdout.write(f"Deleted {_n(sum(deleted.values()), 'run')} {where}{_by_status(deleted)}.")

    # -- output ----------------------------------------------------------------------------
    def _progress(self, label: str, total: int, options: dict[str, Any]) -> Progress:
        quiet = options.get("verbosity", 1) < 1

        def write(text: str) -> None:
            if not quiet:
                self.stderr.write(text, ending="")
                self.stderr.flush()

        return Progress(write, label, total, tty=self.stderr.isatty())

    def _json(self, value: Any) -> None:
        self.stdout.write(json.dumps(value, indent=2, ensure_ascii=False))

    def _table(self, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        if not rows:
            return
        widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            self.stdout.write("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def _runs_of(engine: Engine) -> Any:
    """The runs ``engine`` may read (its namespace when its reads are fenced)."""
    return models.WorkflowRun.objects.using(getattr(engine.store, "using", "default")).in_namespace(engine.read_namespace)


def _statuses(values: Iterable[str], allowed: Sequence[str], *, what: str = "status") -> list[str]:
    statuses = [s.strip() for value in values for s in value.split(",") if s.strip()]
    unknown = [s for s in statuses if s not in allowed]
    if unknown:
        raise CommandError(f"Unknown {what} {', '.join(map(repr, unknown))}: use {', '.join(allowed)}.")
    return list(dict.fromkeys(statuses))


def _duration(text: str, option: str) -> timedelta:
    try:
        return retention.parse_duration(text)
    except ValueError as exc:
        raise CommandError(f"{option}: {exc}") from None


def _n(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def _by_status(counts: dict[str, int]) -> str:
    shown = [f"{status}: {n:,}" for status, n in counts.items() if n]
    return f" ({', '.join(shown)})" if shown else ""


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _when(value: datetime | None) -> str:
    return "" if value is None else timezone.localtime(value).strftime("%Y-%m-%d %H:%M:%S")


def _age(now: datetime, value: datetime | None) -> str:
    if value is None:
        return "-"
    seconds = max(0, int((now - value).total_seconds()))
    days, hours, minutes = seconds // 86400, seconds % 86400 // 3600, seconds % 3600 // 60
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m {seconds % 60}s" if minutes else f"{seconds}s"


def _compact(value: Any, width: int = 200) -> str:
    text = json.dumps(value, ensure_ascii=False, sort_keys=True)
    return text if len(text) <= width else text[: width - 1] + "…"


def _run_summary(run: models.WorkflowRun) -> dict[str, Any]:
    return {
        "run_id": run.run_id,
        "workflow": run.workflow,
        "version": run.version,
        "namespace": run.namespace,
        "status": run.status,
        "attempt": run.attempt,
        "parent": run.parent.run_id if run.parent is not None else None,
        "created_at": _iso(run.created_at),
        "started_at": _iso(run.started_at),
        "finished_at": _iso(run.finished_at),
    }


def _quota(info: quotas.QuotaInfo) -> dict[str, Any]:
    data = {
        "key": info.key,
        "active": info.active,
        "limit": info.limit,
        "queued": info.queued,
        "count_statuses": list(info.count_statuses),
        "oldest_active_at": _iso(info.oldest_active_at),
        "oldest_queued_at": _iso(info.oldest_queued_at),
    }
    if info.pool is not None or info.is_pool:  # as GET quotas/: a burst's figures, for its keys only
        data.update(guaranteed=info.guaranteed, borrowed=info.borrowed, pool=info.pool, up_to=info.up_to)
        data.update(pool_limit=info.pool_limit, pool_active=info.pool_active, is_pool=info.is_pool)
    return data
