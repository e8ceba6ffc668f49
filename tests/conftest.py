"""Eight simulated CPU devices, set before JAX initializes, so mesh code is exercised on any machine.

One persistent compilation cache for the whole session (also inherited by the experiments tests run as
subprocesses): many tests build the same tiny programs, and a cache hit replaces a compile of seconds.
"""

import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxlm-test-compilation-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# The suite's programs are tiny, so compiling dominates: without LLVM's optimizations XLA:CPU compiles about twice
# as fast (tests/test_model.py + test_train.py: 109 -> 56 s of CPU time; the suite 14.9 -> 10.5 min on 2 cores).
# What a program computes is XLA's HLO, which this flag leaves alone; only float rounding order may move.
# XLA:CPU's MLIR fusion emitters compile each fusion through a pipeline of their own; its older LLVM IR emitters
# compute the same fusions and compile them faster (49 model and attention tests: 80 -> 47 s on 2 cores, 2026-11-27).
for flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"):
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


# The longest tests (15-60 s each on 2 cores: deviceless compiles, runs of several processes), in two groups of
# about equal time, tests that share a session fixture in one group. xdist's worksteal gives one worker the first
# half of the collection and the other the second; each half starts with one group, so neither worker begins a long
# test while the other has nothing left to do (with them where they fell, the run's tail was ~45 s of one worker).
LONG_FIRST = (
    (
        "tests/test_gpu_compile.py::test_every_kernel_compiles_for_h100",
        "tests/test_multihost.py::test_sigterm_to_one_process",
        "tests/test_multihost.py::test_data_parallel_two_processes_match_one",
        "tests/fault_injection/test_fault_injection.py::test_fault_then_rerun_continues_exactly",
        "tests/test_cli.py::test_tiny_run_end_to_end_then_resume",
        "tests/test_moe.py::test_moe_stages_equal_one_device",
    ),
    (
        "tests/test_tpu_compile.py::test_every_attention_kernel_and_matmul_compiles_for_v5p",
        "tests/test_compile_at_scale.py::test_an_moe_step_compiles",
        "tests/test_compile_at_scale.py::test_a_1b_llama_step_compiles_and_fits",
        "tests/test_mosaic_attention.py::test_document_and_position_slots_per_batch_row",
        "tests/test_mosaic_attention.py::test_compiles_for_h100_with_tma_wgmma",
        "tests/test_diloco_processes.py::test_two_replica_processes_train_like_two_replicas",
        "tests/test_cli.py::test_pipeline_layout_end_to_end_and_resume_under_another_layout",
    ),
)


@pytest.hookimpl(trylast=True)  # after `-m` has deselected the slow tests: the halves are of what runs
def pytest_collection_modifyitems(config, items):
    groups = [[item for item in items if item.nodeid.startswith(prefixes)] for prefixes in LONG_FIRST]
    long = {id(item) for group in groups for item in group}
    rest = [item for item in items if id(item) not in long]
    split = max(len(items) // 2 - len(groups[0]), 0)  # where the second worker's half begins, less the first group
    items[:] = groups[0] + rest[:split] + groups[1] + rest[split:]
