"""Pallas kernels (block-sparse attention, low-precision matmuls) with their masks, references and custom_vjp
wrappers. Imports nothing from jaxlm; jaxlm.attention picks an implementation from here by config."""
