"""``python manage.py demo``: tenant acme starts 12 chat turns through the real HTTP API.

8 are accepted, 4 are refused with 429 and Retry-After; the turns complete on a
real (in-process) Celery worker; new starts are accepted again. Then a persisted
schedule with a quota of its own on the same key (``tenant:acme``, limit 8) fires
a window while the tenant is full: the window is skipped and written to the
schedule's ``last_error``. Then the admin is served on 127.0.0.1:8000, or on
a free port when 8000 is taken and no ``--port`` was given (``--no-serve`` skips that).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.staticfiles.handlers import StaticFilesHandler
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.core.servers.basehttp import ThreadedWSGIServer, WSGIRequestHandler
from django.core.wsgi import get_wsgi_application
from rest_framework.authtoken.models import Token

from durable import RunStatus, engine, exceptions, schedules
from testproject.celery import app as celery_app
from testproject.embedded import embedded_worker

TENANT = "acme"
SCHEDULE = "acme-digest"
USERNAME = PASSWORD = "demo"


DEFAULT_PORT = 8000


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class Command(BaseCommand):
    help = "Run the chat-turn quota demo through the HTTP API, then serve the admin."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--no-serve", action="store_true", help="exit after the demo instead of serving the admin")
        parser.add_argument(
            "--port",
            type=int,
            default=None,
            help=f"port of the API and the admin (default {DEFAULT_PORT}, or a free one when {DEFAULT_PORT} is taken)",
        )
        parser.add_argument("--turns", type=int, default=12, help="chat turns started at once (default 12)")
        parser.add_argument("--think", type=float, default=3.0, help="seconds each reply takes (default 3)")

    def handle(self, *args: Any, **options: Any) -> None:
        logging.getLogger("durable.schedules").setLevel(logging.ERROR)  # so is the skipped window
        call_command("migrate", verbosity=0)
        token = self._demo_user()
        self._cancel_leftovers()
        server = self._server(options["port"])
        options["port"] = server.server_address[1]
        server.set_app(StaticFilesHandler(get_wsgi_application()))
        threading.Thread(target=server.serve_forever, name="demo-http", daemon=True).start()
        api = _Client(f"http://127.0.0.1:{options['port']}/durable/", token)
        try:
            with embedded_worker(celery_app, concurrency=10):
                # The 429s are expected here (set after the worker, which configures logging).
                logging.getLogger("django.request").setLevel(logging.ERROR)
                self._run(api, options["turns"], options["think"])
                self._skipped_window(api, options["think"], options["port"])
                if not options["no_serve"]:
                    self.stdout.write(
                        self.style.SUCCESS(
                            f"\nAdmin: http://127.0.0.1:{options['port']}/admin/ (user {USERNAME!r}, "
                            f"password {PASSWORD!r}). API: http://127.0.0.1:{options['port']}/durable/runs/ "
                            "Ctrl-C to stop."
                        )
                    )
                    threading.Event().wait()
        except KeyboardInterrupt:
            pass
        finally:
            server.shutdown()
            server.server_close()

    def _server(self, port: int | None) -> ThreadedWSGIServer:
        """The demo's HTTP server on ``port``; without one, on 8000 or else any free port."""
        try:
            return ThreadedWSGIServer(("127.0.0.1", DEFAULT_PORT if port is None else port), _QuietHandler)
        except OSError as exc:
            if port is not None:
                raise CommandError(f"Cannot serve on 127.0.0.1:{port} ({exc.strerror}); choose another with --port.") from exc
        server = ThreadedWSGIServer(("127.0.0.1", 0), _QuietHandler)
        self.stdout.write(f"Port {DEFAULT_PORT} is taken: serving on {server.server_address[1]} (choose one with --port).")
        return server

    def _demo_user(self) -> str:
        User = get_user_model()
        user, created = User.objects.get_or_create(username=USERNAME, defaults={"is_staff": True, "is_superuser": True})
        if created:
            user.set_password(PASSWORD)
            user.save()
        return Token.objects.get_or_create(user=user)[0].key

    def _cancel_leftovers(self) -> None:
        # An interrupted earlier demo may have left turns that no worker will run
        # (the embedded broker keeps messages in memory): they would hold slots.
        leftovers = engine.list_runs(tag=f"concurrency:tenant:{TENANT}", statuses=["pending", "running"])
        for handle in leftovers:
            handle.cancel()
        if leftovers:
            self.stdout.write(f"Cancelled {len(leftovers)} unfinished turns left by an earlier demo.")

    def _run(self, api: _Client, turns: int, think: float) -> None:
        self.stdout.write(f"Tenant {TENANT!r} starts {turns} chat turns at once (quota: 8 in flight):\n")
        self.stdout.write(f"{'turn':>4}  {'HTTP':>4}  {'outcome':<9}  detail")
        accepted: list[str] = []
        for n in range(1, turns + 1):
            status, headers, body = api.post(
                "runs/",
                {"workflow": "chat.turn", "input": {"tenant_id": TENANT, "message": f"hello #{n}", "think_seconds": think}},
            )
            if status == 201:
                accepted.append(body["run_id"])
                self._row(n, status, "accepted", f"run {body['run_id'][:12]}  {body['status']}")
            elif status == 429:
                self._row(
                    n,
                    status,
                    "busy",
                    f"Retry-After: {headers.get('Retry-After')}s  active {body['active']}/{body['limit']} on {body['key']}",
                )
            else:
                raise CommandError(f"unexpected answer {status}: {body}")
        _, _, quota = api.get(f"quotas/tenant:{TENANT}/")
        self.stdout.write(
            f"\nQuota tenant:{TENANT}: {quota['active']} active of {quota['limit']}. "
            "Waiting for the accepted turns to complete on the Celery worker..."
        )
        started = time.monotonic()
        for run_id in accepted:
            while (run := api.get(f"runs/{run_id}/")[2])["status"] not in {RunStatus.COMPLETED, RunStatus.FAILED}:
                if time.monotonic() - started > 60 + think * 4:
                    raise CommandError(f"run {run_id} is still {run['status']}: is the worker running?")
                time.sleep(0.1)
            self.stdout.write(f"  {run_id[:12]}  {run['status']:<9}  {run['output']}")
        self.stdout.write("\nThe slots are free again:")
        for n in range(turns + 1, turns + 3):
            status, _, body = api.post(
                "runs/", {"workflow": "chat.turn", "input": {"tenant_id": TENANT, "message": f"hello #{n}", "think_seconds": 0}}
            )
            self._row(n, status, "accepted" if status == 201 else "refused", f"run {body.get('run_id', '')[:12]}")
        refused = turns - len(accepted)
        self.stdout.write(self.style.SUCCESS(f"\n{len(accepted)} accepted, {refused} refused with 429, then accepted again."))

    def _skipped_window(self, api: _Client, think: float, port: int) -> None:
        """The schedule "acme-digest" has a quota of its own on the chat turns' key:
        a window that finds the tenant full is skipped and written to last_error."""
        schedule = self._digest_schedule()
        self.stdout.write(f"\nSchedule {SCHEDULE!r} ({schedules.describe(schedule)}) shares the tenant's key.")
        self._wait_until_idle(api)
        turns: list[str] = []
        for n in range(1, 9):
            status, _, body = api.post(
                "runs/",
                {"workflow": "chat.turn", "input": {"tenant_id": TENANT, "message": f"long turn #{n}", "think_seconds": think}},
            )
            if status != 201:
                raise CommandError(f"unexpected answer {status} while filling the tenant: {body}")
            turns.append(body["run_id"])
        _, _, quota = api.get(f"quotas/tenant:{TENANT}/")
        self.stdout.write(
            f"{len(turns)} long turns fill tenant:{TENANT} ({quota['active']} active of {quota['limit']}); "
            "the schedule's window fires now, as beat would:"
        )
        firing = schedules.fire(schedule.pk)  # what beat's durable.fire_schedule task does
        assert firing is not None
        schedule.refresh_from_db()
        if firing.outcome is schedules.Outcome.SKIPPED:
            self.stdout.write(f"  window {firing.window:%Y-%m-%d %H:%M} UTC skipped, no run started.")
            self.stdout.write(f"  last_error: {schedule.last_error}")
            self.stdout.write(f"  Visible in the admin at http://127.0.0.1:{port}/admin/durable/schedule/")
        else:
            self.stdout.write(f"  window {firing.window:%Y-%m-%d %H:%M} UTC: {firing.outcome} (run {firing.run_id}).")
        self._wait_for(api, turns, think)

    def _digest_schedule(self) -> Any:
        config: dict[str, Any] = {
            "workflow": "chat.turn",
            "input": {"tenant_id": TENANT, "message": "daily digest", "think_seconds": 0},
            "cron": "0 9 * * *",
            "timezone": "Europe/Paris",
            "concurrency_key": f"tenant:{TENANT}",
            "concurrency_limit": 8,
        }
        try:
            existing = schedules.get_schedule(SCHEDULE)
        except exceptions.ScheduleNotFound:
            return schedules.create_schedule(SCHEDULE, **config)
        return schedules.update_schedule(existing, enabled=True, **config)

    def _wait_until_idle(self, api: _Client) -> None:
        deadline = time.monotonic() + 60
        while api.get(f"quotas/tenant:{TENANT}/")[2].get("active", 0) > 0:
            if time.monotonic() > deadline:
                raise CommandError(f"tenant {TENANT!r} still has turns in flight: is the worker running?")
            time.sleep(0.05)

    def _wait_for(self, api: _Client, run_ids: list[str], think: float) -> None:
        deadline = time.monotonic() + 60 + think * 4
        for run_id in run_ids:
            while api.get(f"runs/{run_id}/")[2]["status"] not in {RunStatus.COMPLETED, RunStatus.FAILED}:
                if time.monotonic() > deadline:
                    raise CommandError(f"run {run_id} did not finish: is the worker running?")
                time.sleep(0.1)

    def _row(self, n: int, status: int, outcome: str, detail: str) -> None:
        self.stdout.write(f"{n:>4}  {status:>4}  {outcome:<9}  {detail}")


class _Client:
    """A tiny JSON client for the demo's own HTTP API (standard library only)."""

    def __init__(self, base: str, token: str) -> None:
        self.base, self.token = base, token

    def get(self, path: str) -> tuple[int, dict[str, str], Any]:
        return self._send("GET", path, None)

    def post(self, path: str, body: Any) -> tuple[int, dict[str, str], Any]:
        return self._send("POST", path, body)

    def _send(self, method: str, path: str, body: Any) -> tuple[int, dict[str, str], Any]:
        request = urllib.request.Request(
            self.base + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Token {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, dict(response.headers), json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), json.loads(error.read() or b"null")
