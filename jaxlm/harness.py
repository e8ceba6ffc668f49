"""lm-evaluation-harness tasks on a jaxlm model: the adapter built from a workdir or live params, tasks checked by
name before anything loads, lm-eval's results dict, and its metrics flattened for metrics.jsonl / TensorBoard.

lm-eval is an optional extra: this module imports it only when used, and a missing extra is one line naming the
install command (`MissingExtra`, a ValueError, so the commands' bad-input handling takes it). The adapter itself is
`jaxlm.harness_lm.JaxlmLM` (docs/lm_eval.md).
"""

from __future__ import annotations

import datetime
import difflib
import functools
import json
import math
from collections.abc import Sequence
from pathlib import Path

from data.atomic_file import write_atomic

INSTALL = 'pip install -e ".[eval]"'
RESULTS_DIR = "lm_eval"  # under a workdir: what experiments.lm_eval writes there
TASK_ERROR_MODULES = ("datasets", "jinja2")  # what reads a task's data files and fills its templates


class MissingExtra(ValueError):
    """lm-eval (the `eval` extra) is not installed."""


def task_names(text: str) -> list[str]:
    """The task names of a comma list (the training config's `eval_harness_tasks`)."""
    return [t.strip() for t in text.split(",") if t.strip()]


def require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise MissingExtra(f"lm-eval is not installed; install the eval extra: {INSTALL}") from None


def adapter(model, tokenizer, *, batch_size: int | None = None, rules: dict | None = None, info: dict | None = None):
    """lm-eval's `LM` over a live model (the training loop's params) and its TextTokenizer."""
    require_lm_eval()
    from jaxlm.harness_lm import DEFAULT_BATCH_SIZE, JaxlmLM

    return JaxlmLM(model, tokenizer, batch_size=batch_size or DEFAULT_BATCH_SIZE, rules=rules, info=info)


def load_adapter(workdir: str | Path, *, step: int | None = None, layout=None, batch_size: int | None = None):
    """lm-eval's `LM` over a workdir's checkpoint (or a quantize_checkpoint output), as jaxlm.inference loads it.
    ValueError of one line for a workdir without a checkpoint."""
    require_lm_eval()
    from jaxlm.inference import load_model

    return adapter_for(load_model(workdir, step=step, layout=layout), str(workdir), batch_size=batch_size)


def adapter_for(loaded, workdir: str, *, batch_size: int | None = None):
    """lm-eval's `LM` over a `jaxlm.inference.Loaded` model; what it was loaded from goes into lm-eval's results
    (`config`)."""
    info = {"workdir": workdir, "step": loaded.step, "int8": loaded.int8}
    return adapter(loaded.model, loaded.tokenizer, batch_size=batch_size, rules=loaded.rules, info=info)


@functools.cache
def _task_manager(include_path: str | None, defaults: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=defaults)


def task_manager(tasks: Sequence[str], include_path: str | Path | None = None):
    """lm-eval's TaskManager that knows `tasks`; ValueError naming the first unknown one (with the closest names).
    When `include_path` alone holds them all, lm-eval's own ~15,000 task files are not indexed (4 s); a name it
    shares with a built-in task means the include path's either way. Built once per include path (the training
    loop asks at every evaluation)."""
    require_lm_eval()
    if not tasks:
        raise ValueError("no lm-eval task given; name one or more, e.g. hellaswag,arc_easy")
    path = None
    if include_path is not None:
        path = str(Path(include_path).absolute())
        if not Path(path).is_dir():
            raise ValueError(f"the include path {include_path} is not a directory of lm-eval task YAML files")
        local = _task_manager(path, False)
        if all(name in local.all_tasks for name in tasks):
            return local
    manager = _task_manager(path, True)
    for name in tasks:
        if name not in manager.all_tasks:
            close = difflib.get_close_matches(name, manager.all_tasks, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            where = f" (nor in {include_path})" if include_path is not None else ""
            raise ValueError(f"unknown lm-eval task {name!r}{where}{hint} (`lm-eval ls tasks` lists them)")
    return manager


def run_tasks(
    lm,
    tasks: Sequence[str],
    *,
    include_path: str | Path | None = None,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    log_samples: bool = False,
    bootstrap_iters: int = 100_000,
) -> dict:
    """lm-eval's results dict (`results`, `versions`, `n-shot`, `config`, ...; `samples` with `log_samples`) of
    `tasks` on `lm` (an `adapter`, or any lm-eval LM). `limit`: examples per task (a fraction if < 1);
    `bootstrap_iters` 0 skips the stderr of metrics that need resampling (perplexities), lm-eval's slowest part."""
    from lm_eval import evaluator

    manager = task_manager(tasks, include_path)
    try:
        return evaluator.simple_evaluate(
            model=lm,
            tasks=list(tasks),
            task_manager=manager,
            limit=limit,
            num_fewshot=num_fewshot,
            log_samples=log_samples,
            bootstrap_iters=bootstrap_iters,
        )
    except Exception as e:  # a task's data or template the user wrote: one line naming it, not a traceback
        if type(e).__module__.partition(".")[0] not in TASK_ERROR_MODULES:
            raise
        cause = e.__cause__ or e.__context__
        detail = f" ({type(cause).__name__}: {str(cause).splitlines()[0]})" if cause and str(cause) else ""
        raise ValueError(f"lm-eval could not read a task: {type(e).__name__}: {e}{detail}") from e


def flat_metrics(results: dict, prefix: str = "harness/") -> dict[str, float]:
    """{"harness/<task>/<metric>": value} of every finite metric in `results["results"]` but the stderrs. lm-eval
    keys a metric "<metric>,<filter>" (its other fields, alias and sample_len, have no comma); the filter is dropped
    for the default one ("none") and kept after an underscore otherwise (gsm8k's "exact_match_strict-match")."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            metric, comma, kind = key.partition(",")
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if comma and number and not metric.endswith("_stderr") and math.isfinite(value):
                out[f"{prefix}{task}/{metric if kind == 'none' else f'{metric}_{kind}'}"] = float(value)
    return out


def save_results(results: dict, directory: str | Path, step: int) -> Path:
    """Writes `results` as lm-eval's JSON to a new file in `directory` (created): written beside its name, then
    renamed, so a reader never sees half of it; a new name each time, so nothing is overwritten."""
    from lm_eval.utils import handle_non_serializable

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H-%M-%S.%f")
    path = directory / f"results_step{step}_{stamp}.json"
    text = json.dumps({k: v for k, v in results.items() if k != "samples"}, indent=2, default=handle_non_serializable)
    write_atomic(path, text + "\n")
    return path
