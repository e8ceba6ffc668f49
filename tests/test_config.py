"""jaxlm.config (config files, --set overrides, validation) and sharding (layout files, logical rules)."""

import dataclasses
import textwrap
from pathlib import Path

import jax
import pytest
from helpers import tiny_config
from jax.sharding import PartitionSpec as P

from jaxlm import config as config_lib
from jaxlm.config import ConfigError, ModelConfig, TrainConfig, apply_overrides, load_config, validate
from jaxlm.config_resume import diff as config_diff
from sharding import DEFAULT_RULES, LayoutError, MeshLayout, build_mesh, load_layout, logical_spec
from sharding.mesh import check_rules

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path, name, source):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


# ----------------------------------------------------------------------------- loading config files


def test_load_config_instance_and_function_forms(tmp_path):
    instance = write(
        tmp_path,
        "inst.py",
        """
        from jaxlm.config import ModelConfig, TrainConfig
        config = TrainConfig(model=ModelConfig(d_model=128), steps=7)
    """,
    )
    function = write(
        tmp_path,
        "func.py",
        """
        from jaxlm.config import DataConfig, TrainConfig
        def config():
            return TrainConfig(data=DataConfig(batch_size=4), seed=3)
    """,
    )
    a, b = load_config(instance), load_config(function)
    assert isinstance(a, TrainConfig) and a.model.d_model == 128 and a.steps == 7
    assert isinstance(b, TrainConfig) and b.data.batch_size == 4 and b.seed == 3
    assert validate(load_config(REPO / "experiments" / "configs" / "tiny_lm.py")).model.num_layers == 6


