"""What a compiled program does per step, read from its optimized HLO text: how often each computation runs, the
collectives it issues (kind, count, bytes, group size) and the custom kernels it calls (Pallas / Mosaic, cuDNN).

Why from the HLO: the collectives are XLA's decision, not the planner's, and checking a layout before renting a
cluster means seeing what XLA will actually send. A loop body's instructions run ``known_trip_count`` times per run
of the loop (a scanned stack of layers: once per layer), so per-step counts multiply along the call graph.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter

_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*?^}$", re.M | re.S)
_CALLS = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8e\w+)\[([\d,]*)\]")
_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT )?%[\w.\-]+ = (.*?) (all-gather|all-reduce|reduce-scatter|all-to-all|ragged-all-to-all"
    r"|collective-permute|collective-broadcast)(-start)?\((.*)$",
    re.M,
)
_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')
_ITEMSIZE = {"pred": 1, "bf16": 2, "f16": 2, "f32": 4, "f64": 8}

#: custom-call targets -> what a report calls them
KERNELS = {
    "tpu_custom_call": "Mosaic (Pallas TPU)",
    "__gpu$xla.gpu.triton": "Triton (Pallas GPU)",
    "mosaic_gpu": "Mosaic GPU (Pallas)",
    "mosaic_gpu_v2": "Mosaic GPU (Pallas)",
    "__cudnn$fmhaSoftmax": "cuDNN attention",
    "__cudnn$fmhaSoftmaxBackward": "cuDNN attention",
}


def computation_runs(hlo_text: str) -> tuple[dict[str, str], dict[str, int]]:
    """(computation name -> its text, computation name -> runs per run of the program).

    A computation runs as often as its callers do; a while loop's body ``known_trip_count`` times more, or where XLA
    does not annotate it (TPU), the bound its condition compares a counter with (``i < N``: a scan from 0). A loop
    whose count neither says counts once, so counts are then lower bounds."""
    computations = {m.group(1): m.group(0) for m in _COMPUTATION.finditer(hlo_text)}
    entry = re.search(r"^ENTRY %([\w.\-]+)", hlo_text, re.M)
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    runs = {name: 0 for name in computations}
    runs[entry.group(1)] = 1
    for name in _callee_order(computations, entry.group(1)):
        for line in computations[name].splitlines():
            trips = _trip_count(line, computations)
            for key, callee in callees(line):
                if callee in runs:
                    runs[callee] += runs[name] * (trips if key == "body" else 1)
    return computations, runs


def _trip_count(line: str, computations: dict[str, str]) -> int:
    known = _TRIP_COUNT.search(line)
    if known:
        return int(known.group(1))
    condition = re.search(r"\bcondition=%([\w.\-]+)", line)
    if not condition or condition.group(1) not in computations:
        return 1
    text = computations[condition.group(1)]
    root = re.search(r"ROOT %[\w.\-]+ = pred\[\]\S* compare\(%[\w.\-]+, %([\w.\-]+)\), direction=LT", text)
    bound = root and re.search(rf"%{re.escape(root.group(1))} = s32\[\]\S* constant\((\d+)\)", text)
    return int(bound.group(1)) if bound else 1


def callees(text: str) -> list[tuple[str, str]]:
    """(attribute, computation name) for each computation the HLO text calls."""
    found = _CALLS.findall(text)
    for group in re.findall(r"branch_computations=\{([^}]*)\}", text):
        found += [("branch_computations", callee) for callee in re.findall(r"%([\w.\-]+)", group)]
    return found


def _callee_order(computations: dict[str, str], entry: str) -> list[str]:
    """Computations with every caller before its callees (the call graph of an HLO module is acyclic)."""
    edges = {name: {callee for _, callee in callees(text)} for name, text in computations.items()}
    order, seen = [], set()

    def visit(name):
        if name in seen or name not in computations:
            return
        seen.add(name)
        for callee in edges[name]:
            visit(callee)
        order.append(name)

    visit(entry)
    return order[::-1]


def _bytes(dtype: str, dims: str) -> int:
    bits = re.match(r"[a-z]+(\d+)", dtype)  # s32, u8, f8e4m3fn: the width follows the kind letters
    size = _ITEMSIZE.get(dtype) or max(1, int(bits.group(1)) // 8 if bits else 1)
    return size * math.prod(int(d) for d in dims.split(",") if d)


def _group_size(attrs: str) -> int:
    """Devices in one replica group: ``replica_groups=[G,S]<=[N]`` (iota form) or ``{{0,1},{2,3}}``."""
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
    if iota:
        return int(iota.group(2))
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", attrs)  # TPU: the mesh and the axes it spans
    if mesh:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", mesh.group(1)))
        return math.prod(int(sizes.get(axis, 1)) for axis in re.findall(r"'(\w+)'", mesh.group(2)))
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
    if listed:
        return len(listed.group(1).split(","))
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}?", attrs)
    return 2 if pairs else 0


@dataclasses.dataclass(frozen=True)
class Collective:
    """One kind of collective over one group size: how many a step issues and the bytes of their arrays (an
    all-gather's output, a reduce-scatter's input, an all-reduce's operand, an all-to-all's or a permute's buffer,
    a ragged all-to-all's output: the most it can receive, what it moves depending on the data), per device per
    step."""

    kind: str
    group: int  # devices in one group (0: not stated)
    count: int
    bytes: int


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective of one run of the program, summed by (kind, group size), largest traffic first."""
    computations, runs = computation_runs(hlo_text)
    totals: dict[tuple[str, int], list[int]] = {}
    for name, text in computations.items():
        if not runs.get(name):
            continue
        for m in _COLLECTIVE.finditer(text):
            result_type, kind, start, attrs = m.groups()
            arrays = _ARRAY.findall(result_type)
            if not arrays:
                continue
            group = _group_size(attrs)
            scale = group if kind == "reduce-scatter" and group else 1  # its result is the scattered shard
            if start and kind in ("all-gather", "reduce-scatter", "all-to-all"):  # ((operands...), (outputs...))
                half = len(arrays) // 2
                arrays, scale = (arrays[:half] if kind == "reduce-scatter" else arrays[half:]), 1
            elif start and kind == "collective-permute":  # (operand, output, contexts...)
                arrays = arrays[1:2]
            elif kind == "ragged-all-to-all":  # ((operand, output, offsets and sizes), output) or its output alone
                arrays = arrays[-1:]
            nbytes = scale * sum(_bytes(dtype, dims) for dtype, dims in arrays)  # a tuple: several arrays at once
            entry = totals.setdefault((kind, group), [0, 0])
            entry[0] += runs[name]
            entry[1] += runs[name] * nbytes
    rows = [Collective(kind, group, count, nbytes) for (kind, group), (count, nbytes) in totals.items()]
    return sorted(rows, key=lambda c: -c.bytes)


def custom_kernels(hlo_text: str) -> Counter:
    """The kernels ``KERNELS`` names, counted once per call site (XLA's own custom calls are left out)."""
    return Counter(KERNELS[target] for target in _CUSTOM_CALL.findall(hlo_text) if target in KERNELS)


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][a-z\-]*)\((.*)$")
_NO_TRAFFIC = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional",
    "after-all", "partition-id", "replica-id", "iota",
}  # fmt: skip
_GEMM = re.compile(r'"kind":"__\w*gemm\w*"')  # XLA's GEMM fusions (Triton's), by their backend config
PRODUCTS = "products"  # traffic()'s label for matrix products: custom kernels and XLA's GEMMs


