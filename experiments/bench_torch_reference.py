"""The PyTorch yardstick for bench_train: the same gpt-bench shape as a nanoGPT-style model in plain PyTorch.

    pip install torch && python -m experiments.bench_torch_reference [--compile]

torch is not a jaxlm dependency; this module exists so the comparison in the README can be rerun on any machine.
Model: tied 8192 vocab, 6 layers, d 384, 6 heads, 4x GELU MLP (nanoGPT's block, learned positions), seq 256,
batch 16, float32, AdamW. It measures torch.mm's 2048^2 float32 peak and the train step in the same run, and
reports model FLOP/s with the same 6N + 12*L*H*E*T convention as bench_train. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from experiments.cli import exit_with


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench_torch_reference",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--windows", type=int, default=3)
    args = p.parse_args(argv)
    try:
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
    except ImportError:
        print("bench_torch_reference: error: torch is not installed (pip install torch)", file=sys.stderr)
        return 2

    V, L, D, H, T, B = 8192, 6, 384, 6, 256, 16

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D, bias=False), nn.LayerNorm(D, bias=False)
            self.qkv, self.proj = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)
            self.fc, self.out = nn.Linear(D, 4 * D, bias=False), nn.Linear(4 * D, D, bias=False)

        def forward(self, x):
            q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
            q, k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
            x = x + self.proj(y)
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.ln_f = nn.LayerNorm(D, bias=False)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(T))
            for block in self.blocks:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.weight.T
            return F.cross_entropy(logits.view(-1, V), targets.view(-1))

    torch.manual_seed(0)
    model = GPT()
    n_params = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fwd = torch.compile(model) if args.compile else model
    idx, tgt = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))

    def step():
        loss = fwd(idx, tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    torch.mm(a, b)
    peak = max(2 * 2048**3 / _timed(lambda: torch.mm(a, b)) for _ in range(5))
    t0 = time.perf_counter()
    step()
    compile_s = time.perf_counter() - t0
    best = min(_timed(lambda: [step() for _ in range(args.steps)]) / args.steps for _ in range(args.windows))
    flops_per_token = 6 * n_params + 12 * L * D * T
    tokens_per_s = B * T / best
    gflops = tokens_per_s * flops_per_token / 1e9
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, compile={args.compile}")
    print(
        f"params {n_params / 1e6:.2f}M, {flops_per_token / 1e6:.1f} MFLOP/token; torch.mm peak {peak / 1e9:.1f} GFLOP/s"
    )
    print(
        f"step {best:.3f}s, {tokens_per_s:.0f} tokens/s, {gflops:.1f} model GFLOP/s, MFU {gflops * 1e9 / peak:.3f} "
        f"(first step incl. compile {compile_s:.1f}s)"
    )
    print(
        json.dumps(
            {
                "tokens_per_s": round(tokens_per_s, 1),
                "model_gflops_per_s": round(gflops, 2),
                "peak_gflops_per_s": round(peak / 1e9, 2),
                "mfu": round(gflops * 1e9 / peak, 4),
                "compile": args.compile,
                "torch": torch.__version__,
            }
        )
    )
    return 0


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    exit_with(main())
