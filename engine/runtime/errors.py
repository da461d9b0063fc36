"""The one error type of engine.runtime: its message is shown to users as is."""


class BackendError(RuntimeError):
    """A model could not be exported, compiled or run; str(e) is a one-line reason."""
