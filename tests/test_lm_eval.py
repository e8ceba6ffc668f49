"""lm-evaluation-harness on a jaxlm model (jaxlm.harness, jaxlm.harness_lm, python -m experiments.lm_eval): on a
tiny trained model, the adapter's loglikelihoods, accuracy and rolling loglikelihoods equal lm-eval's own Hugging
Face backend on the model export_hf wrote; generate_until is experiments.generate's greedy text; the command writes
lm-eval's JSON into the workdir and refuses careless input in one line. The tasks are local (tests/lm_eval_tasks):
nothing is downloaded."""

import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers import tiny_run_sets
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from data import prepare
from experiments import bench_lm_eval, export_hf, tiny_lm
from experiments import generate as generate_cli
from experiments import lm_eval as lm_eval_cli
from jaxlm import harness
from jaxlm.generate import stream
from sharding import MeshLayout

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "tests" / "lm_eval_tasks"
CHOICE, PERPLEXITY = "jaxlm_tiny_choice", "jaxlm_tiny_perplexity"


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the tasks' data_files are relative to the repository root


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Three tiny_lm steps on byte-level Python source (max length 64, so a long text takes several windows),
    trained in this process as a user would from the CLI, and its export_hf directory."""
    root = tmp_path_factory.mktemp("lm_eval")
    (root / "text").mkdir()
    (root / "text" / "train.txt").write_text(Path(textwrap.__file__).read_text())
    assert prepare.main(["--input", str(root / "text"), "--output", str(root / "tokens"), "--no-progress"]) == 0
    sets = tiny_run_sets(data__path=root / "tokens", data__batch_size=8, data__val_fraction=0.05, tensorboard="false")
    sets += ["--set", f"eval_harness_tasks={CHOICE}", "--set", f"eval_harness_include_path={TASKS}"]  # in the loop
    with pytest.MonkeyPatch.context() as m:
        m.chdir(REPO)
        assert tiny_lm.main(["--workdir", str(root / "run"), "--steps", "3", "--no-progress", *sets]) == 0
    assert export_hf.main(["--workdir", str(root / "run"), "--out", str(root / "hf")]) == 0
    return root


@pytest.fixture(scope="module")
def ours(run):
    return harness.load_adapter(run / "run", batch_size=4)  # 4: several batches, a partial one last


@pytest.fixture(scope="module")
def theirs(run):
    return HFLM(pretrained=str(run / "hf"), device="cpu", batch_size=16, dtype="float32")


def test_the_training_loop_logs_the_tasks_metrics_as_the_command_scores_its_checkpoint(run, ours):
    """eval_harness_tasks: at the last step, metrics.jsonl holds what the adapter gives the saved checkpoint, and
    WORKDIR/lm_eval lm-eval's JSON."""
    from jaxlm.metrics import read_metrics

    logged = [r for r in read_metrics(run / "run" / "metrics.jsonl") if any(k.startswith("harness/") for k in r)]
    assert [r["step"] for r in logged] == [3]
    standalone = harness.flat_metrics(harness.run_tasks(ours, [CHOICE], include_path=TASKS, bootstrap_iters=0))
    assert {k: v for k, v in logged[0].items() if k != "step"} == pytest.approx(standalone, abs=1e-6)
    (saved,) = (run / "run" / harness.RESULTS_DIR).glob("results_step3_*.json")
    assert json.loads(saved.read_text())["results"][CHOICE]["acc,none"] == standalone[f"harness/{CHOICE}/acc"]


def test_tasks_score_as_lm_evals_hugging_face_backend_on_the_exported_model(ours, theirs):
    """Per example: every choice's loglikelihood and is-greedy, every text's rolling loglikelihood (one is longer
    than the model's 64 tokens); per task: accuracy and the perplexities."""
    got, want = (
        harness.run_tasks(lm, [CHOICE, PERPLEXITY], include_path=TASKS, log_samples=True, bootstrap_iters=0)
        for lm in (ours, theirs)
    )
    for task in (CHOICE, PERPLEXITY):
        mine, ref = got["samples"][task], want["samples"][task]
        assert [s["doc_id"] for s in mine] == [s["doc_id"] for s in ref] and len(mine) == (8 if task == CHOICE else 4)
        for a, b in zip(mine, ref, strict=True):
            if task == CHOICE:
                np.testing.assert_allclose([r[0] for r in a["filtered_resps"]], [r[0] for r in b["filtered_resps"]],
                                           rtol=0, atol=1e-4)  # fmt: skip
                assert [r[1] for r in a["filtered_resps"]] == [r[1] for r in b["filtered_resps"]]
            else:
                np.testing.assert_allclose(a["filtered_resps"], b["filtered_resps"], rtol=1e-6, atol=1e-4)
    assert got["results"][CHOICE]["acc,none"] == want["results"][CHOICE]["acc,none"]
    assert got["results"][CHOICE]["acc_norm,none"] == want["results"][CHOICE]["acc_norm,none"]
    metrics, reference = harness.flat_metrics(got), harness.flat_metrics(want)
    assert metrics.keys() == reference.keys() == {
        f"harness/{CHOICE}/acc", f"harness/{CHOICE}/acc_norm", f"harness/{PERPLEXITY}/word_perplexity",
        f"harness/{PERPLEXITY}/byte_perplexity", f"harness/{PERPLEXITY}/bits_per_byte",
    }  # fmt: skip
    for key, value in metrics.items():
        assert value == pytest.approx(reference[key], rel=1e-5), key
    assert got["config"]["step"] == 3  # what the adapter was loaded from goes into lm-eval's record


