"""An async Django view that starts a chat turn and answers 429 when the tenant is busy.

No DRF here: ``durable.http.error_response`` gives the status, body and
``Retry-After`` durable's DRF exception handler gives.
"""

from __future__ import annotations

import json

from django.http import HttpRequest, JsonResponse

import durable
from durable.http import error_response
from testproject.chat.workflows import ChatTurnWorkflow


async def start_turn(request: HttpRequest) -> JsonResponse:
    """``POST {"message": "..."}``: start a turn for the signed-in user's tenant."""
    user = await request.auser()
    if not user.is_authenticated:
        return JsonResponse({"detail": "Authentication credentials were not provided."}, status=401)
    if request.method != "POST":
        return JsonResponse({"detail": f"Method {request.method} not allowed."}, status=405, headers={"Allow": "POST"})
    try:
        body = json.loads(request.body)
        message = body["message"]
    except (ValueError, TypeError, KeyError):
        return JsonResponse({"detail": 'The body must be JSON: {"message": "..."}.'}, status=400)
    # The tenant is the user's in this example; a project takes it from the user's company.
    turn = {"tenant_id": str(user.pk), "message": message, "think_seconds": body.get("think_seconds", 0.5)}
    try:
        handle = await ChatTurnWorkflow.adispatch(turn)
    except durable.DurableError as exc:
        response = error_response(exc)  # 429 busy, 400 bad input...
        if response is None:
            raise
        return response
    return JsonResponse({"run_id": handle.run_id, "status": handle.status}, status=202)
