"""Generate text with a trained model: each prompt's continuation streamed to stdout as it is decoded.

    python -m experiments.generate --workdir runs/tiny_lm --prompt "def main(" --max-new-tokens 200
    python -m experiments.generate --workdir runs/tiny_lm --prompt-file prompts.txt --temperature 0  # greedy
    python -m experiments.generate --workdir runs/tiny_lm/quantized_int8 --prompt "import "          # int8

--workdir is a training run's workdir (its latest checkpoint, or --step N) or a quantize_checkpoint output. The
prompts (--prompt, repeatable, or --prompt-file: one prompt per line) are encoded with the run's tokenizer and
decoded as one batch. A continuation ends at the tokenizer's EOS, at a --stop text (not printed), or after
--max-new-tokens. With several prompts each continuation follows a `--- prompt i/n` line. Bad input exits 2 with
one line naming it, before anything compiles.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from experiments.cli import exit_with, load_trained_model, trained_model_parser

PROG = "experiments.generate"
EXIT_BAD_INPUT = 2
DEFAULT_TEMPERATURE = 0.8  # also what experiments.compile_at_scale --decode compiles


def parse_args(argv):
    p = trained_model_parser(PROG, __doc__.split("\n")[0])
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable: decoded as one batch)")
    p.add_argument("--prompt-file", help="a text file of prompts, one per line (empty lines skipped)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt at most (default 128)")
    p.add_argument(
        "--temperature",
        type=float,
        default=DEFAULT_TEMPERATURE,
        help=f"softmax temperature; 0 is greedy (default {DEFAULT_TEMPERATURE})",
    )
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample among the smallest set holding p of the mass")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--stop", action="append", default=[], help="stop a continuation at this text (repeatable)")
    p.add_argument("--truncate", action="store_true", help="keep a too-long prompt's last tokens instead of failing")
    return p.parse_args(argv)


def check_args(args) -> list[str]:
    """The prompts' texts; ValueError naming the first bad flag (all before JAX starts)."""
    from jaxlm.generate import check_sampling

    for flag in ("workdir", "prompt_file", "mesh"):
        value = getattr(args, flag)
        if value is not None and not value.strip():
            raise ValueError(f"--{flag.replace('_', '-')} is empty; give a path (or leave the flag out)")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.cpu_devices < 0:
        raise ValueError(f"--cpu-devices must be >= 0, got {args.cpu_devices}")
    try:
        check_sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        raise ValueError(f"--{str(e).replace('_', '-', 1)}") from None
    if any(not s for s in args.stop):
        raise ValueError("--stop is empty; give the text to stop at")
    prompts = list(args.prompt)
    if args.prompt_file:
        path = Path(args.prompt_file)
        try:
            prompts += [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--prompt-file {path} cannot be read: {getattr(e, 'strerror', None) or e}") from None
        if not prompts:
            raise ValueError(f"--prompt-file {path} holds no prompt (one per line)")
    if not prompts:
        raise ValueError("give a prompt: --prompt TEXT (repeatable) or --prompt-file FILE")
    if any(not p for p in prompts):
        raise ValueError("--prompt is empty; give some text to continue")
    return prompts


def fit_prompts(ids: list, max_len: int, max_new: int, truncate: bool) -> list:
    """Each prompt must leave room for --max-new-tokens within the model's max length (or is cut to its tail)."""
    room = max_len - max_new
    if room < 1:
        raise ValueError(
            f"--max-new-tokens {max_new} leaves no room for a prompt in the model's max length of {max_len} tokens"
        )
    for i, p in enumerate(ids):
        if len(p) > room and not truncate:
            raise ValueError(
                f"prompt {i + 1} is {len(p)} tokens, longer than the {room} that the model's max length of "
                f"{max_len} leaves beside --max-new-tokens {max_new}; shorten it or pass --truncate"
            )
    return [p[-room:] for p in ids]


class Printer:
    """Streams each prompt's text in order: the first unfinished prompt live, later ones once it is done. Holds
    back text that may be the start of a stop string or an incomplete UTF-8 character."""

    def __init__(self, tokenizer, count: int, stops: list[str], out=None):
        self.tok, self.stops, self.out = tokenizer, stops, out or sys.stdout
        self.ids = [[] for _ in range(count)]
        self.done = [False] * count
        self.shown = [0] * count  # characters of each text printed
        self.current, self.headed, self.closed = 0, set(), False

    def text(self, i: int) -> tuple[str, bool]:
        """(text so far, cut at a stop string?)."""
        text = self.tok.decode(self.ids[i], skip_special_tokens=True)
        cuts = [text.find(s) for s in self.stops if s in text]
        return (text[: min(cuts)], True) if cuts else (text, False)

    def add(self, new) -> None:
        for i, t in enumerate(new):
            if t >= 0 and not self.done[i]:
                if t == self.tok.eos_id:
                    self.done[i] = True
                else:
                    self.ids[i].append(int(t))
                    self.done[i] = self.text(i)[1]
        self._flush()

    def finish(self) -> None:
        self.done = [True] * len(self.done)
        self._flush()

    def _flush(self) -> None:
        while self.current < len(self.ids):
            i = self.current
            if len(self.ids) > 1 and i not in self.headed:
                self.headed.add(i)
                self.out.write(f"{chr(10) if i else ''}--- prompt {i + 1}/{len(self.ids)}\n")
            text, _ = self.text(i)
            end = len(text) if self.done[i] else len(text) - self._held_back(text)
            self.out.write(text[self.shown[i] : end])
            self.shown[i] = max(self.shown[i], end)
            self.out.flush()
            if not self.done[i]:
                return
            self.current += 1
        if not self.closed:
            self.closed = True
            self.out.write("\n")
            self.out.flush()

    def _held_back(self, text: str) -> int:
        if text.endswith("\ufffd"):
            return 1
        return max((n for s in self.stops for n in range(len(s) - 1, 0, -1) if text.endswith(s[:n])), default=0)


def main(argv: list[str] | None = None) -> int:
    """SIGTERM / Ctrl-C: one line and exit 143 / 130, also while XLA compiles (nothing is written; a second
    Ctrl-C exits at once)."""
    from data.command_signals import run_stoppable

    return run_stoppable(PROG, lambda _: _main(argv), grace_s=2.0)


def _main(argv: list[str] | None) -> int:
    try:
        args = parse_args(argv)
        texts = check_args(args)
    except ValueError as e:
        return _fail(str(e))
    try:
        loaded = load_trained_model(args)  # first: --cpu-devices must be set before anything starts JAX's backends
        from jaxlm.generate import check_sampling, stream

        tok, cfg = loaded.tokenizer, loaded.cfg.model
        check_sampling(args.temperature, args.top_k, args.top_p, tok.vocab_size)
        ids = fit_prompts([list(tok.document(t)) for t in texts], cfg.max_seq_len, args.max_new_tokens, args.truncate)
    except (ValueError, OSError) as e:
        return _fail(str(e).replace("top_k", "--top-k"))
    printer = Printer(tok, len(ids), args.stop)
    t0 = time.perf_counter()
    made = 0
    for new in stream(
        loaded.model,
        ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_ids=[tok.eos_id],
        vocab_limit=tok.vocab_size,
        rules=loaded.rules,
    ):
        made += int((new >= 0).sum())
        printer.add(new)
        if all(printer.done):
            break
    printer.finish()
    seconds = time.perf_counter() - t0
    kind = "int8 weight-only" if loaded.int8 else "checkpoint"
    print(
        f"{PROG}: {len(ids)} prompt(s), {made} new tokens in {seconds:.2f} s (compiling included); "
        f"{kind} step {loaded.step} of {args.workdir}",
        file=sys.stderr,
    )
    return 0


def _fail(message: str) -> int:
    print(f"{PROG}: error: {' '.join(message.splitlines())}", file=sys.stderr)
    return EXIT_BAD_INPUT


if __name__ == "__main__":
    exit_with(main())
