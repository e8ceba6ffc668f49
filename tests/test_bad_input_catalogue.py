"""The bad-input catalogue (experiments.bad_input_catalogue): every case exits with its code in one clean line, and
docs/fault_tolerance.md shows exactly what the commands print today."""

from experiments import bad_input_catalogue as catalogue


def test_every_careless_input_is_one_line_and_the_docs_show_real_outputs(tmp_path):
    results = catalogue.run_catalogue(root=tmp_path)
    unclean = [(r.what, r.code, r.lines, r.line) for r in results if not r.ok]
    assert not unclean, unclean
    assert len(results) == len(catalogue.CASES) >= 20
    got, documented = catalogue.comparable(catalogue.table(results)), catalogue.comparable(catalogue.doc_table())
    assert got == documented, "docs/fault_tolerance.md is stale: run python -m experiments.bad_input_catalogue --write"
