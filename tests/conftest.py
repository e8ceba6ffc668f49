"""Eight simulated CPU devices, set before JAX initializes, so mesh code is exercised on any machine."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
