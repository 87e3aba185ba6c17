"""The OpenAI error of a request: status, message, the field it names (`param`)."""


class APIError(Exception):
    """status: 400 (bad field), 404 (unknown model or route), 405, 413 (body too large),
    503 (queue full, engine down), 500 (engine failure)."""

    TYPES = {404: "not_found_error", 503: "server_overloaded"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict | None = None, type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}
        self.type = type_

    def body(self) -> dict:
        default = "invalid_request_error" if self.status < 500 else "server_error"
        kind = self.type or self.TYPES.get(self.status, default)
        return {"error": {"message": self.message, "type": kind,
                          "param": self.param, "code": self.status}}


def bad(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", param)
