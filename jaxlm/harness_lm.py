"""A jaxlm model as an lm-evaluation-harness `LM`: loglikelihood, loglikelihood_rolling and generate_until.

Requests are scored as lm-eval's Hugging Face backend (`HFLM`) scores them, so the two agree on an
exported model: the same encoding of a (context, continuation) pair (lm-eval's `TemplateLM`), contexts cut from the
left to the model's max length, rolling windows from lm-eval's own `get_rolling_token_windows`, generated text cut
at the first `until` string. What differs is how they run: requests are sorted by length and scored in batches of
`batch_size` rows padded to a few lengths (`score_length`), so a task compiles a handful of programs, not one per
request; generation is `jaxlm.generate.stream` (the KV cache), stopped once every row has met a stop string.

Encoding follows the model's own tokenizer: a text gets BOS only if the model was trained with one
(`TextTokenizer.document`), and the token before an empty context is that BOS, else EOS (what precedes every
document in training). HFLM takes the tokenizer's BOS whenever it has one; pass it `prefix_token_id` to compare.
A model trained with the `document` mask scores with segment ids from its EOS tokens, as training and
`jaxlm.evaluate` do (the exported model has no such mask).

This module imports lm-eval at the top: reach it through `jaxlm.harness`, which says how to install it.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from data.iterator import batch_from_windows
from jaxlm.generate import batch_rows, bucket, greedy_ids, placement_of, stream, traced_in
from jaxlm.model import Transformer
from pallas_kernels.mask_spec import parse_mask, uses_documents

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 16
MAX_GEN_TOKS = 256  # HFLM's default, for tasks that do not set max_gen_toks


@functools.partial(jax.jit, static_argnames=("graphdef", "where"))
def _scores(params, inputs_BT, targets_BT, mask_BT, segment_ids_BT, *, graphdef, where):
    """Each row's summed log-probability of its masked targets, and whether every one of them is the argmax.
    The target's logit is a one-hot product (a vocabulary split over `tensor` stays local: train.cross_entropy_sums)."""
    with traced_in(where):
        logits_BTV = nnx.merge(graphdef, params)(inputs_BT, segment_ids_BT=segment_ids_BT, inference=True)
        target_BT = jnp.sum(logits_BTV * jax.nn.one_hot(targets_BT, logits_BTV.shape[-1], dtype=logits_BTV.dtype), -1)
        logp_BT = target_BT - jax.nn.logsumexp(logits_BTV, axis=-1)
        greedy_BT = greedy_ids(logits_BTV) == targets_BT  # the first largest, as torch's argmax
        return jnp.sum(jnp.where(mask_BT, logp_BT, 0.0), -1), jnp.all(greedy_BT | ~mask_BT, -1)


