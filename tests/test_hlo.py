"""sharding.hlo on HLO text in the forms XLA's GPU and TPU compilers print: loop trip counts (annotated, or read from
a TPU loop's condition), collectives (async tuples, all-to-all's included, TPU's mesh replica groups,
reduce-scatter's input), kernels."""

from sharding.hlo import Collective, collectives, computation_runs, custom_kernels

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
