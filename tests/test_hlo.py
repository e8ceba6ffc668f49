"""sharding.hlo on HLO text in the forms XLA's GPU and TPU compilers print: loop trip counts (annotated, or read from
a TPU loop's condition), collectives (async tuples, all-to-all's included, TPU's mesh replica groups,
reduce-scatter's input), kernels."""

from sharding.hlo import PRODUCTS, Collective, collectives, computation_runs, custom_kernels, kernel_kinds, traffic

LOOP = """HloModule m

%cond (p: (s32[], f32[8])) -> pred[] {
  %c = s32[]{:T(128)} constant(12)
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %c), direction=LT
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ag = bf16[64,256]{1,0:T(8,128)(2,1)} all-reduce(%x), replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}
  %g = (bf16[8,16]{1,0}, bf16[64,16]{1,0}) all-gather-start(%x), replica_groups=[2,8]<=[16], dimensions={0}
  %rs = ((f32[64], f32[128]), (f32[8], f32[16])) reduce-scatter-start(%x), replica_groups={{0,1,2,3,4,5,6,7}}
  %k = f32[8]{0} custom-call(%x), custom_call_target="tpu_custom_call"
  ROOT %t = (s32[], f32[8]) tuple(%i, %x)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %w = (s32[], f32[8]) while(%t0), condition=%cond, body=%body
  %s = f32[4]{0} reduce-scatter(%a), replica_groups=[1,2]<=[2], dimensions={0}
  %cp = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%a), source_target_pairs={{0,1},{1,0}}
  %aa = ((bf16[4,32,8]{2,1,0}), bf16[4,32,8]{2,1,0}) all-to-all-start(%a), replica_groups={{0,1,2,3}}, dimensions={0}
  %z = f32[8]{0} custom-call(%a), custom_call_target="AllocateBuffer"
  ROOT %r = f32[8]{0} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton"
}
"""


def test_a_tpu_loop_without_a_trip_count_runs_as_often_as_its_condition_bounds_it():
    _, runs = computation_runs(LOOP)
    assert runs["body"] == 12 and runs["main"] == 1
    annotated = LOOP.replace("body=%body", 'body=%body, backend_config={"known_trip_count":{"n":"5"}}')
    assert computation_runs(annotated)[1]["body"] == 5


def test_collectives_are_counted_per_step_with_the_bytes_of_their_arrays():
    got = {(c.kind, c.group): c for c in collectives(LOOP)}
    # TPU: a tuple-less all-reduce over the mesh axis of size 4, twelve times
    assert got["all-reduce", 4] == Collective("all-reduce", 4, 12, 12 * 64 * 256 * 2)
    # an async all-gather's output (the tuple's second half), iota groups of 8
    assert got["all-gather", 8] == Collective("all-gather", 8, 12, 12 * 64 * 16 * 2)
    # an async reduce-scatter's inputs (the first half), listed groups of 8; a sync one's output times the group
    assert got["reduce-scatter", 8].bytes == 12 * (64 + 128) * 4
    assert got["reduce-scatter", 2] == Collective("reduce-scatter", 2, 1, 4 * 4 * 2)
    assert got["collective-permute", 2] == Collective("collective-permute", 2, 1, 8 * 4)
    # an async all-to-all (GPU): ((operand), output), counted once
    assert got["all-to-all", 4] == Collective("all-to-all", 4, 1, 4 * 32 * 8 * 2)


def test_fp8_and_integer_arrays_count_their_own_width():
    text = LOOP.replace("bf16[64,256]{1,0:T(8,128)(2,1)} all-reduce", "f8e4m3fn[64,256]{1,0} all-reduce")
    assert {(c.kind, c.group): c for c in collectives(text)}["all-reduce", 4].bytes == 12 * 64 * 256


def test_kernels_are_named_and_xla_s_own_custom_calls_left_out():
    assert custom_kernels(LOOP) == {"Mosaic (Pallas TPU)": 1, "Triton (Pallas GPU)": 1}


