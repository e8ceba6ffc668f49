"""Generation (jaxlm.generate, jaxlm.inference, experiments.generate): the cached decode against full recomputes,
padded batches against prompts alone, sampling, sharding, compile counts, int8 weights and the CLI."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_model, tiny_run_sets
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments import generate as generate_cli
from experiments import quantize_checkpoint
from jaxlm import generate as gen
from jaxlm.inference import load_model
from jaxlm.model import Transformer, row_weights
from sharding import MeshLayout, build_mesh, tree_shardings

REPO = Path(__file__).resolve().parents[1]
LONG = " ".join(str(i) for i in range(100, 200))  # more than 64 tokens in any tokenizer


def model_of(seed: int = 0, **overrides) -> Transformer:
    """A tiny GQA model (4 query heads over 2 kv heads) with larger weights than at init, so its greedy choices
    are clear-cut rather than near-ties."""
    cfg = tiny_model(max_seq_len=64, **overrides)
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a * 3 if a.ndim > 1 else a, state))


def recomputed_greedy(model: Transformer, prompt, n: int) -> list[int]:
    """Greedy tokens by a full forward pass over the whole sequence for every new token (no cache)."""
    length = model.cfg.max_seq_len
    forward = jax.jit(lambda tokens: model(tokens, inference=True)[0])
    seq = list(prompt)
    for _ in range(n):
        padded = np.zeros((1, length), np.int32)
        padded[0, : len(seq)] = seq  # causal: the padding after the sequence changes nothing before it
        seq.append(int(jnp.argmax(forward(padded)[len(seq) - 1])))
    return seq[len(prompt) :]


MOE = dict(num_experts=4, experts_per_token=2, expert_mlp_dim=32, capacity_factor=0.5)


@pytest.mark.parametrize(
    "overrides", [dict(scan_layers=True), dict(scan_layers=False), MOE], ids=["scan", "unrolled", "moe"]
)
def test_greedy_decode_with_cache_equals_full_recompute(overrides):
    """The MoE model trains with capacity dispatch, but prefill and decode route dropless (the full recompute
    below too: `inference=True`), so generation never drops a token's experts."""
    model = model_of(**overrides)
    prompt = [5, 17, 3, 60, 22, 9, 41]
    (new,) = gen.generate(model, [prompt], max_new_tokens=40)
    assert new.tolist() == recomputed_greedy(model, prompt, 40)


@pytest.mark.parametrize("T", [1, 3])
def test_a_one_row_cache_without_its_row_axis_decodes_like_one_with_it(T):
    """generate keeps one unsharded row's cache as k_KSE / v_KSE (a row axis of 1 made XLA copy it every token)."""
    model = model_of(seed=4)
    cfg = model.cfg
    K, E, S, L = cfg.num_kv_heads, cfg.resolved_head_dim, 16, cfg.num_layers
    r = np.random.default_rng(0)
    keys = tuple(jnp.asarray(r.normal(size=(1, K, S, E)), jnp.float32) for _ in range(L))
    values = tuple(jnp.asarray(r.normal(size=(1, K, S, E)), jnp.float32) for _ in range(L))
    tokens, positions = jnp.asarray([[3, 9, 4][:T]]), jnp.arange(5, 5 + T)[None]
    logits4, k4, v4 = model.decode(tokens, positions, keys, values)
    logits3, k3, v3 = model.decode(tokens, positions, tuple(k[0] for k in keys), tuple(v[0] for v in values))
    np.testing.assert_allclose(logits3, logits4, rtol=1e-6, atol=1e-6)
    for a, b in zip(k3 + v3, k4 + v4):
        assert a.shape == b.shape[1:]
        np.testing.assert_array_equal(a, b[0])


def test_one_row_decodes_alike_through_the_transposed_output_projections():
    """generate hands a one-row decode the output projections transposed (`row_weights`); the logits are the
    stored layout's, and quantized layers get none (their products go through the recipe)."""
    model = model_of(seed=5)
    cfg = model.cfg
    K, E, S, L = cfg.num_kv_heads, cfg.resolved_head_dim, 16, cfg.num_layers
    r = np.random.default_rng(1)
    keys = tuple(jnp.asarray(r.normal(size=(K, S, E)), jnp.float32) for _ in range(L))
    values = tuple(jnp.asarray(r.normal(size=(K, S, E)), jnp.float32) for _ in range(L))
    tokens, positions = jnp.asarray([[11]]), jnp.asarray([[6]])
    rows = row_weights(cfg, nnx.state(model.blocks))
    assert len(rows) == L and rows[0][0].shape == (cfg.d_model, cfg.num_heads * E)
    plain, _, _ = model.decode(tokens, positions, keys, values)
    transposed, _, _ = model.decode(tokens, positions, keys, values, rows=rows)
    np.testing.assert_allclose(transposed, plain, rtol=1e-5, atol=1e-5)
    assert not np.allclose(model.decode(tokens, positions, keys, values, rows=rows[::-1])[0], plain)  # rows are read
    int8 = model_of(seed=5, matmul_precision="int8_weight_only")
    assert row_weights(int8.cfg, nnx.state(int8.blocks)) is None


