"""Hugging Face Llama, Mixtral, Qwen3 and Qwen3-MoE <-> jaxlm: the config fields and the parameter mapping, by
renaming, reshaping, transposing.

jaxlm's model computes what `transformers`' LlamaForCausalLM computes (half-split RoPE, GQA, pre-norm RMSNorm,
SwiGLU), so a conversion moves numbers and never changes one. Two layouts differ:
- HF keeps each projection as a torch Linear weight [out, in]; jaxlm keeps [in, ...out] and fuses q/k/v (wqkv
  [D, K, G+2, E]: per kv head its G query heads, then k, then v) and gate/up (w_in [D, 2, F]). HF orders query
  heads h = k*G + g, which is wqkv's [K, G] flattened.
- jaxlm stacks layers on a leading axis; HF names each layer's tensors `model.layers.{i}.`.
The other families are Llamas with one or two differences (`FAMILIES`):
- Mixtral's MLPs are mixtures of experts (softmax top-k, renormalized: `model.router=softmax`). It keeps its router
  as `block_sparse_moe.gate` [X, D] and each expert as w1 (gate), w3 (up) [F, D] and w2 (down) [D, F], the Hub's
  layout (transformers 5 fuses them on load); jaxlm stacks the experts (w_in [X, D, 2, F], w_out [X, F, D], router
  [D, X]).
- Qwen3 normalizes each head's query and key before RoPE (`model.qk_norm`: `self_attn.q_norm` / `k_norm` [E]).
- Qwen3-MoE is both: QK-norm, and experts as `mlp.gate` + `mlp.experts.{e}.gate_proj / up_proj / down_proj`, the
  top-k renormalized or not (`norm_topk_prob` = `model.router_norm_topk`).

The vocabulary: jaxlm's may be padded past the tokenizer's (ids that are never predicted); HF files carry the
tokenizer's. Export slices the padding off, import pads with zero rows up to a multiple of VOCAB_MULTIPLE
(model.tokenizer_vocab_size marks where the padding starts: those ids are never predicted).

This module reads and writes no files (`jaxlm.hf_files` does); tensors are numpy float32 arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from jaxlm.config import VOCAB_MULTIPLE, ModelConfig

# Tensors some Llama checkpoints carry that are not weights (older transformers saved the RoPE table).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Family:
    """What tells one HF architecture jaxlm converts from another: its names, QK-norm, and where its experts are."""

    name: str
    architecture: str
    model_type: str
    qk_norm: bool = False
    moe: str = ""  # the experts' module under a layer ("" for a dense MLP)
    router: str = ""  # the router's module under a layer
    expert_names: tuple[str, str, str] = ("", "", "")  # gate, up, down projections of one expert


FAMILIES = (
    Family("Llama", "LlamaForCausalLM", "llama"),
    Family(
        "Mixtral",
        "MixtralForCausalLM",
        "mixtral",
        False,
        "block_sparse_moe.experts",
        "block_sparse_moe.gate",
        ("w1", "w3", "w2"),
    ),
    Family("Qwen3", "Qwen3ForCausalLM", "qwen3", True),
    Family(
        "Qwen3-MoE",
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        True,
        "mlp.experts",
        "mlp.gate",
        ("gate_proj", "up_proj", "down_proj"),
    ),
)
LLAMA, MIXTRAL, QWEN3, QWEN3_MOE = FAMILIES


def family_of(cfg: ModelConfig) -> Family:
    """The HF family that computes `cfg`'s model: QK-norm makes it a Qwen3, experts a mixture."""
    return {(False, False): LLAMA, (False, True): MIXTRAL, (True, False): QWEN3, (True, True): QWEN3_MOE}[
        (cfg.qk_norm, bool(cfg.num_experts))
    ]


class HFError(ValueError):
    """An HF directory or a checkpoint that cannot be converted; the message names the field or tensor."""


# ----------------------------------------------------------------------------- config


