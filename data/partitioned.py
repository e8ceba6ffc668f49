"""Non-i.i.d. data for DiLoCo replicas: replica m's rows of every global batch come from its own slice of the data.

DiLoCo's paper also trains replicas on disjoint shards of the data (one domain per worker). The token range is cut
into M contiguous parts; part m has its own seeded iterator (seed + m) over B/M rows, and a global batch is the
parts' batches stacked in replica order, which is how `jaxlm.diloco` hands rows to replicas. The state is every
part's O(1) position, so a resumed run continues each partition exactly.
"""

from __future__ import annotations

import numpy as np

from data.access_plan import checked_rows
from data.iterator import Batch, SeededBatchIterator


class PartitionedBatches:
    def __init__(
        self,
        tokens,
        *,
        parts: int,
        batch_size: int,
        seq_len: int,
        seed: int,
        start: int,
        stop: int,
        eos_id: int | None = None,
    ):
        if parts < 1 or batch_size % parts:
            raise ValueError(f"batch_size {batch_size} must split evenly into {parts} partitions")
        bounds = np.linspace(start, stop, parts + 1).astype(np.int64)
        self.rows_per_part = batch_size // parts
        self.parts = [
            SeededBatchIterator(
                tokens,
                batch_size=self.rows_per_part,
                seq_len=seq_len,
                seed=seed + m,
                start=int(bounds[m]),
                stop=int(bounds[m + 1]),
                eos_id=eos_id,
            )
            for m in range(parts)
        ]
        self.batch_size = batch_size
        self.held = list(range(parts))  # parts with rows this process reads

    def set_rows(self, start: int, stop: int) -> None:
        """Rows [start, stop) of each global batch from now on; parts outside them are skipped, not read."""
        start, stop = checked_rows(start, stop, self.batch_size)
        b, self.held = self.rows_per_part, []
        for m, part in enumerate(self.parts):
            lo, hi = max(start, m * b) - m * b, min(stop, (m + 1) * b) - m * b
            if lo < hi:
                part.set_rows(lo, hi)
                self.held.append(m)

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        batches = []
        for m, part in enumerate(self.parts):
            if m in self.held:
                batches.append(next(part))
            else:
                part.skip()
        return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}

    def get_state(self) -> dict[str, int]:
        return {f"part{m}.{k}": v for m, part in enumerate(self.parts) for k, v in part.get_state().items()}

    def set_state(self, state: dict[str, int]) -> None:
        for m, part in enumerate(self.parts):
            prefix = f"part{m}."
            mine = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            if not mine:
                raise ValueError(
                    f"data state has no entries for partition {m} (keys {sorted(state)[:4]}...): "
                    f"was it written with another diloco.data or diloco.replicas?"
                )
            part.set_state(mine)
