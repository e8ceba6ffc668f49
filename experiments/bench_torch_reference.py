"""The PyTorch yardstick for bench_train: the gpt-bench shape as nanoGPT's model, in plain PyTorch, initialised as
nanoGPT initialises it.

    pip install torch && python -m experiments.bench_torch_reference [--compile] [--nanogpt DIR]

torch is not a jaxlm dependency; this module exists so the comparison in the README can be rerun on any machine.
Model: tied 8192 vocab, 6 layers, d 384, 6 heads, 4x GELU MLP (nanoGPT's block, learned positions, no biases), seq
256, batch 16, float32, AdamW. Weights are drawn as nanoGPT draws them: normal(0, 0.02), the residual projections
normal(0, 0.02 / sqrt(2 L)). PyTorch's own defaults (an N(0, 1) embedding tied to the head) make float32 denormals in
the backward, which x86 runs at a fraction of normal speed: the peer ran at half nanoGPT's speed with them (issue 38).
It measures torch.mm's 2048^2 float32 peak and the train step in the same run, and reports model FLOP/s with the
same 6N + 12*L*H*E*T convention as bench_train. `--nanogpt DIR` (a checkout of karpathy/nanoGPT) also times
nanoGPT's own model.py on the same shape in this run and prints this yardstick's speed over it. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from experiments.cli import exit_with

V, L, D, H, T, B = 8192, 6, 384, 6, 256, 16


def build_model(torch, nanogpt_init: bool = True):
    """The yardstick, initialised as nanoGPT's GPT is, or with PyTorch's defaults (the slow peer of before issue 38,
    for comparison). torch is passed in: it is imported only when used."""
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D, bias=False), nn.LayerNorm(D, bias=False)
            self.qkv, self.proj = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)
            self.fc, self.out = nn.Linear(D, 4 * D, bias=False), nn.Linear(4 * D, D, bias=False)

        def forward(self, x):
            b, t = x.shape[:2]
            q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
            q, k, v = (y.view(b, t, H, D // H).transpose(1, 2) for y in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D)
            x = x + self.proj(y)
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.ln_f = nn.LayerNorm(D, bias=False)
            if nanogpt_init:
                self._init_as_nanogpt()

        def _init_as_nanogpt(self):
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, mean=0.0, std=0.02)
            for block in self.blocks:  # the projections into the residual stream: GPT-2's scaled init
                for residual in (block.proj, block.out):
                    nn.init.normal_(residual.weight, mean=0.0, std=0.02 / math.sqrt(2 * L))

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for block in self.blocks:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.weight.T
            return F.cross_entropy(logits.view(-1, V), targets.view(-1))

    return GPT()


def denormals_in_training(torch, model, idx, tgt, steps: int = 3) -> dict:
    """Float32 denormals (non-zero, below the smallest normal) in every activation and every gradient of the last
    of `steps` AdamW steps (as the benchmark times them: they appear as training moves the weights), and the first
    step's loss: {"activations": n, "gradients": n, "loss": first loss}."""
    import warnings

    tiny = torch.finfo(torch.float32).tiny
    count = lambda t: int(((t != 0) & (t.abs() < tiny)).sum()) if t.dtype == torch.float32 else 0
    found = {"activations": 0, "gradients": 0}

    def on_forward(module, inputs, output):
        for t in output if isinstance(output, tuple) else (output,):
            if isinstance(t, torch.Tensor):
                found["activations"] += count(t.detach())

    def on_backward(module, grad_inputs, grad_outputs):
        for t in (*grad_inputs, *grad_outputs):
            if isinstance(t, torch.Tensor):
                found["gradients"] += count(t)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for i in range(steps):
        hooks = []
        if i == steps - 1:
            hooks = [m.register_forward_hook(on_forward) for m in model.modules()]
            hooks += [m.register_full_backward_hook(on_backward) for m in model.modules() if m is not model]
        try:
            with warnings.catch_warnings():  # the embedding's inputs are ids: no gradient, which the hook warns of
                warnings.simplefilter("ignore", UserWarning)
                loss = model(idx, tgt)
                opt.zero_grad(set_to_none=True)
                loss.backward()
        finally:
            for hook in hooks:
                hook.remove()
        losses.append(float(loss.detach()))
        if i < steps - 1:
            opt.step()
    found["gradients"] += sum(count(p.grad) for p in model.parameters() if p.grad is not None)
    return found | {"loss": losses[0]}