def model_config_from_hf(hf: dict) -> ModelConfig:
    """ModelConfig of a config.json of the Llama family (Llama 2 / 3 / 3.1: GQA, tied or not, any head_dim, `llama3`
    RoPE scaling), Mixtral, Qwen3 or Qwen3-MoE; HFError naming the first field it cannot express."""
    family = _family(hf)
    if hf.get("sliding_window") and hf.get("use_sliding_window", True):  # Qwen3's flag; Mistral's has none
        raise HFError(f"sliding_window is {hf['sliding_window']}; jaxlm's {family.name} attends over the whole row")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise HFError(f"{flag} is true; jaxlm's {family.name} has no biases")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFError(f"hidden_act is {hf['hidden_act']!r}; only 'silu' (SwiGLU) is supported")
    D, H = _int(hf, "hidden_size"), _int(hf, "num_attention_heads")
    rope = _rope(hf)
    V = _int(hf, "vocab_size")
    cfg = ModelConfig(
        vocab_size=-(-V // VOCAB_MULTIPLE) * VOCAB_MULTIPLE,
        tokenizer_vocab_size=V,
        d_model=D,
        num_layers=_int(hf, "num_hidden_layers"),
        num_heads=H,
        num_kv_heads=_int(hf, "num_key_value_heads", H),
        head_dim=_int(hf, "head_dim", None) or D // H,
        mlp_dim=_int(hf, "intermediate_size"),
        max_seq_len=_int(hf, "max_position_embeddings", 2048),
        norm_eps=_float(hf, "rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=family.qk_norm,
        **rope,
        **(_moe_fields(hf, family) if family.moe else {}),
    )
    try:
        cfg.validate()
    except ValueError as e:
        raise HFError(f"config.json describes a model jaxlm cannot build: {e}") from None
    return cfg


def _family(hf: dict) -> Family:
    """The family a config.json names in `architectures` (or, without one, in `model_type`)."""
    by_type = {f.model_type: f for f in FAMILIES}
    archs = hf.get("architectures") or [by_type.get(hf.get("model_type"), LLAMA).architecture]
    found = [f for f in FAMILIES if f.architecture in archs]
    if not found:
        supported = ", ".join(f.architecture for f in FAMILIES)
        raise HFError(f"architectures is {archs}; supported: {supported}")
    family = found[0]
    if hf.get("model_type", family.model_type) != family.model_type:
        raise HFError(f"model_type is {hf['model_type']!r}; {family.architecture} has {family.model_type!r}")
    return family


def _moe_fields(hf: dict, family: Family) -> dict:
    """The experts of every layer: softmax top-k (Mixtral renormalizes; Qwen3-MoE as `norm_topk_prob` says),
    dropless."""
    if family is MIXTRAL:
        experts, size, norm_topk = _int(hf, "num_local_experts"), _int(hf, "intermediate_size"), True
    else:
        dense = hf.get("mlp_only_layers") or []
        if dense:
            raise HFError(
                f"mlp_only_layers is {dense}: jaxlm's Qwen3-MoE places its dense layers by decoder_sparse_step "
                f"(model.moe_every) only"
            )
        # the Hub's configs say num_experts; transformers 5 writes its attribute's name, num_local_experts
        experts = _int(hf, "num_experts", None) or _int(hf, "num_local_experts")
        size = _int(hf, "moe_intermediate_size")
        norm_topk = bool(hf.get("norm_topk_prob", False))
    return {
        "num_experts": experts,
        "moe_every": 1 if family is MIXTRAL else _int(hf, "decoder_sparse_step", 1),
        "experts_per_token": _int(hf, "num_experts_per_tok"),
        "expert_mlp_dim": size,
        "router": "softmax",
        "router_norm_topk": norm_topk,
        "moe_aux_loss": _float(hf, "router_aux_loss_coef", 0.02 if family is MIXTRAL else 0.001),
        "capacity_factor": 0.0,
    }


def _rope(hf: dict) -> dict:
    """The RoPE fields: transformers 5 writes `rope_parameters` (theta inside), earlier ones `rope_theta` +
    `rope_scaling` (whose type key was once `type`)."""
    key = "rope_parameters" if isinstance(hf.get("rope_parameters"), dict) else "rope_scaling"
    params = hf.get(key) or {}
    if not isinstance(params, dict):
        raise HFError(f"{key} must be an object, got {params!r}")
    theta = _float({**hf, **params}, "rope_theta", 10_000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("default", None):
        return {"rope_theta": theta}
    if kind != "llama3":
        raise HFError(f"{key}.rope_type is {kind!r}; supported: 'default', 'llama3'")
    return {
        "rope_theta": theta,
        "rope_scaling": "llama3",
        "rope_scaling_factor": _float(params, "factor", prefix=key),
        "rope_low_freq_factor": _float(params, "low_freq_factor", prefix=key),
        "rope_high_freq_factor": _float(params, "high_freq_factor", prefix=key),
        "rope_original_max_seq_len": _int(params, "original_max_position_embeddings", prefix=key),
    }


def _int(d: dict, key: str, default=..., prefix: str = ""):
    return _number(d, key, default, int, prefix)


def _float(d: dict, key: str, default=..., prefix: str = ""):
    return float(_number(d, key, default, (int, float), prefix))


def _number(d: dict, key: str, default, kind, prefix: str):
    """d[key] checked to be a number of `kind`; missing: `default`, or HFError naming `prefix.key`."""
    name = f"{prefix}.{key}" if prefix else key
    value = d.get(key)
    if value is None:
        if default is ...:
            raise HFError(f"config.json has no {name}")
        return default
    if isinstance(value, bool) or not isinstance(value, kind):
        raise HFError(f"config.json {name} must be a number, got {value!r}")
    return value


def hf_config(cfg: ModelConfig, *, vocab_size: int, eos_id: int, bos_id: int | None, dtype: str) -> dict:
    """config.json of the HF model (`family_of(cfg)`) computing `cfg`'s function over the first `vocab_size` ids.
    RoPE as `rope_theta` + `rope_scaling`, the form every transformers version (and vLLM, llama.cpp) reads."""
    check_exportable(cfg)
    family = family_of(cfg)
    rope_scaling = None
    if cfg.rope_scaling == "llama3":
        rope_scaling = {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_seq_len,
        }
    config = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if family is LLAMA:
        config["mlp_bias"] = False
    if family.qk_norm:
        config |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.num_layers}
    if family is MIXTRAL:
        del config["attention_bias"]
        config |= {
            "intermediate_size": cfg.expert_mlp_dim,
            "num_local_experts": cfg.num_experts,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
        }
    if family is QWEN3_MOE:
        config |= {
            "num_experts": cfg.num_experts,
            "moe_intermediate_size": cfg.expert_mlp_dim,
            "norm_topk_prob": cfg.router_norm_topk,
            "decoder_sparse_step": cfg.moe_every,
            "mlp_only_layers": [],
        }
    if family.moe:
        config |= {
            "num_experts_per_tok": cfg.experts_per_token,
            "router_aux_loss_coef": cfg.moe_aux_loss,
            "output_router_logits": False,
        }
    return config


def check_exportable(cfg: ModelConfig) -> None:
    """HFError naming a model setting its HF family does not compute (a mask is fine if it only separates packed
    training documents)."""
    family = family_of(cfg)
    if cfg.attention_softcap:
        raise HFError(f"model.attention_softcap is {cfg.attention_softcap}; HF's {family.name} has no soft cap")
    if cfg.num_experts and (cfg.router != "softmax" or cfg.num_shared_experts):
        raise HFError(
            f"model.router {cfg.router!r} (num_shared_experts {cfg.num_shared_experts}) is not "
            f"{family.architecture}'s: it exports softmax top-k routers without shared experts"
        )
    if family is MIXTRAL and cfg.moe_every > 1:
        raise HFError(
            f"model.moe_every is {cfg.moe_every}, and Mixtral has experts in every layer (Qwen3-MoE has dense layers "
            f"between them, and also normalizes queries and keys: model.qk_norm)"
        )
    if family is MIXTRAL and not cfg.router_norm_topk:
        raise HFError(
            "model.router_norm_topk is false, and Mixtral always renormalizes the top-k weights "
            "(Qwen3-MoE does not, but it also normalizes queries and keys: model.qk_norm)"
        )
    if cfg.attention_mask.replace(" ", "") not in ("causal", "causal&document", "document&causal"):
        raise HFError(f"model.attention_mask is {cfg.attention_mask!r}; HF's {family.name} attends causally only")


# ----------------------------------------------------------------------------- tensors

Fetch = Callable[[tuple[str, ...], "int | None"], np.ndarray]  # (param path, layer or None) -> float32 array


def hf_tensors(cfg: ModelConfig, vocab_size: int, fetch: Fetch) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array) of every tensor, one at a time: `fetch` is asked for one param (one layer of a stacked
    one) just before the tensors made from it are yielded, so a caller that writes each tensor away holds one
    layer's param at a time."""
    yield "model.embed_tokens.weight", fetch(("embed",), None)[:vocab_size]
    for i in range(cfg.num_layers):
        stack, j = cfg.layer_slot(i)
        yield from _layer_tensors(cfg, i, lambda *path: fetch((stack, *path), j))
    yield "model.norm.weight", fetch(("final_norm", "scale"), None)
    if not cfg.tie_embeddings:
        yield "lm_head.weight", fetch(("lm_head",), None)[:, :vocab_size].T


def _layer_tensors(cfg: ModelConfig, i: int, get) -> Iterator[tuple[str, np.ndarray]]:
    D, K, E = cfg.d_model, cfg.num_kv_heads, cfg.resolved_head_dim
    G = cfg.num_heads // K
    family = family_of(cfg)
    p = f"model.layers.{i}."
    yield p + "input_layernorm.weight", get("attn_norm", "scale")
    wqkv = get("attn", "wqkv")  # [D, K, G+2, E]
    yield p + "self_attn.q_proj.weight", wqkv[:, :, :G].reshape(D, K * G * E).T
    yield p + "self_attn.k_proj.weight", wqkv[:, :, G].reshape(D, K * E).T
    yield p + "self_attn.v_proj.weight", wqkv[:, :, G + 1].reshape(D, K * E).T
    yield p + "self_attn.o_proj.weight", get("attn", "wo").reshape(K * G * E, D).T
    if family.qk_norm:
        yield p + "self_attn.q_norm.weight", get("attn", "q_norm", "scale")
        yield p + "self_attn.k_norm.weight", get("attn", "k_norm", "scale")
    yield p + "post_attention_layernorm.weight", get("mlp_norm", "scale")
    w_in = get("mlp", "w_in")  # [D, 2, F] (experts: [X, D, 2, F]): gate, up
    if cfg.is_moe_layer(i):
        yield f"{p}{family.router}.weight", get("mlp", "router").T
        w_out = get("mlp", "w_out")
        gate, up, down = family.expert_names
        for e in range(cfg.num_experts):
            q = f"{p}{family.moe}.{e}."
            yield f"{q}{gate}.weight", w_in[e, :, 0].T
            yield f"{q}{up}.weight", w_in[e, :, 1].T
            yield f"{q}{down}.weight", w_out[e].T
        return
    yield p + "mlp.gate_proj.weight", w_in[:, 0].T
    yield p + "mlp.up_proj.weight", w_in[:, 1].T
    yield p + "mlp.down_proj.weight", get("mlp", "w_out").T


def hf_shapes(cfg: ModelConfig, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """{HF name: shape} of every tensor a model of `cfg` has (what an import must find)."""
    D, H, K, E = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    shapes = {"model.embed_tokens.weight": (vocab_size, D), "model.norm.weight": (D,)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (H * E, D),
            p + "self_attn.k_proj.weight": (K * E, D),
            p + "self_attn.v_proj.weight": (K * E, D),
            p + "self_attn.o_proj.weight": (D, H * E),
            p + "post_attention_layernorm.weight": (D,),
        }
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (E,), p + "self_attn.k_norm.weight": (E,)}
        shapes |= _mlp_shapes(cfg, p, cfg.is_moe_layer(i))
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (vocab_size, D)
    return shapes


def _mlp_shapes(cfg: ModelConfig, p: str, moe: bool) -> dict[str, tuple[int, ...]]:
    D, family = cfg.d_model, family_of(cfg)
    if not moe:
        F = cfg.mlp_dim
        return {
            p + "mlp.gate_proj.weight": (F, D),
            p + "mlp.up_proj.weight": (F, D),
            p + "mlp.down_proj.weight": (D, F),
        }
    X, F = cfg.num_experts, cfg.expert_mlp_dim
    gate, up, down = family.expert_names
    shapes = {f"{p}{family.router}.weight": (X, D)}
    for e in range(X):
        q = f"{p}{family.moe}.{e}."
        shapes |= {f"{q}{gate}.weight": (F, D), f"{q}{up}.weight": (F, D), f"{q}{down}.weight": (D, F)}
    return shapes


def unexpected_tensors(cfg: ModelConfig, vocab_size: int, names) -> list[str]:
    """Names in an HF file that are not part of a model of `cfg` (a tied model's lm_head.weight copy and old RoPE
    tables excepted: transformers itself ignores them)."""
    expected = hf_shapes(cfg, vocab_size)
    ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()
    return sorted(n for n in names if n not in expected and n not in ignored and not n.endswith(IGNORED_SUFFIXES))


def params_from_hf(cfg: ModelConfig, vocab_size: int, read: Callable[[str], np.ndarray]) -> dict:
    """jaxlm params (the nested dict `nnx.to_pure_dict` gives, float32 numpy) from HF tensors; `read(name)` returns
    one tensor, already checked against `hf_shapes`. The vocabulary is zero-padded to cfg.vocab_size."""
    D, H, K, E = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    G = H // K
    family = family_of(cfg)
    stacks = {}
    for i in range(cfg.num_layers):
        name, j = cfg.layer_slot(i)
        if name not in stacks:
            count = sum(cfg.layer_slot(n)[0] == name for n in range(cfg.num_layers))
            stacks[name] = _empty_stack(cfg, count, cfg.is_moe_layer(i))
        blocks = stacks[name]
        attn, mlp = blocks["attn"], blocks["mlp"]
        p = f"model.layers.{i}."
        blocks["attn_norm"]["scale"][j] = read(p + "input_layernorm.weight")
        wqkv = attn["wqkv"][j]
        wqkv[:, :, :G] = read(p + "self_attn.q_proj.weight").T.reshape(D, K, G, E)
        wqkv[:, :, G] = read(p + "self_attn.k_proj.weight").T.reshape(D, K, E)
        wqkv[:, :, G + 1] = read(p + "self_attn.v_proj.weight").T.reshape(D, K, E)
        attn["wo"][j] = read(p + "self_attn.o_proj.weight").T.reshape(H, E, D)
        if family.qk_norm:
            attn["q_norm"]["scale"][j] = read(p + "self_attn.q_norm.weight")
            attn["k_norm"]["scale"][j] = read(p + "self_attn.k_norm.weight")
        blocks["mlp_norm"]["scale"][j] = read(p + "post_attention_layernorm.weight")
        if cfg.is_moe_layer(i):
            mlp["router"][j] = read(f"{p}{family.router}.weight").T
            gate, up, down = family.expert_names
            for e in range(cfg.num_experts):
                q = f"{p}{family.moe}.{e}."
                mlp["w_in"][j, e, :, 0] = read(f"{q}{gate}.weight").T
                mlp["w_in"][j, e, :, 1] = read(f"{q}{up}.weight").T
                mlp["w_out"][j, e] = read(f"{q}{down}.weight").T
            continue
        mlp["w_in"][j, :, 0] = read(p + "mlp.gate_proj.weight").T
        mlp["w_in"][j, :, 1] = read(p + "mlp.up_proj.weight").T
        mlp["w_out"][j] = read(p + "mlp.down_proj.weight").T
    params = {"embed": _zeros((cfg.vocab_size, D)), **stacks, "final_norm": {"scale": _zeros((D,))}}
    params["embed"][:vocab_size] = read("model.embed_tokens.weight")
    params["final_norm"]["scale"][:] = read("model.norm.weight")
    if not cfg.tie_embeddings:
        params["lm_head"] = _zeros((D, cfg.vocab_size))
        params["lm_head"][:, :vocab_size] = read("lm_head.weight").T
    return params


def _zeros(shape) -> np.ndarray:
    return np.zeros(shape, np.float32)


def _empty_stack(cfg: ModelConfig, L: int, moe: bool) -> dict:
    """A stack of L layers' params (jaxlm.model.Block's), zeros: dense MLPs, or with `moe` experts and router."""
    D, H, K, E = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    X, F = cfg.num_experts, cfg.expert_mlp_dim if moe else cfg.mlp_dim
    experts = (X,) if moe else ()
    blocks = {
        "attn": {"wqkv": _zeros((L, D, K, H // K + 2, E)), "wo": _zeros((L, H, E, D))},
        "attn_norm": {"scale": _zeros((L, D))},
        "mlp": {"w_in": _zeros((L, *experts, D, 2, F)), "w_out": _zeros((L, *experts, F, D))},
        "mlp_norm": {"scale": _zeros((L, D))},
    }
    if cfg.qk_norm:
        blocks["attn"] |= {"q_norm": {"scale": _zeros((L, E))}, "k_norm": {"scale": _zeros((L, E))}}
    if moe:
        blocks["mlp"]["router"] = _zeros((L, D, X))
    return blocks
