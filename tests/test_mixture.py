"""Data mixtures (data.mixture): seeded per-row sources at set weights and stages, O(1) resume (also with new
weights), the clairvoyant loader's exact batches and Belady hit rate across sources, and a run that logs its
realized proportions and each source's eval loss and refuses another set of sources."""

import math

import numpy as np
import pytest
from helpers import one_device_mesh, random_token_file, repetitive_token_file, tiny_config

from data.loader import ClairvoyantLoader
from data.mixture import MIX_BLOCK, MixtureError, MixturePlan, parse_mixture, parse_stages
from data.mixture_data import ConcatSource, PlannedBatches
from data.sources import TokenWindowSource
from jaxlm.config import ConfigError, DataConfig, TrainConfig, validate
from jaxlm.data_metrics import EvalSets
from jaxlm.metrics import read_metrics
from jaxlm.run_data import open_run_data, run_data_fingerprint
from jaxlm.trainer import Trainer

NAMES, SIZES = ["code", "docs", "math"], [5000, 700, 90]


def plan(weights=(0.6, 0.3, 0.1), stages=(), batch=16, **kw):
    return MixturePlan(NAMES, SIZES, weights, global_batch=batch, seed=7, stages=stages, **kw)


def test_realized_proportions_match_the_weights_and_each_stage_starts_at_its_step():
    p = plan(stages=[(2048, (0.0, 0.5, 0.5))])
    source, _ = p.locate(0, 2048 + 1024)
    first = np.bincount(source[:2048].ravel(), minlength=3) / source[:2048].size  # 8 whole blocks
    np.testing.assert_allclose(first, [0.6, 0.3, 0.1], atol=1 / MIX_BLOCK)
    assert not (source[2048:] == 0).any()  # the stage's first batch already has none of code
    np.testing.assert_allclose(np.bincount(source[2048:].ravel(), minlength=3) / source[2048:].size, [0, 0.5, 0.5])
    per_step = [p.fractions(s, s + 1)["code"] for s in range(200)]  # rows drawn by the seed, not in a fixed pattern
    assert len(set(per_step)) > 3 and abs(np.mean(per_step) - 0.6) < 0.02


def test_no_index_of_a_source_is_read_twice_across_stages_and_a_resume_with_new_weights():
    p = plan(stages=[(300, (0.2, 0.2, 0.6))])
    before = p.locate(0, 500)
    later = p.resumed({"step": 500, **p.state_at(500)})  # same schedule: the checkpoint's own plan
    np.testing.assert_array_equal(later.samples(500, 900), p.samples(500, 900))
    annealed = plan(weights=(1.0, 0.0, 0.0)).resumed({"step": 500, **p.state_at(500)})
    after = annealed.locate(500, 900)
    assert (after[0] == 0).all()  # the new weights from the resumed step on
    pairs = np.concatenate([np.stack([s.ravel(), i.ravel()], 1) for s, i in (before, after)])
    assert len(np.unique(pairs, axis=0)) == len(pairs)  # each source continues where the checkpoint left it
    state = annealed.state_at(700)
    assert plan().resumed({"step": 700, **state}).origin_step == 700  # and resuming again keeps going
    assert plan(weights=(1.0, 0.0, 0.0)).resumed({"step": 700, **state}).origin_step == 500


def test_every_process_split_reads_its_rows_of_the_same_global_batches():
    p = plan(batch=24)
    whole = p.samples(10, 30)
    for lo, hi in ((0, 8), (8, 16), (16, 24), (5, 19)):
        np.testing.assert_array_equal(p.samples(10, 30, (lo, hi)), whole[:, lo:hi])


