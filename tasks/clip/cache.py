"""A cache of encoded samples for datasets larger than memory, with CoorDL's policy (Mohan et al., "Analyzing
and Mitigating Data Stalls in DNN Training", VLDB 2021, the MinIO cache): an item, once cached, stays; an item
that misses is cached only while there is room, and nothing is ever evicted for it. Under random epochs every
item is read once per epoch, so LRU (the page cache's policy, roughly) evicts exactly the items the rest of the
epoch will ask for and thrashes once the data set exceeds memory; keeping a fixed subset hits on
capacity/dataset of the reads, every epoch.

Partitioned across ranks (CoorDL's partitioned caching): the loader gives each rank only the samples it owns
(`owner`), so no sample is cached by two ranks and the ranks together cache up to `ranks x capacity`."""

from __future__ import annotations

from collections.abc import Callable


def owner(position: int, ranks: int) -> int:
    """The rank that owns (reads and caches) the sample at `position` in the training list."""
    return position % ranks


class NoEvictCache:
    """key -> bytes, at most `capacity` bytes of values; counts hits, misses and the bytes read on a miss."""

    def __init__(self, capacity: int):
        self.capacity, self.used = capacity, 0
        self.items: dict[str, bytes] = {}
        self.hits = self.misses = self.bytes_read = 0

    def get(self, key: str, read: Callable[[], bytes]) -> bytes:
        """The cached value of `key`, else `read()` (cached if it fits; nothing is evicted for it)."""
        data = self.items.get(key)
        if data is not None:
            self.hits += 1
            return data
        data = read()
        self.misses += 1
        self.bytes_read += len(data)
        if self.used + len(data) <= self.capacity:
            self.items[key] = data
            self.used += len(data)
        return data

    def stats(self) -> dict:
        return {"cache_hits": self.hits, "cache_misses": self.misses, "cache_bytes_read": self.bytes_read,
                "cache_items": len(self.items), "cache_used": self.used}
