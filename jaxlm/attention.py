"""The one attention entry point: a mask spec and an implementation name in, [B, T, H, E] out.

Implementations:
  auto             the fastest measured for the platform, mask and length (`auto_impl`); the default
  reference        dense masked softmax in XLA (grouped, no K/V repeat); the plain baseline
  jax              jax.nn.dot_product_attention: cuDNN's fused kernel on a GPU for bf16/fp16, causal or no mask and
                   head dim <= 128 (jaxlm.attention.cudnn_fits), XLA's otherwise
  xla_blocksparse  pallas_kernels.block_sparse_attention_xla: the non-empty tiles only (a host mask's as a few large
                   products merged by log-sum-exp, a traced one's by a scan over the tiles)
  pallas           pallas_kernels.block_sparse_attention: the Pallas kernels (interpret mode on CPU)

Masks are pallas_kernels masks, given as objects or as a spec string from the config, e.g.
``"causal & sliding_window(1024)"`` or ``"causal & document"``; ``document`` stands for the batch's segment ids.

Shape suffixes follow the legend in docs/architecture.md. Query head h uses kv head h // G (the usual grouped-query
convention).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from jaxlm.config import ATTENTION_IMPLS as IMPLEMENTATIONS
from pallas_kernels.kernel_inputs import target_platform
from pallas_kernels.mask_spec import bind_segments, parse_mask, uses_documents
from pallas_kernels.targets import cudnn_attention_takes
from pallas_kernels.xla_tiled_attention import STRIPS_MAX_LEN
from sharding.context import context_attention
from sharding.rules import active_mesh_axes, dividing_axes

BLOCK_SPARSE = ("xla_blocksparse", "pallas")


def attention(
    q_BTHE: jax.Array,
    k_BSKE: jax.Array,
    v_BSKE: jax.Array,
    *,
    mask: str | pk.Mask = "causal",
    segment_ids_BT: jax.Array | None = None,
    scale: float | None = None,
    score_mod: pk.ScoreMod | None = None,
    impl: str = "reference",
    block_sizes: pk.BlockSizes = pk.BlockSizes(),
    positions_BT: jax.Array | None = None,
    context_parallel: str = "ring",
    deterministic: bool = True,
) -> jax.Array:
    """Softmax attention under ``mask`` (a Mask or a spec string), returning [B, T, H, E].

    ``segment_ids_BT`` feeds the mask's ``document`` term (packed sequences) and is ignored by masks without one.
    Block-sparse implementations shrink ``block_sizes`` to the sequence (rounded up to a power of two) and, when a
    mesh is in context, run per shard under ``jax.shard_map``, batch and heads split as the active sharding rules
    split them; when the rules split the sequence too (a `context` axis), each shard attends its queries to every
    shard's keys, by ``context_parallel`` ("ring" or "all_gather", sharding.context), masked at ``positions_BT``
    (default: 0..T-1, the tokens' places in their rows; a numpy array [T] when every row has the same, known when
    tracing, as a balancing reorder gives them). Not ``deterministic``: the Pallas kernels' backward on Hopper sums
    dQ across programs in no fixed order (``pallas_kernels.block_sparse_attention``).
    """
    B, T, H, E = q_BTHE.shape
    S, K = k_BSKE.shape[1], k_BSKE.shape[2]
    if H % K:
        raise ValueError(f"query heads ({H}) must be a multiple of kv heads ({K})")
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {IMPLEMENTATIONS}")
    template = parse_mask(mask) if isinstance(mask, str) else mask
    context = _sequence_axes(T)
    if impl == "auto":
        block_sizes = auto_block_sizes(template, q_BTHE, block_sizes)
        impl = auto_impl(template, q_BTHE, score_mod, block_sizes)
        if context and impl not in BLOCK_SPARSE + ("reference",):  # cuDNN's kernel cannot take a split sequence
            impl = "xla_blocksparse" if target_platform() == "cpu" else "pallas"
    if not uses_documents(template):
        segment_ids_BT = None  # nothing reads them: don't carry them into the kernels' shard_map
    elif segment_ids_BT is None:
        raise ValueError(
            "the attention mask uses document() but no segment ids were given (the batch needs 'segment_ids')"
        )
    scale = E**-0.5 if scale is None else scale

    if impl in BLOCK_SPARSE:
        attend = functools.partial(
            _attend, scale=scale, score_mod=score_mod, impl=impl, block_sizes=block_sizes, deterministic=deterministic
        )
        if context:
            if T != S:
                raise ValueError(f"context parallelism attends a sequence to itself; got {T} queries and {S} keys")
            if score_mod is not None and not isinstance(score_mod, pk.masks.SoftCap):
                raise ValueError(f"score mod {score_mod!r} reads positions; under context parallelism only soft_cap")
            order = None  # positions known when tracing (the same for every row): the ring skips what they allow
            if positions_BT is None or isinstance(positions_BT, np.ndarray):
                order, positions_BT = (np.arange(T) if positions_BT is None else positions_BT.reshape(-1, T)[0]), None
            fn = functools.partial(
                context_attention, attend, template=template, axis=context, variant=context_parallel, order=order
            )
            return _shard_map(fn, q_BTHE, k_BSKE, v_BSKE, segment_ids_BT, positions_BT, context)
        known = positions_BT if isinstance(positions_BT, np.ndarray) else None  # closed over, not sharded

        def one_shard(q, k, v, seg, pos):
            return attend(q, k, v, _at(bind_segments(template, seg), known if pos is None else pos))[0]

        traced = None if known is not None else positions_BT
        return _shard_map(one_shard, q_BTHE, k_BSKE, v_BSKE, segment_ids_BT, traced, ())
    mask_obj = _at(bind_segments(template, segment_ids_BT), positions_BT)
    if impl == "jax":
        if score_mod is not None:
            raise ValueError("attention impl 'jax' (jax.nn.dot_product_attention) does not support score mods")
        window = causal_window(mask_obj) if T == S and positions_BT is None else None
        dense = None if window is not None else _dense_mask(mask_obj, T, S)
        return jax.nn.dot_product_attention(
            q_BTHE,
            k_BSKE,
            v_BSKE,
            mask=None if dense is None else dense[:, None],
            is_causal=window is not None,
            local_window_size=(window - 1, 0) if window else None,
            scale=scale,
            implementation="cudnn" if dense is None and cudnn_fits(q_BTHE) else "xla",
        )
    return _reference(q_BTHE, k_BSKE, v_BSKE, _dense_mask(mask_obj, T, S), scale, score_mod)


def auto_impl(template: pk.Mask, q_BTHE, score_mod=None, block_sizes: pk.BlockSizes = pk.BlockSizes()) -> str:
    """What `impl="auto"` runs: the fastest implementation measured for this platform, mask and length.

    CPU: `xla_blocksparse` once the sequence spans more than one query block (its tiled path turns a static mask's
    non-empty tiles into a few large products, 1.3-1.9x the dense reference for causal at T=2k-8k; short sequences
    as strips of `auto_block_sizes`, 1.1-1.7x the dense reference at T=128-256: docs/results/bench_attention.md),
    else `reference` (one tile: nothing to skip).
    GPU: cuDNN's fused kernel (`jax`) where it serves the query (causal, or causal within a sliding window;
    bf16/fp16; `cudnn_fits`): on an H200 the Mosaic GPU kernels' forward + backward ran 0.94-1.25x its own for
    causal at T = 2k-8k (with the backward summing dQ across programs; 1.18x at the ~1B step's GQA shape), yet
    that step with them ran 0.994-0.997x cuDNN's, though the programs around the kernels are the same
    (docs/results/hopper-h200-2026-11-28.md and cudnn-step-traffic-2026-11-28.md; on GPUs before Hopper the Triton
    kernels, 0.3x). The Pallas kernels for every other mask. TPU: the Pallas kernels.
    """
    platform = target_platform()
    if platform == "cpu":
        return "xla_blocksparse" if q_BTHE.shape[1] > block_sizes.block_q else "reference"
    if platform == "gpu" and score_mod is None and causal_window(template) is not None and cudnn_fits(q_BTHE):
        return "jax"
    return "pallas"


#: The tile side `auto` gives the CPU's tiled path for short sequences, which it plans as strips (one product per
#: q block, pallas_kernels.xla_tiled_attention.STRIPS_MAX_LEN): causal forward + backward at T=256 (head dims 64
#: and 128) ran 1.13-1.18x faster in strips of 64 than of 128, 1.3-1.8x faster than of 32.
CPU_STRIP_BLOCK = 64


def auto_block_sizes(template: pk.Mask, q_BTHE, block_sizes: pk.BlockSizes) -> pk.BlockSizes:
    """The tiles `impl="auto"` runs with: on a CPU, CPU_STRIP_BLOCK for a sequence the tiled path plans as strips,
    unless the mask has a document term (its tiles are known only on device: the scan, not strips, runs it); the
    configured ones otherwise."""
    T = q_BTHE.shape[1]
    if target_platform() == "cpu" and not uses_documents(template) and T <= STRIPS_MAX_LEN:
        return pk.BlockSizes(CPU_STRIP_BLOCK, CPU_STRIP_BLOCK)
    return block_sizes


def causal_window(mask: pk.Mask) -> int | None:
    """How `jax.nn.dot_product_attention` can express this mask itself: 0 for causal, w for causal within a
    sliding window of w keys (also written `causal() & sliding_window(w)`), None for any other mask."""
    if mask == pk.causal():
        return 0
    if isinstance(mask, pk.masks.SlidingWindow):
        return mask.window
    if isinstance(mask, pk.masks.And):
        windows = [causal_window(m) for m in mask.masks]
        if None not in windows:
            return min((w for w in windows if w), default=0)
    return None


def cudnn_fits(q_BTHE) -> bool:
    """cuDNN's fused attention serves this query: traced for a GPU, and a dtype and head dim it takes
    (``pallas_kernels.targets.cudnn_attention_takes``)."""
    return target_platform() == "gpu" and cudnn_attention_takes(q_BTHE.dtype, q_BTHE.shape[-1])


def _dense_mask(mask: pk.Mask, T: int, S: int):
    m = jnp.asarray(mask(jnp.arange(T, dtype=jnp.int32)[:, None], jnp.arange(S, dtype=jnp.int32)[None, :]))
    return m if m.ndim == 3 else m[None]  # [B or 1, T, S]


def _reference(q_BTHE, k_BSKE, v_BSKE, mask_BTS, scale, score_mod):
    """Grouped attention without materialising repeated K/V: scores are [B, K, G, T, S]."""
    B, T, H, E = q_BTHE.shape
    S, K = k_BSKE.shape[1], k_BSKE.shape[2]
    q_BTKGE = q_BTHE.reshape(B, T, K, H // K, E)
    scores = jnp.einsum("btkge,bske->bkgts", q_BTKGE * scale, k_BSKE, preferred_element_type=jnp.float32)
    if score_mod is not None:
        head = jnp.arange(H, dtype=jnp.int32).reshape(1, K, H // K, 1, 1)
        scores = score_mod(scores, jnp.arange(T)[:, None], jnp.arange(S)[None, :], head)
    scores = jnp.where(mask_BTS[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSKE.dtype)
    out_BTKGE = jnp.einsum("bkgts,bske->btkge", probs, v_BSKE)
    return out_BTKGE.reshape(B, T, H, E)


def _at(mask: pk.Mask, positions_BT) -> pk.Mask:
    """The mask at the tokens' positions when given (a reordered sequence), else as it is."""
    return mask if positions_BT is None else pk.at_positions(mask, positions_BT)


def _fit_block(block: int, length: int) -> int:
    """The configured block, or the sequence rounded up to a power of two when that is smaller."""
    return min(block, 1 << max(0, (length - 1).bit_length()))


def _attend(q_BTHE, k_BSKE, v_BSKE, mask: pk.Mask, *, scale, score_mod, impl, block_sizes, deterministic=True):
    """One block-sparse product of the queries and keys in hand under ``mask`` (a bound Mask): (out_BTHE, lse_BHT)."""
    T, S = q_BTHE.shape[1], k_BSKE.shape[1]
    bs = pk.BlockSizes(_fit_block(block_sizes.block_q, T), _fit_block(block_sizes.block_kv, S))
    block_mask = pk.make_block_mask(mask, T, S, bs)
    if impl == "pallas":  # in the model's layout: the Mosaic GPU kernels need no transposes around them
        pallas = functools.partial(pk.block_sparse_attention, deterministic=deterministic, layout="BTHE")
        return pallas(q_BTHE, k_BSKE, v_BSKE, block_mask, scale=scale, score_mod=score_mod)
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q_BTHE, k_BSKE, v_BSKE))
    out_BHTE, lse_BHT = pk.block_sparse_attention_xla(q, k, v, block_mask, scale=scale, score_mod=score_mod)
    return out_BHTE.transpose(0, 2, 1, 3), lse_BHT


