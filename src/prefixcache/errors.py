"""User-facing errors shared by the command line tools, and how an exception is described in
logs: its type and where it was raised, never its message (which may quote a tenant's input)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
from types import ModuleType, TracebackType

__all__ = [
    "CliError",
    "InvalidParam",
    "code_location",
    "describe_exception",
    "have_extra",
    "require_extra",
]


class CliError(Exception):
    """A user error on the command line: printed as one line, exit status 2."""


class InvalidParam(ValueError):
    """A request's ``param`` (a sampling field, ``prompt``, ``n``) is invalid; an API names it in
    its error body."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def code_location(tb: TracebackType | None) -> str:
    """``function (file.py:line)`` of the innermost frame of ``tb``, or "" without one."""
    frames = traceback.extract_tb(tb)
    if not frames:
        return ""
    frame = frames[-1]
    return f"{frame.name} ({frame.filename.rsplit('/', 1)[-1]}:{frame.lineno})"


def describe_exception(exc: BaseException) -> str:
    """``TypeName at function (file.py:line)``: safe to log, enough to find the bug."""
    where = code_location(exc.__traceback__)
    return f"{type(exc).__name__} at {where}" if where else type(exc).__name__


def have_extra(module: str) -> bool:
    """Whether an optional dependency is installed (without importing it); a module set to
    None in ``sys.modules`` counts as missing."""
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def require_extra(module: str, extra: str, feature: str) -> ModuleType:
    """Import an optional dependency, or raise a `CliError` naming the extra that installs it."""
    if not have_extra(module):
        raise CliError(
            f"{feature} needs the optional package {module!r}: pip install 'prefixcache[{extra}]'"
        )
    return importlib.import_module(module)