def test_a_source_that_runs_out_wraps_to_a_new_seeded_order_reading_each_sample_once_per_epoch():
    p = plan()
    source, index = p.locate(0, MIX_BLOCK // 16)  # one whole block: math's quota is 410 indices, 4.5 epochs
    ids = p.samples(0, MIX_BLOCK // 16)[source == 2] - sum(SIZES[:2])
    order = ids[np.argsort(index[source == 2])]
    epochs = [order[e * 90 : (e + 1) * 90] for e in range(4)]
    assert all(sorted(e) == list(range(90)) for e in epochs)  # every sample once per epoch
    assert not np.array_equal(epochs[0], epochs[1])  # in a new order
    assert p.epochs_at(MIX_BLOCK // 16)["math"] == 4 and p.epochs_at(0)["math"] == 0


@pytest.mark.parametrize(
    "mixture, stages, message",
    [
        ("a:0.5", "", "at least two datasets"),
        ("a:0.5,b:-1", "", "weight of b is '-1'; weights must be finite and >= 0"),
        ("a:0,b:0", "", "every weight is 0"),
        ("a:1,b", "", "entry 'b' is not PATH:WEIGHT"),
        ("x/a:1,y/a:1", "", "share the name 'a'"),
        ("a:1,b:1", "10:1", "has 1 weights for data.mixture's 2 datasets"),
        ("a:1,b:1", "x:1,1", "is not STEP:W,W"),
        ("a:1,b:1", "5:0,0", "at step 5: every weight is 0"),
    ],
)
def test_a_bad_mixture_or_stage_is_one_line_naming_it(mixture, stages, message):
    with pytest.raises(MixtureError, match=message.replace("(", r"\(")):
        parse_stages(stages, len(parse_mixture(mixture)))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        validate(tiny_config(data=dict(mixture=mixture, mixture_stages=stages)))


def test_a_config_file_may_give_the_mixture_as_a_dict():
    d = DataConfig(mixture={"/d/web": 3, "/d/code": 1})
    assert d.mixture == "/d/web:3,/d/code:1" and validate(TrainConfig(data=d)).data == d
    assert [(c.name, c.weight) for c in parse_mixture(d.mixture)] == [("web", 3.0), ("code", 1.0)]


def _sources():
    rng = np.random.default_rng(0)
    return [TokenWindowSource(rng.integers(0, 500, n * 16 + 1).astype(np.uint16), seq_len=16) for n in (300, 80, 40)]


def test_the_clairvoyant_loader_follows_the_mixture_exactly_at_belady_hit_rate_and_resumes():
    source = ConcatSource(_sources())
    p = MixturePlan(NAMES, list(source.sizes), (0.5, 0.3, 0.2), global_batch=8, seed=3, stages=[(40, (0, 0, 1))])
    simple = PlannedBatches(p, source)
    loader = ClairvoyantLoader(source, batch_size=8, seed=3, plan=p, ram_bytes=90 * source.sample_nbytes, workers=3)
    for step in range(60):
        got, want = next(loader), next(simple)
        assert all(np.array_equal(got[k], want[k]) for k in want), step
    m, state = loader.metrics(), loader.get_state()
    loader.close()
    served = sum(m[f"data_samples_{k}"] for k in ("ram", "disk", "peer", "source"))
    assert m["data_hit_rate"] > 0.3  # the small sources repeat: Belady keeps them
    assert m["data_hit_rate"] + m["data_samples_rerouted"] / served == pytest.approx(m["data_planned_hit_rate"])
    resumed = ClairvoyantLoader(source, batch_size=8, seed=3, plan=p, ram_bytes=0, workers=1)
    resumed.set_state(state)  # another worker count and cache: the same stream, as the simple loader resumes it
    other = PlannedBatches(p, source)
    other.set_state(state)
    assert all(np.array_equal(next(resumed)["inputs"], next(other)["inputs"]) for _ in range(5))
    resumed.close()


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    repetitive_token_file(root / "code", repeats=300)
    random_token_file(root / "docs", num_tokens=5000)
    random_token_file(root / "math", num_tokens=3000, seed=1)
    return root


def _run(root, workdir, steps, mixture, stages="", **data):
    cfg = tiny_config(
        steps=steps,
        eval_every=0,
        optim=dict(decay_steps=8),
        data=dict(mixture=mixture, mixture_stages=stages, val_fraction=0.1, eval_batches=1, **data),
    )
    cfg = validate(cfg)
    train_iter, evals = open_run_data(cfg)
    trainer = Trainer(cfg, one_device_mesh(), workdir, train_iter, evals, data_fingerprint=run_data_fingerprint(cfg))
    trainer.progress = False
    return trainer.run()


def test_a_mixture_run_logs_its_proportions_and_per_source_eval_resumes_exactly_and_refuses_other_sources(
    datasets, tmp_path
):
    mix = f"{datasets}/code:0.75,{datasets}/docs:0.25"
    _run(datasets, tmp_path / "straight", 8, mix, "5:0,1")
    _run(datasets, tmp_path / "resumed", 4, mix, "5:0,1")
    last = _run(datasets, tmp_path / "resumed", 8, mix, "5:0,1")

    def records(name, key="loss"):
        return [r for r in read_metrics(tmp_path / name / "metrics.jsonl") if key in r]

    straight, resumed = records("straight"), records("resumed")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]  # bit for bit
    assert all(r["data_mix/docs"] == 1.0 for r in straight[5:])  # the stage from step 6 (batch of step 5)
    assert np.mean([r["data_mix/code"] for r in straight[:5]]) == pytest.approx(0.75, abs=0.15)
    evals = records("resumed", "eval_loss")[-1]
    assert evals["eval_loss"] == pytest.approx((evals["eval_loss/code"] + evals["eval_loss/docs"]) / 2)  # equal tokens
    assert evals["eval_loss/code"] < evals["eval_loss/docs"]  # the repetitive source is the easy one
    assert evals == records("straight", "eval_loss")[-1]
    with pytest.raises(ConfigError, match=r"data.mixture adds math; drops docs; .*allow_other_data"):
        _run(datasets, tmp_path / "resumed", 10, f"{datasets}/code:0.75,{datasets}/math:0.25")
    last = _run(datasets, tmp_path / "resumed", 10, f"{datasets}/code:0.5,{datasets}/math:0.5", allow_other_data=True)
    assert last["step"] == 10 and "eval_loss/math" in records("resumed", "eval_loss")[-1]


def test_eval_sets_weigh_sources_by_tokens_and_give_each_its_bits_per_byte():
    batch = {"targets": np.array([[1, 2, 2]]), "loss_mask": np.ones((1, 3), np.float32)}
    short = {"targets": np.array([[3, 0, 0]]), "loss_mask": np.array([[1.0, 0, 0]], np.float32)}
    token_bytes = np.array([1, 1, 2, 4])
    sets = EvalSets({"a": [batch], "b": [short]}, token_bytes)
    record = sets.evaluate(lambda batches: {id(batch): 2.0, id(short): 6.0}[id(batches[0])])
    assert record["eval_loss"] == pytest.approx((3 * 2.0 + 1 * 6.0) / 4)
    assert record["eval_bits_per_byte/a"] == pytest.approx(2.0 * 3 / (math.log(2) * 5))
    assert record["eval_bits_per_byte/b"] == pytest.approx(6.0 / (math.log(2) * 4))
    assert record["eval_bits_per_byte"] == pytest.approx(12.0 / (math.log(2) * 9))
    assert set(EvalSets([batch], token_bytes).evaluate(lambda b: 1.0)) == {"eval_loss", "eval_bits_per_byte"}


@pytest.mark.slow  # fast cover: test_a_mixture_run_logs_its_proportions_and_per_source_eval_... (docs/testing.md)
def test_compare_mixture_trains_each_variant_and_reports_each_source(tmp_path, capsys):
    import json

    from experiments import compare_mixture

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(40):
        (docs / f"page{i}.md").write_text(f"# Page {i}\n\nSome *markdown* text about item {i}.\n" * 40)
    sets = ["model.num_layers=1", "data.batch_size=8", "data.seq_len=64", "eval_prompts=", "data.val_fraction=0.05"]
    argv = ["--root", str(tmp_path / "runs"), "--docs", str(docs), "--steps", "10", "--no-progress"]
    assert compare_mixture.main(argv + [a for s in sets for a in ("--set", s)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(summary) == {"python", "markdown", "mixture"}
    assert summary["python"]["markdown_share_before"] == 0 and summary["markdown"]["markdown_share_before"] == 1
    assert 0 < summary["mixture"]["markdown_share_before"] < 1 and summary["mixture"]["markdown_share_annealing"] == 0
