"""The Pallas kernels lower for TPU (Mosaic) on CPU with jax.export, forward + backward: this catches what interpret
mode cannot (Mosaic layout and memory-space rules). For the GPU the kernels are compiled, not only lowered, for an
H100 in tests/test_gpu_compile.py; here only the GPU lowering inside a user's shard_map is checked."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels import (
    BlockSizes,
    alibi,
    alibi_slopes,
    block_sparse_attention,
    causal,
    document,
    make_block_mask,
    sliding_window,
    soft_cap,
)

B, H, HKV, T, D = 2, 4, 2, 384, 128


@pytest.fixture
def tpu_target(monkeypatch):
    """Mosaic asks the default device for its TPU generation; on CPU, say it is a v5p."""
    try:
        from jax._src.pallas.mosaic import tpu_info

        info = tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5P, 1)
    except (ImportError, AttributeError) as e:  # the private hook moved: nothing to lower against
        pytest.skip(f"this jax has no TPU info registry to target a TPU from CPU: {e}")
    monkeypatch.setitem(tpu_info.registry, jax.devices()[0].device_kind, lambda: info)


def lower(platform, backend, mask, **kw):
    bm = make_block_mask(mask, T, T, BlockSizes(128, 128))

    def loss(q, k, v):
        out, lse = block_sparse_attention(q, k, v, bm, interpret=False, backend=backend, **kw)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

    q = jax.ShapeDtypeStruct((B, H, T, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, HKV, T, D), jnp.bfloat16)
    exported = export.export(
        jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))),
        platforms=[platform],
        disabled_checks=[
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton"),
            export.DisabledSafetyCheck.custom_call("tpu_custom_call"),
        ],
    )(q, kv, kv)
    return exported.mlir_module()


MASKS = {
    "causal": (causal(), {}),
    "sliding+softcap": (sliding_window(200), {"score_mod": soft_cap(30.0)}),
    "document+alibi": (
        causal() & document(np.repeat(np.arange(3), T // 3)[None].repeat(B, 0)),
        {"score_mod": alibi(alibi_slopes(H))},
    ),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_lowers_for_tpu_mosaic(tpu_target, name):
    mask, kw = MASKS[name]
    text = lower("tpu", "tpu", mask, **kw)
    assert text.count("@tpu_custom_call") == 3


@pytest.mark.parametrize("lowering, target", [("triton", "__gpu$xla.gpu.triton"), ("mosaic", "mosaic_gpu_v2")])
def test_lowers_for_gpu_under_shard_map(lowering, target):
    """Per-shard kernels inside a user's shard_map (check_vma=True): outputs are typed as varying like q, from the
    Triton kernels and from the Mosaic GPU ones (whose results jax 0.10 returns without the axes)."""
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    bm = make_block_mask(causal(), T, T, BlockSizes(128, 128))
    attn = jax.shard_map(
        lambda q, k, v: block_sparse_attention(q, k, v, bm, interpret=False, backend="gpu", lowering=lowering)[0],
        mesh=mesh,
        in_specs=(P("data", "tensor"),) * 3,
        out_specs=P("data", "tensor"),
    )
    x = jax.ShapeDtypeStruct((B, H, T, D), jnp.bfloat16)
    grad = jax.jit(jax.grad(lambda q, k, v: attn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    exported = export.export(
        grad, platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call(target)]
    )(x, x, x)
    assert exported.mlir_module().count(target) == 3


QUANT_CASES = {  # x dtype, x scale shape, w dtype, w scale shape, k_block
    "int8 per channel": (jnp.int8, (512, 1), jnp.int8, (1, 768), None),
    "fp8 per tensor": (jnp.float8_e4m3fn, (1, 1), jnp.float8_e4m3fn, (1, 1), None),
    "fp8 e5m2 x e4m3 blockwise": (jnp.float8_e5m2, (512, 8), jnp.float8_e4m3fn, (8, 768), 128),
    "int8 weight-only": (jnp.bfloat16, None, jnp.int8, (1, 768), None),
}


@pytest.mark.parametrize("platform, backend, marker", [("tpu", "tpu", "@tpu_custom_call")])
@pytest.mark.parametrize("case", list(QUANT_CASES))
def test_quantized_matmul_lowers(tpu_target, platform, backend, marker, case):
    from pallas_kernels.quantized_matmul import scaled_matmul

    x_dtype, xs_shape, w_dtype, ws_shape, k_block = QUANT_CASES[case]
    M, K, N = 512, 1024, 768

    def matmul(x, xs, w, ws):
        return scaled_matmul(
            x, xs, w, ws, k_block=k_block, impl="pallas", interpret=False, backend=backend, out_dtype=jnp.bfloat16
        )

    args = (
        jax.ShapeDtypeStruct((M, K), x_dtype),
        None if xs_shape is None else jax.ShapeDtypeStruct(xs_shape, jnp.float32),
        jax.ShapeDtypeStruct((K, N), w_dtype),
        jax.ShapeDtypeStruct(ws_shape, jnp.float32),
    )
    exported = export.export(
        jax.jit(matmul),
        platforms=[platform],
        disabled_checks=[
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton"),
            export.DisabledSafetyCheck.custom_call("tpu_custom_call"),
        ],
    )(*args)
    assert exported.mlir_module().count(marker) == 1
