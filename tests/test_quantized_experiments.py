"""The quantization experiments: post-training quantization of a finished run (eval loss before/after, the int8
artifact, bad input) and the float32-vs-quantized training comparison."""

import dataclasses
import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx, traverse_util
from helpers import one_device_mesh, repetitive_token_file, tiny_config

from experiments import compare_precision, quantize_checkpoint
from jaxlm.run_data import open_run_data
from jaxlm.train import Program
from jaxlm.trainer import Trainer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("ptq")
    tokens = repetitive_token_file(root / "tokens")
    cfg = tiny_config(
        steps=20,
        checkpoint_every=20,
        optim=dict(learning_rate=1e-2),
        data=dict(path=str(tokens), val_fraction=0.1, eval_batches=2),
    )
    train_iter, eval_data = open_run_data(cfg)
    Trainer(cfg, one_device_mesh(), root / "run", train_iter, eval_data, progress=False).run()
    return root / "run", cfg, eval_data


def run(capsys, *args):
    code = quantize_checkpoint.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_quantizes_weights_and_reports_eval_loss(trained, capsys):
    workdir, cfg, eval_data = trained
    code, out, _ = run(capsys, "--workdir", workdir)
    assert code == 0
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["step"] == 20 and summary["eval_loss_before"] < 3.0
    assert abs(summary["eval_loss_change"]) < 0.02  # int8 per-channel weights barely move the loss
    assert summary["weight_bytes_before"] / summary["weight_bytes_after"] > 3.5
    assert summary["quantized_tensors"] == [
        "blocks/attn/wo",
        "blocks/attn/wqkv",
        "blocks/mlp/w_in",
        "blocks/mlp/w_out",
        "embed",
    ]
    manifest = json.loads((workdir / "quantized_int8" / "manifest.json").read_text())
    assert manifest["eval_loss_after"] == summary["eval_loss_after"] and manifest["config"]["steps"] == 20

    # The artifact, dequantized and evaluated with float matmuls, gives the reported int8 loss: so its scales are
    # per output channel exactly as the model's int8 weight-only matmuls compute them (re-quantizing is exact).
    artifact = ocp.StandardCheckpointer().restore((workdir / "quantized_int8" / "weights").absolute())
    assert artifact["int8"]["blocks/mlp/w_in"]["q"].dtype == np.int8
    program = Program(cfg, one_device_mesh())
    params = jax.tree.map(lambda a: a, program.abstract_state.params)
    weights = {
        **artifact["float"],
        **{name: e["q"].astype(np.float32) * e["scale"] for name, e in artifact["int8"].items()},
    }
    nnx.replace_by_pure_dict(params, traverse_util.unflatten_dict(weights, sep="/"))
    assert abs(program.evaluate(params, eval_data) - summary["eval_loss_after"]) < 1e-4


def test_bad_input_is_one_line(trained, tmp_path, capsys):
    workdir, _, _ = trained
    code, _, err = run(capsys, "--workdir", tmp_path)
    assert code == 2 and "it has no checkpoints/; give the --workdir of a training run" in err
    assert len(err.strip().splitlines()) == 1
    (tmp_path / "checkpoints").mkdir()
    code, _, err = run(capsys, "--workdir", tmp_path)
    assert code == 2 and "holds no complete checkpoint to quantize" in err
    code, _, err = run(capsys, "--workdir", workdir, "--eval-batches", "-1")
    assert code == 2 and "--eval-batches must be >= 0" in err
    code, _, err = run(capsys, "--workdir", workdir, "--nope")
    assert code == 2 and "unrecognized arguments: --nope" in err
    code, _, err = run(capsys, "--workdir", "")
    assert code == 2 and "must not be empty" in err
    (tmp_path / "a_file").write_text("keep me")
    code, _, err = run(capsys, "--workdir", workdir, "--out", tmp_path / "a_file")
    assert code == 2 and "a_file exists and is not a directory" in err
    code, _, err = run(capsys, "--workdir", workdir, "--out", tmp_path)
    assert code == 2 and "holds other files; give a new or empty directory" in err
    assert (tmp_path / "a_file").read_text() == "keep me"


