"""bench_loader's contract on a small dataset: the table, the JSON line, and the loader's targets."""

import json

import pytest

from experiments import bench_loader


@pytest.mark.slow  # the loader it times: test_loader.py, test_cache_plan.py, test_peers.py (docs/testing.md)
def test_bench_loader_small(capsys):
    assert (
        bench_loader.main(
            [
                "--samples",
                "3000",
                "--epochs",
                "2",
                "--batch",
                "32",
                "--latency-ms",
                "2",
                "--workers",
                "16",
                "--procs",
                "2",
                "--peer-samples",
                "1600",
                "--peer-epochs",
                "3",
                "--model-samples",
                "1024",
                "--skip-train",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "Belady" in out and "grain DataLoader" in out
    summary = json.loads(out.strip().splitlines()[-1])
    for fraction in (10, 25, 50, 100):
        assert summary[f"hit_vs_belady_{fraction}"] >= 0.99
    assert summary["hit_vs_lru_25"] >= 5
    for fraction, c in ((25, 0.25), (50, 0.5), (100, 1.0)):
        assert summary[f"peers_hit_{fraction}"] >= 0.95 * c
    # the timing model: where it predicts the tiers keep up, stalls are small; where not, they are not
    assert summary["model_fast_keeps_up"] and summary["model_fast_stall_frac"] <= 0.05
    assert not summary["model_slow_keeps_up"] and summary["model_slow_stall_frac"] > 0.05