def nanogpt_model(torch, directory: str):
    """karpathy/nanoGPT's own GPT (its model.py from `directory`) on the same shape; forward(idx, targets) -> loss."""
    sys.path.insert(0, directory)
    try:
        from model import GPT, GPTConfig
    finally:
        sys.path.remove(directory)
    gpt = GPT(GPTConfig(block_size=T, vocab_size=V, n_layer=L, n_head=H, n_embd=D, dropout=0.0, bias=False))

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt = gpt

        def forward(self, idx, targets):
            return self.gpt(idx, targets)[1]

    return Loss()


def time_training(torch, model, *, compile: bool, steps: int, windows: int) -> dict:
    """AdamW steps on one fixed batch: the first step's seconds (compilation included) and the best window's."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fwd = torch.compile(model) if compile else model
    gen = torch.Generator().manual_seed(0)
    idx, tgt = torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B, T), generator=gen)

    def step():
        loss = fwd(idx, tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    t0 = time.perf_counter()
    first_loss = float(step())
    first_s = time.perf_counter() - t0
    best = min(_timed(lambda: [step() for _ in range(steps)]) / steps for _ in range(windows))
    return {"step_s": best, "tokens_per_s": B * T / best, "first_s": first_s, "first_loss": first_loss}


def torch_matmul_peak(torch, n: int = 2048, repeats: int = 5) -> float:
    """Best-of-`repeats` float32 torch.mm throughput, FLOP/s."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    return max(2 * n**3 / _timed(lambda: torch.mm(a, b)) for _ in range(repeats))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench_torch_reference",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--nanogpt", metavar="DIR", help="a karpathy/nanoGPT checkout: also time its model.py")
    p.add_argument(
        "--torch-init", action="store_true", help="PyTorch's default init (the slow peer before issue 38), to compare"
    )
    args = p.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("bench_torch_reference: error: torch is not installed (pip install torch)", file=sys.stderr)
        return 2

    torch.manual_seed(0)
    model = build_model(torch, nanogpt_init=not args.torch_init)
    n_params = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    peak = torch_matmul_peak(torch)
    r = time_training(torch, model, compile=args.compile, steps=args.steps, windows=args.windows)
    flops_per_token = 6 * n_params + 12 * L * D * T
    gflops = r["tokens_per_s"] * flops_per_token / 1e9
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, compile={args.compile}")
    print(
        f"params {n_params / 1e6:.2f}M, {flops_per_token / 1e6:.1f} MFLOP/token; torch.mm peak {peak / 1e9:.1f} GFLOP/s"
    )
    print(
        f"step {r['step_s']:.3f}s, {r['tokens_per_s']:.0f} tokens/s, {gflops:.1f} model GFLOP/s, MFU "
        f"{gflops * 1e9 / peak:.3f} (first step incl. compile {r['first_s']:.1f}s, loss {r['first_loss']:.3f})"
    )
    summary = {
        "tokens_per_s": round(r["tokens_per_s"], 1),
        "model_gflops_per_s": round(gflops, 2),
        "peak_gflops_per_s": round(peak / 1e9, 2),
        "mfu": round(gflops * 1e9 / peak, 4),
        "compile": args.compile,
        "init": "torch defaults" if args.torch_init else "nanoGPT",
        "torch": torch.__version__,
    }
    if args.nanogpt:
        torch.manual_seed(0)
        theirs = time_training(
            torch, nanogpt_model(torch, args.nanogpt), compile=args.compile, steps=args.steps, windows=args.windows
        )
        ratio = r["tokens_per_s"] / theirs["tokens_per_s"]
        print(f"nanoGPT's model.py: {theirs['tokens_per_s']:.0f} tokens/s; this yardstick / nanoGPT: {ratio:.3f}x")
        summary |= {"nanogpt_tokens_per_s": round(theirs["tokens_per_s"], 1), "vs_nanogpt": round(ratio, 3)}
    print(json.dumps(summary))
    return 0


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    exit_with(main())
