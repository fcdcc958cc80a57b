"""User-facing errors shared by the command line tools."""

from __future__ import annotations


class CliError(Exception):
    """A user error on the command line: printed as one line, exit status 2."""
