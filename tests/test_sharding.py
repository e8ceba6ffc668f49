"""Every shipped mesh layout computes the single-device loss and gradients, with params placed as the rules say."""

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import one_device_mesh, random_batch, tiny_config
from jax.sharding import AxisType, NamedSharding

import pallas_kernels as pk
from jaxlm.train import Program
from sharding import LayoutError, MeshLayout, build_mesh, load_layout
from sharding.rules import LOGICAL_AXES_KEY, active_mesh_axes, active_rules, logical_spec, use_rules

MESHES = Path(__file__).resolve().parents[1] / "experiments" / "meshes"
# single_device.py is the reference itself
SHIPPED = ["fsdp8", "dp2_fsdp2_tp2", "fsdp2_tp2_pp2", "dp4_pp2", "context4_dp2"]  # context2_fsdp2_tp2: test_context
CFG = tiny_config(model=dict(num_layers=4), data=dict(batch_size=16))


def loss_and_grads(program, batch):
    state = program.init()
    (loss_sum, count), grads = program.loss_and_grads(state.params, program.device_batch(batch))
    return state, float(loss_sum), float(count), jax.device_get(nnx.to_pure_dict(grads))


@pytest.fixture(scope="module")
def reference():
    single = load_layout(MESHES / "single_device.py", 1)
    plain = loss_and_grads(Program(CFG, one_device_mesh(), single), random_batch(0, batch=16))[1:]
    document = loss_and_grads(Program(_documents(CFG), one_device_mesh(), single), _doc_batch())[1:]
    return {"plain": plain, "document": document}


def assert_same(got, want):
    loss, count, grads = got
    want_loss, want_count, want_grads = want
    assert count == want_count
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    flat_got, flat_want = jax.tree.leaves_with_path(grads), jax.tree.leaves(want_grads)
    for (path, g), w in zip(flat_got, flat_want):
        rel = np.linalg.norm(g - w) / np.linalg.norm(w)
        assert rel <= 1e-5, (jax.tree_util.keystr(path), rel)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_layout_matches_single_device(name, reference):
    layout = load_layout(MESHES / f"{name}.py", 8)
    program = Program(CFG, build_mesh(layout), layout)
    state, *result = loss_and_grads(program, random_batch(0, batch=16))
    assert_same(result, reference["plain"])

    # Params are placed exactly as the rules say, and every parameter-sharding axis of the layout is in use.
    used = set()
    for path, variable in jax.tree.leaves_with_path(
        nnx.state(state.params), is_leaf=lambda x: isinstance(x, nnx.Variable)
    ):
        array = variable[...]
        want = NamedSharding(program.mesh, logical_spec(variable.get_metadata(LOGICAL_AXES_KEY), layout.rules))
        assert array.sharding.is_equivalent_to(want, array.ndim), (jax.tree_util.keystr(path), array.sharding.spec)
        used |= {a for part in array.sharding.spec if part for a in (part if isinstance(part, tuple) else (part,))}
    for axis in ("fsdp", "tensor", "pipeline"):
        if layout.axis_sizes[axis] > 1:
            assert axis in used, (axis, used)


def _documents(cfg):
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention_mask="causal & document"))


def _doc_batch():
    batch = random_batch(1, batch=16)
    batch["segment_ids"] = (np.arange(16)[None, :] >= np.arange(16)[:, None] % 7 + 4).astype(np.int32)
    return batch


@pytest.mark.parametrize(
    "schedule, impl", [pytest.param("gpipe", "xla_blocksparse", marks=pytest.mark.slow), ("1f1b", "pallas")]
)
def test_four_stage_pipeline_with_document_mask(schedule, impl, reference):
    """Four stages of one layer each, 8 microbatches; segment ids travel with their microbatch to every stage, and
    the block-sparse attention implementations run their own shard_map inside the stages'."""
    layout = MeshLayout(data=2, pipeline=4, pipeline_schedule=schedule, pipeline_microbatches=8).validate(8)
    cfg = _documents(CFG)
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, attention_impl=impl, attention_block_q=8, attention_block_kv=8)
    )
    program = Program(cfg, build_mesh(layout), layout)
    _, *result = loss_and_grads(program, _doc_batch())
    assert_same(result, reference["document"])


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(
            MeshLayout(data=2, tensor=2, pipeline=2, pipeline_schedule="zbv", pipeline_microbatches=4),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            MeshLayout(fsdp=2, tensor=2, pipeline=2, pipeline_schedule="interleaved-1f1b", pipeline_microbatches=4),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            MeshLayout(data=2, pipeline=4, pipeline_schedule="zb-h1", pipeline_microbatches=8), marks=pytest.mark.slow
        ),
    ],
    ids=lambda layout: layout.pipeline_schedule,
)
def test_schedules_run_from_tables_match_single_device(layout, reference):
    """Interleaved 1F1B, ZB-H1 and ZB-V run by sharding.pipeline, with the documents' segment ids travelling to
    every chunk (ZB-V's V turns on the last stage), tensor or FSDP inside a stage: loss and gradients equal one
    device."""
    layout = layout.validate(8)
    program = Program(_documents(CFG), build_mesh(layout), layout)
    _, *result = loss_and_grads(program, _doc_batch())
    assert_same(result, reference["document"])


