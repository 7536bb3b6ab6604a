"""The one exception type for errors a user can cause.

The CLI prints its message without a traceback and exits with ``exit_code`` (2).
"""


class EldrError(Exception):
    """A user-caused error: bad file, wrong schema version, K mismatch, ...

    The message says what was expected and what to do about it.
    """

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None):
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\n  hint: {hint}")