def test_padded_batch_equals_each_prompt_alone_and_stops_at_a_stop_id():
    model = model_of(seed=1)
    prompts = [[7, 1, 9], list(range(10, 29)), [33, 2, 2, 40, 5, 6, 8], [50]]
    batched = gen.generate(model, prompts, max_new_tokens=16)
    alone = [gen.generate(model, [p], max_new_tokens=16)[0] for p in prompts]
    for b, a in zip(batched, alone):
        assert b.tolist() == a.tolist() and len(b) == 16
    stop = int(alone[1][4])
    first = alone[1].tolist().index(stop)
    stopped = gen.generate(model, prompts, max_new_tokens=16, stop_ids=[stop])
    assert stopped[1].tolist() == alone[1][: first + 1].tolist()  # the stop id is included, nothing after it
    for s, a in zip(stopped, alone):
        assert s.tolist() == a[: len(s)].tolist() and (len(s) == 16 or s[-1] == stop)
    streamed = np.stack(list(gen.stream(model, prompts, max_new_tokens=16, stop_ids=[stop])), axis=1)
    for row, s in zip(streamed, stopped):  # the per-token path gives the same tokens, -1 after a stop
        assert row[row >= 0].tolist() == s.tolist() and (row[len(s) :] == -1).all()


def test_sampling_is_reproducible_by_seed_and_stays_in_the_vocabulary_limit():
    model = model_of()
    prompts = [[1, 2, 3], [4, 5]]
    kw = dict(max_new_tokens=24, temperature=1.5, top_p=0.95, vocab_limit=40)
    a, b = gen.generate(model, prompts, seed=3, **kw), gen.generate(model, prompts, seed=3, **kw)
    c = gen.generate(model, prompts, seed=4, **kw)
    assert all((x == y).all() for x, y in zip(a, b))
    assert any(x.tolist() != z.tolist() for x, z in zip(a, c))
    assert all(x.max() < 40 for x in a + c)
    greedy = gen.generate(model, prompts, max_new_tokens=8, top_k=1, temperature=2.0)
    assert [g.tolist() for g in greedy] == [g.tolist() for g in gen.generate(model, prompts, max_new_tokens=8)]


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    top_k=st.integers(0, 12),
    top_p=st.floats(0.05, 1.0),
    temperature=st.floats(0.1, 3.0),
)
def test_sampler_respects_top_k_top_p_and_the_vocabulary_limit(seed, top_k, top_p, temperature):
    rng = np.random.default_rng(seed)
    V, limit = 24, 20
    logits = rng.normal(0, 2, (64, V)).astype(np.float32)
    sampler = gen.Sampler(temperature, top_k, top_p, vocab_limit=limit)
    ids = np.asarray(sampler(jnp.asarray(logits), jax.random.key(seed)))
    for row, i in zip(logits, ids):
        order = np.argsort(-row[:limit])  # the candidates, best first
        allowed = order[: top_k or limit]
        probs = np.exp((row[allowed] - row[allowed].max()) / temperature)
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        allowed = allowed[before < top_p + 1e-6]  # the smallest prefix holding top_p of the mass
        assert i in allowed


