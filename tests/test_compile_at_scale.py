"""experiments.compile_at_scale: a ~1B Llama's real train step compiled for 64 TPU v5p chips and 64 H100s on this
CPU machine, fitting, with its kernels and collectives read from the program; every bad input refused in one line
before anything compiles. The 8B-405B matrix runs as a slow test."""

import json
import math
import subprocess
import sys

import pytest
from helpers import compile_env

from experiments import compile_at_scale

GiB = 2**30


def _run(args, timeout=900):
    env = compile_env()
    return subprocess.run(
        [sys.executable, "-m", "experiments.compile_at_scale", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.parametrize("cluster", ["h100x64", pytest.param("v5p-128", marks=pytest.mark.slow)])
def test_a_1b_llama_step_compiles_and_fits_on_64_v5p_chips_and_64_h100s(tmp_path, cluster):
    """(v5p slow: its fast cover is test_tpu_compile.py, every kernel for v5p at 8k and 32k, and this test's H100
    row: the same program's FSDP collectives, compiled for another cluster.)"""
    layout = tmp_path / "half_fsdp.py"
    layout.write_text("from sharding import MeshLayout\n\nlayout = lambda n: MeshLayout(data=2, fsdp=n // 2)\n")
    out = tmp_path / "scale"
    args = ["--model", "llama3-1b", "--cluster", cluster, "--seq", "2048", "--layout", str(layout)]
    proc = _run([*args, "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert (row["cluster"], row["chips"]) == (cluster, 64)  # Google's v5p-128 counts TensorCores
    tpu = cluster.startswith("v5p")
    kernels = ["Mosaic (Pallas TPU)"] if tpu else ["Mosaic GPU (Pallas)", "Triton (Pallas GPU)"]
    assert row["compiled"] and row["fits"] and row["layout"] == "d2 f32 t1 p1"
    assert 1 < row["xla_gib"]["total"] < row["hbm_gib"]
    # the attention forward, dQ and dK/dV (Mosaic GPU on an H100 in bfloat16): nothing fell back
    assert sum(row["kernels"].get(k, 0) for k in kernels) >= 3, row["kernels"]
    # the FSDP gathers: over 32 devices, once per layer and step at least (16 layers)
    assert any(c["group"] == 32 and c["count"] >= 16 for c in row["collectives"]), row["collectives"]
    assert row["planner_mfu"] > 0
    # the planner's memory follows XLA's GPU program and its fitted TPU terms (within 10% at 1B-405B, docs/scale.md)
    assert 0.9 <= row["planner_over_xla"] <= 1.1, row["planner_over_xla"]
    report = out.with_suffix(".md").read_text()
    assert f"| llama3-1b | {cluster} | 2048 | d2 f32 t1 p1 | train | yes |" in report
    assert proc.stdout.strip().splitlines()[-1] == '{"layouts": 1, "fit": 1, "nothing_fits": []}'


def test_a_config_with_the_default_attention_compiles_for_h100s_with_cudnns_kernels(tmp_path):
    """``attention_impl=auto`` takes cuDNN's fused attention for causal bf16 attention on a GPU. jax asks the local
    cuDNN and GPU while it traces that, and refused here ("cuDNN is not detected"): a user's config was reported as
    not compiling for any H100 cluster. ``targets.tracing_for`` answers for the H100 described."""
    out = tmp_path / "auto"
    sets = ["--set", "model.vocab_size=512", "--set", "model.dtype=bfloat16"]
    args = ["--model", "experiments/configs/tiny_lm.py", "--cluster", "h100x8", "--seq", "256", "--layout", "auto:1"]
    proc = _run([*args, *sets, "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert row["compiled"] and row["fits"], row
    assert row["kernels"].get("cuDNN attention", 0) >= 2, row["kernels"]  # a layer's forward and backward at least


@pytest.mark.slow
def test_a_1b_llama_decode_step_compiles_beside_its_train_step_on_8_h100s(tmp_path):
    """--decode: generate's decode step for 8 rows (one per FSDP shard) over a 2048-slot KV cache. Its arguments are
    the per-layer weight copies, the embedding and the cache; the stacked params a run keeps are held beside."""
    from sharding.model_shape import MODEL_PRESETS, param_specs

    layout = tmp_path / "fsdp.py"
    layout.write_text("from sharding import MeshLayout\n\nlayout = lambda n: MeshLayout(fsdp=n)\n")
    out = tmp_path / "decode"
    args = ["--model", "llama3-1b", "--cluster", "h100x8", "--seq", "2048", "--layout", str(layout), "--decode"]
    proc = _run([*args, "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train, decode = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert (train["step"], decode["step"], decode["layout"]) == ("train", "decode", "d1 f8 t1 p1")
    assert decode["compiled"] and decode["fits"] and (decode["decode_rows"], decode["cache_len"]) == (8, 2048)
    shape = MODEL_PRESETS["llama3-1b"]
    params = sum(math.prod(p.shape) for p in param_specs(shape)) * 4 / 8 / GiB  # float32, a device's share
    cache = 2 * shape.num_layers * 8 * 2048 * shape.num_kv_heads * shape.resolved_head_dim * 2 / 8 / GiB  # bf16
    args = decode["xla_gib"]["arguments"]
    assert params + cache <= args <= 1.5 * (params + cache), (args, params, cache)
    assert 0.5 * params <= decode["held_gib"] <= params  # the stacked layers; the embedding is read
    assert decode["planner_gib"] is None and any(c["group"] == 8 for c in decode["collectives"])
    report = out.with_suffix(".md").read_text()
    assert "| llama3-1b | h100x8 | 2048 | d1 f8 t1 p1 | decode, 8 rows x 2048 slots | yes |" in report
    assert " | - | - | " in report and "| llama3-1b | h100x8 | 2048 | d1 f8 t1 p1 | train | yes |" in report
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last == {"layouts": 1, "fit": 1, "decode_fit": 1, "nothing_fits": []}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--cluster", "a100x8"], "unknown cluster 'a100x8': write hardware and count, e.g. h100x64"),
        (["--cluster", "v5p-127"], "a v5p name counts TensorCores, 2 per chip"),
        (["--cluster", "v5e-512"], "TPU v5e: 512 chips is not a slice libtpu describes"),
        (["--cluster", "h100x12"], "H100s come 8 to a host"),
        (["--model", "llama9"], "unknown model 'llama9': a config file (.py / .json) or a preset (7b, 13b, 70b"),
        (["--layout", "auto:x"], "write auto or auto:N with N a positive count"),
        (["--seq", "0"], "give positive token counts"),
        (["--batch-tokens", "1000"], "--batch-tokens 1000 is not a multiple of --seq 8192"),
        (["--set", "model.num_layerz=2"], "num_layerz"),
        (["--decode", "--decode-batch", "0"], "--decode-batch 0: give a positive number of prompts"),
        (["--decode-batch", "16"], "--decode-batch 16 sizes the decode step: add --decode"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_compiling(tmp_path, capsys, args, message):
    base = {"--model": "llama3-1b", "--cluster": "h100x64"}
    flags = [x for k, v in base.items() if k not in args for x in (k, v)] + args
    assert compile_at_scale.main([*flags, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("compile_at_scale: error: ") and message in err and "\n" not in err, err


def test_a_layout_for_another_device_count_is_refused(tmp_path, capsys):
    layout = tmp_path / "l.py"
    layout.write_text("from sharding import MeshLayout\nlayout = MeshLayout(fsdp=8)\n")
    argv = ["--model", "llama3-1b", "--cluster", "h100x64", "--layout", str(layout), "--out", str(tmp_path / "r")]
    assert compile_at_scale.main(argv) == 2
    assert "8" in capsys.readouterr().err and not (tmp_path / "r.md").exists()


def test_a_layout_whose_microbatches_do_not_split_over_the_batch_axes_is_refused(tmp_path, capsys):
    """As the trainer refuses it: XLA would give every device every row of the microbatch (a 70B step at 32 rows
    over fsdp 64 compiled to 30 GiB per GPU where 11 do, the 'tensor 1' gap of docs/results)."""
    layout = tmp_path / "pp.py"
    layout.write_text(
        "from sharding import MeshLayout\nlayout = MeshLayout(fsdp=32, pipeline=2, pipeline_microbatches=4)\n"
    )
    argv = ["--model", "llama3-1b", "--cluster", "h100x64", "--seq", "2048", "--layout", str(layout)]
    assert compile_at_scale.main([*argv, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert "microbatch size 16 (batch 64 / 1 accumulation x 4 pipeline microbatches) is not divisible by" in err
    assert "\n" not in err and not (tmp_path / "r.md").exists()


def test_decode_with_a_pipeline_layout_is_refused_before_compiling(tmp_path, capsys):
    layout = tmp_path / "pp.py"
    layout.write_text("from sharding import MeshLayout\nlayout = MeshLayout(fsdp=32, pipeline=2)\n")
    argv = ["--model", "llama3-1b", "--cluster", "h100x64", "--layout", str(layout), "--out", str(tmp_path / "r")]
    assert compile_at_scale.main([*argv, "--decode"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "compile_at_scale: error: generation runs without pipeline stages; the layout has pipeline=2", err


def test_an_existing_report_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "r.md").write_text("last week's matrix")
    assert compile_at_scale.main(["--model", "llama3-1b", "--cluster", "h100x64", "--out", str(tmp_path / "r")]) == 2
    assert "exists; give another --out or --overwrite" in capsys.readouterr().err
    assert (tmp_path / "r.md").read_text() == "last week's matrix"


@pytest.mark.slow
def test_the_matrix_of_llama3_8b_70b_405b_on_h100_and_v5p_clusters(tmp_path):
    """docs/results/scale-*.md's matrix: each model on each cluster, the planner's best layout, fits."""
    out = tmp_path / "matrix"
    args = ["--model", "llama3-8b,llama3-70b,llama3-405b", "--cluster", "h100x256,v5px256", "--layout", "auto:1"]
    proc = _run([*args, "--out", str(out)], timeout=7200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert len(rows) == 6 and all(r["fits"] for r in rows)
    # the planner follows XLA's GPU program and its fitted TPU terms within 10% (docs/scale.md)
    assert all(0.9 <= r["planner_over_xla"] <= 1.1 for r in rows), rows


@pytest.mark.slow
def test_plan_verify_compiles_the_planner_s_best_layout_and_prints_xla_s_memory_beside_it():
    args = ["--model", "experiments/configs/tiny_lm.py", "--vocab-size", "4096", "--devices", "8"]
    args += ["--global-batch-tokens", "4096", "--seq", "256", "--hardware", "h100-sxm", "--verify", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "sharding.plan", *args], capture_output=True, text=True, env=compile_env()
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    (row,) = figures["verified"]
    assert row["fits"] and 0 < row["xla_gb"] < row["planner_gb"] * 3 and row["planner_gb"] == figures["memory_gb"]
    assert "planner GB    XLA GB  planner/XLA  fits" in proc.stdout


def test_plan_verify_names_hardware_it_cannot_compile_for(capsys):
    from sharding import plan

    argv = ["--model", "llama3-8b", "--devices", "8", "--global-batch-tokens", "65536", "--seq", "8192"]
    assert plan.main([*argv, "--hardware", "a100", "--verify", "1"]) == 2
    assert "hardware 'a100' has no compiler description to check against" in capsys.readouterr().err


MOE_CONFIG = """from jaxlm.config import DataConfig, ModelConfig, TrainConfig

config = TrainConfig(
    model=ModelConfig(vocab_size=4096, d_model=512, num_layers=1, num_heads=8, num_kv_heads=4, mlp_dim=1024,
                      num_experts=8, experts_per_token=2, expert_mlp_dim=512, dtype="bfloat16",
                      attention_impl="xla_blocksparse", remat="full"),
    data=DataConfig(seq_len=1024, batch_size=8),
)
"""  # attention by XLA: what this step is for is the experts' exchanges (a step with the kernels: the 1B's); one
# layer: every layer's exchanges are the same (a second cost 8 s of XLA:GPU's compile)


@pytest.mark.parametrize("cluster", ["h100x8", pytest.param("v5px8", marks=pytest.mark.slow)])
def test_an_moe_step_compiles_with_the_all_to_all_bytes_the_planner_counts(tmp_path, cluster):
    """A small MoE (8 experts, top 2) on 8 H100s (and, in the slow suite, 8 v5p chips) with experts over 4 devices:
    the token copies go out and come back by ragged all-to-alls (each device sends what is routed, received into
    worst-case buffers), per layer forward, backward and the remat forward; the planner counts the routed copies
    (sharding.planner.expert_all_to_all_bytes), within what the buffers allow; on the GPU the grouped matmuls run
    as tiles (XLA:GPU's ragged_dot would be a dense product over every expert), on the TPU as XLA's ragged dot."""
    from sharding import MeshLayout
    from sharding.model_shape import ModelShape
    from sharding.planner import expert_all_to_all_bytes

    config, layout = tmp_path / "moe.py", tmp_path / "experts.py"
    config.write_text(MOE_CONFIG)
    layout.write_text("from sharding import MeshLayout\n\nlayout = MeshLayout(expert=4, fsdp=2)\n")
    out = tmp_path / "moe"
    args = ["--model", str(config), "--cluster", cluster, "--seq", "1024", "--layout", str(layout)]
    proc = _run([*args, "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from jaxlm.config import load_config

    shape = ModelShape.from_config(load_config(config).model)
    want = expert_all_to_all_bytes(shape, MeshLayout(expert=4, fsdp=2), 8 * 1024, "full")
    L, E, A, D, cb = 1, 4, 1024 * 2, 512, 2  # layers; a device's 1,024 tokens x top 2 = A copies
    # per layer, buffers: out [E A, D] + their experts [E A] int32 + back [A, D], twice (remat), and the backward's
    # transposes [A, D] and [E A, D]
    buffers = L * (3 * E * A * D * cb + 3 * A * D * cb + 2 * E * A * 4)
    for row in json.loads(out.with_suffix(".json").read_text())["rows"]:
        assert row["compiled"] and row["fits"] and row["layout"] == "d1 f2 t1 p1 e4", row
        (ragged,) = [c for c in row["collectives"] if c["kind"] == "ragged-all-to-all" and c["group"] == 4]
        # over the expert axis only the exchanges' offsets, no [E, A, D] block (the embedding lookup's all-to-all
        # runs over the FSDP pair, sharding.embedding)
        dense = sum(c["bytes"] for c in row["collectives"] if c["kind"] == "all-to-all" and c["group"] == 4)
        assert dense < 1024, row["collectives"]
        assert want <= ragged["bytes"], (ragged, want)
        assert ragged["count"] == L * 8, ragged
        if row["cluster"] == "h100x8":
            assert ragged["bytes"] == buffers, (ragged, buffers)
