"""Train a small Llama-style language model on CPU, on the Python standard library's own source code.

    python -m experiments.tiny_lm                      # ~6M params, 160 steps, ~4 minutes on 2 CPU cores
    python -m experiments.tiny_lm --steps 500 --workdir runs/longer --set optim.learning_rate=1e-3

Rerunning the same command resumes from the workdir's latest checkpoint.
"""

from pathlib import Path

from experiments.cli import exit_with, run_training

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "tiny_lm.py"


def main(argv: list[str] | None = None) -> int:
    return run_training("tiny_lm", DEFAULT_CONFIG, default_workdir="runs/tiny_lm", argv=argv)


if __name__ == "__main__":
    exit_with(main())
