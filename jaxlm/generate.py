"""Text generation: a KV cache, one compiled prefill and one compiled decode step per shape bucket, sampling.

Prompts of different lengths share a batch right-padded: a row's token at position p sits in slot p of every
layer's cache, so positions, RoPE and masks are exactly those of the prompt alone (a pad slot is either never
visible to the row's queries or overwritten by a generated token before it is). Shapes are bucketed (batch,
prompt block and cache length rounded up), the number of new tokens is a traced value, and the sampler's settings
are compile-time constants: a program is compiled once per (bucket, sampler), never per token.

`generate` runs the decode steps in one `lax.while_loop` (no host round trip per token); `stream` calls the same
compiled decode step once per token and yields each token as it comes (what a terminal shows).

Under a mesh (found from the params' shardings) the cache shards by the logical axes `CACHE_AXES` with the same
rules as the params: batch over data x fsdp, kv heads over tensor.

Shape suffixes follow the legend in docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxlm.config import ModelConfig
from jaxlm.model import Transformer, head_logits, row_weights
from sharding import MeshLayout
from sharding.rules import constrain, logical_spec, use_rules

CACHE_AXES = ("batch", "kv_heads", "cache_seq", "head_dim")  # every layer's k_BKSE and v_BKSE
TOKEN_AXES = ("batch", "cache_seq")  # tokens_BS


@functools.partial(jax.tree_util.register_dataclass, data_fields=["keys", "values"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Every layer's rotated keys k_BKSE and values v_BKSE, in the model's dtype; slot s holds position s.

    One array per layer, not one stacked [L, ...] array: the decode step updates and reads each in place, where a
    layer sliced out of a stack is a copy. Keys and values [.., S, E]: attention's two products read them as they
    lie (kv_cache.cached_attention). One unsharded row keeps no row axis (k_KSE, v_KSE): with a row axis
    of 1, XLA:CPU copied every layer's cache once per token to feed the attention (2.43 vs 3.05 ms a gpt-bench step,
    measured)."""

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["tokens_BS", "positions_B", "done_B", "step", "cache"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """What the decode steps carry: every row's tokens so far (prompt then new, slot = position), the position of
    its last token (the next step's input), whether it stopped, how many new tokens were made, the cache."""

    tokens_BS: jax.Array
    positions_B: jax.Array
    done_B: jax.Array
    step: jax.Array
    cache: KVCache


@dataclasses.dataclass(frozen=True)
class Sampler:
    """Next-token choice from float32 logits [B, V]: greedy at temperature 0, else softmax(logits / temperature)
    restricted to the top_k largest (0: all) and to the smallest set holding top_p of the mass. Ids >= vocab_limit
    (a vocabulary padded past the tokenizer's) are never chosen. Hashable: its values are constants of the
    compiled programs."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    vocab_limit: int = 0  # 0: every id of the logits

    def __post_init__(self):
        check_sampling(self.temperature, self.top_k, self.top_p, self.vocab_limit or None)

    def __call__(self, logits_BV: jax.Array, key: jax.Array) -> jax.Array:
        V = logits_BV.shape[-1]
        if self.vocab_limit and self.vocab_limit < V:
            logits_BV = jnp.where(jnp.arange(V) < self.vocab_limit, logits_BV, -jnp.inf)
        if self.temperature == 0:
            return greedy_ids(logits_BV)
        logits_BV = logits_BV.astype(jnp.float32) / self.temperature
        if not self.top_k and self.top_p >= 1:
            return jax.random.categorical(key, logits_BV).astype(jnp.int32)
        # Candidates in descending order: the top k (a partial sort), or every id when only top_p is set.
        k = min(self.top_k or V, V)
        values_BN, ids_BN = jax.lax.top_k(logits_BV, k)
        if self.top_p < 1:
            probs_BN = jax.nn.softmax(values_BN, axis=-1)
            before_BN = jnp.cumsum(probs_BN, axis=-1) - probs_BN  # mass of the better candidates
            values_BN = jnp.where(before_BN < self.top_p, values_BN, -jnp.inf)  # the best one is always kept
        choice_B = jax.random.categorical(key, values_BN)
        return jnp.take_along_axis(ids_BN, choice_B[:, None], axis=1)[:, 0].astype(jnp.int32)


def greedy_ids(logits_BV: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first largest id; the first NaN if there is one) as two plain
    reductions: XLA:CPU's paired value-index reduce took 0.30 ms on [16, 8192] logits, these 0.10 (measured)."""
    V = logits_BV.shape[-1]
    max_B1 = jnp.max(logits_BV, axis=-1, keepdims=True)
    hits_BV = (logits_BV == max_B1) | jnp.isnan(logits_BV)
    return jnp.min(jnp.where(hits_BV, jnp.arange(V, dtype=jnp.int32), V), axis=-1)


def check_sampling(temperature: float, top_k: int, top_p: float, vocab_limit: int | None = None) -> None:
    """ValueError naming the first bad sampling value (caught before anything compiles)."""
    if not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature}")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0: no limit), got {top_k}")
    if vocab_limit is not None and top_k > vocab_limit:
        raise ValueError(f"top_k {top_k} exceeds the vocabulary of {vocab_limit} tokens")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1: no limit), got {top_p}")