@pytest.mark.parametrize(
    "source, message",
    [
        ("x = 1\n", "must define `config`"),
        ("config = 3\n", "`config` is a int, expected TrainConfig"),
        ("def config():\n    return {'steps': 1}\n", "`config` is a dict, expected TrainConfig"),
        ("import nonexistent_module_xyz\n", "raised ModuleNotFoundError: No module named 'nonexistent_module_xyz'"),
        ("x = 1\nraise RuntimeError('boom')\n", "c.py, line 2 raised RuntimeError: boom"),
        ("def config():\n    return 1 / 0\n", "c.py, line 2 raised ZeroDivisionError: division by zero"),
        (
            "from jaxlm.config import ModelConfig, TrainConfig\nconfig = TrainConfig(model=ModelConfig(d_modle=64))\n",
            "c.py, line 2: ModelConfig has no field 'd_modle' (did you mean 'd_model'",
        ),
        (
            "from jaxlm.config import TrainConfig\nconfig = TrainConfig(zzz=1)\n",
            "c.py, line 2: TrainConfig has no field 'zzz' (fields: model, optim, data",
        ),
        (
            "from jaxlm.config import TrainConfig\nconfig = TrainConfig(steps='ten')\n",
            "c.py: steps must be int, got str 'ten'",
        ),
        (
            "from jaxlm.config import ModelConfig, TrainConfig\nconfig = TrainConfig(model=ModelConfig(d_model=1.5))\n",
            "c.py: model.d_model must be int, got float 1.5",
        ),
        (
            "from jaxlm.config import OptimConfig, TrainConfig\n"
            "config = TrainConfig(optim=OptimConfig(learning_rate=float('nan')))\n",
            "c.py: optim.learning_rate must be a finite float, got nan",
        ),
    ],
)
def test_load_config_errors(tmp_path, source, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        load_config(write(tmp_path, "c.py", source))
    assert str(info.value).startswith(f"config file {tmp_path / 'c.py'}") and "\n" not in str(info.value)


def test_config_syntax_error_names_the_line(tmp_path):
    path = write(
        tmp_path,
        "broken.py",
        """\
        from jaxlm.config import TrainConfig

        config = = TrainConfig(steps=3)
    """,
    )
    with pytest.raises(ConfigError, match=r"syntax error at line 3\b") as info:
        load_config(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_a_runs_config_json_is_a_config_file(tmp_path):
    """What a run writes as config.json loads back as the same config (DiLoCo section and all)."""
    import json

    cfg = apply_overrides(tiny_config(), ["diloco.replicas=2", "model.attention_impl=xla_blocksparse", "steps=7"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config_lib.to_dict(cfg), indent=2))
    assert load_config(path) == cfg
    data = config_lib.to_dict(cfg)
    del data["optim"]["learning_rate"]  # an older run's file: missing fields keep their defaults
    path.write_text(json.dumps(data))
    assert load_config(path).optim.learning_rate == config_lib.OptimConfig().learning_rate


@pytest.mark.parametrize(
    "name, text, message",
    [
        (
            "c.json",
            '{"model": {"d_modle": 64}}',
            r"c.json: unknown field model.d_modle \(did you mean model.d_model\?\)",
        ),
        ("c.json", '{"model": 3}', r"c.json: model must be a JSON object"),
        ("c.json", '{"steps": "ten"}', r"c.json: steps must be int, got str 'ten'"),
        ("c.json", "{not json", r"c.json is not valid JSON"),
        ("c.yaml", "steps: 3", r"c.yaml must be a Python file \(.py\) or a run's config.json \(.json\)"),
    ],
)
def test_bad_config_files_are_one_line(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path)
    assert "\n" not in str(info.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*missing.py"):
        load_config(tmp_path / "missing.py")


# ----------------------------------------------------------------------------- --set overrides


def test_overrides_parse_each_type():
    cfg = apply_overrides(
        TrainConfig(),
        [
            "model.d_model=64",
            "optim.learning_rate=1e-3",
            "optim.weight_decay=0",
            "model.tie_embeddings=false",
            "model.scan_layers=True",
            "model.dtype=bfloat16",
            "steps=5",
            " data.path = /tmp/x ",
        ],
    )
    assert cfg.model.d_model == 64 and type(cfg.model.d_model) is int
    assert cfg.optim.learning_rate == 1e-3 and type(cfg.optim.learning_rate) is float
    assert cfg.optim.weight_decay == 0.0 and type(cfg.optim.weight_decay) is float
    assert cfg.model.tie_embeddings is False and cfg.model.scan_layers is True
    assert cfg.model.dtype == "bfloat16" and cfg.steps == 5 and cfg.data.path == "/tmp/x"
    assert TrainConfig().model.d_model == 256  # frozen originals are untouched
    for raw, expected in [("1", True), ("yes", True), ("on", True), ("0", False), ("no", False), ("OFF", False)]:
        assert apply_overrides(TrainConfig(), [f"tensorboard={raw}"]).tensorboard is expected


@pytest.mark.parametrize(
    "assignment, message",
    [
        ("model.d_model=abc", r"bad value for model.d_model: 'abc' is not a valid int"),
        ("model.d_model=1.5", r"bad value for model.d_model: '1.5' is not a valid int"),
        ("optim.learning_rate=fast", r"bad value for optim.learning_rate: 'fast' is not a valid float"),
        ("optim.learning_rate=nan", r"not a valid float"),
        ("tensorboard=maybe", r"bad value for tensorboard: 'maybe' is not a valid bool"),
        ("model.d_model", r"--set expects dotted.key=value"),
        ("=3", r"--set expects dotted.key=value"),
        ("model=3", r"'model' is a section"),
        ("model.d_model.x=3", r"'d_model' is not a section"),
    ],
)
def test_bad_overrides(assignment, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides(TrainConfig(), [assignment])


def test_unknown_key_lists_the_section_fields():
    with pytest.raises(ConfigError) as info:
        apply_overrides(TrainConfig(), ["model.nonexistent=1"])
    message = str(info.value)
    assert "model.nonexistent" in message and "ModelConfig has no field 'nonexistent'" in message
    for name in (f.name for f in dataclasses.fields(ModelConfig)):
        assert name in message
    with pytest.raises(ConfigError, match=r"TrainConfig has no field 'xyz'.*model, optim, data, diloco, steps"):
        apply_overrides(TrainConfig(), ["xyz.d_model=1"])


@pytest.mark.parametrize(
    "assignment, suggestion",
    [("modle.d_model=1", "'model'"), ("model.n_layers=2", "'model.num_layers'"), ("stepz=3", "'steps'")],
)
def test_a_misspelt_key_gets_the_close_one_suggested(assignment, suggestion):
    with pytest.raises(ConfigError, match=rf"has no field '\w+' \(did you mean {suggestion}\?\)$"):
        apply_overrides(TrainConfig(), [assignment])


# ----------------------------------------------------------------------------- validation


def test_default_and_tiny_configs_are_valid():
    assert validate(TrainConfig()) == TrainConfig()
    validate(tiny_config())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model.num_heads=4", "model.num_kv_heads=3"],
            r"model.num_heads \(4\) must be divisible by model.num_kv_heads \(3\)",
        ),
        (
            ["data.batch_size=10", "data.microbatches=4"],
            r"data.batch_size \(10\) must be divisible by data.microbatches \(4\)",
        ),
        (["data.seq_len=512", "model.max_seq_len=256"], r"data.seq_len \(512\) exceeds model.max_seq_len \(256\)"),
        (
            ["model.d_model=250", "model.num_heads=4"],
            r"model.d_model \(250\) must be divisible by model.num_heads \(4\)",
        ),
        (["model.d_model=36", "model.num_heads=4"], r"head dim must be even"),
        (["steps=-3"], r"steps must be positive, got -3"),
        (["model.num_layers=0"], r"model.num_layers must be positive, got 0"),
        (["optim.warmup_steps=-1"], r"optim.warmup_steps must be >= 0"),
        (["optim.learning_rate=0"], r"optim.learning_rate must be positive"),
        (["optim.min_lr_ratio=1.5"], r"optim.min_lr_ratio must be in \[0, 1\]"),
        (["data.val_fraction=1"], r"data.val_fraction must be in \[0, 1\)"),
        (["model.dtype=float16"], r"model.dtype must be 'float32' or 'bfloat16'"),
        (["model.attention_impl=flash"], r"model.attention_impl must be one of"),
        # values the optimizer or the model would turn into inf / NaN at the first step
        (["optim.learning_rate=1e300"], r"^optim.learning_rate 1e\+300 overflows float32 \(largest 3.4e\+38\)"),
        (["optim.weight_decay=1e300"], r"^optim.weight_decay 1e\+300 overflows float32"),
        (["optim.b1=1.5"], r"^optim.b1 must be in \[0, 1\) \(Adam's moment decay\), got 1.5$"),
        (["optim.b2=1"], r"^optim.b2 must be in \[0, 1\) \(Adam's moment decay\), got 1.0$"),
        (["optim.eps=0"], r"^optim.eps must be positive"),
        (["model.rope_theta=0"], r"^model.rope_theta must be positive \(RoPE's base; 10000 is usual\), got 0.0$"),
        (["model.norm_eps=-1"], r"^model.norm_eps must be >= 0"),
    ],
)
def test_validate_rejects_bad_combinations(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(apply_overrides(TrainConfig(), overrides))


def test_large_but_finite_learning_rates_pass():
    validate(apply_overrides(TrainConfig(), ["optim.learning_rate=1e3", "optim.optimizer=sgd"]))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["eval_every=1", "data.val_fraction=0"],
            r"^eval_every 1 asks for evaluation, but data.val_fraction is 0: nothing would be evaluated; set "
            r"data.val_fraction above 0 \(e.g. 0.01\), or eval_every=0 to train without evaluating$",
        ),
        (
            ["eval_every=5", "data.eval_batches=0"],
            r"^eval_every 5 asks for evaluation, but data.eval_batches is 0: .*; set data.eval_batches >= 1, or "
            r"eval_every=0 to train",
        ),
        (
            ["eval_every=0", "data.val_fraction=0", "eval_prompts=def |x"],
            r"^eval_prompts 'def \|x' asks for evaluation, but data.val_fraction is 0: .*, or eval_prompts= to train",
        ),
        (
            ["model.max_seq_len=32", "data.seq_len=32", "eval_prompts=def ", "eval_sample_tokens=100"],
            r"^eval_sample_tokens 100 exceeds model.max_seq_len 32: the eval samples would run past the model's "
            r"length; lower eval_sample_tokens",
        ),
    ],
)
def test_training_refuses_evaluations_that_cannot_happen(overrides, message):
    cfg = apply_overrides(TrainConfig(), overrides)
    validate(cfg)  # a saved config a model is read from (generate, export) need not pass these
    with pytest.raises(ConfigError, match=message):
        config_lib.validate_training(cfg)


