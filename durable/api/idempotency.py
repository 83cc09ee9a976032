"""``Idempotency-Key`` on ``POST runs/``: a retried start returns the run the first one made.

The key (the header of public HTTP APIs, draft-ietf-httpapi-idempotency-key-header)
is mapped to a run id within the caller's namespace, so the engine's idempotent
re-start does the rest: the first request creates the run (201), a retry, even
one racing the first, returns it (200), never a second run and never a 429. Two
tenants using the same key get two runs. The key used again with another
workflow or another input is a 422: that is a new request under an old key.
"""

from __future__ import annotations

import hashlib
import unicodedata
from typing import Any

from rest_framework import status
from rest_framework.exceptions import APIException

HEADER = "Idempotency-Key"
MAX_LENGTH = 255
#: Run ids made from keys start with it; a request body may not choose such a run id.
RUN_ID_PREFIX = "idempotency:"


class InvalidIdempotencyKey(APIException):
    status_code = status.HTTP_400_BAD_REQUEST
    default_code = "invalid_idempotency_key"


class IdempotencyKeyReused(APIException):
    status_code = status.HTTP_422_UNPROCESSABLE_ENTITY
    default_code = "idempotency_key_reused"


def run_id(namespace: str, key: str) -> str:
    """The run id of ``key`` in ``namespace`` (a digest: any key makes a valid run id)."""
    digest = hashlib.sha256(f"{namespace}\x00{key}".encode()).hexdigest()
    return f"{RUN_ID_PREFIX}{digest[:40]}"


def key_of(headers: Any) -> str | None:
    """The request's ``Idempotency-Key``, or None; a 400 for one that is empty, too long or not text."""
    key = headers.get(HEADER)
    if key is None:
        return None
    if not 0 < len(key) <= MAX_LENGTH or any(unicodedata.category(c) == "Cc" for c in key):
        raise InvalidIdempotencyKey(f"The {HEADER} header must be 1 to {MAX_LENGTH} characters without control characters.")
    return str(key)


def check_same_request(existing: Any, workflow: str, input: Any) -> None:
    """A retry must be the request that made ``existing``: the same workflow and input."""
    if existing.workflow != workflow or existing.input != input:
        raise IdempotencyKeyReused(
            f"This {HEADER} was first used to start a run of {existing.workflow!r} with another input or workflow; "
            "send a new key for a new request."
        )
