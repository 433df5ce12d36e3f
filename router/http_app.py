"""The FastAPI app every ingress route is on, and what it does around them: every error
(ours, validation, Starlette's own, an unexpected exception) becomes an OpenAI error body;
a POST body is read as JSON whatever its Content-Type says. No route lives here."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router import protocol as p
from router.errors import APIError, BadRequestError

log = logging.getLogger("router.ingress")  # the ingress's one log, whichever module writes

app = FastAPI(title="lorafleet", description="Multi-LoRA serving, OpenAI-compatible API.")


def printable(text: str) -> str:
    """`text` without lone surrogates (written as \\udXXX): error messages may quote the
    client's input, and a response body must encode as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
    type_: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    """An OpenAI error body: {"error": {"message", "type", "param", "code"}}."""
    body = p.error_body(status, printable(message), type_, param and printable(param), code)
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


@app.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return error_response(e.status, e.message, getattr(e, "param", None), e.headers, e.type, e.code)


@app.exception_handler(RequestValidationError)
async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
    errors = [_unicode_error(err) for err in e.errors()]
    if errors and errors[0].get("type") == "json_invalid":
        return error_response(400, _json_error(errors[0], e.body))
    return error_response(400, *p.validation_error(errors))


def _json_error(error: dict[str, Any], document: Any) -> str:
    """A body that is not JSON: the parser's message and where, as line and column (FastAPI
    reports the character offset in `loc`, where a field name would be: not a param)."""
    reason = (error.get("ctx") or {}).get("error") or "not valid JSON"
    loc = error.get("loc", ())
    pos = loc[-1] if loc and isinstance(loc[-1], int) else None
    if pos is None or not isinstance(document, str):
        return f"Invalid JSON body: {reason}"
    line = document.count("\n", 0, pos) + 1
    column = pos - document.rfind("\n", 0, pos)  # 1-based, as json's own messages count
    return f"Invalid JSON body: {reason} (line {line} column {column})"


def _unicode_error(error: dict[str, Any]) -> dict[str, Any]:
    """pydantic's error for a lone surrogate where it wants a str (a key, in practice: it
    takes such values) says "unable to parse raw data": say which string it was."""
    if error.get("type") != "string_unicode":
        return error
    quoted = ascii(error.get("input"))  # \\udXXX, not the surrogate itself
    return {**error, "msg": f"invalid Unicode: a lone surrogate in {quoted}"}


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (no route, wrong method), which FastAPI would answer with
    {"detail": ...}."""
    method, path = request.method, request.url.path
    if e.status_code == 404:
        message = f"no such endpoint: {method} {path}"
    elif e.status_code == 405:
        allowed = (e.headers or {}).get("Allow", "")
        message = f"method {method} is not allowed on {path}; allowed: {allowed}"
    else:
        message = str(e.detail)
    return error_response(e.status_code, message, headers=e.headers)


class CatchAll:
    """Any exception that escapes a route becomes a 500 with an OpenAI error body (no
    traceback: that goes to the log), not Starlette's plain-text "Internal Server Error".
    A pure ASGI middleware, not an exception handler for Exception: Starlette re-raises
    after such a handler, and Serve would then report the error its own way."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = ended = False

        async def tracked(message: Message) -> None:
            nonlocal started, ended
            started = started or message["type"] == "http.response.start"
            ended = ended or (
                message["type"] == "http.response.body" and not message.get("more_body")
            )
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            error_id = p.random_uuid()[:12]
            log.exception("internal error %s on %s %s", error_id, scope["method"], scope["path"])
            if not started:
                message = f"internal server error (id {error_id}); the server log has details"
                await error_response(500, message)(scope, receive, send)
            elif not ended:  # the status line is out: end the body, the client sees it cut
                await send({"type": "http.response.body", "body": b"", "more_body": False})


class JSONBodies:
    """Every body this API takes is JSON: a POST whose Content-Type is missing, or is what
    `curl -d` sends by default (application/x-www-form-urlencoded) or text/plain, is read as
    JSON, not refused as "Input should be a valid dictionary"."""

    AS_JSON = (b"", b"application/x-www-form-urlencoded", b"text/plain")

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            given = [v for k, v in scope["headers"] if k == b"content-type"]
            mime = given[0].split(b";")[0].strip().lower() if given else b""
            if mime in self.AS_JSON:
                headers.append((b"content-type", b"application/json"))
                scope = {**scope, "headers": headers}
        await self.app(scope, receive, send)


app.add_middleware(CatchAll)
app.add_middleware(JSONBodies)

# The Authorization header, for the endpoints that may require an API key. (A default value,
# not an annotation: Serve's class-based views drop `request: Request` parameters.)
AUTHORIZATION = Header(None, include_in_schema=False)


def refuse_invalid_unicode(body: BaseModel) -> None:
    """A lone surrogate anywhere in the body: 400 naming the field (the tokenizer, and any
    UTF-8 encoder, would fail on it).

    JSON can spell a lone UTF-16 surrogate ("\\ud800"): Python's parser turns it into a
    string that is not valid Unicode, which pydantic accepts and the tokenizer (Rust) then
    cannot take. NULs and any normalization form are valid text: not refused."""
    if found := find_invalid_unicode(body):
        param, message = found
        raise BadRequestError(message, param)


def find_invalid_unicode(value: Any, path: str = "") -> tuple[str, str] | None:
    """(the field's dotted path, a message) for the first string in `value` (a pydantic
    model, or JSON-like dicts, lists and strings) holding a lone surrogate; else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")  # C speed; fails exactly on surrogates
        except UnicodeEncodeError as e:
            where, code = path or "body", f"U+{ord(value[e.start]):04X}"
            return (
                where,
                f"{where}: invalid Unicode: a lone surrogate ({code}) at character {e.start}",
            )
        return None
    if isinstance(value, BaseModel):
        for name, field in type(value).model_fields.items():
            found = find_invalid_unicode(getattr(value, name), _join(path, field.alias or name))
            if found:
                return found
        return find_invalid_unicode(value.model_extra or {}, path)
    if isinstance(value, Mapping):
        for key, item in value.items():
            found = find_invalid_unicode(key, path) or find_invalid_unicode(
                item, _join(path, str(key))
            )
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if found := find_invalid_unicode(item, _join(path, str(i))):
                return found
    return None


def _join(path: str, part: str) -> str:
    return f"{path}.{part}" if path else part