def _fused(computations: dict[str, str]) -> set[str]:
    """Computations that are a fusion's or a reduction's insides: their instructions move nothing of their own. A
    ``call``'s computation is not one: its instructions launch their kernels (on a GPU, XLA gathers runs of kernels
    into a CUDA graph as a call of a ``command_buffer`` computation)."""
    inside = re.compile(r"\b(?:calls|to_apply)=%([\w.\-]+)")
    fused = set()
    for text in computations.values():
        for line in text.splitlines():
            m = _INSTRUCTION.match(line)
            if not (m and m.group(3) == "call"):
                fused.update(inside.findall(line))
    return fused


def _operand_bytes(shape: str, runs: int) -> int:
    """An operand's bytes; one whose leading dim is the number of times its loop runs (a stacked [layers, ...]
    buffer, which each run slices a layer of) counts one layer."""
    arrays = _ARRAY.findall(shape)
    whole = sum(_bytes(d, s) for d, s in arrays)
    lead = int(arrays[0][1].split(",")[0]) if len(arrays) == 1 and arrays[0][1] else 1
    return whole // lead if runs > 1 and lead == runs else whole


def traffic(hlo_text: str) -> Counter:
    """Bytes of device memory each kind of kernel reads and writes in one run of the program: every kernel XLA
    launches (a fusion, a custom call, a copy) counted as its operands plus its results, per run of its computation.
    Matrix products (the custom kernels of ``KERNELS``, XLA's GEMMs) are labelled ``PRODUCTS``; the rest by their
    name without its number (``loop_convert_fusion``, ``input_transpose_fusion``). An in-place dynamic-update-slice
    counts the slice it writes and what it reads, not the buffer; in a loop, an operand whose leading dim is the
    loop's trip count counts one slice of it (a stacked [layers, ...] buffer, of which each run reads a layer).

    Why: bytes, not FLOPs, price the work around the products (quantization, transposes into the layouts a kernel
    wants, saved residuals); two programs' totals, over the HBM bandwidth, bound how much of their time gap it
    explains. An estimate: caches, and kernels that read an operand twice, are not modelled."""
    computations, runs = computation_runs(hlo_text)
    fused = _fused(computations)
    total: Counter = Counter()
    for name, text in computations.items():
        if name in fused or not runs.get(name):
            continue
        matches = [_INSTRUCTION.match(line) for line in text.splitlines()[1:]]
        shapes = {m.group(1): m.group(2) for m in matches if m}
        for m in matches:
            if not m or m.group(3) in _NO_TRAFFIC:
                continue
            label, result, op, rest = m.groups()
            operands = re.findall(r"%([\w.\-]+)", re.split(r"\), |\)$", rest, maxsplit=1)[0])
            out = sum(_bytes(d, s) for d, s in _ARRAY.findall(result))
            ins = [_operand_bytes(shapes.get(o, ""), runs[name]) for o in operands]
            if "dynamic_update_slice" in label or op == "dynamic-update-slice":
                nbytes = 2 * (sum(ins) - max(ins, default=0))
            else:
                nbytes = out + sum(ins)
            kind = _kernel_kind(label, rest)
            total[PRODUCTS if kind in _PRODUCT_KINDS else kind] += runs[name] * nbytes
    return total