@settings(max_examples=30, deadline=None)
@given(data=st.data(), B=st.integers(1, 4), V=st.integers(1, 9))
def test_greedy_ids_is_argmax_with_ties_infinities_and_nans(data, B, V):
    values = st.sampled_from([-np.inf, -1.0, 0.0, 0.5, 2.0, np.inf, np.nan])
    logits = np.asarray(data.draw(st.lists(values, min_size=B * V, max_size=B * V)), np.float32).reshape(B, V)
    np.testing.assert_array_equal(np.asarray(gen.greedy_ids(jnp.asarray(logits))), np.argmax(logits, axis=-1))


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(temperature=-0.5), "temperature must be"),
        (dict(temperature=float("nan")), "temperature must be"),
        (dict(top_k=-1), "top_k must be"),
        (dict(top_p=0.0), "top_p must be in (0, 1]"),
        (dict(top_p=1.5), "top_p must be in (0, 1]"),
        (dict(top_k=100, vocab_limit=50), "exceeds the vocabulary of 50"),
    ],
)
def test_bad_sampling_values_are_one_line_errors(bad, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        gen.Sampler(**bad)


def test_sharded_generation_equals_one_device_and_shards_the_cache():
    model = model_of(seed=2)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3], [5, 8, 9, 7, 9, 3]]
    expected = gen.generate(model, prompts, max_new_tokens=12)
    layout = MeshLayout(data=2, fsdp=2, tensor=2)
    mesh = build_mesh(layout)
    graphdef, state = nnx.split(model)
    sharded = nnx.merge(graphdef, jax.device_put(state, tree_shardings(state, mesh, layout.rules)))
    got = gen.generate(sharded, prompts, max_new_tokens=12, rules=layout.rules)
    assert [g.tolist() for g in got] == [e.tolist() for e in expected]
    run = gen._Run(sharded, prompts, 12, gen.Sampler(), 0, (), layout.rules)
    state, _ = run.prefill()
    batch_and_kv_heads = jax.sharding.PartitionSpec(("data", "fsdp"), "tensor")  # slots and head dim whole
    assert state.cache.keys[0].sharding.spec == state.cache.values[0].sharding.spec == batch_and_kv_heads


def test_the_decode_step_lowered_ahead_of_time_is_the_one_a_sharded_run_lowers():
    """jaxlm.deviceless compiles generate's decode step for clusters this machine lacks from ShapeDtypeStructs
    (lower_decode_step): its program must be the run's, every placement included."""
    layout = MeshLayout(data=2, fsdp=2, tensor=2)
    graphdef, params = nnx.split(model_of(seed=2))
    params = jax.device_put(params, tree_shardings(params, build_mesh(layout), layout.rules))
    run = gen._Run(nnx.merge(graphdef, params), [[3, 1, 4], [1, 5]], 12, gen.Sampler(0.8), 0, (), layout.rules)
    state, _ = run.prefill()
    expected = gen._decode_step.lower(run.params, run.weights, state, run.key, run.stop_V, spec=run.spec)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), params)
    rows, cache_len = run.batch.tokens_BT.shape[0], run.batch.cache_len
    lowered, _ = gen.lower_decode_step(nnx.merge(graphdef, abstract), rows, cache_len, gen.Sampler(0.8), layout.rules)
    assert lowered.as_text() == expected.as_text()


def _lowerings(fn) -> int:
    """How many programs `fn()` lowered (traced to a new executable), from JAX's own monitoring events."""
    count = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            count.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return len(count)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000))
def test_a_bucket_holds_the_length_and_wastes_under_a_third_past_128(n):
    b = gen.bucket(n, 1)
    assert n <= b and gen.bucket(b, 1) == b
    assert b - n < b / 3 if n > 128 else b < 2 * n
    assert gen.bucket(n) == max(b, 8)


def test_buckets_are_few():
    assert len({gen.bucket(n, 1) for n in range(1, 5121)}) == 8 + 6 + 18  # 1..128, 192..512, 768..5120


def test_decode_compiles_once_per_bucket_not_per_token():
    model = model_of(seed=3, num_layers=3)
    # Cache bucket 32 in every call; the prompt block is 32 slots, then 8; batch bucket 1, then 2.
    first = _lowerings(lambda: gen.generate(model, [list(range(1, 27))], max_new_tokens=3))
    assert first >= 2  # the prefill and the decode loop (and small helpers)
    # 29 decode steps instead of 2: the same loop program; only the prefill of the shorter block is new.
    assert _lowerings(lambda: gen.generate(model, [[4, 5, 6]], max_new_tokens=29)) == 1
    assert _lowerings(lambda: gen.generate(model, [[7]], max_new_tokens=25)) == 0
    assert _lowerings(lambda: gen.generate(model, [[7], [8, 9]], max_new_tokens=25)) >= 2  # batch bucket 2
    assert _lowerings(lambda: gen.generate(model, [[3, 4], [5]], max_new_tokens=20)) == 0
    assert _lowerings(lambda: list(gen.stream(model, [[6, 7, 8]], max_new_tokens=20))) == 1  # the one-step program
    assert _lowerings(lambda: list(gen.stream(model, [[9]], max_new_tokens=30))) == 0