def test_greedy_tokens_score_greedy_in_both_and_generate_until_is_experiments_generate_text(run, ours, theirs, capsys):
    """Both prompts fill one prompt bucket, so the adapter, the library and the CLI share compiled programs."""
    asks = [
        ("def wrap", {"until": ["\n"], "max_gen_toks": 12}),
        ("import t", {"until": ["e", "x"], "max_gen_toks": 12}),
    ]
    texts = ours.generate_until([Instance("generate_until", {}, ask, i) for i, ask in enumerate(asks)])
    assert texts == theirs.generate_until([Instance("generate_until", {}, ask, i) for i, ask in enumerate(asks)])
    for text, (context, settings) in zip(texts, asks, strict=True):
        stops = [a for s in settings["until"] for a in ("--stop", s)]
        argv = ["--workdir", str(run / "run"), "--prompt", context, "--temperature", "0", *stops]
        assert generate_cli.main([*argv, "--max-new-tokens", str(settings["max_gen_toks"])]) == 0
        assert capsys.readouterr().out == text + "\n"

    prompt = ours.tok_encode(asks[0][0])  # its greedy ids are greedy to both scorers; one id changed, to neither
    steps = stream(ours.model, [prompt], max_new_tokens=12, stop_ids=[ours.tok.eos_id], vocab_limit=ours.tok.vocab_size)
    greedy = [int(new[0]) for new in steps][:6]  # the CLI's programs
    request = [(None, prompt, greedy), (None, prompt, greedy[:-1] + [(greedy[-1] + 1) % 256])]
    mine, ref = ours._loglikelihood_tokens(request), theirs._loglikelihood_tokens(request)
    assert [g for _, g in mine] == [g for _, g in ref] == [True, False]
    np.testing.assert_allclose([p for p, _ in mine], [p for p, _ in ref], rtol=0, atol=1e-4)