def test_training_without_evaluation_or_with_what_it_needs_passes():
    for overrides in (
        ["eval_every=0", "data.val_fraction=0"],  # nothing asked
        ["eval_every=0", "data.eval_batches=0", "eval_prompts=def ", "eval_sample_tokens=0"],  # samples off
        ["eval_prompts=def ", "eval_sample_tokens=32", "model.max_seq_len=32", "data.seq_len=32"],
    ):
        config_lib.validate_training(apply_overrides(TrainConfig(), overrides))
    config_lib.validate_training(load_config(REPO / "experiments" / "configs" / "tiny_lm.py"))


def test_validate_checks_types_of_python_configs():
    bad = dataclasses.replace(TrainConfig(), model=dataclasses.replace(ModelConfig(), d_model="64"))
    with pytest.raises(ConfigError, match=r"config model.d_model must be int, got str '64'"):
        validate(bad)
    with pytest.raises(ConfigError, match=r"config steps must be int, got bool"):
        validate(dataclasses.replace(TrainConfig(), steps=True))
    with pytest.raises(ConfigError, match=r"config data must be a DataConfig"):
        validate(dataclasses.replace(TrainConfig(), data={"seq_len": 1}))
    validate(dataclasses.replace(TrainConfig(), optim=dataclasses.replace(TrainConfig().optim, learning_rate=1)))


