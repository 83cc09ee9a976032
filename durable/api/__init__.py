"""The HTTP API (Django REST framework): the only part of durable that imports DRF.

``urls`` holds the routes (``path("durable/", include("durable.api.urls"))``);
``exception_handler`` maps durable's errors for the project's own DRF views::

    REST_FRAMEWORK = {"EXCEPTION_HANDLER": "durable.api.exception_handler"}
"""

from __future__ import annotations

from durable.api.errors import exception_handler

__all__ = ["exception_handler"]
