#!/usr/bin/env bash
# A new user's install, end to end: build the wheel, make a fresh venv and a
# `django-admin startproject` project, install the wheel with the README's own
# install line, write the quickstart's files (docs/tutorial/quickstart.md),
# migrate, start the web server and beat, start chat turns through the HTTP API
# until one gets 429 (no worker yet: the runs hold their slots, as in the
# quickstart's step 6), then start a real Celery worker on Redis and check that
# a run completes and that beat stored durable's sweep.
#
# Usage: tests/e2e/install.sh PYTHON [REDIS_URL]
# Exit 0: passed; 77: skipped (no package index can be reached); else failed.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
python=${1:?usage: install.sh PYTHON [REDIS_URL]}
broker=${2:-redis://127.0.0.1:6379/14}
work=$(mktemp -d)
queue="e2e-$$"  # the Celery queue of this run only
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  # The messages left in this run's queue (runs the worker did not get to).
  [ -x "$work/venv/bin/python" ] && "$work/venv/bin/python" -c "
import sys, redis
client = redis.Redis.from_url(sys.argv[1])
for key in client.scan_iter(match='*' + sys.argv[2] + '*'):  # the queue and kombu's bindings of it
    client.delete(key)" "$broker" "$queue" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

log() { echo "--- $*"; }

# The README's install line, exactly as written there.
line=$(grep -m1 -E '^pip install .*django-durable-workflows' "$root/README.md")
[ -n "$line" ] || { echo "README.md has no 'pip install ...django-durable-workflows...' line" >&2; exit 1; }

reachable=""
for _ in 1 2 3; do  # three tries: one failed lookup is no reason to skip
  if "$python" -m pip download --no-deps --dest "$work/probe" -q six >/dev/null 2>&1; then reachable=1; break; fi
  sleep 5
done
if [ -z "$reachable" ]; then
  echo "no package index can be reached: skipped"
  exit 77
fi

log "wheel"
"$python" -m pip wheel --no-deps -q -w "$work/dist" "$root"
log "venv ($("$python" --version))"
"$python" -m venv "$work/venv"
venv="$work/venv/bin"
"$venv/python" -m pip install -q --upgrade pip
log "install: $line"
# The README's line; the wheel comes from the local build (the distribution is not on the index yet).
eval "${line/pip install/\"$venv/python\" -m pip install -q --find-links \"$work/dist\"}"
"$venv/python" -c "import django, durable; print('Django', django.get_version(), 'durable', durable.__version__)"

log "project"
cd "$work"
"$venv/django-admin" startproject proj
cd proj
"$venv/python" manage.py startapp chat
"$venv/python" "$root/tests/e2e/quickstart_project.py" "$root/docs/tutorial/quickstart.md" . "$broker" "$queue"
export DJANGO_SETTINGS_MODULE=proj.settings
"$venv/python" manage.py check --fail-level WARNING
"$venv/python" manage.py migrate -v0
DJANGO_SUPERUSER_PASSWORD=pw "$venv/python" manage.py createsuperuser --noinput --username alice --email alice@example.com

port=$("$venv/python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
log "web server on $port, beat"
"$venv/python" manage.py runserver --noreload "127.0.0.1:$port" >"$work/web.log" 2>&1 &
pids+=($!)
"$venv/celery" -A proj beat -l info -s "$work/beat-schedule" >"$work/beat.log" 2>&1 &
pids+=($!)
touch "$work/worker.log"

fail() {
  echo "FAILED: $*" >&2
  for name in web worker beat; do echo "--- $name.log" >&2; tail -n 40 "$work/$name.log" >&2; done
  exit 1
}

for _ in $(seq 100); do
  curl -sf -o /dev/null -u alice:pw "http://127.0.0.1:$port/durable/runs/" && break
  sleep 0.2
done

# As the quickstart's step 6: no worker yet, so the runs stay pending and hold their slots.
log "start turns until one gets 429"
first=""
got429=""
for i in $(seq 1 12); do
  response=$(curl -s -w '\n%{http_code}' -u alice:pw -H 'Content-Type: application/json' \
    -d "{\"conversation_id\": \"c1\", \"message\": \"hi $i\"}" "http://127.0.0.1:$port/tenants/acme/turns/")
  code=${response##*$'\n'}
  body=${response%$'\n'*}
  echo "turn $i: $code $body"
  if [ "$code" = 202 ] && [ -z "$first" ]; then
    first=$("$venv/python" -c "import json, sys; print(json.loads(sys.argv[1])['run_id'])" "$body")
  elif [ "$code" = 429 ]; then
    got429=$body
    break
  elif [ "$code" != 202 ]; then
    fail "turn $i answered $code"
  fi
done
[ -n "$got429" ] || fail "no start was refused with 429"
echo "$got429" | grep -q '"code":"concurrency_limit"' || fail "the 429's body is not the quota's: $got429"

log "worker: the first run completes (run $first)"
"$venv/celery" -A proj worker -l info --concurrency 2 >"$work/worker.log" 2>&1 &
pids+=($!)
for _ in $(seq 180); do
  status=$(curl -s -u alice:pw "http://127.0.0.1:$port/durable/runs/$first/" | "$venv/python" -c "import json, sys; print(json.load(sys.stdin)['status'])")
  [ "$status" = completed ] && break
  sleep 0.5
done
[ "$status" = completed ] || fail "run $first is $status after 90 s"
curl -s -u alice:pw "http://127.0.0.1:$port/durable/runs/$first/" | grep -q '"reply":"echo: hi 1 (1 earlier messages)"' \
  || fail "run $first has not the tutorial's reply"

log "beat stored durable's sweep"
for _ in $(seq 60); do
  "$venv/python" manage.py shell -c "
from django_celery_beat.models import PeriodicTask
raise SystemExit(0 if PeriodicTask.objects.filter(task='durable.sweep').exists() else 1)" 2>/dev/null && break
  sleep 0.5
done || true
"$venv/python" manage.py shell -c "
from django_celery_beat.models import PeriodicTask
raise SystemExit(0 if PeriodicTask.objects.filter(task='durable.sweep').exists() else 1)" || fail "beat did not store durable.sweep"
grep -q "ModuleNotFoundError\|Traceback" "$work/worker.log" "$work/beat.log" && fail "a traceback in the worker's or beat's log"

echo "PASSED: $("$venv/python" --version), $("$venv/python" -c 'import django; print("Django", django.get_version())')"