# Layouts whose rules move the batch and the heads off their default mesh axes, and the [rows, query heads] each
# device's attention kernel then sees of the [16, 4] batch x heads (the old hard-coded data/fsdp x tensor split
# gave [4, 2] and [8, 4]).
RULE_OVERRIDES = {
    "batch_on_data_heads_whole": (
        MeshLayout(data=2, fsdp=2, tensor=2, rules={"batch": ("data",), "heads": None}),
        (8, 4),
    ),
    "batch_on_tensor_heads_on_fsdp": (
        MeshLayout(
            fsdp=2,
            tensor=4,
            rules={
                "batch": ("tensor",),
                "heads": "fsdp",
                "kv_heads": "fsdp",
                "embed": None,
                "mlp": None,
                "vocab": None,
            },
        ),
        (4, 2),
    ),
}


@pytest.mark.parametrize(
    "name, impl",
    [
        pytest.param("batch_on_data_heads_whole", "xla_blocksparse", marks=pytest.mark.slow),
        ("batch_on_tensor_heads_on_fsdp", "pallas"),
    ],
)
def test_attention_kernels_split_as_the_rules_say(name, impl, reference, monkeypatch):
    """The block-sparse kernels run under their own shard_map; its batch and head axes come from the layout's rules,
    and the loss and gradients stay the single device's."""
    layout, local_rows_heads = RULE_OVERRIDES[name]
    kernel_name = "block_sparse_attention" if impl == "pallas" else "block_sparse_attention_xla"
    kernel, seen = getattr(pk, kernel_name), set()

    def recording(q, *args, **kwargs):
        heads = q.shape[2] if kwargs.get("layout") == "BTHE" else q.shape[1]  # q [B, T, H, E] or [B, H, T, E]
        seen.add((q.shape[0], heads))  # as one device holds it
        return kernel(q, *args, **kwargs)

    monkeypatch.setattr(pk, kernel_name, recording)
    cfg = _documents(CFG)
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, attention_impl=impl, attention_block_q=8, attention_block_kv=8)
    )
    program = Program(cfg, build_mesh(layout.validate(8)), layout)
    _, *result = loss_and_grads(program, _doc_batch())
    assert seen == {local_rows_heads}
    assert_same(result, reference["document"])


def test_divisibility_follows_the_rules():
    """Heads must divide the mesh axes the layout's rules put them on, not `tensor` regardless."""
    sizes = dict(batch_size=8, microbatches=1, num_heads=6, num_kv_heads=2, mlp_dim=64, num_layers=2)
    on_fsdp = MeshLayout(fsdp=2, tensor=4, rules={"heads": "fsdp", "kv_heads": "fsdp"})
    on_fsdp.check_divisibility(**sizes)  # 6 heads over fsdp = 2, though not over tensor = 4
    both = MeshLayout(fsdp=2, tensor=4, rules={"heads": ("fsdp", "tensor")})
    with pytest.raises(LayoutError) as refused:
        both.check_divisibility(**sizes)
    assert str(refused.value) == (
        "model.num_heads = 6 is not divisible by mesh axes fsdp x tensor = 8 (the layout's rules split heads over them)"
    )
    with pytest.raises(LayoutError) as refused:
        MeshLayout(fsdp=2, tensor=4).check_divisibility(**sizes)  # the default rules: the old message
    assert str(refused.value) == "model.num_heads = 6 is not divisible by mesh axis 'tensor' = 4"


def test_active_mesh_axes_follow_the_rules_in_context():
    mesh = build_mesh(MeshLayout(data=2, fsdp=4)).abstract_mesh
    assert active_mesh_axes("batch") == ()  # no mesh in context
    with jax.sharding.use_abstract_mesh(mesh):
        assert active_mesh_axes("batch") == ("data", "fsdp")  # the defaults, less axes of size 1 (replica)
        assert active_mesh_axes("heads") == ()  # tensor is 1
        with use_rules({"batch": ("fsdp",), "heads": "data"}):
            assert active_rules()["batch"] == ("fsdp",) and active_rules()["embed"] == "fsdp"
            assert (active_mesh_axes("batch"), active_mesh_axes("heads")) == (("fsdp",), ("data",))
    with jax.sharding.use_abstract_mesh(mesh.update_axis_types({"data": AxisType.Manual})):
        assert active_mesh_axes("batch") == ("fsdp",)  # data is manual here, as inside a shard_map over it


def test_a_program_refuses_to_train_on_a_batch_that_does_not_split_over_its_devices():
    """However the Program was built (here from Python, not the CLI, which checks the config first): 8 rows in 2
    microbatches of 4 over data 8 would compile with every device given every row of a microbatch, so tracing the
    step refuses, in one line, before compiling."""
    cfg = tiny_config(data={"batch_size": 8, "microbatches": 2})
    layout = MeshLayout(data=8)
    program = Program(cfg, build_mesh(layout), layout)
    state, batch = program.init(), program.device_batch(random_batch(0))
    with pytest.raises(LayoutError, match=r"microbatch size 4 .* not divisible by replica x data x fsdp x expert = 8"):
        program.train_step(state, batch)
