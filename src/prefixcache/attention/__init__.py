"""Paged KV tensors, slot writes and paged attention (torch paths and a compiled CPU kernel).

The attention layer sees block ids and slots, never hashes: the scheduler turns cache block
tables into an `AttentionMetadata` per step.
"""

from prefixcache.attention.kv_cache import KVLayout, PagedKVCache, bytes_per_block
from prefixcache.attention.metadata import AttentionMetadata
from prefixcache.attention.paged_attention import paged_attention, write_kv

__all__ = [
    "AttentionMetadata", "KVLayout", "PagedKVCache", "bytes_per_block", "paged_attention",
    "write_kv",
]  # fmt: skip
