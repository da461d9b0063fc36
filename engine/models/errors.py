"""The one error type of engine.models: its message is shown to users as is."""


class ModelError(Exception):
    """A model could not be found, read or built; str(e) is a one-line reason."""
