"""Generation speed: prefill and decode tokens/s of jaxlm.generate against transformers' `generate` (torch, CPU) on
the same weights, and the decode step against this machine's memory-bandwidth bound, all in one run.

    python -m experiments.bench_generate                         # gpt-bench model, batch 1 and 16
    python -m experiments.bench_generate --batches 1 --new-tokens 64 --set model.num_layers=2

The model is bench_train's gpt-bench shape with random weights, copied into a transformers LlamaForCausalLM by
jaxlm.hf (float32 both); both sides run greedy on the same random prompts and their first tokens are compared.
Prefill: the time to the first new token. Decode: (time for N new tokens - time for 1) / (N - 1) per step, best
of --repeats. The bound of a decode step is the bytes it must read (every weight once, plus each row's filled
cache slots, on average prompt + N/2 of them) over the machine's copy bandwidth (an in-place add over 256 MB,
bytes read + written per second). "products ms" is the step's weight products alone, in the model's einsums on the
same weights (`weight_products_s`): the floor XLA's own matmul kernels put under the step here, and "ceiling x" the
decode speed-up over transformers were the step nothing else. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.bench_train import GPT_BENCH
from experiments.cli import exit_with
from jaxlm import config as config_lib
from jaxlm import generate as gen
from jaxlm.model import Transformer, row_weights


def copy_bandwidth(megabytes: int = 256, repeats: int = 10) -> float:
    """Bytes read + written per second by an in-place elementwise add over `megabytes` (donated: no fresh pages)."""
    x = jnp.zeros(megabytes * 2**20 // 4, jnp.float32)
    add = jax.jit(lambda a: a + 1, donate_argnums=0)
    x = add(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = add(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * x.nbytes / best


def best_of(fn, repeats: int) -> float:
    fn()  # compiles
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def jax_times(model, prompts, new_tokens: int, repeats: int) -> tuple[float, float, np.ndarray]:
    """(prefill s, decode s per step, the greedy tokens) of jaxlm.generate."""

    def run(n):
        return gen.generate(model, prompts, max_new_tokens=n)

    first = best_of(lambda: run(1), repeats)
    full = best_of(lambda: run(new_tokens), repeats)
    return first, (full - first) / (new_tokens - 1), np.stack(run(new_tokens))


def weight_products(model: Transformer, rows: int, steps: int = 32):
    """(compiled fn, its args): `steps` decode steps of nothing but the model's weight products, on `rows` rows: each
    layer's QKV, output, gate/up and down projections and the vocabulary head, in the model's own einsums and weight
    layouts, chained with only the glue that keeps them dependent (no attention, cache, norms or sampling)."""
    cfg = model.cfg
    L, K, D = cfg.num_layers, cfg.num_kv_heads, cfg.d_model
    G = cfg.num_heads // K
    wqkv, w_in = list(model.blocks.attn.wqkv[...]), list(model.blocks.mlp.w_in[...])
    transposed = rows == 1 and row_weights(cfg, nnx.state(model.blocks))  # as generate decodes one row
    if transposed:  # wo [D, H*E], w_out [D, F]
        wo, w_out = (list(w) for w in zip(*transposed, strict=True))
        wo_spec, w_out_spec = "btx,dx->btd", "btf,df->btd"
    else:  # wo [H*E, D], w_out [F, D]
        wo, w_out = list(model.blocks.attn.wo[...].reshape(L, -1, D)), list(model.blocks.mlp.w_out[...])
        wo_spec, w_out_spec = "btx,xd->btd", "btf,fd->btd"
    head = model.embed[...] if cfg.tie_embeddings else model.lm_head[...]

    def step(x_BTD, wqkv, wo, w_in, w_out, head):
        for l in range(L):
            qkv = jnp.einsum("btd,dkge->btkge", x_BTD, wqkv[l])
            attn = qkv[:, :, :, :G].reshape(rows, 1, -1)  # the query heads stand in for attention's output
            x_BTD = x_BTD + jnp.einsum(wo_spec, attn, wo[l])
            h_BTCF = jnp.einsum("btd,dcf->btcf", x_BTD, w_in[l])
            x_BTD = x_BTD + jnp.einsum(w_out_spec, h_BTCF[:, :, 0] * h_BTCF[:, :, 1], w_out[l])
        head_DV = head.T if cfg.tie_embeddings else head  # as Transformer.head_params gives it
        return x_BTD + jnp.einsum("btd,dv->btv", x_BTD, head_DV)[:, :, :1]

    fn = jax.jit(lambda x, *w: jax.lax.fori_loop(0, steps, lambda _, x: step(x, *w), x))
    return fn, (jnp.full((rows, 1, D), 1e-3, jnp.float32), wqkv, wo, w_in, w_out, head)


def weight_products_s(model: Transformer, rows: int, repeats: int, steps: int = 32) -> float:
    """Seconds per decode step of its weight products alone (`weight_products`): the floor that XLA's own matmul
    kernels put under the decode step on this machine."""
    fn, args = weight_products(model, rows, steps)
    return best_of(lambda: fn(*args).block_until_ready(), repeats) / steps


def hf_model(model: Transformer):
    """transformers' LlamaForCausalLM holding `model`'s weights (jaxlm.hf's mapping)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from jaxlm import hf

    cfg = model.cfg
    pure = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))

    def fetch(path, layer):
        value = pure
        for key in path:
            value = value[key]
        return value if layer is None else value[layer]

    config = hf.hf_config(cfg, vocab_size=cfg.vocab_size, eos_id=cfg.vocab_size - 1, bos_id=None, dtype="float32")
    config = LlamaConfig(**{**config, "eos_token_id": None, "pad_token_id": None})
    torch_model = LlamaForCausalLM(config).float().eval()
    tensors = {k: torch.tensor(np.ascontiguousarray(v)) for k, v in hf.hf_tensors(cfg, cfg.vocab_size, fetch)}
    torch_model.load_state_dict(tensors, strict=not cfg.tie_embeddings)
    return torch_model