_PRODUCT_KINDS = {*KERNELS.values(), "cuBLAS product", "XLA GEMM fusion"}


def _kernel_kind(label: str, rest: str) -> str:
    """A custom kernel by what ``KERNELS`` calls it, cuBLAS's calls and XLA's GEMM fusions as such, anything else by
    its instruction name without its number (``loop_convert_fusion``, ``copy``)."""
    target = _CUSTOM_CALL.search(rest)
    kernel = target.group(1) if target else ""
    if kernel in KERNELS:
        return KERNELS[kernel]
    if kernel.startswith("__cublas"):
        return "cuBLAS product"
    if _GEMM.search(rest):
        return "XLA GEMM fusion"
    return re.sub(r"\.\d+$", "", label)


def kernel_kinds(hlo_text: str) -> dict[str, str]:
    """Instruction name -> the kind of kernel it launches (as ``traffic`` names them, products told apart), for
    every instruction outside a fusion's insides that launches one; control flow (a loop, a call) launches none. A
    Pallas kernel's kind carries its own name where jax wrote it into the op_name (its body function's, e.g.
    "Mosaic GPU (Pallas) attention_dq"): the kernels of one kind are then told apart.

    Why: a profile's events name the HLO instructions they ran, whose numbers differ from one compile to the next;
    their kinds line two programs' times up."""
    computations, _ = computation_runs(hlo_text)
    fused = _fused(computations)
    kinds = {}
    for name, text in computations.items():
        if name in fused:
            continue
        for line in text.splitlines()[1:]:
            m = _INSTRUCTION.match(line)
            if m and m.group(3) not in _NO_TRAFFIC:
                kind = _kernel_kind(m.group(1), m.group(4))
                own = _pallas_name(m.group(4)) if kind in KERNELS.values() else ""
                kinds[m.group(1)] = f"{kind} {own}" if own else kind
    return kinds


_OP_NAME = re.compile(r'op_name="([^"]*)"')
# op_name segments that are jax's transforms and wrappers around a Pallas call, not its name
_WRAPPER = re.compile(
    r"^(jit|jvp|transpose|vmap|checkpoint|remat|custom_jvp_call|custom_vjp_call)\b|^(mpmd_map|shard_map|pallas_call)$"
)


def _pallas_name(rest: str) -> str:
    """A Pallas call's name from its op_name: the last segment that is not a transform or wrapper ("" if none)."""
    m = _OP_NAME.search(rest)
    segments = [s for s in (m.group(1).split("/") if m else []) if s and not _WRAPPER.search(s)]
    return segments[-1] if segments else ""
