"""What the kernels do to their inputs before the math: which lowering a Pallas call takes, padding to whole
blocks, and for both block-sparse attention implementations (Pallas kernels, XLA path) the shape contract and the
block mask's lists and segment ids as arrays with a batch dim.

Shape suffixes follow the legend in docs/architecture.md."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from .block_mask import PARTIAL, BlockMask
from .kernel_mask import bind_documents
from .masks import Document, Full, Mask, ScoreMod


@dataclasses.dataclass(frozen=True)
class AttentionStatic:
    """What every block-sparse attention implementation is specialised on (hashable: a custom_vjp's
    non-differentiable argument). Each implementation's own record adds its fields to these."""

    template: Mask  # the mask with document terms as slots
    score_mod: ScoreMod | None
    scale: float
    block_q: int
    block_kv: int
    q_len: int
    kv_len: int
    # No block the kernels walk is PARTIAL, so they need no masked path (in the Mosaic GPU dK/dV the path's code
    # alone, never run, cost registers: sm_90 ptxas, head dim 64, 120 bytes of spills with it, 0 without). Known on
    # the host only: a block mask classified under tracing (documents from the batch) may have PARTIAL blocks.
    masks_nothing: bool

    @staticmethod
    def shared(template: Mask, score_mod: ScoreMod | None, scale: float | None, block_mask: BlockMask, E: int) -> dict:
        """The shared fields as keywords; ``scale`` None is 1 / sqrt(head dim)."""
        bs = block_mask.block_sizes
        return dict(
            template=template,
            score_mod=score_mod,
            scale=1.0 / math.sqrt(E) if scale is None else float(scale),
            block_q=bs.block_q,
            block_kv=bs.block_kv,
            q_len=block_mask.q_len,
            kv_len=block_mask.kv_len,
            masks_nothing=not block_mask.is_traced and not np.any(block_mask.kind == PARTIAL),
        )

    @property
    def masks_padding_only(self) -> bool:
        """The mask has no term of its own (``full()``): its PARTIAL blocks, if any, only cut the padding."""
        return isinstance(self.template, Full)

    @property
    def n_mod_arrays(self) -> int:
        """How many arrays the score mod captures: kernel inputs after the document ids."""
        return len(self.score_mod.arrays()) if self.score_mod is not None else 0

    def mod_scores(self, s, q_pos, kv_pos, head, with_grad: bool = False, arrays=(), tile=None):
        """(the score mod applied to scores ``s``, d mod / d s when ``with_grad``), positions and head broadcasting
        against ``s``; (s, None) without a score mod. Score mods are elementwise in the score, so a jvp with ones is
        the derivative; it is None too where the mod only adds to the score (``adds_to_score``: the derivative is
        1). A mod that captures arrays reads ``arrays`` (``score_tables``: HeadRows in a kernel, the
        arrays in their own shapes elsewhere). ``tile`` (q_first, q_last, kv_first, kv_last: the tile's positions)
        lets the mod's ``tile_shortcut`` take the tile where it holds. The positions and ``arrays`` may be given as
        functions that make them: with a shortcut they are then made inside each branch, not held across it (in
        the Mosaic GPU kernels what a branch holds adds to the registers the scores already take)."""
        if self.score_mod is None:
            return s, None

        def made(x):
            return x() if callable(x) else x

        def modded(score_mod, ones):
            read = made(arrays)
            score_mod = score_mod.with_arrays(read) if read else score_mod
            q, kv = made(q_pos), made(kv_pos)

            def mod(x):
                return score_mod(x, q, kv, head)

            if with_grad and not self.score_mod.adds_to_score:
                return jax.jvp(mod, (s,), (ones(),))
            return mod(s), None

        cut = self.score_mod.tile_shortcut(*tile) if tile is not None else None
        if cut is None:
            return modded(self.score_mod, lambda: jnp.ones_like(s))
        # the tangent laid out like the scores: a branch that passes a constant's through yields another layout
        # than one that selects over it, and Mosaic GPU's branches must yield the same
        ones = lambda: s * 0.0 + 1.0  # noqa: E731
        return jax.lax.cond(cut[0], lambda: modded(cut[1], ones), lambda: modded(self.score_mod, ones))

    def keep(self, doc_tiles, q_pos, kv_pos):
        """The element mask of a tile: the template with its document slots bound to the loaded id tiles
        ``doc_tiles``, within the real (unpadded) lengths."""
        keep = jnp.asarray(bind_documents(self.template, doc_tiles)(q_pos, kv_pos), dtype=bool)
        return keep & (q_pos < self.q_len) & (kv_pos < self.kv_len)


