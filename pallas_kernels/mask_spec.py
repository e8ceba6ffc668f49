"""Mask spec strings, as a run's config writes them, -> static mask objects.

``"causal & sliding_window(1024)"`` or ``"causal & document"``: ``document`` stands for the batch's segment ids, bound
when the batch is known (a `DocumentSlot`).
"""

from __future__ import annotations

import ast
import functools

from .kernel_mask import DocumentSlot
from .masks import And, Mask, Or, causal, chunked_causal, document, full, global_tokens, prefix_lm, sliding_window

_SPEC_CONSTRUCTORS = {
    "sliding_window": sliding_window,
    "chunked_causal": chunked_causal,
    "prefix_lm": prefix_lm,
    "global_tokens": global_tokens,
}
_SPEC_NAMES = {"causal": causal, "full": full}


@functools.lru_cache(maxsize=64)
def parse_mask(spec: str) -> Mask:
    """A mask spec string -> a static mask, with ``document`` as a slot for the batch's segment ids.

    Grammar: names ``causal``, ``full``, ``document``; calls ``sliding_window(n)``, ``chunked_causal(n)``,
    ``prefix_lm(n)``, ``global_tokens(n)`` with integer literals; ``&``, ``|`` and parentheses.
    """
    try:
        tree = ast.parse(spec.strip(), mode="eval").body
    except SyntaxError:
        raise ValueError(f"attention mask spec {spec!r} is not a valid expression") from None

    def build(node):
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitAnd, ast.BitOr)):
            a, b = build(node.left), build(node.right)
            return a & b if isinstance(node.op, ast.BitAnd) else a | b
        if isinstance(node, ast.Name) and node.id in _SPEC_NAMES:
            return _SPEC_NAMES[node.id]()
        if isinstance(node, ast.Name) and node.id == "document":
            return DocumentSlot(0)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name = node.func.id
            if name in _SPEC_NAMES | {"document": None} and not node.args and not node.keywords:
                return build(node.func)
            if (
                name in _SPEC_CONSTRUCTORS
                and len(node.args) == 1
                and not node.keywords
                and isinstance(node.args[0], ast.Constant)
                and type(node.args[0].value) is int
            ):
                return _SPEC_CONSTRUCTORS[name](node.args[0].value)
        known = sorted(_SPEC_NAMES) + ["document"] + [f"{n}(int)" for n in _SPEC_CONSTRUCTORS]
        raise ValueError(
            f"attention mask spec {spec!r}: cannot read {ast.unparse(node)!r}; use {', '.join(known)} "
            f"combined with & and |"
        )

    return build(tree)


def uses_documents(mask: Mask) -> bool:
    if isinstance(mask, DocumentSlot):
        return True
    return any(uses_documents(m) for m in getattr(mask, "masks", ()))


def bind_segments(mask: Mask, q_segment_ids, kv_segment_ids=None) -> Mask:
    """The parsed mask with its ``document`` slot reading the batch's segment ids (the keys' own, e.g. another
    shard's, when given)."""
    if isinstance(mask, DocumentSlot):
        return document(q_segment_ids, kv_segment_ids)
    if isinstance(mask, (And, Or)):
        return type(mask)(tuple(bind_segments(m, q_segment_ids, kv_segment_ids) for m in mask.masks))
    return mask
