"""Memory before compiling: a step the planner's estimate says cannot fit is refused in one line naming the
estimate, the memory there is and the knobs; the default config fits this machine."""

import subprocess
import sys

import pytest
from helpers import tiny_config

from jaxlm.config import ConfigError, apply_overrides
from jaxlm.memory_check import check_step_fits, device_memory_bytes, estimated_step_bytes
from sharding import MeshLayout


def test_a_step_too_big_is_refused_naming_estimate_memory_and_knobs():
    cfg = tiny_config()
    need = estimated_step_bytes(cfg, MeshLayout(data=1))
    check_step_fits(cfg, MeshLayout(data=1), available=(need * 1.01, "the test device has"))
    with pytest.raises(ConfigError) as info:
        check_step_fits(cfg, MeshLayout(data=1), available=(need * 0.5, "the test device has"))
    message = str(info.value)
    assert f"needs about {need / 2**30:.1f} GiB per device" in message and "the test device has" in message
    for knob in ("data.batch_size", "data.seq_len", "data.microbatches", "model.remat=full", "--mesh"):
        assert knob in message


def test_the_estimate_follows_the_knobs():
    cfg = tiny_config()
    base = estimated_step_bytes(cfg, MeshLayout(data=1))
    longer = apply_overrides(cfg, [f"data.seq_len={cfg.data.seq_len * 4}", f"model.max_seq_len={cfg.data.seq_len * 4}"])
    assert estimated_step_bytes(longer, MeshLayout(data=1)) > base
    assert estimated_step_bytes(apply_overrides(cfg, ["model.remat=full"]), MeshLayout(data=1)) < base
    assert estimated_step_bytes(cfg, MeshLayout(fsdp=2)) < base


def test_this_machine_reports_its_memory():
    limit, where = device_memory_bytes()
    assert limit > 2**28 and "host" in where


def test_a_sequence_far_beyond_memory_exits_2_before_compiling(tmp_path):
    huge = 1 << 20
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.tiny_lm",
            "--workdir",
            str(tmp_path),
            "--steps",
            "1",
            "--set",
            f"data.seq_len={huge}",
            "--set",
            f"model.max_seq_len={huge}",
            "--set",
            "data.path=" + str(_long_token_file(tmp_path / "data", huge)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "the train step needs about" in last and "GiB per device" in last, last
    assert "compiled" not in proc.stderr


def _long_token_file(path, n):
    import numpy as np

    from data.token_file import write_token_file

    tokens = np.random.default_rng(0).integers(0, 256, 40 * n).astype(np.int32)
    write_token_file(path, [tokens], vocab_size=257, tokenizer="bytes")
    return path
