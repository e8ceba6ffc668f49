"""A process's fast storage tiers: RAM and a local-disk slot file, behind one thread-safe cache.

The cache only executes decisions: what to store, drop or demote, and when,
comes from the placement plan. Fetch workers read it (and may wait for a sample
the plan says is about to arrive); peers read it through the peer server.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time

import numpy as np

from data.cache_plan import DISK, RAM


class DiskTier:
    """Fixed-size slots in one preallocated file: a sample is one pwrite / pread, no per-sample files."""

    def __init__(self, directory: str | os.PathLike, capacity_samples: int, sample_shape: tuple[int, ...], dtype):
        self.capacity, self.shape, self.dtype = int(capacity_samples), tuple(sample_shape), np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
        self._slot: dict[int, int] = {}
        self._free = list(range(self.capacity - 1, -1, -1))
        self._fd = None
        if self.capacity:
            os.makedirs(directory, exist_ok=True)
            fd, self.path = tempfile.mkstemp(prefix="jaxlm-cache-", suffix=".slots", dir=directory)
            os.unlink(self.path)  # the file disappears with the process, however it ends
            self._fd = fd

    def __contains__(self, sample: int) -> bool:
        return sample in self._slot

    def put(self, sample: int, row: np.ndarray) -> None:
        """Raises OSError (e.g. disk full) without changing the tier."""
        if sample in self._slot:
            return
        if not self._free:
            raise OSError(f"disk tier is full ({self.capacity} samples)")
        slot = self._free.pop()
        try:
            data = np.ascontiguousarray(row, self.dtype).tobytes()
            if os.pwrite(self._fd, data, slot * self.nbytes) != len(data):
                raise OSError("short write to the disk tier")
        except BaseException:
            self._free.append(slot)
            raise
        self._slot[sample] = slot

    def get(self, sample: int) -> np.ndarray | None:
        slot = self._slot.get(sample)
        if slot is None:
            return None
        data = os.pread(self._fd, self.nbytes, slot * self.nbytes)
        return np.frombuffer(data, self.dtype).reshape(self.shape).copy()

    def drop(self, sample: int) -> None:
        slot = self._slot.pop(sample, None)
        if slot is not None:
            self._free.append(slot)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class TieredCache:
    """RAM dict + DiskTier. `wait_get` blocks until a sample arrives, is given up on, or the timeout passes."""

    def __init__(self, ram_samples: int, disk_samples: int, sample_shape, dtype, disk_dir=None):
        self.ram_capacity = int(ram_samples)
        self._ram: dict[int, np.ndarray] = {}
        self.disk = DiskTier(disk_dir or tempfile.gettempdir(), disk_samples, sample_shape, dtype)
        self._failed: set[int] = set()  # a store that could not be done: nobody should wait for these
        self._dropped: set[int] = set()
        self._cond = threading.Condition()
        self.store_failures = 0

    def get(self, sample: int) -> tuple[np.ndarray, int] | None:
        with self._cond:
            row = self._ram.get(sample)
            if row is not None:
                return row, RAM
            if sample in self.disk:
                return self.disk.get(sample), DISK
        return None

    def wait_get(
        self, sample: int, timeout_s: float, give_up_if_dropped: bool = False
    ) -> tuple[np.ndarray, int] | None:
        """Waits for a sample the plan says is coming. A failed store ends the wait at once; so does an earlier
        drop when `give_up_if_dropped` (a peer asking for what this process already evicted)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                found = self.get(sample)
                if found is not None or sample in self._failed or (give_up_if_dropped and sample in self._dropped):
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def store(self, sample: int, row: np.ndarray, tier: int) -> bool:
        """Caches `row`; False (counted, sample marked gone) if the tier cannot take it (full, disk error)."""
        with self._cond:
            try:
                if tier == RAM:
                    if len(self._ram) >= self.ram_capacity and sample not in self._ram:
                        raise OSError(f"RAM tier is full ({self.ram_capacity} samples)")
                    self._ram[sample] = np.asarray(row)
                else:
                    self.disk.put(sample, row)
                self._failed.discard(sample)
                self._dropped.discard(sample)
                return True
            except OSError:
                self.store_failures += 1
                self._failed.add(sample)
                return False
            finally:
                self._cond.notify_all()

    def drop(self, sample: int, tier: int) -> None:
        with self._cond:
            if tier == RAM:
                self._ram.pop(sample, None)
            else:
                self.disk.drop(sample)
            self._dropped.add(sample)
            self._cond.notify_all()

    def demote(self, sample: int) -> None:
        """RAM -> disk; a failed disk write just drops it (a later access reads the source)."""
        with self._cond:
            row = self._ram.pop(sample, None)
            if row is not None:
                self.store(sample, row, DISK)

    def close(self) -> None:
        with self._cond:
            self._ram.clear()
            self.disk.close()