# ----------------------------------------------------------------------------- a trained workdir and the CLI


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A few steps of experiments.tiny_lm at a tiny size, as a user would train it."""
    root = tmp_path_factory.mktemp("generate")
    sets = tiny_run_sets()
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.tiny_lm", "--workdir", root / "run", "--steps", "3", "--no-progress"]
        + sets,
        cwd=REPO,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return root / "run"


def cli(capsys, *args) -> tuple[int, str, str]:
    code = generate_cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_cli_streams_what_the_library_generates(workdir):
    """As a user runs it: a process, greedy, two prompts; the text equals the library's for the same checkpoint.
    (Fast cover: test_cli_no_checkpoint_and_truncate compares main()'s output with the library's.)"""
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.generate", "--workdir", workdir, "--prompt", "import o", "--prompt", "d"]
        + ["--max-new-tokens", "12", "--temperature", "0"],
        cwd=REPO,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "2 prompt(s)" in proc.stderr and "step 3 of" in proc.stderr
    loaded = load_model(workdir)
    tok = loaded.tokenizer
    prompts = [tok.document("import o"), tok.document("d")]
    new = gen.generate(loaded.model, prompts, max_new_tokens=12, stop_ids=[tok.eos_id], vocab_limit=tok.vocab_size)
    texts = [tok.decode(ids, skip_special_tokens=True) for ids in new]
    assert proc.stdout == f"--- prompt 1/2\n{texts[0]}\n--- prompt 2/2\n{texts[1]}\n"


def test_cli_stop_text_seed_and_int8_weights(workdir, capsys, tmp_path):
    code, out, _ = cli(capsys, "--workdir", workdir, "--prompt", "x = ", "--max-new-tokens", 20, "--seed", 5)
    assert code == 0
    again = cli(capsys, "--workdir", workdir, "--prompt", "x = ", "--max-new-tokens", 20, "--seed", 5)[1]
    assert out == again  # sampling is reproducible by seed
    text = out[:-1]
    stop = next((c for c in text[1:] if c.isascii()), None)
    if stop:  # stopping at a text the run printed cuts it before that text
        code, cut, _ = cli(capsys, "--workdir", workdir, "--prompt", "x = ", "--max-new-tokens", 20, "--seed", 5,
                           "--stop", stop)  # fmt: skip
        assert code == 0 and cut == text[: text.find(stop)] + "\n"
    assert quantize_checkpoint.main(["--workdir", str(workdir), "--out", str(tmp_path / "int8")]) == 0
    capsys.readouterr()
    code, out, err = cli(capsys, "--workdir", tmp_path / "int8", "--prompt", "import ", "--max-new-tokens", 8)
    assert code == 0 and "int8 weight-only step 3" in err and out.endswith("\n")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
        (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--top-k", "-3"], "--top-k must be an integer >= 0"),
        (["--top-k", "100000"], "--top-k 100000 exceeds the vocabulary of"),
        (["--step", "99"], "has no checkpoint at step 99; its steps: 3"),
        (
            ["--prompt", LONG, "--max-new-tokens", "10"],
            "tokens, longer than the 54 that the model's max length of 64 leaves beside --max-new-tokens 10; "
            "shorten it or pass --truncate",
        ),  # fmt: skip
        (["--max-new-tokens", "64"], "--max-new-tokens 64 leaves no room for a prompt in the model's max length of 64"),
        (["--stop", ""], "--stop is empty"),
        (["--nope"], "unrecognized arguments: --nope"),
    ],
)
def test_cli_bad_input_is_one_line(workdir, capsys, args, message):
    code, out, err = cli(capsys, "--workdir", workdir, "--prompt", "a", *args)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("experiments.generate: error: ") and message in err


def test_cli_no_checkpoint_and_truncate(workdir, capsys, tmp_path):
    code, _, err = cli(capsys, "--workdir", tmp_path, "--prompt", "a")
    assert code == 2 and err.count("\n") == 1 and f"no checkpoint in {tmp_path}: it has no checkpoints/" in err
    (tmp_path / "checkpoints").mkdir()
    code, _, err = cli(capsys, "--workdir", tmp_path, "--prompt", "a")
    assert code == 2 and "holds no complete checkpoint" in err
    code, _, err = cli(capsys, "--workdir", tmp_path / "missing", "--prompt", "a")
    assert code == 2 and "is not a directory" in err
    code, _, err = cli(capsys, "--workdir", workdir)
    assert code == 2 and "give a prompt" in err
    code, out, _ = cli(capsys, "--workdir", workdir, "--prompt", LONG, "--max-new-tokens", 6, "--truncate",
                       "--temperature", 0)  # fmt: skip
    loaded = load_model(workdir)
    tok = loaded.tokenizer
    tail = list(tok.document(LONG))[-58:]  # --truncate keeps the prompt's last tokens
    (new,) = gen.generate(loaded.model, [tail], max_new_tokens=6, stop_ids=[tok.eos_id], vocab_limit=tok.vocab_size)
    assert code == 0 and out == tok.decode(new, skip_special_tokens=True) + "\n"