STEP = """HloModule m

%fused_slice (p0: f32[4,256], p1: s32[]) -> f32[256] {
  %p0 = f32[4,256]{1,0} parameter(0)
  ROOT %big_inside = f32[4,256]{1,0} add(%p0, %p0)
}

%body (p: (s32[], f32[4,256], bf16[4,64])) -> (s32[], f32[4,256], bf16[4,64]) {
  %p = (s32[], f32[4,256], bf16[4,64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %stack = f32[4,256]{1,0} get-tuple-element(%p), index=1
  %saved = bf16[4,64]{1,0} get-tuple-element(%p), index=2
  %layer = f32[256]{0} fusion(%stack, %i), kind=kLoop, calls=%fused_slice
  %q = f8e4m3fn[64]{0} fusion(%layer), kind=kLoop, calls=%fused_slice
  %mm.3 = bf16[64]{0} custom-call(%q, %q), custom_call_target="mosaic_gpu_v2"
  %loop_dynamic_update_slice_fusion.7 = bf16[4,64]{1,0} fusion(%saved, %mm.3, %i), kind=kLoop, calls=%fused_slice
  ROOT %t = (s32[], f32[4,256], bf16[4,64]) tuple(%i, %stack, %loop_dynamic_update_slice_fusion.7)
}

ENTRY %main (a: f32[4,256]) -> f32[4,256] {
  %a = f32[4,256]{1,0} parameter(0)
  %w = (s32[], f32[4,256], bf16[4,64]) while(%a), body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %gemm_fusion.2 = f32[8,8]{1,0} fusion(%a), kind=kCustom, calls=%fused_slice, backend_config={"kind":"__triton_gemm"}
  ROOT %copy.1 = f32[4,256]{1,0} copy(%a)
}
"""


def test_traffic_counts_each_kernel_s_operands_and_results_per_run():
    """Per step: a layer's slice of a stacked buffer counts as the slice, an in-place update as what it writes and
    reads, products (custom kernels, XLA's GEMMs) under one label, a fusion's insides not at all."""
    t = traffic(STEP)
    assert t["layer"] == 4 * (1024 + 1024 + 4)  # the 4 KiB stack of 4 layers read as one 1 KiB layer, and i
    assert t["q"] == 4 * (64 + 1024)  # a reduction's operand counts whole
    assert t[PRODUCTS] == 4 * (128 + 2 * 64) + (256 + 4096)  # mosaic_gpu_v2 in the loop, the GEMM fusion once
    assert t["loop_dynamic_update_slice_fusion"] == 4 * 2 * (128 + 4)  # the 128-byte row and the index, not the stack
    assert t["copy"] == 2 * 4096 and "big_inside" not in t and "t" not in t


def test_a_pallas_kernel_s_kind_carries_the_name_jax_wrote_into_its_op_name():
    """The three Mosaic attention kernels are one kind by custom call; their body functions' names, in the op_name
    past jax's transforms and the shard_map around them, tell them apart in a profile."""
    named = STEP.replace(
        'custom_call_target="mosaic_gpu_v2"',
        'custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(step)/transpose(jvp())/attention_dq/mpmd_map"}',
    )
    assert kernel_kinds(named)["mm.3"] == "Mosaic GPU (Pallas) attention_dq"
    bare = STEP.replace(
        'custom_call_target="mosaic_gpu_v2"',
        'custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(step)/jvp()/mpmd_map"}',
    )
    assert kernel_kinds(bare)["mm.3"] == "Mosaic GPU (Pallas)"  # nothing past the wrappers
    assert traffic(named) == traffic(STEP)  # traffic keeps one kind for every product


def test_kernel_kinds_name_every_launch_and_tell_the_products_apart():
    """Each instruction outside a fusion's insides that launches a kernel, by kind: a Pallas kernel and XLA's GEMM
    fusion each their own (not ``PRODUCTS``), the rest without its number; control flow and tuples launch none."""
    assert kernel_kinds(STEP) == {
        "layer": "layer",
        "q": "q",
        "mm.3": "Mosaic GPU (Pallas)",
        "loop_dynamic_update_slice_fusion.7": "loop_dynamic_update_slice_fusion",
        "gemm_fusion.2": "XLA GEMM fusion",
        "copy.1": "copy",
    }


def test_kernels_inside_a_gpu_command_buffer_still_count():
    """On a GPU, XLA puts runs of kernels into a CUDA graph: a ``call`` of a ``command_buffer`` computation. Its
    kernels are launched all the same: the step keeps its kinds and its bytes, and the call launches none."""
    kernels = STEP[STEP.index("  %gemm_fusion.2") : STEP.rindex("}")]  # the entry's last two instructions
    gathered = STEP.replace(kernels, "  ROOT %call.9 = f32[4,256]{1,0} call(%a), to_apply=%command_buffer\n") + (
        "\n%command_buffer (a: f32[4,256]) -> f32[4,256] {\n  %a = f32[4,256]{1,0} parameter(0)\n" + kernels + "}\n"
    )
    assert "command_buffer" in gathered
    assert kernel_kinds(gathered) == kernel_kinds(STEP)
    assert traffic(gathered) == traffic(STEP)