def score_length(n: int) -> int:
    """The padded length of a batch whose longest input is `n` tokens: generation's bucket up to 32, then a multiple
    of 32. A task's batches reuse each shape many times, so finer steps than generation's pay for their compiles:
    multiple-choice requests of ~143 tokens were padded 12% here, 22% at generation's multiples of 64 (1,000
    requests on tiny_lm: 8 programs against 5)."""
    return bucket(n) if n <= 32 else -(-n // 32) * 32


def _bar(total: int, desc: str, disable: bool) -> tqdm:
    """A progress bar on a terminal only: the training loop's log and a command's captured stderr stay clean."""
    return tqdm(total=total, desc=desc, leave=False, disable=disable or not sys.stderr.isatty())


class JaxlmLM(TemplateLM):
    """lm-eval's `LM` over a jaxlm `Transformer` and its `TextTokenizer` (live params or a loaded checkpoint;
    `rules`: the layout's logical-axis overrides when the params are sharded over a mesh)."""

    def __init__(
        self,
        model: Transformer,
        tokenizer,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        rules: dict | None = None,
        info: dict | None = None,
    ):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.tok, self.batch_size, self.rules = model, tokenizer, batch_size, rules
        self.max_length = model.cfg.max_seq_len
        self.info = info or {}
        self._graphdef, self._params = nnx.split(model)
        self._where = placement_of(self._params, rules)
        self._shards = self._where.batch_shards() if self._where else 1
        self._eos_for_segments = tokenizer.eos_id if uses_documents(parse_mask(model.cfg.attention_mask)) else None

    # ------------------------------------------------------------------ what TemplateLM asks of a model

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id if self.tok.add_bos else self.tok.eos_id

    @property
    def tokenizer_name(self) -> str:
        return self.tok.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As training encodes a document (BOS only if it was trained with one); `add_special_tokens=False`: none.
        A text that already starts with the BOS token's text gets no second one, as in HFLM."""
        bos = self.tok.bos_token
        plain = add_special_tokens is False or (add_special_tokens is None and bos and string.startswith(bos))
        return [int(i) for i in (self.tok.encode(string) if plain else self.tok.document(string))]

    def get_model_info(self) -> dict:
        return {"model_num_parameters": int(sum(p.size for p in jax.tree.leaves(self._params))), **self.info}

    # ------------------------------------------------------------------ loglikelihood

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: (key, context ids, continuation ids) -> (log p(continuation | context), is it greedy)."""
        windows, scored = [], []
        for _, context, continuation in requests:
            if not continuation:
                raise ValueError("lm-eval asked to score an empty continuation")
            if len(continuation) > self.max_length:
                raise ValueError(
                    f"a continuation of {len(continuation)} tokens is longer than the model's max length "
                    f"{self.max_length}"
                )
            windows.append((list(context) + list(continuation))[-(self.max_length + 1) :])  # HFLM's left cut
            scored.append(len(continuation))
        results = self._score_windows(windows, scored, disable_tqdm)
        for (key, _, _), answer in zip(requests, results, strict=True):
            if key is not None:  # rolling windows have none; loglikelihood_rolling caches whole strings
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def _score_windows(self, windows: list[list[int]], scored: list[int], disable_tqdm: bool):
        """Windows of tokens (inputs + 1), longest first in batches of `batch_size` rows padded to `score_length`;
        the last `scored[i]` targets of window i are summed. Every batch of a call has the same rows, the last one
        padded: a program per length, not one more for the remainder."""
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i]))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(windows)
        B, pad = batch_rows(min(self.batch_size, len(windows)), self._shards), self.tok.eos_id
        with _bar(len(windows), "jaxlm loglikelihood", disable_tqdm) as bar:
            for first in range(0, len(order), self.batch_size):
                rows = order[first : first + self.batch_size]
                T = min(score_length(len(windows[rows[0]]) - 1), self.max_length)
                windows_BT1 = np.full((B, T + 1), pad, np.int32)
                mask_BT = np.zeros((B, T), bool)
                for r, i in enumerate(rows):
                    n = len(windows[i]) - 1
                    windows_BT1[r, : n + 1] = windows[i]
                    mask_BT[r, n - scored[i] : n] = True
                batch = batch_from_windows(windows_BT1, self._eos_for_segments)
                logp_B, greedy_B = jax.device_get(
                    _scores(
                        self._params,
                        batch["inputs"],
                        batch["targets"],
                        mask_BT,
                        batch.get("segment_ids"),
                        graphdef=self._graphdef,
                        where=self._where,
                    )
                )
                for r, i in enumerate(rows):
                    out[i] = (float(logp_B[r]), bool(greedy_B[r]))
                bar.update(len(rows))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each string's log-likelihood in disjoint windows of the model's max length (lm-eval's own windows, each
        with the most context that fits), every window of every string batched together."""
        pieces, owner = [], []
        for r, (string,) in enumerate(req.args for req in requests):
            windows = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(lm_utils.make_disjoint_window, windows):
                pieces.append((None, context, continuation))
                owner.append(r)
        totals = [0.0] * len(requests)
        for r, (logp, _) in zip(owner, self._loglikelihood_tokens(pieces, disable_tqdm), strict=True):
            totals[r] += logp
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------ generate_until

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with do_sample) continuations through the KV cache, requests of the same settings
        batched, cut at the first `until` string or the EOS."""
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        with _bar(len(requests), "jaxlm generate_until", disable_tqdm) as bar:
            for indices in groups.values():
                settings = requests[indices[0]].args[1]
                prompts = [requests[i].args[0] for i in indices]
                for i, text in zip(indices, self._generate(prompts, settings), strict=True):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(indices))
        return out

    def _generate(self, contexts: Sequence[str], settings: dict) -> list[str]:
        kwargs = dict(normalize_gen_kwargs(settings, MAX_GEN_TOKS))
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok.decode([self.tok.eos_id]))
        max_new = kwargs.pop("max_gen_toks")
        room = self.max_length - max_new
        if room < 1:
            raise ValueError(f"max_gen_toks {max_new} leaves no room for a context in max length {self.max_length}")
        sampling = {"temperature": 0.0}  # greedy, unless a task asks to sample
        if kwargs.pop("do_sample", False):
            sampling = {k: kwargs.pop(k) for k in ("temperature", "top_k", "top_p", "seed") if k in kwargs}
        ignored = sorted(k for k in kwargs if k != "temperature")
        if ignored:
            log.warning("jaxlm generate_until ignores the generation settings %s", ", ".join(ignored))
        ids = [self.tok_encode(c)[-room:] or [self.prefix_token_id] for c in contexts]
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        texts: list[str] = [""] * len(ids)
        for first in range(0, len(order), self.batch_size):
            rows = order[first : first + self.batch_size]
            made = self._stream([ids[i] for i in rows], max_new, until, sampling)
            for i, new in zip(rows, made, strict=True):
                text = self.tok.decode(new, skip_special_tokens=True)
                texts[i] = postprocess_generated_text(text, until, think_end_token=None)
        return texts

    def _stream(self, prompts: list[list[int]], max_new: int, until: list[str], sampling: dict) -> list[list[int]]:
        """Each prompt's new ids, decoded until every row ended (EOS, `max_new`) or shows one of `until`. A stop
        string first seen after a step ends within that step's token, so only the last few tokens are decoded
        (each token is at least one byte, a character at most four)."""
        made: list[list[int]] = [[] for _ in prompts]
        tail = 4 * max((len(s) for s in until), default=0) + 1
        open_rows = set(range(len(prompts)))
        steps = stream(
            self.model,
            prompts,
            max_new_tokens=max_new,
            stop_ids=[self.tok.eos_id],
            vocab_limit=self.tok.vocab_size,
            rules=self.rules,
            **sampling,
        )
        for new in steps:
            for r in list(open_rows):
                if new[r] >= 0:
                    made[r].append(int(new[r]))
                text = self.tok.decode(made[r][-tail:], skip_special_tokens=True)
                if new[r] < 0 or new[r] == self.tok.eos_id or any(s and s in text for s in until):
                    open_rows.discard(r)
            if not open_rows:
                break
        return made
