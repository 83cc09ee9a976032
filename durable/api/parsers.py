"""The request body parser of the HTTP API: JSON only, strict."""

from __future__ import annotations

from typing import IO, Any

from rest_framework import parsers
from rest_framework.exceptions import ParseError


class StrictJSONParser(parsers.JSONParser):
    """DRF's ``JSONParser`` that always refuses ``NaN``/``Infinity`` (whatever
    ``STRICT_JSON`` says) and answers 400, not 500, to a body nested too deeply."""

    strict = True

    def parse(self, stream: IO[bytes], media_type: str | None = None, parser_context: Any = None) -> Any:
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - the body is nested too deeply.") from None