def test_an_existing_out_file_exits_at_once_without_a_hang(trained, tmp_path):
    """Run as a user would, as a process: one line, exit 2, within the timeout (it used to hang)."""
    import subprocess
    import sys

    workdir, _, _ = trained
    (tmp_path / "out").write_text("x")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.quantize_checkpoint",
            "--workdir",
            str(workdir),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr


def _edit_saved_config(workdir, step, edit):
    path = workdir / "checkpoints" / str(step) / "config" / "metadata"
    saved = json.loads(path.read_text())
    edit(saved)
    path.write_text(json.dumps(saved))


def test_the_checkpoint_s_own_config_is_used_not_the_workdir_s(trained, tmp_path, capsys):
    import shutil

    workdir, cfg, _ = trained
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("quantized_int8"))
    rewritten = json.loads((copy / "config.json").read_text())  # as a later run with other settings leaves it
    rewritten["model"]["d_model"] *= 2
    rewritten["model"]["matmul_precision"] = "fp8"
    (copy / "config.json").write_text(json.dumps(rewritten))
    code, out, err = run(capsys, "--workdir", copy)
    assert code == 0, err
    manifest = json.loads((copy / "quantized_int8" / "manifest.json").read_text())
    assert manifest["config"]["model"]["d_model"] == cfg.model.d_model

    _edit_saved_config(copy, 20, lambda c: c["data"].update(eval_batches=0))
    code, _, err = run(capsys, "--workdir", copy)
    assert code == 2 and "evaluated on no batches (data.eval_batches = 0); pass --eval-batches N" in err
    _edit_saved_config(copy, 20, lambda c: c["model"].update(matmul_precision="fp8"))
    code, _, err = run(capsys, "--workdir", copy)
    assert code == 2 and "already trained with model.matmul_precision='fp8'" in err
    _edit_saved_config(copy, 20, lambda c: c["model"].update(matmul_precision="default", num_experts=4))
    code, _, err = run(capsys, "--workdir", copy)
    assert code == 2 and "is a mixture of experts (model.num_experts = 4); post-training quantization covers" in err


def test_quantized_tensor_table_covers_an_untied_head(trained):
    from jaxlm.quantized import quantize_weights

    _, cfg, _ = trained
    untied = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, tie_embeddings=False))
    params = nnx.to_pure_dict(Program(untied, one_device_mesh()).init().params)
    q = quantize_weights(params)
    assert set(q) >= {("lm_head",), ("embed",)}
    assert q[("lm_head",)][1].shape == (1, untied.model.vocab_size)  # one scale per output column
    assert q[("blocks", "attn", "wo")][1].shape == (untied.model.num_layers, 1, 1, untied.model.d_model)


@pytest.mark.slow  # covered by test_quantized_training's test_fp8_and_int8_training_track_float32 (docs/testing.md)
def test_compare_precision_trains_each_precision_and_plots(tmp_path, capsys):
    shrink = [
        "model.d_model=64",
        "model.mlp_dim=128",
        "model.num_layers=2",
        "data.seq_len=64",
        "data.batch_size=8",
        "data.microbatches=1",
        "data.eval_batches=1",
        "checkpoint_every=0",
    ]
    argv = ["--root", str(tmp_path), "--steps", "3", "--precisions", "fp8,f32", "--no-progress"]
    argv += [a for s in shrink for a in ("--set", s)]
    assert compare_precision.main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert list(summary) == ["f32", "fp8"] and summary["f32"]["eval_gap_vs_f32"] == 0
    assert abs(summary["fp8"]["eval_gap_vs_f32"]) < 0.05
    assert (tmp_path / "loss_by_precision.png").stat().st_size > 10_000
    assert (
        json.loads((tmp_path / "fp8" / "config.json").read_text())["model"]["matmul_precision"]
        == "attention=fp8,mlp=fp8"
    )
    with pytest.raises(SystemExit):
        compare_precision.main(["--precisions", "fp4"])
