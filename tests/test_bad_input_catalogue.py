"""The bad-input catalogue (experiments.bad_input_catalogue): every case exits with its code in one clean line,
touches nothing it should not, leaves no scratch copy, and a rerun succeeds where the case says so; and
docs/fault_tolerance.md shows exactly what the commands print today. The default suite runs the `fast` cases (one or
more of each class: values, directories of another command, signals, a full disk); the slow test runs them all."""

import pytest

from experiments import bad_input_catalogue as catalogue
from experiments.bad_input_cases import CASES


def documented_rows() -> dict[str, str]:
    """{careless input: its table row} as docs/fault_tolerance.md shows them, machine figures masked."""
    rows = catalogue.comparable(catalogue.doc_table()).splitlines()[2:]
    return {row.split(" | ")[0].removeprefix("| "): row for row in rows}


def test_every_case_is_documented_once():
    documented = documented_rows()
    assert sorted(documented) == sorted(c.what for c in CASES), "run python -m experiments.bad_input_catalogue --write"
    assert len({c.what for c in CASES}) == len(CASES)
    classes = [c for c in CASES if c.fast]
    assert any(c.signals for c in classes) and any(c.file_limit for c in classes) and len(classes) >= 8


def test_the_fast_cases_are_clean_and_print_what_the_docs_show(tmp_path):
    results = catalogue.run_catalogue([c for c in CASES if c.fast], root=tmp_path)
    unclean = [catalogue.problems(r) for r in results if not r.ok]
    assert not unclean, unclean
    documented = documented_rows()
    for r in results:
        got = catalogue.comparable(catalogue.table([r])).splitlines()[2]
        assert got == documented[r.what], "docs/fault_tolerance.md is stale: run the catalogue with --write"


@pytest.mark.slow
def test_every_careless_input_is_one_line_and_the_docs_show_real_outputs(tmp_path):
    results = catalogue.run_catalogue(root=tmp_path)
    unclean = [catalogue.problems(r) for r in results if not r.ok]
    assert not unclean, unclean
    got, documented = catalogue.comparable(catalogue.table(results)), catalogue.comparable(catalogue.doc_table())
    assert got == documented, "docs/fault_tolerance.md is stale: run python -m experiments.bad_input_catalogue --write"
