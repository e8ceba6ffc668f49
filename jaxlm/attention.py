"""The one attention entry point: a mask spec and an implementation name in, [B, T, H, D] out.

Implementations:
  reference        dense masked softmax in XLA (grouped, no K/V repeat); the plain baseline
  jax              jax.nn.dot_product_attention (XLA; cuDNN-capable on GPU)
  xla_blocksparse  pallas_kernels.block_sparse_attention_xla: blocked online softmax over non-empty blocks only
  pallas           pallas_kernels.block_sparse_attention: the Pallas kernels (interpret mode on CPU)

Masks are pallas_kernels masks, given as objects or as a spec string from the config, e.g.
``"causal & sliding_window(1024)"`` or ``"causal & document"``; ``document`` stands for the batch's segment ids.

Shapes: B batch, T query length, S key length, K kv heads, G query heads per kv head (H = K * G), D head dim.
Query head h uses kv head h // G (the usual grouped-query convention).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from jaxlm.config import ATTENTION_IMPLS as IMPLEMENTATIONS
from pallas_kernels.kernel_mask import DocumentSlot
from pallas_kernels.mask_spec import parse_mask, uses_documents

BLOCK_SPARSE = ("xla_blocksparse", "pallas")
BATCH_MESH_AXES = ("data", "fsdp")  # mesh axes the block-sparse kernels shard the batch over (see _shard_map)
HEAD_MESH_AXIS = "tensor"

def _bind_segments(mask: pk.Mask, segment_ids_BT) -> pk.Mask:
    if isinstance(mask, DocumentSlot):
        return pk.document(segment_ids_BT)
    if isinstance(mask, (pk.masks.And, pk.masks.Or)):
        return type(mask)(tuple(_bind_segments(m, segment_ids_BT) for m in mask.masks))
    return mask


def attention(
    q_BTHD: jax.Array,
    k_BSKD: jax.Array,
    v_BSKD: jax.Array,
    *,
    mask: str | pk.Mask = "causal",
    segment_ids_BT: jax.Array | None = None,
    scale: float | None = None,
    score_mod: pk.ScoreMod | None = None,
    impl: str = "reference",
    block_sizes: pk.BlockSizes = pk.BlockSizes(),
) -> jax.Array:
    """Softmax attention under ``mask`` (a Mask or a spec string), returning [B, T, H, D].

    ``segment_ids_BT`` feeds the mask's ``document`` term (packed sequences) and is ignored by masks without one.
    Block-sparse implementations shrink ``block_sizes`` to the sequence (rounded up to a power of two) and, when a
    mesh with data/fsdp/tensor axes is in context, run per shard under ``jax.shard_map`` (batch and heads split).
    """
    B, T, H, D = q_BTHD.shape
    S, K = k_BSKD.shape[1], k_BSKD.shape[2]
    if H % K:
        raise ValueError(f"query heads ({H}) must be a multiple of kv heads ({K})")
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {IMPLEMENTATIONS}")
    template = parse_mask(mask) if isinstance(mask, str) else mask
    if not uses_documents(template):
        segment_ids_BT = None  # nothing reads them: don't carry them into the kernels' shard_map
    elif segment_ids_BT is None:
        raise ValueError("the attention mask uses document() but no segment ids were given (the batch needs "
                         "'segment_ids')")
    scale = D**-0.5 if scale is None else scale

    if impl in BLOCK_SPARSE:
        return _shard_map(functools.partial(_block_sparse, template=template, scale=scale, score_mod=score_mod,
                                            impl=impl, block_sizes=block_sizes),
                          q_BTHD, k_BSKD, v_BSKD, segment_ids_BT)
    mask_obj = _bind_segments(template, segment_ids_BT)
    if impl == "jax":
        if score_mod is not None:
            raise ValueError("attention impl 'jax' (jax.nn.dot_product_attention) does not support score mods")
        is_causal = mask_obj == pk.causal()
        dense = None if is_causal else _dense_mask(mask_obj, T, S)
        return jax.nn.dot_product_attention(
            q_BTHD, k_BSKD, v_BSKD, mask=None if dense is None else dense[:, None], is_causal=is_causal,
            scale=scale, implementation="xla")
    return _reference(q_BTHD, k_BSKD, v_BSKD, _dense_mask(mask_obj, T, S), scale, score_mod)


def _dense_mask(mask: pk.Mask, T: int, S: int):
    m = jnp.asarray(mask(jnp.arange(T, dtype=jnp.int32)[:, None], jnp.arange(S, dtype=jnp.int32)[None, :]))
    return m if m.ndim == 3 else m[None]  # [B or 1, T, S]


def _reference(q_BTHD, k_BSKD, v_BSKD, mask_BTS, scale, score_mod):
    """Grouped attention without materialising repeated K/V: scores are [B, K, G, T, S]."""
    B, T, H, D = q_BTHD.shape
    S, K = k_BSKD.shape[1], k_BSKD.shape[2]
    q_BTKGD = q_BTHD.reshape(B, T, K, H // K, D)
    scores = jnp.einsum("btkgd,bskd->bkgts", q_BTKGD * scale, k_BSKD, preferred_element_type=jnp.float32)
    if score_mod is not None:
        head = jnp.arange(H, dtype=jnp.int32).reshape(1, K, H // K, 1, 1)
        scores = score_mod(scores, jnp.arange(T)[:, None], jnp.arange(S)[None, :], head)
    scores = jnp.where(mask_BTS[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSKD.dtype)
    out_BTKGD = jnp.einsum("bkgts,bskd->btkgd", probs, v_BSKD)
    return out_BTKGD.reshape(B, T, H, D)


def _fit_block(block: int, length: int) -> int:
    """The configured block, or the sequence rounded up to a power of two when that is smaller."""
    return min(block, 1 << max(0, (length - 1).bit_length()))


def _block_sparse(q_BTHD, k_BSKD, v_BSKD, segment_ids_BT, *, template, scale, score_mod, impl, block_sizes):
    T, S = q_BTHD.shape[1], k_BSKD.shape[1]
    bs = pk.BlockSizes(_fit_block(block_sizes.block_q, T), _fit_block(block_sizes.block_kv, S))
    block_mask = pk.make_block_mask(_bind_segments(template, segment_ids_BT), T, S, bs)
    fn = pk.block_sparse_attention if impl == "pallas" else pk.block_sparse_attention_xla
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q_BTHD, k_BSKD, v_BSKD))
    out_BHTD, _ = fn(q, k, v, block_mask, scale=scale, score_mod=score_mod)
    return out_BHTD.transpose(0, 2, 1, 3)


def _shard_map(fn, q_BTHD, k_BSKD, v_BSKD, segment_ids_BT):
    """Run ``fn`` per shard when a mesh is in context: a kernel is a custom call XLA cannot partition itself.

    Batch goes over the mesh's data/fsdp axes and heads over tensor, where those are free (not already manual,
    e.g. inside a user's shard_map) and divide the sizes; everything else is replicated.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return fn(q_BTHD, k_BSKD, v_BSKD, segment_ids_BT)
    free = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Manual}
    B, K = q_BTHD.shape[0], k_BSKD.shape[2]
    batch_axes, size = [], 1
    for a in BATCH_MESH_AXES:
        if a in free and mesh.shape[a] > 1 and B % (size * mesh.shape[a]) == 0:
            batch_axes.append(a)
            size *= mesh.shape[a]
    head = HEAD_MESH_AXIS if HEAD_MESH_AXIS in free and K % mesh.shape.get(HEAD_MESH_AXIS, 1) == 0 else None
    if not batch_axes and head is None:
        return fn(q_BTHD, k_BSKD, v_BSKD, segment_ids_BT)
    batch = tuple(batch_axes) or None
    x_spec = P(batch, None, head, None)
    seg_spec = None if segment_ids_BT is None else P(batch, None)
    return jax.shard_map(fn, mesh=mesh, in_specs=(x_spec, x_spec, x_spec, seg_spec), out_specs=x_spec,
                         axis_names=free, check_vma=False)(q_BTHD, k_BSKD, v_BSKD, segment_ids_BT)
