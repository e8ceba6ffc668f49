"""Eight simulated CPU devices, set before JAX initializes, so mesh code is exercised on any machine.

One persistent compilation cache for the whole session (also inherited by the experiments tests run as
subprocesses): many tests build the same tiny programs, and a cache hit replaces a compile of seconds.
"""

import atexit
import os
import shutil
import tempfile

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