# Where q, k, v (and out, dO) keep their heads: [B, H, T, E], every kernel's own, or [B, T, H, E], the model's (the
# projections' output as it is). The Mosaic GPU kernels read and write either (a TMA box of a head's rows is a
# strided view), so the model's attention needs no transposes around them; the other kernels transpose.
LAYOUTS = ("BHTE", "BTHE")


def check_layout(name: str, layout: str) -> None:
    """ValueError naming ``name`` unless ``layout`` is one of LAYOUTS."""
    if layout not in LAYOUTS:
        raise ValueError(f"{name}: unknown layout {layout!r}; choose one of {LAYOUTS}")


def seq_axis(layout: str) -> int:
    """The axis of q, k, v in ``layout`` that holds the sequence."""
    return 2 if layout == "BHTE" else 1


def bhte_shape(shape, layout: str) -> tuple:
    """``shape`` of an array in ``layout`` as (B, H, T, E)."""
    return tuple(shape) if layout == "BHTE" else (shape[0], shape[2], shape[1], shape[3])


def to_bhte(x, layout: str):
    """``x`` in ``layout`` as [B, H, T, E] (a transpose from the model's), for the kernels that take only that."""
    return x if layout == "BHTE" else jnp.swapaxes(x, 1, 2)


def from_bhte(x_BHTE, layout: str):
    """[B, H, T, E] back in ``layout``."""
    return x_BHTE if layout == "BHTE" else jnp.swapaxes(x_BHTE, 1, 2)


def head_rows(ref, layout: str, b, h, rows, *rest):
    """The view of ``ref`` (q, k, v, out or their gradients, in ``layout``) that holds batch row ``b``, head ``h``,
    sequence slice ``rows`` (and ``rest``, e.g. a slice of the head dim): what a Mosaic GPU kernel's TMA copies."""
    return ref.at[b, h, rows, *rest] if layout == "BHTE" else ref.at[b, rows, h, *rest]


def check_attention_inputs(name: str, q, k, v, block_mask: BlockMask, layout: str = "BHTE") -> None:
    """The shape contract every block-sparse implementation shares; raises ValueError naming ``name``."""
    check_layout(name, layout)
    B, H, T, E = bhte_shape(q.shape, layout)
    _, K, S, _ = bhte_shape(k.shape, layout)
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != E:
        want = "[B, H, T, E] / [B, K, S, E]" if layout == "BHTE" else "[B, T, H, E] / [B, S, K, E]"
        raise ValueError(f"{name}: q {list(q.shape)} and k/v {list(k.shape)}/{list(v.shape)} shapes do not fit {want}")
    if H % K:
        raise ValueError(f"{name}: kv heads {K} must divide query heads {H}")
    if (T, S) != (block_mask.q_len, block_mask.kv_len):
        raise ValueError(
            f"{name}: q/kv lengths {(T, S)} do not match the block mask's {(block_mask.q_len, block_mask.kv_len)}"
        )
    if len(block_mask.batch_shape) > 1 or block_mask.batch_shape not in ((), (1,), (B,)):
        raise ValueError(f"{name}: block mask batch shape {block_mask.batch_shape} does not match batch size {B}")


BACKENDS = ("gpu", "tpu", "interpret")

_compile_target: contextvars.ContextVar[str | None] = contextvars.ContextVar("compile_target", default=None)


@contextlib.contextmanager
def compile_target(platform: str):
    """Trace kernels for ``platform`` ("gpu" or "tpu") whatever this machine's default backend is: what compiling
    ahead of time for a device this machine lacks needs (``pallas_kernels.targets``). Inside it, kernels that
    are not told otherwise lower for ``platform`` and ``impl="auto"`` matmuls take the Pallas kernel."""
    if platform not in BACKENDS[:2]:
        raise ValueError(f"compile_target: unknown platform {platform!r}; choose one of {BACKENDS[:2]}")
    token = _compile_target.set(platform)
    try:
        yield
    finally:
        _compile_target.reset(token)


def target_platform() -> str:
    """The platform kernels are traced for: the compile_target in force, else the default backend's."""
    return _compile_target.get() or jax.default_backend()