def test_dict_roundtrip_and_diff():
    cfg = apply_overrides(TrainConfig(), ["model.d_model=128", "data.path=x"])
    assert config_lib.from_dict(config_lib.to_dict(cfg)) == cfg
    changes = config_diff(config_lib.to_dict(TrainConfig()), config_lib.to_dict(cfg))
    assert changes == ["data.path: '' -> 'x'", "model.d_model: 256 -> 128"]


# ----------------------------------------------------------------------------- mesh layouts


@pytest.mark.parametrize(
    "source",
    [
        "layout = {'data': 2, 'fsdp': 4}\n",
        "from sharding import MeshLayout\nlayout = MeshLayout(data=2, fsdp=4)\n",
        "from sharding import MeshLayout\n"
        "def layout(num_devices):\n    return MeshLayout(data=2, fsdp=num_devices // 2)\n",
        "def layout(num_devices):\n    return {'data': 2, 'fsdp': num_devices // 2}\n",
    ],
)
def test_load_layout_forms(tmp_path, source):
    layout = load_layout(write(tmp_path, "mesh.py", source), 8)
    assert layout == MeshLayout(data=2, fsdp=4)
    mesh = build_mesh(layout)
    shape = {"replica": 1, "data": 2, "fsdp": 4, "pipeline": 1, "context": 1, "expert": 1, "tensor": 1}
    assert dict(mesh.shape) == shape
    assert mesh.devices.size == len(jax.devices()) == 8


