"""Masks as kernels see them: document terms swapped for slots, so the rest of the mask is static.

A kernel cannot gather ``segment_ids[q_idx]`` inside a tile; it loads the segment-id tile of its q block and of the
kv block it is visiting and compares those. ``split_documents`` turns ``causal() & document(ids)`` into the static,
hashable template ``causal() & DocumentSlot(0)`` plus the list of Document objects (whose arrays become kernel
inputs); ``bind_documents`` puts the loaded tiles back in the slots inside the kernel.
"""

from __future__ import annotations

import dataclasses

from .masks import And, At, Document, Mask, Or


@dataclasses.dataclass(frozen=True)
class DocumentSlot(Mask):
    """Stands for the ``index``-th document term of a mask until ``bind_documents`` fills it."""

    index: int

    def __call__(self, q_idx, kv_idx):
        raise TypeError(f"DocumentSlot({self.index}) has no segment ids; use bind_documents first")

    def __repr__(self):
        return f"document#{self.index}"


@dataclasses.dataclass(frozen=True)
class PositionSlot(Mask):
    """Stands for an At term: its static mask, evaluated at the ``index``-th loaded pair of tiles (positions)."""

    index: int
    mask: Mask

    def __call__(self, q_idx, kv_idx):
        raise TypeError(f"PositionSlot({self.index}) has no positions; use bind_documents first")

    def __repr__(self):
        return f"at_positions#{self.index}({self.mask!r})"


class _TileApply(Mask):
    """The static ``mask`` on the loaded position tiles q_tile [bq, 1] and kv_tile [1, bkv] (or transposed)."""

    is_static = False

    def __init__(self, mask, q_tile, kv_tile):
        self.mask, self.q_tile, self.kv_tile = mask, q_tile, kv_tile

    def __call__(self, q_idx, kv_idx):
        return self.mask(self.q_tile, self.kv_tile)


class _TileEquality(Mask):
    """q_tile [bq, 1] == kv_tile [1, bkv]: the document mask on the tiles a kernel has loaded."""

    is_static = False

    def __init__(self, q_tile, kv_tile):
        self.q_tile, self.kv_tile = q_tile, kv_tile

    def __call__(self, q_idx, kv_idx):
        return self.q_tile == self.kv_tile


def split_documents(mask: Mask) -> tuple[Mask, list[Document]]:
    """(static template, document terms in slot order). Raises for array-holding masks a kernel cannot load."""
    docs: list[Document] = []

    def walk(m):
        if isinstance(m, Document):
            docs.append(m)
            return DocumentSlot(len(docs) - 1)
        if isinstance(m, At):  # its positions load like segment ids
            docs.append(m.positions)
            return PositionSlot(len(docs) - 1, m.mask)
        if isinstance(m, (And, Or)):
            return type(m)(tuple(walk(c) for c in m.masks))
        if not m.is_static:
            raise ValueError(
                f"mask {m!r} holds arrays the kernel does not know how to load; kernels support "
                f"static masks, document() and at_positions()"
            )
        return m

    return walk(mask), docs


def bind_documents(template: Mask, tiles) -> Mask:
    """The template with slot i replaced by the comparison of ``tiles[i] = (q_tile, kv_tile)``."""
    if isinstance(template, DocumentSlot):
        return _TileEquality(*tiles[template.index])
    if isinstance(template, PositionSlot):
        return _TileApply(template.mask, *tiles[template.index])
    if isinstance(template, (And, Or)):
        return type(template)(tuple(bind_documents(c, tiles) for c in template.masks))
    return template