def hf_times(torch_model, prompts, new_tokens: int, repeats: int) -> tuple[float, float, np.ndarray]:
    """(prefill s, decode s per step, the greedy tokens) of transformers' generate (KV cache on, greedy)."""
    import torch

    ids = torch.tensor(np.asarray(prompts))

    def run(n):
        with torch.no_grad():
            return torch_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False
            )

    first = best_of(lambda: run(1), repeats)
    full = best_of(lambda: run(new_tokens), repeats)
    return first, (full - first) / (new_tokens - 1), run(new_tokens)[:, ids.shape[1] :].numpy()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench_generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a gpt-bench field")
    p.add_argument("--batches", default="1,16", help="batch sizes, comma-separated (default 1,16)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per row (default 64)")
    p.add_argument("--new-tokens", type=int, default=128, help="new tokens per row (default 128)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per figure, best kept (default 3)")
    p.add_argument("--no-torch", action="store_true", help="skip the transformers peer")
    args = p.parse_args(argv)
    try:
        cfg = config_lib.validate(config_lib.apply_overrides(GPT_BENCH, args.set)).model
        batches = [int(b) for b in args.batches.split(",")]
        if min(batches) < 1 or args.prompt_len < 1 or args.new_tokens < 2 or args.repeats < 1:
            raise ValueError("--batches, --prompt-len and --repeats must be >= 1, --new-tokens >= 2")
        if args.prompt_len + args.new_tokens > cfg.max_seq_len:
            raise ValueError(f"--prompt-len + --new-tokens exceed the model's max length {cfg.max_seq_len}")
    except ValueError as e:
        print(f"bench_generate: error: {e}", file=sys.stderr)
        return 2

    model = Transformer(cfg, rngs=nnx.Rngs(0))
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    # A tied table counts once: the head reads it whole every step, the lookup only B rows.
    bandwidth = copy_bandwidth()
    torch_model = None if args.no_torch else hf_model(model)
    rng = np.random.default_rng(0)
    rows = []
    for B in batches:
        prompts = rng.integers(0, cfg.vocab_size, (B, args.prompt_len)).tolist()
        prefill_s, step_s, tokens = jax_times(model, prompts, args.new_tokens, args.repeats)
        filled = args.prompt_len + args.new_tokens / 2  # cache slots a step must read, on average per row
        cache_bytes = 2 * cfg.num_layers * B * filled * cfg.num_kv_heads * cfg.resolved_head_dim * 4
        bound_s = (weight_bytes + cache_bytes) / bandwidth
        products_s = weight_products_s(model, B, args.repeats)
        row = {
            "batch": B,
            "prefill_tokens_per_s": B * args.prompt_len / prefill_s,
            "decode_tokens_per_s": B / step_s,
            "decode_step_ms": 1e3 * step_s,
            "bound_step_ms": 1e3 * bound_s,
            "step_over_bound": step_s / bound_s,
            "weight_products_ms": 1e3 * products_s,
            "products_over_bound": products_s / bound_s,
        }
        if torch_model is not None:
            hf_prefill_s, hf_step_s, hf_tokens = hf_times(torch_model, prompts, args.new_tokens, args.repeats)
            agree = [int(np.argmin(np.append(t == h, False))) for t, h in zip(tokens, hf_tokens)]
            row.update(
                hf_prefill_tokens_per_s=B * args.prompt_len / hf_prefill_s,
                hf_decode_tokens_per_s=B / hf_step_s,
                prefill_speedup=hf_prefill_s / prefill_s,
                decode_speedup=hf_step_s / step_s,
                decode_speedup_ceiling=hf_step_s / products_s,  # were the step nothing but its weight products
                same_greedy_tokens=min(agree),  # leading tokens equal in every row (float32 both)
            )
        rows.append(row)

    print(f"gpt-bench generation: {cfg.num_layers} layers, d {cfg.d_model}, vocab {cfg.vocab_size}, float32; ")
    print(
        f"prompt {args.prompt_len} + {args.new_tokens} new tokens per row; weights {weight_bytes / 1e6:.1f} MB; "
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; {jax.device_count()} JAX device(s)"
    )
    head = f"{'batch':>5} {'prefill tok/s':>14} {'decode tok/s':>13} {'step ms':>8} {'bound ms':>9} {'/bound':>7}"
    head += f" {'products ms':>12} {'/bound':>7}"
    if torch_model is not None:
        head += f" {'HF prefill':>11} {'HF decode':>10} {'prefill x':>10} {'decode x':>9} {'ceiling x':>10} {'same':>5}"
    print(head)
    for r in rows:
        line = (
            f"{r['batch']:>5} {r['prefill_tokens_per_s']:>14.0f} {r['decode_tokens_per_s']:>13.1f} "
            f"{r['decode_step_ms']:>8.2f} {r['bound_step_ms']:>9.2f} {r['step_over_bound']:>7.2f}"
            f" {r['weight_products_ms']:>12.2f} {r['products_over_bound']:>7.2f}"
        )
        if torch_model is not None:
            line += (
                f" {r['hf_prefill_tokens_per_s']:>11.0f} {r['hf_decode_tokens_per_s']:>10.1f} "
                f"{r['prefill_speedup']:>10.2f} {r['decode_speedup']:>9.2f} {r['decode_speedup_ceiling']:>10.2f}"
                f" {r['same_greedy_tokens']:>5}"
            )
        print(line)
    summary = {
        "model": "gpt-bench" if not args.set else "gpt-bench " + " ".join(args.set),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "weight_bytes": weight_bytes,
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "rows": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in rows],
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    exit_with(main())
