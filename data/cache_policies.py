"""Reference cache policies over a known access stream: the yardsticks for the clairvoyant loader.

`lru_hits` is what a cache without knowledge of the future does; `belady_hits`
is the offline optimum (Belady's MIN with bypass: on a miss with a full cache,
evict the cached item whose next use is furthest away, unless the newcomer's is
further still). Both are written plainly, independent of `cache_plan`, so the
benchmark and tests compare the loader against an implementation it shares no
code with.
"""

from __future__ import annotations

import collections
import heapq

import numpy as np


def lru_hits(stream, capacity: int) -> np.ndarray:
    """[len(stream)] bool: which accesses an LRU cache of `capacity` items serves."""
    cache: collections.OrderedDict[int, None] = collections.OrderedDict()
    hits = np.zeros(len(stream), bool)
    if capacity <= 0:
        return hits
    for i, s in enumerate(np.asarray(stream).tolist()):
        if s in cache:
            hits[i] = True
            cache.move_to_end(s)
            continue
        cache[s] = None
        if len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def belady_hits(stream, capacity: int) -> np.ndarray:
    """[len(stream)] bool: which accesses the offline-optimal cache of `capacity` items serves."""
    items = np.asarray(stream).tolist()
    never = len(items) + 1
    next_use, last = [never] * len(items), {}
    for i in range(len(items) - 1, -1, -1):
        next_use[i] = last.get(items[i], never)
        last[items[i]] = i
    hits = np.zeros(len(items), bool)
    if capacity <= 0:
        return hits
    cached: dict[int, int] = {}  # item -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, item), stale entries skipped
    for i, s in enumerate(items):
        n = next_use[i]
        if s in cached:
            hits[i] = True
        elif len(cached) >= capacity:
            while -heap[0][0] != cached.get(heap[0][1]):
                heapq.heappop(heap)
            if -heap[0][0] <= n:
                continue  # bypass: everything cached is needed sooner than the newcomer
            del cached[heapq.heappop(heap)[1]]
        cached[s] = n
        heapq.heappush(heap, (-n, s))
    return hits
