"""The HTTP API's error: OpenAI's error JSON (`{"error": {"message", "type", "param", "code"}}`) with a status, and
`details` beside "error" where an answer says more (/health's 503: each model deployment's state)."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None, details: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}
        self.details = details or {}

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code},
                **self.details}
        return JSONResponse(body, status_code=self.status, headers=self.headers)
