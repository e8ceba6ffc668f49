"""experiments.step_products: a compiled program's dots found with their shapes and run counts, and timed alone."""

import jax
import jax.numpy as jnp
import pytest

from experiments.step_products import print_products, products, time_product


def _program(x, w, a, b):
    """A loop of 5 matmuls over x (through a data-dependent carry, so XLA cannot hoist them) and one batched
    product outside the loop."""

    def body(_, carry):
        return jnp.tanh(carry @ w)

    y = jax.lax.fori_loop(0, 5, body, x)
    return y, jnp.einsum("bqe,bwe->bqw", a, b)


def _hlo():
    args = (jnp.ones((8, 16)), jnp.ones((16, 16)), jnp.ones((3, 4, 6)), jnp.ones((3, 5, 6)))
    return jax.jit(_program).lower(*args).compile().as_text()


def test_products_finds_each_dot_with_its_shapes_axes_and_runs():
    found = {(p.lhs, p.rhs): (p, runs) for p, runs in products(_hlo()).items()}
    loop, runs = found[((8, 16), (16, 16))]
    assert runs == 5 and loop.contracting == ((1,), (0,)) and loop.batch == ((), ())
    assert loop.out_shape == (8, 16) and loop.flops == 2 * 8 * 16 * 16
    batched, runs = found[((3, 4, 6), (3, 5, 6))]
    assert runs == 1 and batched.contracting == ((2,), (2,)) and batched.batch == ((0,), (0,))
    assert batched.out_shape == (3, 4, 5) and batched.flops == 2 * 3 * 4 * 5 * 6
    assert len(found) == 2


def test_products_rejects_text_without_an_entry_computation():
    with pytest.raises(ValueError, match="no ENTRY computation"):
        products("HloModule m\n")


def test_print_products_sums_the_runs_of_each_product(capsys):
    counts = products(_hlo())
    summary = print_products(_hlo(), peak_flops=1e11, step_s=0.01, repeats=2)
    out = capsys.readouterr().out
    assert "products timed alone" in out and "unbatched" in out and "batched" in out
    assert summary["products_ms"] == pytest.approx(summary["unbatched_ms"] + summary["batched_ms"], abs=0.11)
    loop = next(p for p in counts if p.lhs == (8, 16))
    assert time_product(loop, repeats=2) > 0
    assert summary["unbatched_at_peak_ms"] == pytest.approx(5 * loop.flops / 1e11 * 1e3, abs=0.05)
