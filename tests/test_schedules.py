"""sharding.schedules: pipeline schedules as tables. Every table passes the checker and idles exactly its formula's
share (F = B = W), holds what its schedule promises, and the checker names the first broken rule; the CLI prints the
chart and a JSON last line."""

import dataclasses
import json

import pytest

from sharding import schedule as cli
from sharding import schedules as S

CASES = [
    (name, p, m, v)
    for p in (2, 4)
    for m in (p, 2 * p, 4 * p)
    for name, v in [("gpipe", None), ("1f1b", None), ("zb-h1", None), ("zbv", None)]
    + [("interleaved-1f1b", 2), ("interleaved-1f1b", 3)]
]


@pytest.mark.parametrize("name, stages, microbatches, virtual", CASES)
def test_every_table_is_valid_and_idles_its_formula(name, stages, microbatches, virtual):
    sc = S.make(name, stages, microbatches, virtual)
    S.check(sc)
    assert sc.bubble_fraction == pytest.approx(S.theory(name, stages, microbatches, sc.chunks), abs=1e-12)
    stash = sc.peak_stash()
    if name == "gpipe":
        assert stash == [microbatches] * stages
    if name == "1f1b":
        assert stash == [min(microbatches, stages - s) for s in range(stages)]
    if name in ("zb-h1", "zbv"):  # weight gradients wait, but never more than about 1F1B's most (stage 0's)
        assert max(stash) <= min(microbatches, stages + (name == "zb-h1"))


def test_zero_bubble_schedules_cut_1f1b_s_idle_time():
    one_f_one_b, zb_h1, zbv = (S.make(n, 4, 8).bubble_fraction for n in ("1f1b", "zb-h1", "zbv"))
    assert one_f_one_b == pytest.approx(3 / 11)  # 27%
    assert zb_h1 == pytest.approx(3 / 27) and zbv == pytest.approx(3 / 51)  # 11%, 5.9%: the synchronous bound
    assert S.make("zbv", 4, 16).bubble_fraction < 0.05


def test_the_checker_names_the_first_broken_rule():
    sc = S.make("1f1b", 2, 2)
    ops = list(sc.ops)
    b0 = next(op for op in ops if op.kind == "BW" and op.stage == 0 and op.microbatch == 0)
    early = dataclasses.replace(b0, tick=2)  # before stage 1's backward of microbatch 0 has ended
    broken = dataclasses.replace(sc, ops=tuple(op if op is not b0 else early for op in ops))
    with pytest.raises(S.ScheduleError, match=r"BW of microbatch 0 on stage 0 starts before B of microbatch 0"):
        S.check(broken)
    missing = dataclasses.replace(sc, ops=tuple(op for op in ops if op is not b0))
    with pytest.raises(S.ScheduleError, match="BW of microbatch 0 on virtual stage 0 is missing"):
        S.check(missing)
    f1 = next(op for op in ops if op.kind == "F" and op.stage == 0 and op.microbatch == 1)
    clash = dataclasses.replace(sc, ops=tuple(op if op is not f1 else dataclasses.replace(f1, tick=0) for op in ops))
    with pytest.raises(S.ScheduleError, match="stage 0 runs F0 and F1 at tick 0"):
        S.check(clash)
    with pytest.raises(S.ScheduleError, match="holds 2 microbatches of activations, more than 1"):
        S.check(S.make("1f1b", 2, 4), max_stash=1)


def test_the_cli_prints_the_chart_and_json_last(capsys):
    assert cli.main(["--schedule", "zbv", "--stages", "4", "--microbatches", "8"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1].startswith("stage 0 F") and len(lines) == 1 + 4 + 2
    assert json.loads(lines[-1]) == {"bubble_fraction": 0.058824, "peak_stash": [4.0] * 4, "ticks": 51}
    assert cli.main(["--schedule", "zbv", "--stages", "4", "--microbatches", "8", "--lockstep"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "in lockstep" in lines[0] and json.loads(lines[-1])["bubble_fraction"] == 0.533981


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--schedule", "zz", "--stages", "4", "--microbatches", "8"], "schedule 'zz' is unknown"),
        (["--schedule", "interleaved-1f1b", "--stages", "4", "--microbatches", "6"], "do not divide into groups"),
        (["--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--virtual-stages", "2"], "interleaved-1f1b"),
        (["--schedule", "1f1b", "--stages", "0", "--microbatches", "8"], "must be >= 1"),
        (["--stages", "4"], "required"),
    ],
)
def test_bad_settings_are_one_line_exit_2(capsys, argv, line):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sharding.schedule: error: ") and line in err[0]


@pytest.mark.parametrize(
    "fields, line",
    [
        (dict(pipeline_schedule="zbv", pipeline_virtual_stages=2), "applies to pipeline_schedule 'interleaved-1f1b'"),
        (dict(pipeline_schedule="interleaved-1f1b", pipeline_microbatches=6), "is not a multiple of pipeline = 4"),
        (dict(pipeline_schedule="interleaved-1f1b", pipeline_virtual_stages=1), r"must be 0 \(the default\) or an int"),
        (dict(pipeline_schedule="zb-v"), "pipeline_schedule 'zb-v' is unknown; choose one of gpipe, 1f1b, interleav"),
    ],
)
def test_a_layout_names_what_its_schedule_cannot_do(fields, line):
    from sharding import LayoutError, MeshLayout

    with pytest.raises(LayoutError, match=line):
        MeshLayout(data=2, pipeline=4, **fields).validate(8)
    chunked = MeshLayout(data=2, pipeline=4, pipeline_schedule="zbv").validate(8)
    with pytest.raises(LayoutError, match=r"num_layers = 4 does not split into pipeline = 4 stages x 2 chunks \(zbv\)"):
        chunked.check_divisibility(batch_size=16, microbatches=1, num_heads=4, num_kv_heads=2, mlp_dim=64, num_layers=4)


@pytest.mark.parametrize("name", S.NAMES)
def test_a_lockstep_table_runs_one_kind_per_tick_in_each_stage_s_order(name):
    """sharding.schedules.lockstep: what a stage holding ring attention's ppermute runs. GPipe, 1F1B and interleaved
    keep their idle share; the zero-bubble tables lose what filling the gaps with W gained."""
    table = S.make(name, 4, 8)
    locked = S.lockstep(table)
    S.check(locked)
    assert locked.lockstep and not table.lockstep
    assert all(len({op.kind for op in locked.ops if op.tick == t}) <= 1 for t in range(locked.ticks))

    def order(sc, s, kind):
        return [
            (op.chunk, op.microbatch) for op in sorted(sc.ops, key=lambda o: o.tick) if (op.stage, op.kind) == (s, kind)
        ]

    for s in range(4):  # each kind in the table's order on every stage
        assert all(order(locked, s, k) == order(table, s, k) for k in ("F", "B", "W", "BW"))
    if name in ("gpipe", "1f1b", "interleaved-1f1b"):
        assert locked.bubble_fraction == pytest.approx(table.bubble_fraction)
    else:
        assert locked.bubble_fraction > table.bubble_fraction
    assert S.forward_pass(locked).lockstep
