"""OpenAI's error JSON: ApiError (an error with its HTTP status), the body and response
it is answered with, and the app's handlers that answer every failure that way
(malformed JSON, validation, unknown URL or method, anything unexpected).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered as OpenAI's error JSON with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = dict(headers or {})  # e.g. Retry-After on a 429


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(e: ApiError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status,
                        headers=dict(headers or {}))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, e: ApiError) -> JSONResponse:
        return error_response(e, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, e: RequestValidationError) -> JSONResponse:
        errors = list(e.errors())
        bad_json = [err for err in errors if err.get("type") == "json_invalid"]
        if bad_json:
            why = (bad_json[0].get("ctx") or {}).get("error", "")
            return error_response(ApiError(400, f"We could not parse the JSON body of your request ({why})."))
        parts: list[str] = []
        param = None
        for err in errors:
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            if param is None and loc:
                param = loc[0]
            text = f"{'.'.join(loc)}: {err.get('msg', 'invalid')}" if loc else err.get("msg", "invalid")
            if text not in parts:
                parts.append(text)
        message = "; ".join(parts[:4]) or "invalid request body"
        return error_response(ApiError(400, message, param=param))

    async def _http(req: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 404:
            err = ApiError(404, f"Unknown request URL: {req.method} {req.url.path}.", code="unknown_url")
        elif e.status_code == 405:
            err = ApiError(405, f"Method {req.method} is not allowed for {req.url.path}.",
                           code="method_not_allowed")
        else:
            err = ApiError(e.status_code, str(e.detail), "server_error" if e.status_code >= 500
                           else "invalid_request_error")
        return error_response(err, e.headers)

    app.add_exception_handler(StarletteHTTPException, _http)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http)  # type: ignore[arg-type]

    @app.exception_handler(Exception)
    async def _unexpected(_req: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error in the API", exc_info=e)
        return error_response(ApiError(500, "The server had an error while processing your request.",
                                       "server_error", code="internal_error"))