# ----------------------------------------------------------------------------- shape buckets and placement


def bucket(n: int, minimum: int = 8) -> int:
    """`n` rounded up to a power of two up to 128 (at least `minimum`), then to a multiple of 64 up to 512, then of
    256: few programs, and at most a third of a long cache or prompt block wasted (the decode step's attention reads
    every slot; a 192-token generation no longer reads 256). One prompt runs as one row (the model writes its cache
    with a dynamic_update_slice): a padded second row made every weight product a two-row one, 1.3x the decode step
    of gpt-bench on CPU (3.27 vs 4.24 ms, measured)."""
    n = max(n, minimum)
    if n <= 128:
        return 1 << (n - 1).bit_length()
    step = 64 if n <= 512 else 256
    return -(-n // step) * step


def batch_rows(prompts: int, shards: int) -> int:
    """The rows of a batch of `prompts`: their bucket, rounded up to a multiple of the mesh's batch shards."""
    return -(-bucket(prompts, 1) // shards) * shards


def check_layout(layout: MeshLayout, model: ModelConfig | None = None) -> None:
    """What generation refuses of a mesh layout: pipeline stages, a context axis (a checkpoint trained under one
    loads under any layout); with `model`, heads, kv heads, MLP or layers its axes do not divide (a LayoutError
    names the axis). A ValueError of one line, raised before anything compiles."""
    if layout.pipeline > 1:
        raise ValueError(f"generation runs without pipeline stages; the layout has pipeline={layout.pipeline}")
    if layout.context > 1:
        raise ValueError(
            f"generation keeps each row's tokens on one device; the layout has context={layout.context} (the "
            f"checkpoint does not depend on it: give a layout without a context axis)"
        )
    if model is not None:
        layout.check_divisibility(
            batch_size=layout.batch_shards,
            microbatches=1,
            num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads,
            mlp_dim=model.mlp_dim,
            num_layers=model.num_layers,
            num_experts=model.num_experts,
        )


@dataclasses.dataclass(frozen=True)
class Placement:
    """The mesh the params live on and the logical-axis rules (hashable, a static argument of the programs)."""

    mesh: Mesh
    rules: tuple = ()

    @property
    def rules_dict(self) -> dict:
        return dict(self.rules)

    def sharding(self, axes: tuple[str, ...]) -> NamedSharding:
        return NamedSharding(self.mesh, logical_spec(axes, self.rules_dict))

    def batch_shards(self) -> int:
        target = logical_spec(("batch",), self.rules_dict)[0]
        axes = target if isinstance(target, tuple) else (target,)
        return int(np.prod([self.mesh.shape[a] for a in axes if a is not None]))


def placement_of(params, rules: dict | None = None) -> Placement | None:
    """The mesh of sharded params (None on one device)."""
    for leaf in jax.tree.leaves(params):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
            return Placement(sharding.mesh, tuple(sorted((rules or {}).items())))
    return None


@contextlib.contextmanager
def traced_in(where: Placement | None):
    """Traces with the mesh and rules in context, so `constrain` pins activations and the cache as in training."""
    if where is None:
        yield
        return
    with jax.sharding.use_abstract_mesh(where.mesh.abstract_mesh), use_rules(where.rules_dict):
        yield


# ----------------------------------------------------------------------------- the compiled programs


class _Spec:
    """What a program is compiled for besides shapes: the model's graph, the sampler, the placement. Interned (one
    object per distinct triple), so jit's static-argument lookup is an identity check: hashing the graph for every
    token cost ~2 ms per decode step (measured, 6 layers)."""

    _interned: dict = {}

    def __init__(self, graphdef, sampler: Sampler, where: Placement | None):
        self.graphdef, self.sampler, self.where = graphdef, sampler, where

    @classmethod
    def of(cls, graphdef, sampler: Sampler, where: Placement | None) -> _Spec:
        key = (graphdef, sampler, where)
        if key not in cls._interned:
            cls._interned[key] = cls(*key)
        return cls._interned[key]


@functools.partial(jax.jit, static_argnames=("spec", "cache_len"))
def _prefill(params, weights, tokens_BT, lengths_B, live_B, key, stop_V, *, spec: _Spec, cache_len: int):
    """The prompt block through the model as in training -> the first new token of every row and a DecodeState
    whose cache (allocated here, `cache_len` slots) holds the prompt's keys and values. `weights` are the decode
    steps' (`_decode_weights`), read in place here too."""
    with traced_in(spec.where):
        model = nnx.merge(spec.graphdef, params)
        B, T = tokens_BT.shape
        rows_B = jnp.arange(B)
        valid_BT = jnp.arange(T)[None, :] < lengths_B[:, None]
        layers, head, _ = weights  # the one-row weights are for one token at a time
        x_BTD, k_LBTKE, v_LBTKE = model.prefill(tokens_BT, segment_ids_BT=valid_BT.astype(jnp.int32), layers=layers)
        logits_BV = head_logits(model.cfg, head, x_BTD[rows_B, lengths_B - 1][:, None])[:, 0]
        new_B = spec.sampler(logits_BV, jax.random.fold_in(key, 0))
        cache = KVCache(_layer_caches(k_LBTKE, cache_len), _layer_caches(v_LBTKE, cache_len))
        if B == 1 and spec.where is None:  # see KVCache
            cache = KVCache(tuple(k[0] for k in cache.keys), tuple(v[0] for v in cache.values))
        tokens_BS = jnp.pad(tokens_BT, ((0, 0), (0, cache_len - T))).at[rows_B, lengths_B].set(new_B)
        state = DecodeState(
            tokens_BS=constrain(tokens_BS, TOKEN_AXES),
            positions_B=lengths_B,
            done_B=~live_B | stop_V[new_B],
            step=jnp.ones((), jnp.int32),
            cache=cache,
        )
        return state, new_B


def _layer_caches(x_LBTKE: jax.Array, cache_len: int) -> tuple[jax.Array, ...]:
    """A prompt block's keys or values -> one cache per layer, [B, K, S, E] with `cache_len` slots."""
    x_LBKTE = jnp.pad(
        x_LBTKE.transpose(0, 1, 3, 2, 4), ((0, 0), (0, 0), (0, 0), (0, cache_len - x_LBTKE.shape[2]), (0, 0))
    )
    return tuple(constrain(x, CACHE_AXES) for x in x_LBKTE)


def _decode(params, weights, state: DecodeState, key, stop_V, spec: _Spec) -> tuple[DecodeState, jax.Array]:
    """One new token per row: the last token through the model over the cache, then sampled. Stopped rows are
    computed (the batch is one program) but neither advance nor change anything."""
    model = nnx.merge(spec.graphdef, params)
    rows_B = jnp.arange(state.positions_B.shape[0])
    last_B1 = state.tokens_BS[rows_B, state.positions_B][:, None]
    logits_B1V, keys, values = model.decode(
        last_B1, state.positions_B[:, None], state.cache.keys, state.cache.values, *weights
    )
    new_B = spec.sampler(logits_B1V[:, 0], jax.random.fold_in(key, state.step))
    live_B = ~state.done_B
    positions_B = state.positions_B + live_B
    tokens_BS = state.tokens_BS.at[rows_B, positions_B].set(
        jnp.where(live_B, new_B, state.tokens_BS[rows_B, positions_B])
    )
    state = DecodeState(
        tokens_BS=tokens_BS,
        positions_B=positions_B,
        done_B=state.done_B | stop_V[new_B],
        step=state.step + 1,
        cache=KVCache(tuple(constrain(k, CACHE_AXES) for k in keys), tuple(constrain(v, CACHE_AXES) for v in values)),
    )
    return state, jnp.where(live_B, new_B, -1)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def _decode_step(params, weights, state, key, stop_V, *, spec: _Spec):
    """One decode step (what `stream` calls per token); returns the state and the new tokens (-1: stopped row)."""
    with traced_in(spec.where):
        return _decode(params, weights, state, key, stop_V, spec)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def _decode_loop(params, weights, state, key, stop_V, max_new_tokens, *, spec: _Spec):
    """Decode steps until every row stopped or made `max_new_tokens` (a traced value: one program for any count)."""
    with traced_in(spec.where):

        def more(state):
            return (state.step < max_new_tokens) & ~jnp.all(state.done_B)

        return jax.lax.while_loop(more, lambda s: _decode(params, weights, s, key, stop_V, spec)[0], state)


@functools.partial(jax.jit, static_argnames=("one_row",))
def _decode_weights(model: Transformer, one_row: bool):
    """The layers' params one state each, the head's arrays ([D, V] even when tied) and, for one row on one
    device, the output projections transposed (`row_weights`): copies made once per generation that the decode
    steps read in place (Transformer.decode)."""
    rows = row_weights(model.cfg, nnx.state(model.blocks)) if one_row else None
    return model.layer_states(), model.head_params(), rows


# ----------------------------------------------------------------------------- ahead of time (jaxlm.deviceless)


def lower_decode_step(model: Transformer, rows: int, cache_len: int, sampler: Sampler, rules: dict | None = None):
    """`stream`'s decode step, bound as `_Run` binds it, lowered for a model whose params are ShapeDtypeStructs
    placed on a mesh (`Program.abstract_with_shardings`, what load_model restores into): `rows` rows (a multiple
    of the batch shards, as `_Batch` makes them) over a `cache_len`-slot cache. Its inputs are placed as a run
    places them: the weights as XLA places `_decode_weights`' outputs (that small program is compiled to say),
    the state as `_prefill` leaves it. Nothing is allocated, so a cluster this machine lacks can compile it.
    Returns the Lowered and its arguments (ShapeDtypeStructs)."""
    graphdef, params = nnx.split(model)
    where = placement_of(params, rules)
    mesh = jax.tree.leaves(params)[0].sharding.mesh
    one_row = rows == 1 and where is None
    weights_lowered = _decode_weights.lower(model, one_row=one_row)
    weights = jax.tree.map(_placed, weights_lowered.out_info, weights_lowered.compile().output_shardings)
    args = (
        params,
        weights,
        abstract_decode_state(model.cfg, rows, cache_len, where or Placement(mesh), one_row),
        jax.eval_shape(lambda: jax.random.key(0)),  # the key and stop_V: host values, as in a run
        jax.ShapeDtypeStruct((model.cfg.vocab_size,), jnp.bool_),
    )
    return _decode_step.lower(*args, spec=_Spec.of(graphdef, sampler, where)), args


def abstract_decode_state(
    cfg: ModelConfig, rows: int, cache_len: int, where: Placement, one_row: bool = False
) -> DecodeState:
    """The DecodeState `_prefill` returns as ShapeDtypeStructs, placed as it places them: the cache by CACHE_AXES
    in the model's dtype (no row axis for `one_row`, see KVCache), the tokens by TOKEN_AXES, the rest by row."""
    B, S, K, E = rows, cache_len, cfg.num_kv_heads, cfg.resolved_head_dim

    def split(target):  # a rule's mesh axes of size > 1, as `constrain` keeps them
        kept = tuple(a for a in (target if isinstance(target, tuple) else (target,)) if where.mesh.shape.get(a, 1) > 1)
        return kept if len(kept) > 1 else (kept[0] if kept else None)

    def placed(shape, dtype, axes):
        spec = PartitionSpec(*(split(t) for t in logical_spec(axes, where.rules_dict)))
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(where.mesh, spec))

    if one_row:
        layer = placed((K, S, E), jnp.dtype(cfg.dtype), CACHE_AXES[1:])
    else:
        layer = placed((B, K, S, E), jnp.dtype(cfg.dtype), CACHE_AXES)
    return DecodeState(
        tokens_BS=placed((B, S), jnp.int32, TOKEN_AXES),
        positions_B=placed((B,), jnp.int32, ("batch",)),
        done_B=placed((B,), jnp.bool_, ("batch",)),
        step=placed((), jnp.int32, ()),
        cache=KVCache((layer,) * cfg.num_layers, (layer,) * cfg.num_layers),
    )


def _placed(info, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sharding)


# ----------------------------------------------------------------------------- the entry points


@dataclasses.dataclass(frozen=True)
class _Batch:
    """Prompts padded into one bucket: the host-side half of a generation."""

    tokens_BT: np.ndarray
    lengths_B: np.ndarray
    live_B: np.ndarray
    cache_len: int
    count: int

    @classmethod
    def of(cls, prompts: Sequence[Sequence[int]], max_new_tokens: int, vocab_size: int, shards: int) -> _Batch:
        if not prompts:
            raise ValueError("no prompts to generate from")
        arrays = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
        for i, ids in enumerate(arrays):
            if ids.size == 0:
                raise ValueError(f"prompt {i} is empty; a prompt needs at least one token")
            if ids.min() < 0 or ids.max() >= vocab_size:
                raise ValueError(f"prompt {i} holds ids outside the model's vocabulary [0, {vocab_size})")
        B = batch_rows(len(arrays), shards)
        longest = max(a.size for a in arrays)
        T = bucket(longest)
        tokens_BT = np.zeros((B, T), np.int32)
        lengths_B = np.ones(B, np.int32)  # pad rows: one token, stopped from the start
        for i, ids in enumerate(arrays):
            tokens_BT[i, : ids.size], lengths_B[i] = ids, ids.size
        live_B = np.arange(B) < len(arrays)
        return cls(tokens_BT, lengths_B, live_B, max(T, bucket(longest + max_new_tokens)), len(arrays))


class _Run:
    """One generation's compiled pieces bound to a model, its placement and a sampler."""

    def __init__(self, model: Transformer, prompts, max_new_tokens, sampler, seed, stop_ids, rules):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        cfg = model.cfg
        graphdef, self.params = nnx.split(model)
        self.where = placement_of(self.params, rules)
        self.spec = _Spec.of(graphdef, sampler, self.where)
        shards = self.where.batch_shards() if self.where else 1
        self.batch = _Batch.of(prompts, max_new_tokens, cfg.vocab_size, shards)
        self.weights = _decode_weights(model, one_row=self.batch.tokens_BT.shape[0] == 1 and self.where is None)
        self.max_new_tokens = max_new_tokens
        self.key = jax.random.key(seed)
        stop_V = np.zeros(cfg.vocab_size, bool)
        stop_V[[i for i in stop_ids if 0 <= i < cfg.vocab_size]] = True
        self.stop_V = stop_V

    def _put(self, array: np.ndarray, axes: tuple[str, ...]):
        # device_put, not jnp.asarray: that staged a small program per new shape (lax.stage), compiled each time
        return jax.device_put(array) if self.where is None else jax.device_put(array, self.where.sharding(axes))

    def prefill(self) -> tuple[DecodeState, jax.Array]:
        b = self.batch
        return _prefill(
            self.params,
            self.weights,
            self._put(b.tokens_BT, ("batch", "seq")),
            self._put(b.lengths_B, ("batch",)),
            self._put(b.live_B, ("batch",)),
            self.key,
            self.stop_V,
            spec=self.spec,
            cache_len=b.cache_len,
        )

    def loop(self, state: DecodeState) -> DecodeState:
        return _decode_loop(
            self.params,
            self.weights,
            state,
            self.key,
            self.stop_V,
            np.int32(self.max_new_tokens),
            spec=self.spec,
        )

    def step(self, state: DecodeState) -> tuple[DecodeState, jax.Array]:
        return _decode_step(
            self.params,
            self.weights,
            state,
            self.key,
            self.stop_V,
            spec=self.spec,
        )

    def new_tokens(self, state: DecodeState) -> list[np.ndarray]:
        tokens_BS, positions_B = jax.device_get((state.tokens_BS, state.positions_B))
        b = self.batch
        return [tokens_BS[i, b.lengths_B[i] : positions_B[i] + 1].astype(np.int64) for i in range(b.count)]


def generate(
    model: Transformer,
    prompts: list[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
    vocab_limit: int = 0,
    rules: dict | None = None,
) -> list[np.ndarray]:
    """The new ids of every prompt: up to `max_new_tokens`, ending early at the first of `stop_ids`, which is
    included (so a caller can tell a stop from running out; decode with skip_special_tokens to drop an EOS).

    `vocab_limit` (the tokenizer's vocabulary size; 0: the model's) bounds the ids that can be chosen. `rules` are
    the layout's logical-axis overrides when the model is sharded over a mesh. Repeated calls with prompts in the
    same bucket reuse the compiled programs.
    """
    sampler = Sampler(temperature, top_k, top_p, vocab_limit)
    run = _Run(model, prompts, max_new_tokens, sampler, seed, stop_ids, rules)
    state, _ = run.prefill()
    return run.new_tokens(run.loop(state))


def stream(
    model: Transformer,
    prompts: list[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
    vocab_limit: int = 0,
    rules: dict | None = None,
) -> Iterator[np.ndarray]:
    """`generate` one token at a time: yields every prompt's next id per step ([len(prompts)], -1 once a row has
    stopped) until all stopped or `max_new_tokens` steps; the same tokens `generate` returns. A caller may stop
    iterating at any time (e.g. on a stop string)."""
    sampler = Sampler(temperature, top_k, top_p, vocab_limit)
    run = _Run(model, prompts, max_new_tokens, sampler, seed, stop_ids, rules)
    count = run.batch.count
    state, new_B = run.prefill()
    yield np.asarray(new_B)[:count]
    for _ in range(max_new_tokens - 1):
        if bool(np.all(np.asarray(state.done_B)[:count])):
            return
        state, new_B = run.step(state)
        yield np.asarray(new_B)[:count]