def test_shipped_layout_files():
    root = REPO / "experiments" / "meshes"
    assert load_layout(root / "data_parallel.py", 8) == MeshLayout(data=8)
    assert load_layout(root / "fsdp.py", 4) == MeshLayout(fsdp=4)
    assert load_layout(root / "single_device.py", 1) == MeshLayout()
    assert load_layout(root / "fsdp8.py", 8) == MeshLayout(fsdp=8)
    assert load_layout(root / "dp2_fsdp2_tp2.py", 8) == MeshLayout(data=2, fsdp=2, tensor=2)
    pp = load_layout(root / "fsdp2_tp2_pp2.py", 8)
    assert (pp.fsdp, pp.tensor, pp.pipeline, pp.pipeline_schedule, pp.num_microbatches) == (2, 2, 2, "1f1b", 4)
    assert load_layout(root / "expert4_dp2.py", 8) == MeshLayout(data=2, expert=4)
    pp = load_layout(root / "dp4_pp2.py", 8)
    assert (pp.data, pp.pipeline, pp.pipeline_schedule, pp.num_microbatches) == (4, 2, "gpipe", 4)


def test_layout_product_mismatch_names_the_numbers(tmp_path):
    with pytest.raises(LayoutError, match=r"data=2 x tensor=3 covers 6 devices but 8 are available"):
        load_layout(write(tmp_path, "m.py", "layout = {'data': 2, 'tensor': 3}\n"), 8)
    with pytest.raises(LayoutError, match=r"covers 8 devices but 1 are available"):
        build_mesh(MeshLayout(data=8), devices=jax.devices()[:1])


@pytest.mark.parametrize(
    "source, message",
    [
        ("layout = {'data': 8, 'model': 1}\n", r"unknown mesh axis 'model'; known axes: replica, data, fsdp"),
        (
            "from sharding import MeshLayout\nlayout = MeshLayout(data=4, replica=3)\n",
            r"mesh layout replica=3 x data=4 covers 12 devices but 8 are available",
        ),
        (
            "from sharding import MeshLayout\nlayout = MeshLayout(data=4, pipeline=2, pipeline_schedule='zb')\n",
            r"pipeline_schedule 'zb' is unknown; choose one of gpipe, 1f1b",
        ),
        (
            "from sharding import MeshLayout\nlayout = MeshLayout(data=4, pipeline=2, pipeline_microbatches=-1)\n",
            r"pipeline_microbatches must be an int >= 0",
        ),
        ("layout = {'data': 0}\n", r"mesh axis 'data' must be a positive int, got 0"),
        ("layout = [8]\n", r"`layout` is a list, expected MeshLayout or dict"),
        ("x = 1\n", r"must define `layout`"),
        ("layout = {'data': 8\n", r"syntax error at line 1"),
        (
            "from sharding import MeshLayout\nlayout = MeshLayout(data=8, rules={'embed': 'model'})\n",
            r"rule 'embed' -> 'model': unknown mesh axis",
        ),
        ("layout = {'data': 8, 'rules': ['embed']}\n", r"rules must be a dict of logical axis -> mesh axis, got list"),
        ("layout = {'data': 2.5}\n", r"mesh axis 'data' must be a positive int, got 2.5"),
        ("layout = {8: 1}\n", r"unknown mesh axis 8"),
        (
            "from sharding import MeshLayout\nlayout = MeshLayout(datta=8)\n",
            r"m.py, line 2: MeshLayout has no field 'datta' \(did you mean 'data'\?\)",
        ),
        ("def layout(num_devices):\n    return {'data': num_devices // 0}\n", r"m.py, line 2 raised ZeroDivisionError"),
    ],
)
def test_bad_layouts(tmp_path, source, message):
    with pytest.raises(LayoutError, match=message) as info:
        load_layout(write(tmp_path, "m.py", source), 8)
    assert str(info.value).startswith(f"mesh layout file {tmp_path / 'm.py'}") and "\n" not in str(info.value)


def test_missing_layout_file(tmp_path):
    with pytest.raises(LayoutError, match="mesh layout file not found"):
        load_layout(tmp_path / "nope.py", 8)


