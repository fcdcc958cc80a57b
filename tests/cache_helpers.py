"""Helpers shared by the prefix-cache test modules."""

from __future__ import annotations

from typing import Any

from prefixcache.cache import PrefixCache


class Checked:
    """A cache whose every method call is followed by `check_integrity()`."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.cache, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            out = attr(*args, **kwargs)
            self.cache.check_integrity()
            return out

        return call
