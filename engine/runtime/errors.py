"""The error types of engine.runtime: their messages are shown to users as is."""


class BackendError(RuntimeError):
    """A model could not be exported, compiled or run; str(e) is a one-line reason."""


class RequestError(ValueError):
    """The request itself cannot be served as asked; `code` is one of the protocol's
    EVENT_ERROR_CODES for a client error ("bad_request", "context_length_exceeded"), so
    an engine's error event, and the API's 400, carry the category and not just words."""

    def __init__(self, message: str, code: str = "bad_request") -> None:
        super().__init__(message)
        self.code = code


def error_code_of(e: BaseException) -> str:
    """The event error code for an exception that ended a request."""
    return e.code if isinstance(e, RequestError) else "engine"


def one_line(e: BaseException) -> str:
    """An exception as an event's error text: one line, at most 500 characters."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:500]
