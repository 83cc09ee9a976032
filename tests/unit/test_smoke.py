import pytest

from durable import engine


@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_run_completes_on_worker(celery_worker):
    handle = engine.start("test.add", {"a": 1, "b": 2})
    assert handle.result(timeout=10) == {"total": 3}


@pytest.mark.django_db
def test_quota_infos_counts_active_runs():
    from durable.models import ConcurrencyLock
    from durable.quotas import quota_infos
    from durable.testing import WorkflowRunFactory, tagged

    ConcurrencyLock.objects.create(key="tenant:a", limit=2, count_statuses=["pending", "running"])
    tagged(WorkflowRunFactory(status="running"), "concurrency:tenant:a")
    tagged(WorkflowRunFactory(status="suspended"), "concurrency:tenant:a")
    tagged(WorkflowRunFactory(status="completed"), "concurrency:tenant:a")
    [info] = quota_infos()
    assert (info.key, info.limit, info.active, info.queued) == ("tenant:a", 2, 1, 0)
    assert info.oldest_active_at is not None