def _sequence_axes(T: int) -> tuple[str, ...]:
    """The mesh axes the active rules split the sequence over here (a layout's `context`); () without."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = active_mesh_axes("seq")
    if axes and T % math.prod(mesh.shape[a] for a in axes):
        sizes = " x ".join(f"{a}={mesh.shape[a]}" for a in axes)
        raise ValueError(f"a sequence of {T} tokens does not split over mesh axis {sizes}")
    return axes


def _shard_map(fn, q_BTHE, k_BSKE, v_BSKE, segment_ids_BT, positions_BT, seq: tuple[str, ...]):
    """Run ``fn`` per shard when a mesh is in context: a kernel is a custom call XLA cannot partition itself.

    Batch and heads split as the active rules (`sharding.rules.use_rules`, the layout's) split the logical axes
    `batch` and `heads` / `kv_heads`, over the mesh axes that are free here (not manual, e.g. inside a pipeline
    stage or a user's shard_map) and larger than 1, as far as they divide the sizes. Query head h reads kv head
    h // G, so query and kv heads must split alike: heads go over the axes both rules name (and batch does not).
    The sequence splits over ``seq`` (context parallelism: ``fn`` brings the other shards' keys); head dim stays
    whole; everything else is replicated.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return fn(q_BTHE, k_BSKE, v_BSKE, segment_ids_BT, positions_BT)
    B, K = q_BTHE.shape[0], k_BSKE.shape[2]
    batch = dividing_axes(mesh.shape, [a for a in active_mesh_axes("batch") if a not in seq], B)
    kv_heads = active_mesh_axes("kv_heads")
    heads = [a for a in active_mesh_axes("heads") if a in kv_heads and a not in batch + seq]
    heads = dividing_axes(mesh.shape, heads, K)
    if not batch and not heads and not seq:
        return fn(q_BTHE, k_BSKE, v_BSKE, segment_ids_BT, positions_BT)
    tokens = seq or None
    x_spec = P(batch or None, tokens, heads or None, None)
    row_spec = P(batch or None, tokens)
    seg_spec = None if segment_ids_BT is None else row_spec
    pos_spec = None if positions_BT is None else row_spec
    free = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Manual}
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(x_spec, x_spec, x_spec, seg_spec, pos_spec),
        out_specs=x_spec,
        axis_names=free,
        check_vma=False,
    )(q_BTHE, k_BSKE, v_BSKE, segment_ids_BT, positions_BT)
