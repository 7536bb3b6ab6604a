"""The exception family for errors a user can cause.

The CLI prints any :class:`EldrError` as one ``error: ...`` line without a traceback and exits
with ``exit_code`` (2); it decides how by the exception's type alone (``eldr_cli.main``):

- :class:`EldrError`: a bad file, wrong schema version, K mismatch, refused output, ...
- :class:`InvalidParameterError`: a parameter outside its declaration (``eldr_cli.constraints``); it
  names the *parameter* (``n_pairs``), and the CLI puts the flag (``--pairs``) in its place.
- :class:`InvalidDataError`: data a stage cannot use (too few requests, NaN signatures, ...).

The last two are also ``ValueError`` (and the first a ``TypeError``), as scikit-learn's are, so
library callers can catch them as they would any estimator's.
"""

from __future__ import annotations


class EldrError(Exception):
    """A user-caused error: bad file, wrong schema version, K mismatch, ...

    The message says what was expected and what to do about it.
    """

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None):
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\n  hint: {hint}")


class InvalidParameterError(EldrError, ValueError, TypeError):
    """A parameter has a value the estimator cannot use; ``param`` is its (library) name."""

    def __init__(self, param: str, message: str, *, hint: str | None = None):
        self.param = param
        super().__init__(message, hint=hint)

    def renamed(self, names: dict[str, str]) -> EldrError:
        """The same error in the words of whoever set the parameters (``names``: parameter -> flag)."""
        msg, hint = self.message, self.hint
        flag = names.get(self.param)
        if flag is not None and msg.startswith(self.param + " "):
            msg = flag + msg[len(self.param):]
        elif flag is not None and flag not in msg + (hint or ""):  # already in the caller's words
            msg = f"{flag}: {msg}"
        for param, fl in names.items():
            if hint:
                hint = hint.replace(param, fl)
        return EldrError(msg, hint=hint)


class InvalidDataError(EldrError, ValueError):
    """Data passed to a stage that it cannot use (shapes, too few requests, non-finite values)."""