def hopper_target() -> bool:
    """True when kernels are traced for a Hopper-or-newer GPU (sm_90+): the local GPU's compute capability, or,
    compiling ahead of time with no GPU here (``compile_target("gpu")``), the H100 that ``targets`` describes.
    Only meaningful once the backend resolved to "gpu"."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return True
    return float(getattr(gpus[0], "compute_capability", "9.0")) >= 9.0


def resolve_backend(name: str, interpret: bool | None, backend: str | None) -> str:
    """'interpret' (the default on CPU), or the lowering to target: ``backend`` if given, else the default device's.
    Setting ``backend`` lets a CPU machine lower (export) a kernel for an accelerator."""
    platform = target_platform()
    if interpret is None:
        interpret = platform == "cpu"
    backend = "interpret" if interpret else (backend or ("tpu" if platform == "tpu" else "gpu"))
    if backend not in BACKENDS:
        raise ValueError(f"{name}: unknown backend {backend!r}; choose one of {BACKENDS[:2]}")
    return backend


def like(shape, dtype, x) -> jax.ShapeDtypeStruct:
    """An output type that varies over the same manual mesh axes as ``x`` (kernels run inside shard_map too)."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(x).mat)


def pad_axis(x, axis: int, size: int, value=0):
    """Pad ``x`` along ``axis`` up to ``size`` with ``value`` (zeros by default)."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def list_arrays(block_mask: BlockMask) -> tuple:
    """(kv_block_indices, kv_partial_counts, kv_block_counts, q_block_indices, q_partial_counts, q_block_counts),
    each with a leading batch dim: B for per-batch (document) masks, 1 for static ones."""
    arrays = (
        block_mask.kv_block_indices,
        block_mask.kv_partial_counts,
        block_mask.kv_block_counts,
        block_mask.q_block_indices,
        block_mask.q_partial_counts,
        block_mask.q_block_counts,
    )
    return tuple(_batched(block_mask, a) for a in arrays)


def _batched(block_mask: BlockMask, a):
    """``a`` (one of the block mask's arrays, or made from one) with a leading batch dim: the mask's, else 1."""
    return jnp.asarray(a) if block_mask.batch_shape else jnp.asarray(a)[None]


#: where ``line_orders``' two arrays sit in the mask arrays the Pallas GPU kernels take, after ``list_arrays``' six
ROW_ORDER, COLUMN_ORDER = 6, 7


def heavy_first(counts):
    """[.., lines] int32: the block mask's lines (rows or columns) in the order a kernel's programs take them, the
    most tiles first, ties in index order. A static mask's order is worked out on the host, a constant of the
    program; a traced mask's (documents) is sorted on the device.

    Why: a GPU starts programs in grid order as SMs free up, so the last programs started set the tail. In index
    order a causal mask's forward and dQ take their longest rows last: simulated on 132 SMs (one program each), the
    kernel then ends 5.8-6.3% after the work divided evenly, heavy first 0.2-1.8% (B x H x rows = 8 x 16 x 16, 2 x
    16 x 64, 1 x 16 x 128; ``python -m experiments.program_order``). FlashAttention-3 reverses a causal mask's rows
    for this; this does it for any mask."""
    if isinstance(counts, np.ndarray):
        return np.argsort(-counts, axis=-1, kind="stable").astype(np.int32)
    return jnp.argsort(-counts, axis=-1, stable=True).astype(jnp.int32)


def line_orders(block_mask: BlockMask) -> tuple:
    """(the q block rows' order, the kv block columns'), ``heavy_first``, with ``list_arrays``' leading batch dim:
    the Mosaic GPU kernels' programs walk the block mask's lines in these orders."""
    counts = (block_mask.kv_block_counts, block_mask.q_block_counts)
    return tuple(_batched(block_mask, heavy_first(c)) for c in counts)


def segment_arrays(name: str, docs: list[Document], block_mask: BlockMask, batch: int) -> list:
    """Per document term: (q ids [1 or B, padded q_len], kv ids [1 or B, padded kv_len]) int32, zero-padded."""
    T, S = block_mask.q_len, block_mask.kv_len
    out = []
    for d in docs:
        q_ids, kv_ids = (jnp.atleast_2d(jnp.asarray(x, jnp.int32)) for x in (d.q_segment_ids, d.kv_segment_ids))
        if q_ids.shape[0] not in (1, batch) or q_ids.shape[-1] != T or kv_ids.shape[-1] != S:
            raise ValueError(
                f"{name}: document segment ids {list(q_ids.shape)} / {list(kv_ids.shape)} do not fit "
                f"batch {batch}, q length {T}, kv length {S}"
            )
        out.append((pad_axis(q_ids, 1, block_mask.padded_q_len), pad_axis(kv_ids, 1, block_mask.padded_kv_len)))
    return out
