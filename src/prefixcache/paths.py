"""Where prefixcache keeps files it derives on first use (converted models, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """$PREFIXCACHE_CACHE_DIR, else $XDG_CACHE_HOME/prefixcache, else ~/.cache/prefixcache."""
    explicit = os.environ.get("PREFIXCACHE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "prefixcache"
