"""experiments.bench_generate: the transformers peer holds the same weights, bad flags are one line, and (slow) the
whole benchmark prints its table and a JSON last line. No timing is asserted."""

import json

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import tiny_model

from experiments import bench_generate
from jaxlm.model import Transformer

TINY = ["--set", "model.num_layers=1", "--set", "model.d_model=64", "--set", "model.num_heads=2"]
TINY += ["--set", "model.num_kv_heads=1", "--set", "model.mlp_dim=128", "--set", "model.vocab_size=256"]


def test_the_transformers_peer_computes_the_same_logits_and_greedy_tokens():
    model = Transformer(tiny_model(max_seq_len=64), rngs=nnx.Rngs(0))
    prompts = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, 5)).tolist()
    peer = bench_generate.hf_model(model)
    with torch.no_grad():
        theirs = peer(torch.tensor(prompts)).logits.numpy()
    ours = np.asarray(model(jnp.asarray(prompts)))
    assert np.abs(theirs - ours).max() < 1e-4
    _, _, jax_tokens = bench_generate.jax_times(model, prompts, 6, repeats=1)
    _, _, hf_tokens = bench_generate.hf_times(peer, prompts, 6, repeats=1)
    assert (jax_tokens == hf_tokens).all()


@pytest.mark.parametrize("rows", [1, 2])
def test_the_products_floor_is_the_models_own_weight_products(rows):
    """Four products a layer and the head, each contracting one of the model's weights as decode lays it out
    (one row: the output projections transposed, `row_weights`)."""
    model = Transformer(tiny_model(max_seq_len=64, num_layers=3, mlp_dim=96), rngs=nnx.Rngs(0))  # F != V, D
    fn, args = bench_generate.weight_products(model, rows=rows, steps=1)
    dots = [e for e in _equations(jax.make_jaxpr(fn)(*args).jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 4 * 3 + 1
    weights = {tuple(w.shape[1:]) for w in jax.tree.leaves(nnx.state(model.blocks))}  # one layer's, unstacked
    _, H, E, D = model.blocks.attn.wo[...].shape
    weights |= {(H * E, D), model.embed[...].T.shape}  # wo as decode reads it, [H * E, D]; the tied head, [D, V]
    shapes = [tuple(d.invars[1].aval.shape) for d in dots]
    assert all(shape in weights | {(D, H * E), (D, model.cfg.mlp_dim)} for shape in shapes)
    assert ((D, model.cfg.mlp_dim) in shapes) == (rows == 1)
    assert np.isfinite(np.asarray(fn(*args))).all()


def _equations(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _equations(sub)


def test_bad_flags_are_one_line(capsys):
    assert bench_generate.main(["--batches", "0"]) == 2
    assert bench_generate.main(["--prompt-len", "200", "--new-tokens", "100"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "exceed the model's max length 256" in err[1]


@pytest.mark.slow
def test_the_benchmark_prints_a_table_and_json(capsys):
    args = ["--batches", "1,2", "--prompt-len", "4", "--new-tokens", "4", "--repeats", "1", *TINY]
    assert bench_generate.main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert [r["batch"] for r in summary["rows"]] == [1, 2] and summary["copy_bandwidth_gb_s"] > 0
    for row in summary["rows"]:
        assert row["same_greedy_tokens"] == 4 and {"decode_speedup", "step_over_bound", "prefill_speedup"} <= set(row)
        assert row["weight_products_ms"] > 0 and row["decode_speedup_ceiling"] > 0
    assert out[2].split()[:3] == ["batch", "prefill", "tok/s"]
