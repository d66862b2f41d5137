"""The NamError tree: every failure a user can act on carries a message, a hint and an exit code.

The CLI prints ``error: <message>`` and ``hint: <hint>`` on stderr and exits with ``exit_code``
(``NAM_DEBUG=1`` shows the traceback instead). Exit codes: 1 generic failure, 2 usage (click's), 3 "cannot
run here" (plugin activation, preflight), 4 bad data, 5 a training run stopped by a guard (NaN/Inf), 6 the run
folder cannot be used (held by another run, not writable, a file in its place, no space left), 129 / 130 / 143 a
run stopped by SIGHUP / SIGINT / SIGTERM after saving a checkpoint (128 + the signal's number, as a shell reports it).
"""

from __future__ import annotations


class NamError(Exception):
    """Base class: a failure with a message, a next step, and the process exit code."""

    exit_code: int = 1

    def __init__(self, message: str, *, hint: str | None = None, exit_code: int | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        if exit_code is not None:
            self.exit_code = exit_code

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\nhint: {self.hint}"


class ConfigError(NamError):
    """A recipe, an override or a pattern that cannot describe a valid model or run."""

    exit_code = 2


class CannotRunHere(NamError):
    """The run is valid but this machine or process cannot run it (a device, a package, a launch, a check).

    The one spelling of exit code 3: raise this (or a subclass), never ``NamError(..., exit_code=3)``.
    """

    exit_code = 3


class PluginActivationError(CannotRunHere):
    """One or more requested plugins cannot run here; nothing was registered."""

    def __init__(self, failures: list, *, hint: str | None = None):
        self.failures = list(failures)
        n = len(self.failures)
        lines = [f"{n} check{'s' if n != 1 else ''} failed; no plugin was activated"]
        lines += [f"  {f.describe()}" for f in self.failures]
        hints = [f.hint for f in self.failures if getattr(f, "hint", None)]
        super().__init__("\n".join(lines), hint=hint or "; ".join(dict.fromkeys(hints)) or None)


class UnknownBackendError(CannotRunHere):
    """A config names a backend that no active plugin registered."""


class PatchError(CannotRunHere):
    """A patch that should apply failed to apply: the run must not go on."""


class DataError(NamError):
    """A dataset that is missing, corrupt, or does not fit the model."""

    exit_code = 4


class TrainingGuardError(NamError):
    """A run stopped by a guard (non-finite loss or gradient)."""

    exit_code = 5


class RunFolderError(NamError):
    """The run folder cannot be used as it is: another live run holds it, it is not writable, a file stands
    where a folder should be, or its disk is full. Nothing of the run's state was lost."""

    exit_code = 6


class Interrupted(NamError):
    """A run stopped on request (SIGHUP, SIGINT, SIGTERM) after finishing its step and saving a checkpoint.

    The exit code is the shell's for that signal (129, 130, 143), so scripts see what they would without nam."""

    def __init__(self, message: str, *, signum: int, hint: str | None = None):
        super().__init__(message, hint=hint, exit_code=128 + signum)
        self.signum = signum