def test_check_divisibility():
    layout = MeshLayout(data=2, fsdp=2, tensor=2)
    ok = dict(batch_size=8, microbatches=2, num_heads=4, num_kv_heads=2, mlp_dim=64, num_layers=2)
    layout.check_divisibility(**ok)
    with pytest.raises(LayoutError, match=r"microbatch size 2 .* not divisible by replica x data x fsdp x expert = 4"):
        layout.check_divisibility(**{**ok, "microbatches": 4})
    with pytest.raises(LayoutError, match=r"model.num_kv_heads = 1 is not divisible by mesh axis 'tensor' = 2"):
        layout.check_divisibility(**{**ok, "num_kv_heads": 1})
    piped = MeshLayout(data=2, pipeline=2, pipeline_microbatches=4)
    with pytest.raises(LayoutError, match=r"model.num_layers = 3 is not divisible by mesh axis 'pipeline' = 2"):
        piped.check_divisibility(**{**ok, "num_layers": 3, "microbatches": 1})
    with pytest.raises(LayoutError, match=r"batch 12 does not split into 2 accumulation x 4 pipeline microbatches"):
        piped.check_divisibility(**{**ok, "batch_size": 12})
    moe = {**ok, "microbatches": 1, "num_experts": 4, "moe_every": 2}  # stages take whole groups of 2 layers
    piped.check_divisibility(**{**moe, "num_layers": 4})
    with pytest.raises(LayoutError, match=r"moe_every = 1 groups of dense layers and an MoE layer do not split over 2"):
        piped.check_divisibility(**moe)
    with pytest.raises(
        LayoutError,
        match=r"microbatch size 1 .* 4 pipeline microbatches\) is not divisible by "
        r"replica x data x fsdp x expert = 2",
    ):
        piped.check_divisibility(**{**ok, "batch_size": 4, "microbatches": 1})
    assert MeshLayout(pipeline=4).num_microbatches == 8 and MeshLayout(data=8).num_microbatches == 1
    with pytest.raises(LayoutError, match=r"data.seq_len = 30 is not divisible by mesh axis 'context' = 4"):
        MeshLayout(data=2, context=4).check_divisibility(**ok, seq_len=30)


def test_indivisible_param_dimension_is_a_layout_error():
    from jaxlm.train import Program

    cfg = tiny_config(model=dict(d_model=44, num_heads=2, num_kv_heads=1, mlp_dim=64))
    validate(cfg)
    with pytest.raises(LayoutError, match=r"logical axis 'embed' of size 44 .* mesh axis 'fsdp' = 8"):
        Program(cfg, build_mesh(MeshLayout(fsdp=8)))


# ----------------------------------------------------------------------------- logical rules


def test_logical_spec_defaults_and_overrides():
    assert logical_spec(("layers", "embed", "kv_heads", None, "head_dim")) == P(
        "pipeline", "fsdp", "tensor", None, None
    )
    assert logical_spec(("batch", "seq")) == P(("replica", "data", "fsdp", "expert"), "context")
    # a context axis shares the params like FSDP (a layout's own embed rule wins)
    assert MeshLayout(context=2).rules == {"embed": ("fsdp", "context")}
    assert MeshLayout(context=2, rules={"embed": None}).rules == {"embed": None} and MeshLayout().rules == {}
    assert logical_spec(("vocab", "embed"), {"vocab": None, "embed": ("fsdp", "tensor")}) == P(None, ("fsdp", "tensor"))
    assert logical_spec(("unknown_name",)) == P(None)
    assert set(DEFAULT_RULES) >= {"batch", "embed", "vocab", "heads", "kv_heads", "mlp", "head_dim", "layers"}


def test_logical_spec_rejects_two_axes_on_one_mesh_axis():
    with pytest.raises(ValueError, match=r"logical axes 'embed' and 'mlp' .* both map to mesh axis 'fsdp'"):
        logical_spec(("embed", "mlp"), {"mlp": "fsdp"})
    with pytest.raises(ValueError, match=r"both map to mesh axis 'tensor'"):
        logical_spec(("heads", "mlp"))
    with pytest.raises(ValueError, match=r"both map to mesh axis 'data'"):
        logical_spec(("batch", "embed"), {"embed": ("data",)})


