"""The OpenAI error object and the exception routes raise to produce it."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from server.protocol import ErrorInfo, ErrorResponse

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """Raised anywhere under a route; the app turns it into an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or _TYPES.get(status, "BadRequestError")


def error_body(
    status: int,
    message: str,
    type_: str | None = None,
    param: str | None = None,
    code: str | None = None,
) -> dict:
    info = ErrorInfo(
        message=message, type=type_ or _TYPES.get(status, "BadRequestError"), param=param, code=code
    )
    return ErrorResponse(error=info).model_dump()


def error_response(
    status: int,
    message: str,
    type_: str | None = None,
    param: str | None = None,
    headers: dict | None = None,
    code: str | None = None,
) -> JSONResponse:
    body = error_body(status, message, type_, param, code)
    return JSONResponse(body, status_code=status, headers=headers)
