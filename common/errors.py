"""twinseq's own exceptions: every error caused by the user's input is one of these.

They subclass ``ValueError``/``TypeError`` so that code written against the standard types
keeps working, and ``TwinseqError`` so that the CLI can tell a user error (printed as one
line, exit code 2) from a bug (a traceback). A message names the field, file or line, the
value, and the fix.

>>> try:
...     raise ConfigError("max_length=0 is not valid: it must be an integer >= 1 (--max-length).")
... except ValueError as err:
...     isinstance(err, TwinseqError)
True
"""

from __future__ import annotations


class TwinseqError(Exception):
    """Base of every user-facing twinseq error (never raised itself)."""


class ConfigError(TwinseqError, ValueError):
    """A configuration value (YAML, flag or Python argument) is invalid or unsupported here."""


class ConfigTypeError(TwinseqError, TypeError):
    """A configuration value has the wrong type (a string where a number belongs, ...)."""


class DataError(TwinseqError, ValueError):
    """The training data is malformed: a file, a row, a field or a token id."""


class DataTypeError(TwinseqError, TypeError):
    """A piece of data has the wrong type (a number where text belongs, a dict where rows belong)."""


class CheckpointError(TwinseqError, ValueError):
    """A model folder or training checkpoint is missing, corrupt, unsafe or from another run."""


class MissingDependencyError(TwinseqError, ImportError):
    """An optional package is not installed; the message names the extra to install."""


class NonFiniteError(TwinseqError, FloatingPointError):
    """A loss or gradient norm is NaN or Inf; the message names the step and the micro-batch."""


class TrainingInterrupted(Exception):
    """SIGTERM or Ctrl-C stopped a run at a step boundary, after a checkpoint was saved.

    Not a user error: the CLI prints its message without "error" and exits with ``exit_code``
    (143 for SIGTERM, 130 for SIGINT, as a shell reports a process killed by the signal).
    """

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code
