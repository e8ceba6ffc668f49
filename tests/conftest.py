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

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