def test_check_rules():
    check_rules({"embed": ("fsdp", "tensor"), "mlp": None})
    with pytest.raises(LayoutError, match=r"rule 'mlp' -> 'gpu': unknown mesh axis"):
        check_rules({"mlp": ("tensor", "gpu")})


def test_auto_microbatches_follow_the_platform_and_the_shards():
    """data.microbatches=0: on CPU the most microbatches that keep >= CPU_MICROBATCH_TOKENS tokens per batch shard
    (and divide the rows evenly over the shards); 1 on accelerators; an explicit count is kept everywhere."""
    from jaxlm.config import CPU_MICROBATCH_TOKENS, DataConfig

    assert CPU_MICROBATCH_TOKENS == 1024
    gpt_bench = DataConfig(seq_len=256, batch_size=16)
    assert gpt_bench.microbatches == 0
    assert gpt_bench.resolved_microbatches("cpu") == 4  # 4 x 256 tokens each
    assert gpt_bench.resolved_microbatches("gpu") == gpt_bench.resolved_microbatches("tpu") == 1
    assert gpt_bench.resolved_microbatches("cpu", shards=2) == 2  # 8 rows per shard: 2 microbatches of 4 x 256
    assert gpt_bench.resolved_microbatches("cpu", shards=8) == 1  # 2 rows of 256 per shard: already under 1024
    assert gpt_bench.resolved_microbatches("cpu", rows=8) == 2  # a DiLoCo replica's half of the batch
    assert DataConfig(seq_len=16, batch_size=8).resolved_microbatches("cpu") == 1  # tiny test batches: one step
    assert DataConfig(seq_len=4096, batch_size=6).resolved_microbatches("cpu") == 6  # one row each is enough
    assert DataConfig(seq_len=256, batch_size=16, microbatches=2).resolved_microbatches("cpu") == 2
    assert DataConfig(seq_len=256, batch_size=16, microbatches=8).resolved_microbatches("gpu") == 8


def test_auto_microbatches_in_the_program_and_under_a_pipeline():
    from helpers import one_device_mesh, tiny_config

    from jaxlm.train import Program, step_microbatches
    from sharding import MeshLayout

    cfg = tiny_config(data=dict(seq_len=64, batch_size=32))  # 2048 tokens: 2 microbatches of 1024 on CPU
    assert Program(cfg, one_device_mesh()).microbatches == 2
    assert step_microbatches(cfg, MeshLayout(data=1, pipeline=2), "cpu") == 1  # the pipeline splits the batch
    explicit = tiny_config(data=dict(seq_len=64, batch_size=32, microbatches=4))
    assert step_microbatches(explicit, MeshLayout(data=1, pipeline=2), "cpu") == 4


def test_unrolled_layers_scan_under_fsdp_with_accumulation():
    """The default unrolled layers scan where unrolling would cost memory (a pipeline stage; FSDP with
    accumulation: XLA would hoist every layer's all-gathered weights out of the loop, test_planner's memory
    comparison) and nowhere else."""
    from jaxlm.config import ModelConfig
    from jaxlm.train import step_model_config
    from sharding import MeshLayout

    unrolled = ModelConfig()
    assert unrolled.scan_layers is False
    assert step_model_config(unrolled, MeshLayout(fsdp=8), 2).scan_layers is True
    assert step_model_config(unrolled, MeshLayout(fsdp=8), 1).scan_layers is False
    assert step_model_config(unrolled, MeshLayout(data=8), 4).scan_layers is False
    assert step_model_config(ModelConfig(scan_layers=True), MeshLayout(data=8), 1).scan_layers is True
    assert step_model_config(unrolled, MeshLayout(data=4, pipeline=2), 1).scan_layers is True  # a pipeline stage
