"""A Llama-style decoder-only transformer in flax.nnx.

Every parameter carries `logical_axes` metadata (e.g. ("embed", "mlp")); `sharding.rules` maps those names to mesh
axes, so the model never knows how it is parallelised. The layers are created stacked (a leading "layers" axis) and
run with `lax.scan`, so compile time does not grow with depth.

Shape suffixes follow the legend in docs/architecture.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.attention import attention
from jaxlm.config import REMAT_CHOICES, ModelConfig
from jaxlm.expert_swiglu import gate_up_grads
from jaxlm.kv_cache import cached_attention, one_document, write_cache
from jaxlm.moe import MoE, RouterBias
from jaxlm.quantized import PROJECTION_NAME, AmaxHistory, amax_history, layer_recipe, project
from pallas_kernels import BlockSizes, soft_cap
from pallas_kernels.mask_spec import parse_mask
from sharding.embedding import sharded_take
from sharding.model_shape import expert_params
from sharding.rules import LOGICAL_AXES_KEY as LOGICAL_AXES
from sharding.rules import constrain

ACTIVATION_AXES = ("batch", "seq", "act_embed")  # x_BTD at every layer boundary
# The logit of a padded vocabulary id. Finite, not -inf: the loss picks the target's logit with a one-hot product,
# and -inf * 0 is NaN. exp(-1e30 - max) is exactly 0 in float32, so softmax and sampling never see it.
PADDED_LOGIT = -1e30

# What the backward pass may keep from each layer's forward; everything else is recomputed. "dots_no_batch" keeps
# the projection outputs but recomputes attention scores and elementwise ops: less memory, and on CPU no slower
# because fewer per-layer residuals have to be stacked by the scan. Plain projections run under a custom_vjp, whose
# dot the dot policies cannot see, so their outputs are also kept by name (jaxlm.quantized.PROJECTION_NAME).
_PROJECTIONS = jax.checkpoint_policies.save_only_these_names(PROJECTION_NAME)
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.save_from_both_policies(jax.checkpoint_policies.dots_saveable, _PROJECTIONS),
    "dots_no_batch": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _PROJECTIONS
    ),
}
assert tuple(REMAT_POLICIES) == REMAT_CHOICES, "jaxlm.config.REMAT_CHOICES names the policies the config allows"


def _param(key: jax.Array, shape: tuple[int, ...], axes: tuple[str | None, ...], std: float | None) -> nnx.Param:
    value = jnp.ones(shape, jnp.float32) if std is None else std * jax.random.normal(key, shape, jnp.float32)
    return nnx.Param(value, **{LOGICAL_AXES: axes})


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, axis: str = "embed"):
        self.scale = _param(None, (dim,), (axis,), None)
        self.eps = eps

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        return rms_norm(x_BTD, self.scale[...], self.eps)


def rms_norm(x_BTD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
    x = x_BTD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return (x * scale_D).astype(x_BTD.dtype)


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """The rotary angular frequencies [E/2] (float64): theta^(-2i/E), with model.rope_scaling="llama3" rescaled as
    Llama 3.1 (and Hugging Face's `llama3` rope type) does: wavelengths longer than original_max / low_freq_factor
    are slowed by the factor, those shorter than original_max / high_freq_factor kept, and a linear ramp in
    original_max / wavelength blends the two in between."""
    E = cfg.resolved_head_dim
    inv_freq = cfg.rope_theta ** (-np.arange(0, E, 2, dtype=np.float64) / E)
    if cfg.rope_scaling == "none":
        return inv_freq
    low, high, original = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_seq_len
    ramp = np.clip((original * inv_freq / (2 * np.pi) - low) / (high - low), 0.0, 1.0)  # 0: slow, 1: kept
    return inv_freq * ((1 - ramp) / cfg.rope_scaling_factor + ramp)


# Tables of known positions are constants of the program up to this many entries (16 MB each); beyond (a million-token
# sequence: 256 MB each) XLA refuses to serialize a program of over 2 GiB, so they are computed on the device.
MAX_CONSTANT_TABLE = 1 << 22


def rotary_tables(positions_BT: jax.Array | None, seq_len: int, cfg: ModelConfig):
    """sin/cos tables [B or 1, T, 1, E/2] for rotary embeddings, in float32 (frequencies: `rope_frequencies`).

    Default positions (0..T-1) give numpy constants, computed once at trace time. Otherwise the tables are kept
    out of their consumers' fusions: XLA would otherwise recompute sin/cos for every element of q and k, in every
    layer, forward and backward (measured: ~4% of a CPU train step).
    """
    inv_freq = rope_frequencies(cfg)
    if positions_BT is None:
        positions_BT = np.arange(seq_len)
    if isinstance(positions_BT, np.ndarray):  # the same for every row, known now (the default, a reorder's)
        positions_BT = positions_BT.reshape(-1, positions_BT.shape[-1])[:1]
        if positions_BT.size * inv_freq.size <= MAX_CONSTANT_TABLE:
            angles = positions_BT[:, :, None].astype(np.float64) * inv_freq
            return (
                jnp.asarray(np.sin(angles), jnp.float32)[:, :, None, :],
                jnp.asarray(np.cos(angles), jnp.float32)[:, :, None, :],
            )
        positions_BT = jnp.asarray(positions_BT, jnp.int32)  # computed on the device, not written into the program
    angles = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    sin, cos = jax.lax.optimization_barrier((jnp.sin(angles), jnp.cos(angles)))
    return sin[:, :, None, :], cos[:, :, None, :]


def apply_rotary(x_BTHE: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    x1, x2 = jnp.split(x_BTHE.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BTHE.dtype)


def attention_score_mod(cfg: ModelConfig):
    """The score mod the model's attention runs with: a soft-cap where the config sets one, else None."""
    return soft_cap(cfg.attention_softcap) if cfg.attention_softcap else None


def attend(cfg: ModelConfig, q_BTHE, k_BTKE, v_BTKE, segment_ids_BT=None, positions_BT=None):
    """The model's attention within a block, as the config sets it up (mask, implementation, mod, tiles, context
    parallelism, determinism): what a layer runs in training and prefill, and what ``experiments.step_profile``
    times alone."""
    return attention(
        q_BTHE,
        k_BTKE,
        v_BTKE,
        mask=cfg.attention_mask,
        segment_ids_BT=segment_ids_BT,
        impl=cfg.attention_impl,
        score_mod=attention_score_mod(cfg),
        block_sizes=BlockSizes(cfg.attention_block_q, cfg.attention_block_kv),
        positions_BT=positions_BT,
        context_parallel=cfg.context_parallel,
        deterministic=cfg.attention_deterministic,
    )


class Attention(nnx.Module):
    """Grouped-query attention with one fused QKV projection.

    wqkv is [D, K, G+2, E]: for each kv head, its G query heads then its key and its value. Splitting the `kv_heads`
    axis over a tensor-parallel mesh axis therefore keeps every group whole.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, E, K = cfg.d_model, cfg.resolved_head_dim, cfg.num_kv_heads
        G = cfg.num_heads // K
        self.cfg = cfg
        self.wqkv = _param(rngs.params(), (D, K, G + 2, E), ("embed", "kv_heads", None, "head_dim"), D**-0.5)
        out_std = (cfg.num_heads * E) ** -0.5 / (2 * cfg.num_layers) ** 0.5
        self.wo = _param(rngs.params(), (cfg.num_heads, E, D), ("heads", "head_dim", "embed"), out_std)
        if cfg.qk_norm:  # Qwen3's per-head RMSNorm of queries and keys, one scale over the head dim each
            self.q_norm, self.k_norm = RMSNorm(E, cfg.norm_eps, "head_dim"), RMSNorm(E, cfg.norm_eps, "head_dim")
        self.recipe = layer_recipe(cfg, "attention")  # None: plain einsums
        self.qkv_amax, self.out_amax = amax_history(cfg, self.recipe), amax_history(cfg, self.recipe)

    def __call__(self, x_BTD, sin, cos, segment_ids_BT=None, positions_BT=None):
        return self.prefill(x_BTD, sin, cos, segment_ids_BT, positions_BT)[0]

    def prefill(self, x_BTD, sin, cos, segment_ids_BT=None, positions_BT=None):
        """Attention within the block, as in training; also returns the block's rotated keys and its values
        ([B, T, K, E] each), which generation keeps as its KV cache. `positions_BT` place the tokens for the mask
        when the sequence is split (context parallelism); None: 0..T-1."""
        q_BTHE, k_BTKE, v_BTKE = self._qkv(x_BTD, sin, cos)
        out_BTHE = attend(self.cfg, q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, positions_BT)
        return self._out(out_BTHE), k_BTKE, v_BTKE

    def decode(self, x_BTD, sin, cos, positions_BT, k_BKSE, v_BKSE, wo_DX=None):
        """Attention of new tokens over this layer's KV cache, whose slot s holds position s: the tokens' keys and
        values are written at their rows' `positions_BT`, then each query sees the slots the config's mask allows
        at its position. Returns (out, k_BKSE, v_BKSE). A cache of one row may come without its row axis (k_KSE,
        v_KSE) and is returned so. `wo_DX`: the output projection transposed ([D, H*E], see `row_weights`)."""
        B, T, _ = x_BTD.shape
        q_BTHE, k_BTKE, v_BTKE = self._qkv(x_BTD, sin, cos)
        k_PSE, v_PSE = write_cache(k_BKSE, v_BKSE, k_BTKE, v_BTKE, positions_BT)
        mask = one_document(parse_mask(self.cfg.attention_mask))
        mask_BTS = mask(positions_BT[:, :, None], jnp.arange(v_BKSE.shape[-2])[None, None, :])
        out_BTHE = cached_attention(q_BTHE, k_PSE, v_PSE, mask_BTS, positions_BT, attention_score_mod(self.cfg))
        k_BKSE, v_BKSE = k_PSE.reshape(k_BKSE.shape), v_PSE.reshape(v_BKSE.shape)  # a one-row cache stays [K, ..]
        if wo_DX is not None:
            return jnp.einsum("btx,dx->btd", out_BTHE.reshape(B, T, -1), wo_DX), k_BKSE, v_BKSE
        # One contracted axis of H*E: with two (h, e), XLA:CPU transposed wo, a weight copy per layer per token.
        wo = self.wo[...].reshape(-1, self.wo.shape[-1])  # [H*E, D]
        y_BTD = project("btx,xd->btd", out_BTHE.reshape(B, T, -1), wo, self.recipe, _value(self.out_amax))
        return y_BTD, k_BKSE, v_BKSE

    def _qkv(self, x_BTD, sin, cos):
        B, T, _ = x_BTD.shape
        K, E = self.cfg.num_kv_heads, self.cfg.resolved_head_dim
        G = self.cfg.num_heads // K
        qkv = project("btd,dkge->btkge", x_BTD, self.wqkv[...], self.recipe, _value(self.qkv_amax))
        # one split, whose gradient is one concatenate (three slices' was pads and adds: the gpt-bench step
        # 1.008-1.021x with the split, in-process A/B)
        q_BTKGE, k_BTK1E, v_BTK1E = jnp.split(qkv, [G, G + 1], axis=3)
        q_BTHE = q_BTKGE.reshape(B, T, K * G, E)
        k_BTKE, v_BTKE = k_BTK1E[:, :, :, 0], v_BTK1E[:, :, :, 0]
        if self.cfg.qk_norm:
            q_BTHE, k_BTKE = self.q_norm(q_BTHE), self.k_norm(k_BTKE)
        return apply_rotary(q_BTHE, sin, cos), apply_rotary(k_BTKE, sin, cos), v_BTKE

    def _out(self, out_BTHE):
        return project("bthe,hed->btd", out_BTHE, self.wo[...], self.recipe, _value(self.out_amax))


class SwiGLU(nnx.Module):
    """silu(x W_gate) * (x W_up) W_down, with gate and up fused into one [D, 2, F] matmul."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, F = cfg.d_model, cfg.mlp_dim
        self.w_in = _param(rngs.params(), (D, 2, F), ("embed", None, "mlp"), D**-0.5)
        self.w_out = _param(rngs.params(), (F, D), ("mlp", "embed"), F**-0.5 / (2 * cfg.num_layers) ** 0.5)
        self.recipe = layer_recipe(cfg, "mlp")
        self.in_amax, self.out_amax = amax_history(cfg, self.recipe), amax_history(cfg, self.recipe)

    def __call__(self, x_BTD, w_out_DF=None):
        """`w_out_DF`: the down projection transposed ([D, F], see `row_weights`)."""
        h_BTCF = project("btd,dcf->btcf", x_BTD, self.w_in[...], self.recipe, _value(self.in_amax))
        if w_out_DF is not None:
            return jnp.einsum("btf,df->btd", swiglu(h_BTCF), w_out_DF)
        return project("btf,fd->btd", swiglu(h_BTCF), self.w_out[...], self.recipe, _value(self.out_amax))


@jax.custom_vjp
def swiglu(h_BTCF: jax.Array) -> jax.Array:
    """silu(gate) * up of the fused projection's output h [B, T, 2, F] (gate, up).

    The backward is written out so the gradient of h is one stack of its two halves: autodiff's pads-and-add of the
    two slices made XLA:CPU a slower fusion (the gpt-bench step 1.012-1.018x with this, in-process A/B)."""
    return jax.nn.silu(h_BTCF[:, :, 0]) * h_BTCF[:, :, 1]


def _swiglu_fwd(h_BTCF):
    return swiglu(h_BTCF), h_BTCF


def _swiglu_bwd(h_BTCF, dy_BTF):
    return (jnp.stack(gate_up_grads(h_BTCF[:, :, 0], h_BTCF[:, :, 1], dy_BTF), axis=2),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def _value(variable):
    return None if variable is None else variable[...]


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, moe: bool | None = None):
        """`moe`: the MLP is a mixture of experts (None: as the config has experts)."""
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        moe = bool(cfg.num_experts) if moe is None else moe
        self.mlp = MoE(cfg, rngs=rngs) if moe else SwiGLU(cfg, rngs=rngs)

    def __call__(self, x_BTD, sin, cos, segment_ids_BT=None, positions_BT=None, inference=False):
        """(the layer's output, its MoE routing statistics: {} for a dense MLP). `inference`: MoE routes dropless
        whatever the capacity factor (generation and scoring never drop a token's experts)."""
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), sin, cos, segment_ids_BT, positions_BT)
        y_BTD, stats = self._mlp(self.mlp_norm(x_BTD), inference=inference)
        return x_BTD + y_BTD, stats

    def _mlp(self, x_BTD, w_out_DF=None, inference=False):
        if isinstance(self.mlp, MoE):
            return self.mlp(x_BTD, dropless=inference)
        return self.mlp(x_BTD, w_out_DF=w_out_DF), {}

    def prefill(self, x_BTD, sin, cos, segment_ids_BT=None):
        """The layer as in training, plus its keys and values (Attention.prefill)."""
        h_BTD, k_BTKE, v_BTKE = self.attn.prefill(self.attn_norm(x_BTD), sin, cos, segment_ids_BT)
        x_BTD = x_BTD + h_BTD
        return x_BTD + self._mlp(self.mlp_norm(x_BTD), inference=True)[0], k_BTKE, v_BTKE

    def decode(self, x_BTD, sin, cos, positions_BT, k_BKSE, v_BKSE, rows=None):
        """The layer for new tokens over this layer's KV cache (Attention.decode); `rows`: its `row_weights`."""
        wo_DX, w_out_DF = rows or (None, None)
        h_BTD, k_BKSE, v_BKSE = self.attn.decode(
            self.attn_norm(x_BTD), sin, cos, positions_BT, k_BKSE, v_BKSE, wo_DX=wo_DX
        )
        x_BTD = x_BTD + h_BTD
        return x_BTD + self._mlp(self.mlp_norm(x_BTD), w_out_DF=w_out_DF, inference=True)[0], k_BKSE, v_BKSE


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.vocab_size <= 0:
            raise ValueError(
                "model.vocab_size is 0 (follow the data's tokenizer): resolve the config with "
                "jaxlm.run_data.resolve_vocab first, or set it"
            )
        self.cfg = cfg
        self.embed = _param(rngs.params(), (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), 0.02)
        # With dense layers between MoE ones (model.moe_every > 1) two stacks: `blocks` the dense layers, `moe_blocks`
        # the MoE ones (ModelConfig.layer_slot says where layer i is); else one stack of all layers.
        if cfg.num_moe_layers and cfg.moe_every > 1:
            self.blocks = _stacked_blocks(cfg, rngs, cfg.num_layers - cfg.num_moe_layers, moe=False)
            self.moe_blocks = _stacked_blocks(cfg, rngs, cfg.num_moe_layers, moe=True)
        else:
            self.blocks = _stacked_blocks(cfg, rngs)
            self.moe_blocks = None
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs.params(), (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), 0.02)
        self.head_amax = amax_history(cfg, layer_recipe(cfg, "lm_head"))

    def __call__(self, tokens_BT: jax.Array, *, segment_ids_BT=None, positions_BT=None, inference=False):
        """Returns float32 logits [B, T, V]; `inference`: as generation and scoring run (MoE dropless)."""
        return self.forward(tokens_BT, segment_ids_BT=segment_ids_BT, positions_BT=positions_BT, inference=inference)[0]

    def forward(self, tokens_BT, *, segment_ids_BT=None, positions_BT=None, inference=False) -> tuple[jax.Array, dict]:
        """(float32 logits [B, T, V], the MoE layers' routing statistics stacked [L, ...]: {} for a dense model)."""
        x_BTD = self.embed_tokens(tokens_BT)
        graphdef, stacked = nnx.split(self.blocks)
        moe = None if self.moe_blocks is None else nnx.split(self.moe_blocks)
        x_BTD, stats = apply_layers(self.cfg, graphdef, stacked, x_BTD, segment_ids_BT, positions_BT, inference, moe)
        return self.logits(x_BTD), stats

    def layer_graphdefs(self) -> tuple[nnx.GraphDef, ...]:
        """Each layer's graphdef, in layer order (dense and MoE layers differ when model.moe_every > 1)."""
        stacks = {"blocks": nnx.split(self.blocks)[0]}
        if self.moe_blocks is not None:
            stacks["moe_blocks"] = nnx.split(self.moe_blocks)[0]
        return tuple(stacks[self.cfg.layer_slot(i)[0]] for i in range(self.cfg.num_layers))

    def layer_states(self) -> tuple[nnx.State, ...]:
        """Each layer's params, one state each, in layer order (what generation reads in place)."""
        stacks = {"blocks": split_layers(nnx.state(self.blocks))}
        if self.moe_blocks is not None:
            stacks["moe_blocks"] = split_layers(nnx.state(self.moe_blocks))
        return tuple(stacks[name][j] for name, j in map(self.cfg.layer_slot, range(self.cfg.num_layers)))

    # The three pieces below are what a pipeline schedule needs separately: the embedding before the first stage,
    # the layers (split over stages by `apply_layers`), the head after the last one.

    def embed_tokens(self, tokens_BT: jax.Array) -> jax.Array:
        # Per shard of the table (sharding.embedding): XLA's own split of this lookup gathers the fp32 table whole
        # on every device and forms its gradient whole.
        x_BTD = sharded_take(self.embed[...], tokens_BT).astype(jnp.dtype(self.cfg.dtype))
        return constrain(x_BTD, ACTIVATION_AXES)

    def head_params(self) -> dict[str, jax.Array]:
        """The arrays `head_logits` reads: final norm scale, the [D, V] output projection (tied: embed.T) and, for a
        quantized head with delayed scaling, its amax history."""
        head = {
            "norm_scale": self.final_norm.scale[...],
            "head_DV": self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...],
        }
        if self.head_amax is not None:
            head["amax"] = self.head_amax[...]
        return head

    def logits(self, x_BTD: jax.Array) -> jax.Array:
        return head_logits(self.cfg, self.head_params(), x_BTD)

    # Generation (jaxlm.generate): a prompt block through the layers as in training, keeping every layer's keys and
    # values; then new tokens one block at a time over that KV cache.

    def prefill(
        self, tokens_BT: jax.Array, *, segment_ids_BT=None, layers=None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(final hidden states x_BTD before the head, keys k_LBTKE, values v_LBTKE) of a block at positions 0..T-1.
        `layers` (`layer_states()`), when a caller has them, are read in place (see decode)."""
        x_BTD = self.embed_tokens(tokens_BT)
        if self.moe_blocks is None and layers is None:
            graphdef, stacked = nnx.split(self.blocks)
            return prefill_layers(self.cfg, graphdef, stacked, x_BTD, segment_ids_BT)
        layers = self.layer_states() if layers is None else layers
        return prefill_layers(self.cfg, self.layer_graphdefs(), None, x_BTD, segment_ids_BT, layers=layers)

    def decode(self, tokens_BT, positions_BT, keys: tuple, values: tuple, layers=None, head=None, rows=None):
        """(float32 logits [B, T, V], keys, values) for tokens at `positions_BT` over a KV cache (per layer
        k_BKSE / v_BKSE; slot s holds position s), their keys and values written into it. A caller decoding many
        tokens passes `layers` (`layer_states()`) and `head` (`head_params()`), made once:
        derived here, they would be copies of the weights made for every token; decoding one row, also `rows`
        (`row_weights`)."""
        layers = self.layer_states() if layers is None else layers
        x_BTD, keys, values = decode_layers(
            self.cfg, self.layer_graphdefs(), layers, self.embed_tokens(tokens_BT), positions_BT, keys, values, rows
        )
        return head_logits(self.cfg, self.head_params() if head is None else head, x_BTD), keys, values


def head_logits(cfg: ModelConfig, head: dict[str, jax.Array], x_BTD: jax.Array) -> jax.Array:
    """Final RMSNorm and the vocabulary projection: float32 logits [B, T, V]."""
    x_BTD = rms_norm(x_BTD, head["norm_scale"], cfg.norm_eps)
    logits_BTV = project(
        "btd,dv->btv", x_BTD, head["head_DV"], layer_recipe(cfg, "lm_head"), head.get("amax"), out_dtype=jnp.float32
    )
    if 0 < cfg.tokenizer_vocab_size < cfg.vocab_size:  # padded ids: probability 0, as in the exported model
        is_token_V = jnp.arange(cfg.vocab_size) < cfg.tokenizer_vocab_size
        logits_BTV = jnp.where(is_token_V, logits_BTV, PADDED_LOGIT)
    return constrain(logits_BTV, ("batch", "seq", "vocab"))


def apply_layers(
    cfg: ModelConfig,
    graphdef: nnx.GraphDef,
    stacked: nnx.State,
    x_BTD: jax.Array,
    segment_ids_BT=None,
    positions_BT=None,
    inference: bool = False,
    moe: tuple[nnx.GraphDef, nnx.State] | None = None,
) -> tuple[jax.Array, dict]:
    """Runs the layers whose params are stacked along a leading axis (all of them, or one pipeline stage's):
    (output, their MoE routing statistics stacked [L, ...], {} for dense layers). `moe`: the MoE layers' graphdef
    and stack when dense layers sit between them (model.moe_every = k > 1; `stacked` then holds the dense ones):
    the layers run in groups of k, k - 1 dense then one MoE, and the statistics are the MoE layers'."""
    sin, cos = rotary_tables(positions_BT, x_BTD.shape[1], cfg)

    def runner(graphdef):
        def layer(x, layer_state):
            x, stats = nnx.merge(graphdef, layer_state)(x, sin, cos, segment_ids_BT, positions_BT, inference)
            return constrain(x, ACTIVATION_AXES), stats

        if cfg.remat != "none":
            return jax.checkpoint(layer, prevent_cse=False, policy=REMAT_POLICIES[cfg.remat])
        return layer

    layer = runner(graphdef)
    if moe is not None:
        return _apply_groups(cfg, layer, runner(moe[0]), stacked, moe[1], x_BTD)
    if cfg.scan_layers:
        return jax.lax.scan(layer, x_BTD, stacked, unroll=cfg.scan_unroll)
    # Unrolled: split the stacked params once (its gradient is one concatenate, where per-layer indexing would
    # pad every layer's gradient to the full stack and add them up).
    leaves, treedef = jax.tree.flatten(stacked)
    num_layers = leaves[0].shape[0]
    split_leaves = [jnp.split(leaf, num_layers) for leaf in leaves]
    per_layer = []
    for i in range(num_layers):
        x_BTD, stats = layer(x_BTD, treedef.unflatten([parts[i].squeeze(0) for parts in split_leaves]))
        per_layer.append(stats)
    return x_BTD, jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)


def _apply_groups(cfg: ModelConfig, dense_layer, moe_layer, dense_stacked, moe_stacked, x_BTD):
    """Groups of moe_every layers, k - 1 dense then one MoE, scanned over the groups (or unrolled): the model's, or
    one pipeline stage's."""
    k, groups = cfg.moe_every, jax.tree.leaves(moe_stacked)[0].shape[0]
    dense_GK = jax.tree.map(lambda a: a.reshape(groups, k - 1, *a.shape[1:]), dense_stacked)

    def group(x, states):
        dense_K, moe_state = states
        for j in range(k - 1):
            x, _ = dense_layer(x, jax.tree.map(lambda a: a[j], dense_K))
        return moe_layer(x, moe_state)

    if cfg.scan_layers:
        return jax.lax.scan(group, x_BTD, (dense_GK, moe_stacked), unroll=cfg.scan_unroll)
    per_group = []
    for g in range(groups):
        x_BTD, stats = group(x_BTD, jax.tree.map(lambda a: a[g], (dense_GK, moe_stacked)))
        per_group.append(stats)
    return x_BTD, jax.tree.map(lambda *xs: jnp.stack(xs), *per_group)


def prefill_layers(cfg: ModelConfig, graphdef, stacked, x_BTD, segment_ids_BT=None, layers=None):
    """`apply_layers` without remat or pipeline, also returning every layer's keys and values [L, B, T, K, E].
    Given `layers` (one state each, made once by a caller), they are run unrolled and read where they lie: split
    from the stack here, every layer's weights were copied (at batch 1 and 64 tokens, most of gpt-bench's prefill
    on CPU). `graphdef`: one for every layer, or with `layers` a tuple of each layer's."""
    sin, cos = rotary_tables(None, x_BTD.shape[1], cfg)

    def layer(graphdef, x, layer_state):
        x, k_BTKE, v_BTKE = nnx.merge(graphdef, layer_state).prefill(x, sin, cos, segment_ids_BT)
        return constrain(x, ACTIVATION_AXES), (k_BTKE, v_BTKE)

    if cfg.scan_layers and layers is None:
        x_BTD, (k_LBTKE, v_LBTKE) = jax.lax.scan(
            functools.partial(layer, graphdef), x_BTD, stacked, unroll=cfg.scan_unroll
        )
        return x_BTD, k_LBTKE, v_LBTKE
    layers = split_layers(stacked) if layers is None else layers
    keys, values = [], []
    for layer_graphdef, layer_state in zip(_per_layer(graphdef, len(layers)), layers, strict=True):
        x_BTD, (k_BTKE, v_BTKE) = layer(layer_graphdef, x_BTD, layer_state)
        keys.append(k_BTKE)
        values.append(v_BTKE)
    return x_BTD, jnp.stack(keys), jnp.stack(values)


def _per_layer(graphdef, num_layers: int) -> tuple:
    return graphdef if isinstance(graphdef, tuple) else (graphdef,) * num_layers


def decode_layers(cfg: ModelConfig, graphdef, layers, x_BTD, positions_BT, keys: tuple, values: tuple, rows=None):
    """The layers for new tokens, unrolled over per-layer params and caches: every weight and cache entry is read
    where it lies. Slicing one layer out of a stack (scan or not) copied all of its weights every token. `rows`:
    per layer its `row_weights`, or None. `graphdef`: one for every layer, or a tuple of each layer's."""
    sin, cos = rotary_tables(positions_BT, x_BTD.shape[1], cfg)
    new_keys, new_values = [], []
    graphdefs = _per_layer(graphdef, len(layers))
    for i, (layer_state, k_BKSE, v_BKSE) in enumerate(zip(layers, keys, values, strict=True)):
        block = nnx.merge(graphdefs[i], layer_state)
        x_BTD, k_BKSE, v_BKSE = block.decode(x_BTD, sin, cos, positions_BT, k_BKSE, v_BKSE, rows and rows[i])
        x_BTD = constrain(x_BTD, ACTIVATION_AXES)
        new_keys.append(k_BKSE)
        new_values.append(v_BKSE)
    return x_BTD, tuple(new_keys), tuple(new_values)


def row_weights(cfg: ModelConfig, stacked: nnx.State) -> tuple[tuple, ...] | None:
    """Per layer (wo [D, H*E], w_out [D, F]): the two output projections transposed, for decoding one row. A
    matrix-vector product over a weight with more rows than columns ran 1.2-1.8x faster on XLA:CPU from its
    transpose ([1024, 384] down projection: 0.070 against 0.123 ms); gpt-bench's batch-1 decode step 1.07-1.12x
    (in-process A/B). From two rows on the stored layout was faster (16 rows: 0.87-0.90x). None for quantized
    layers, whose products go through `project`'s recipe."""
    if layer_recipe(cfg, "attention") is not None or layer_recipe(cfg, "mlp") is not None or cfg.num_experts:
        return None
    wo_LHED, w_out_LFD = stacked["attn"]["wo"][...], stacked["mlp"]["w_out"][...]
    wo_LDX = wo_LHED.reshape(wo_LHED.shape[0], -1, wo_LHED.shape[-1]).swapaxes(1, 2)
    return tuple(zip(wo_LDX, w_out_LFD.swapaxes(1, 2), strict=True))


def split_layers(stacked: nnx.State) -> tuple[nnx.State, ...]:
    """Stacked layer params -> one state per layer."""
    leaves, treedef = jax.tree.flatten(stacked)
    return tuple(treedef.unflatten([leaf[i] for leaf in leaves]) for i in range(leaves[0].shape[0]))


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs, count: int | None = None, moe: bool | None = None) -> Block:
    """`count` (default num_layers) Blocks whose params carry a leading `layers` axis; `moe` as Block's."""

    @nnx.split_rngs(splits=count or cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return Block(cfg, rngs=rngs, moe=moe)

    blocks = make(rngs)
    for _, variable in nnx.iter_graph(blocks):
        if isinstance(variable, (nnx.Param, AmaxHistory, RouterBias)):
            variable.set_metadata(LOGICAL_AXES, ("layers",) + tuple(variable.get_metadata(LOGICAL_AXES)))
    return blocks


def count_params(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def model_flops_per_token(cfg: ModelConfig, num_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls (forward + backward; N the params a token uses: an MoE layer's
    unchosen experts do not count) plus 12*L*H*E*T for attention scores and values (the PaLM / nanoGPT convention,
    counting the full T x T, not only the causal half)."""
    num_params -= cfg.num_moe_layers * (cfg.num_experts - cfg.experts_per_token) * expert_params(cfg)
    return 6 * num_params + 12 * cfg.num_layers * cfg.num_heads * cfg.resolved_head_dim * seq_len
