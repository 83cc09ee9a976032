from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from tests.api import workflows  # noqa: F401  (registers the API tests' workflows)


@pytest.fixture
def user(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user(username="alice", password="pw")


@pytest.fixture
def api(user: Any) -> APIClient:
    """An API client authenticated as ``user`` (force_authenticate: no query per request)."""
    client = APIClient()
    client.force_authenticate(user)
    return client


@pytest.fixture
def anon() -> APIClient:
    return APIClient()
