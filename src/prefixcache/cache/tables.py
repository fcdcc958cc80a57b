"""The live block tables of a `PrefixCache`, by sequence id, and the blocks each isolation
domain holds in them (what fair shares and per-domain caps read)."""

from __future__ import annotations

from collections import Counter

from prefixcache.cache.block_pool import check_invariant
from prefixcache.cache.index import SeqBlocks
from prefixcache.cache.sequence import Sequence

__all__ = ["LiveTables"]


class LiveTables:
    """Sequence id -> `SeqBlocks`, and per domain the number of blocks in its live tables."""

    __slots__ = ("tables", "_held")

    def __init__(self) -> None:
        self.tables: dict[str, SeqBlocks] = {}
        self._held: dict[str, int] = {}  # not a Counter: this is on every allocation's path

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self.tables

    def get(self, seq_id: str) -> SeqBlocks | None:
        return self.tables.get(seq_id)

    def of(self, seq: Sequence) -> SeqBlocks | None:
        """``seq``'s table (None unless ``seq`` itself is live: an id is not enough)."""
        table = self.tables.get(seq.seq_id)
        return table if table is not None and table.seq is seq else None

    def live(self, seq: Sequence) -> SeqBlocks:
        table = self.of(seq)
        if table is None:
            raise ValueError(f"sequence {seq.seq_id!r} holds no blocks in this cache")
        return table

    def add(self, table: SeqBlocks) -> None:
        self.tables[table.seq.seq_id] = table
        self.grew(table.seq.domain, len(table.blocks))

    def remove(self, table: SeqBlocks) -> None:
        del self.tables[table.seq.seq_id]
        self.grew(table.seq.domain, -len(table.blocks))

    def grew(self, domain: str, num: int) -> None:
        """``domain``'s tables hold ``num`` more blocks (fewer if negative)."""
        held = self._held.get(domain, 0) + num
        if held:
            self._held[domain] = held
        else:
            del self._held[domain]

    def held(self, domain: str) -> int:
        return self._held.get(domain, 0)

    def held_by_domain(self) -> dict[str, int]:
        """Blocks in live tables per domain (domains holding none left out)."""
        return dict(self._held)

    def check(self, refs: Counter[int], block_size: int) -> None:
        """Check every table, and add its references (all but its index-held path) to
        ``refs``."""
        held: Counter[str] = Counter()
        for seq_id, table in self.tables.items():
            refs.update(table.block_ids[table.num_path :])
            held[table.seq.domain] += len(table.blocks)
            _check_table(seq_id, table, block_size)
        held = +held
        check_invariant(held == self._held, "blocks held per domain {} == {}", self._held, held)


def _check_table(seq_id: str, table: SeqBlocks, bs: int) -> None:
    blocks = table.blocks
    check_invariant(
        table.seq.seq_id == seq_id and [b.block_id for b in blocks] == table.block_ids,
        "table of {!r} belongs to its sequence; its block ids match its blocks",
        seq_id,
    )
    computed, allocated = table.num_computed_tokens, table.num_alloc_tokens
    check_invariant(
        computed <= allocated <= len(blocks) * bs,
        "computed <= allocated <= table size for {!r}",
        seq_id,
    )
    # the blocks about to be written (none when nothing is pending)
    for block in blocks[computed // bs : -(-allocated // bs) if allocated > computed else 0]:
        check_invariant(block.ref_cnt == 1, "a shared block is never a write target", block)
