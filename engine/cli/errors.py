"""The CLI's own error type (a module of its own, so `python -m engine.cli.main`
and the console script see the same class)."""


class UserError(Exception):
    """A mistake or a missing prerequisite on the user's side: one line, exit 1."""
