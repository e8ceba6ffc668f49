"""The `data` section of a run's config: its fields, their allowed values and checks, and what `microbatches=0`
resolves to. Kept apart from `jaxlm.config` (which gathers the sections and re-exports this one), as DiLoCo's is.
"""

from __future__ import annotations

from dataclasses import dataclass

from data.corpus import bpe_vocab_size
from data.mixture import MixtureError, check_mixture
from jaxlm.config_checks import ConfigError, Section, check_choice, check_non_negative, check_positive

LOADERS = ("clairvoyant", "simple")
CPU_MICROBATCH_TOKENS = 1024  # data.microbatches=0 on CPU: tokens per microbatch and batch shard, at least


@dataclass(frozen=True)
class DataConfig(Section):
    path: str = ""  # token data (python -m data.prepare); "" -> the default stdlib corpus
    # several token datasets (one tokenizer) read at set proportions instead of `path` (data.mixture):
    # "PATH:WEIGHT,PATH:WEIGHT", or a {path: weight} dict in a config file (kept as that string)
    mixture: str = ""
    # weights that change at given steps, in `mixture`'s order: "STEP:W,W;STEP:W,W" (e.g. annealing)
    mixture_stages: str = ""
    # the default corpus's tokenizer (used when path is ""): "byte", or "bpe<N>" (an N-token BPE trained on the
    # corpus, built once)
    corpus_tokenizer: str = "byte"
    seq_len: int = 256
    batch_size: int = 16  # global batch, in sequences
    # gradient accumulation: batch_size is split into this many microbatches (the same optimizer step); 0: auto, the
    # fastest measured (DataConfig.resolved_microbatches)
    microbatches: int = 0
    val_fraction: float = 0.01
    eval_batches: int = 4
    # the training loader: "clairvoyant" (data.loader: plan-driven cache + prefetch) or "simple" (SeededBatchIterator)
    loader: str = "clairvoyant"
    cache_ram_mb: float = 256.0  # this process's RAM tier (0 disables it)
    cache_disk_mb: float = 0.0  # this process's local-disk tier
    cache_dir: str = ""  # where the disk tier's slot file lives ("" -> the system temp dir)
    loader_workers: int = 16  # fetch threads per process
    prefetch_steps: int = 4  # batches fetched ahead of the training step
    # simulate a remote filesystem under the dataset (benchmarks, tests): per-request latency and shared bandwidth
    throttle_latency_ms: float = 0.0
    throttle_mb_per_s: float = 0.0  # 0 -> unlimited
    # resume a checkpoint trained on other token data (its fingerprint differs): off, the run refuses to
    allow_other_data: bool = False

    # fields that change how fast batches arrive, never which batches: a resumed run may change them
    RESUME_MAY_CHANGE = (
        "allow_other_data",
        "mixture",  # its weights take effect from the resumed step; its datasets are checked by their fingerprints
        "mixture_stages",
        "cache_ram_mb",
        "cache_disk_mb",
        "cache_dir",
        "loader_workers",
        "prefetch_steps",
        "throttle_latency_ms",
        "throttle_mb_per_s",
    )

    def __post_init__(self):
        if isinstance(self.mixture, dict):  # a config file's {path: weight}: kept as the string --set takes
            object.__setattr__(self, "mixture", ",".join(f"{path}:{weight}" for path, weight in self.mixture.items()))

    def validate(self, run=None) -> None:
        d = self
        check_positive(data__seq_len=d.seq_len, data__batch_size=d.batch_size)
        check_non_negative(data__microbatches=d.microbatches)
        check_non_negative(data__eval_batches=d.eval_batches)
        if not 0 <= d.val_fraction < 1:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {d.val_fraction}")
        if run is not None and d.seq_len > run.model.max_seq_len:
            raise ConfigError(f"data.seq_len ({d.seq_len}) exceeds model.max_seq_len ({run.model.max_seq_len})")
        check_choice("data.loader", d.loader, LOADERS)
        self._validate_mixture(run)
        if d.corpus_tokenizer != "byte":  # checked even when data.path is set (then unused): a typo surfaces
            try:
                bpe_vocab_size(d.corpus_tokenizer)
            except ValueError as e:
                raise ConfigError(f"data.{e}") from None
        check_non_negative(
            data__cache_ram_mb=d.cache_ram_mb,
            data__cache_disk_mb=d.cache_disk_mb,
            data__throttle_latency_ms=d.throttle_latency_ms,
            data__throttle_mb_per_s=d.throttle_mb_per_s,
        )
        for key in ("loader_workers", "prefetch_steps"):
            if getattr(d, key) < 1:
                raise ConfigError(f"data.{key} must be >= 1, got {getattr(d, key)}")
        if d.microbatches and d.batch_size % d.microbatches:
            raise ConfigError(
                f"data.batch_size ({d.batch_size}) must be divisible by data.microbatches ({d.microbatches})"
            )

    def _validate_mixture(self, run) -> None:
        try:
            check_mixture(self.path, self.mixture, self.mixture_stages)
        except MixtureError as e:
            raise ConfigError(str(e)) from None
        if self.mixture and run is not None and run.diloco.data_partitions:
            raise ConfigError(
                "diloco.data=partition cuts one dataset into slices; with data.mixture use diloco.data=iid"
            )

    def resolved_microbatches(self, platform: str, rows: int | None = None, shards: int = 1) -> int:
        """`microbatches`, or for 0 (auto) the fastest setting measured: on CPU, the most microbatches that still
        give every batch shard >= CPU_MICROBATCH_TOKENS tokens each, elsewhere 1. On CPU an op's working set (the
        [tokens, vocab] logits above all) then stays in the caches: 1.22x the gpt-bench step at 1024 tokens, the
        same at 512, 1.15x at 2048 (docs/results/bench_train.md). `rows`: the batch rows one step splits (default
        batch_size; a DiLoCo replica's share), `shards`: the data-parallel shards they spread over."""
        if self.microbatches:
            return self.microbatches
        rows = self.batch_size if rows is None else rows
        if platform != "cpu":
            return 1
        fits = [
            k
            for k in range(1, rows + 1)
            if rows % k == 0
            and (rows // k) % shards == 0
            and rows // k // shards * self.seq_len >= CPU_MICROBATCH_TOKENS
        ]
        return max(fits, default=1)