def cli(capsys, *args) -> tuple[int, str, str]:
    code = lm_eval_cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_writes_lm_evals_json_into_the_workdir_beside_what_is_there(run, capsys):
    theirs_file = run / "run" / "lm_eval" / "notes.json"
    theirs_file.parent.mkdir(exist_ok=True)
    theirs_file.write_text("mine\n")
    before = sorted(p.name for p in theirs_file.parent.iterdir())  # and the training loop's own results
    code, out, err = cli(capsys, "--workdir", run / "run", "--tasks", CHOICE, "--include-path", TASKS, "--limit", 3)
    assert code == 0, err
    *table, last = out.strip().splitlines()
    record = json.loads(last)
    assert any(CHOICE in line and "acc" in line for line in table)
    assert record["step"] == 3 and record["tasks"] == [CHOICE] and 0 <= record[f"{CHOICE}/acc"] <= 1
    written = json.loads(Path(record["results"]).read_text())
    assert Path(record["results"]).parent == run / "run" / "lm_eval"
    assert written["results"][CHOICE]["acc,none"] == record[f"{CHOICE}/acc"] and written["config"]["limit"] == 3
    assert theirs_file.read_text() == "mine\n"
    assert sorted(p.name for p in theirs_file.parent.iterdir()) == sorted([*before, Path(record["results"]).name])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tasks", CHOICE, "--include-path", "nowhere"], "the include path nowhere is not a directory"),
        (["--tasks", f"{CHOICE},,x"], "names an empty task"),
        (["--tasks", CHOICE, "--limit", "0"], "--limit must be > 0"),
        (["--tasks", CHOICE, "--limit", "2.5"], "--limit 2.5 is neither a whole count nor a fraction below 1"),
        (["--tasks", CHOICE, "--num-fewshot", "-1"], "--num-fewshot must be >= 0, got -1"),
        (["--tasks", CHOICE, "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--tasks", CHOICE, "--nope"], "unrecognized arguments: --nope"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(run, capsys, args, message):
    code, out, err = cli(capsys, "--workdir", run / "run", *args)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("experiments.lm_eval: error: ") and message in err, err


def test_cli_without_a_checkpoint_or_the_extra_is_one_line_exit_2(run, capsys, tmp_path, monkeypatch):
    task = ["--tasks", CHOICE, "--include-path", TASKS]
    code, out, err = cli(capsys, "--workdir", tmp_path, *task)
    assert code == 2 and err.count("\n") == 1 and f"no checkpoint in {tmp_path}: it has no checkpoints/" in err
    code, _, err = cli(capsys, "--workdir", run / "tokens", *task)
    assert code == 2 and err.count("\n") == 1 and "it is a token dataset" in err
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if the extra were not installed
    code, _, err = cli(capsys, "--workdir", run / "run", *task)
    install = 'pip install -e ".[eval]"'
    assert (
        code == 2
        and err == f"experiments.lm_eval: error: lm-eval is not installed; install the eval extra: {install}\n"
    )


class _Index:
    """A stand-in for lm-eval's index of its ~15,000 built-in tasks (4 s to build)."""

    all_tasks = ["hellaswag", "hellaswag_vi", "arc_easy", CHOICE]


def test_an_unknown_task_is_one_line_naming_the_closest_before_the_model_loads(run, capsys, monkeypatch):
    """(The real index: test_an_unknown_built_in_task_is_one_line_naming_the_closest, slow.)"""
    built = harness._task_manager
    monkeypatch.setattr(harness, "_task_manager", lambda path, defaults: _Index if defaults else built(path, defaults))
    code, out, err = cli(capsys, "--workdir", run / "tokens", "--tasks", "hellaswg")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    hint = "did you mean hellaswag, hellaswag_vi? (`lm-eval ls tasks` lists them)"
    assert err == f"experiments.lm_eval: error: unknown lm-eval task 'hellaswg'; {hint}\n"
    code, _, err = cli(capsys, "--workdir", run / "tokens", "--tasks", f"{CHOICE},choice", "--include-path", TASKS)
    assert code == 2 and f"unknown lm-eval task 'choice' (nor in {TASKS})" in err


@pytest.mark.slow
def test_an_unknown_built_in_task_is_one_line_naming_the_closest(run, capsys):
    """(Fast cover: test_an_unknown_task_is_one_line_naming_the_closest_before_the_model_loads.)"""
    code, out, err = cli(capsys, "--workdir", run / "run", "--tasks", "hellaswg")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "unknown lm-eval task 'hellaswg'; did you mean hellaswag," in err


@pytest.mark.slow
def test_a_sharded_model_scores_and_generates_as_one_device(run, ours):
    """(Fast cover: test_evaluate.py::test_a_sharded_model_scores_as_one_device and test_generate.py's sharded
    generation, the placement this adapter reuses.)"""
    many = harness.load_adapter(run / "run", batch_size=4, layout=MeshLayout(data=2, fsdp=2, tensor=2))
    asks = [Instance("loglikelihood", {}, ("def wrap(text", c), i) for i, c in enumerate([", width", "):\n  x"])]
    np.testing.assert_allclose(
        [p for p, _ in many.loglikelihood(asks)], [p for p, _ in ours.loglikelihood(asks)], rtol=1e-5
    )
    text = [Instance("loglikelihood_rolling", {}, ("import re\n" * 30,), 0)]
    np.testing.assert_allclose(many.loglikelihood_rolling(text), ours.loglikelihood_rolling(text), rtol=1e-5)
    until = [Instance("generate_until", {}, ("def wr", {"until": ["\n"], "max_gen_toks": 10}), 0)]
    assert many.generate_until(until) == ours.generate_until(until)


def test_a_task_whose_data_does_not_parse_is_one_line_exit_2(run, capsys, tmp_path):
    (tmp_path / "broken.jsonl").write_text('{"question": "x", "choices": ["a", "b"], "answer": 0}\n{not json\n')
    yaml = (TASKS / "tiny_choice.yaml").read_text().replace(CHOICE, "broken")
    (tmp_path / "broken.yaml").write_text(
        yaml.replace("tests/lm_eval_tasks/tiny_choice.jsonl", str(tmp_path / "broken.jsonl"))
    )
    code, out, err = cli(capsys, "--workdir", run / "run", "--tasks", "broken", "--include-path", tmp_path)
    assert code == 2 and out == "" and "Traceback" not in err, err
    assert err.splitlines()[-1].startswith("experiments.lm_eval: error: lm-eval could not read a task: ")
    assert "JSON parse error" in err.splitlines()[-1]


def test_bench_lm_eval_prints_its_table_then_json(run, capsys):
    """Both backends on the same requests agree (the speed itself is the bench's to measure, not a test's)."""
    assert bench_lm_eval.main(["--workdir", str(run / "run"), "--requests", "8", "--repeats", "1"]) == 0
    *table, last = capsys.readouterr().out.strip().splitlines()
    figures = json.loads(last)
    assert any(line.startswith("jaxlm adapter") for line in table) and figures["requests"] == 8
    assert figures["max_abs_diff"] < 1e-3 and figures["greedy_agree"] == 8 and figures["speedup"] > 0


def test_an_unknown_task_in_the_training_config_is_one_line_exit_2_before_training(tmp_path, capsys, monkeypatch):
    built = harness._task_manager
    monkeypatch.setattr(harness, "_task_manager", lambda path, defaults: _Index if defaults else built(path, defaults))
    sets = ["--set", "eval_harness_tasks=jaxlm_tiny_chioce", "--set", f"eval_harness_include_path={TASKS}"]
    assert tiny_lm.main(["--workdir", str(tmp_path / "w"), "--steps", "1", *tiny_run_sets(), *sets]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown lm-eval task 'jaxlm_tiny_chioce'" in err and CHOICE in err, err
    assert not (tmp_path / "w").exists()
