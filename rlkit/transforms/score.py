"""``score(batch, reward) -> Batch``: run reward functions and write ``rewards (b)``.

Accepted reward functions, detected by their signature, used unchanged:

- **TRL style** (batched): ``f(completions, prompts=..., completion_ids=..., **columns) -> list[float]``
  — ``completions`` is the decoded response text (for a chat prompt, TRL's conversational format:
  see below); any keyword the function names that is a
  column of the batch (``answer``, ``ground_truth``, ...) is passed as a list. As TRL does, a
  function is called by keyword where it has a ``completions`` parameter, no positional one, or a
  first parameter that is one of the keywords ``score`` passes (``prompts``, ``completion_ids``,
  a data column, or TRL's ``trainer_state``/``log_metric``/``log_extra``): so
  ``f(prompts, completions, **kw)``, ``f(completion_ids, **kw)`` (TRL's own
  ``get_soft_overlong_punishment``) and ``f(answer, **kw)`` work, the completions reaching the
  last two in ``kw["completions"]`` (a function with neither a ``completions`` parameter nor
  ``**kwargs`` is not given them). One whose first parameter has another name
  (``f(responses, answer)``) gets the completions as its first positional argument. The batch's
  own columns (``rollout_metrics``, ``prompt_text``, ``prompt_messages``, ``response_text``) are
  not passed as data columns.

  TRL also passes every reward ``trainer_state``, ``log_metric`` and ``log_extra``; ``score``
  passes stand-ins to a function that names them or takes ``**kwargs``: ``trainer_state`` has
  only ``global_step``, the batch's ``policy_version`` (the number of updates that stepped the
  weights that sampled it, 0 for a batch without the field), and reading another of TRL's
  attributes (``max_steps``) is an error saying so; ``log_metric(name, value)`` records a number
  into the returned batch's ``rollout_metrics`` (the mean where it is logged more than once), so
  the recipes' step metrics carry it under ``name`` (under :func:`rlkit.parallel.shard_reward`
  each rank records what its share of the rows gave); ``log_extra(column, values)`` does nothing
  (rlkit keeps no completions table).
- **verl style** (per sample): ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``
  returning a float or a dict with a ``"score"`` key. ``ground_truth`` comes from the
  ``ground_truth`` column, else from verl's own format, a ``reward_model`` column holding
  ``{"style": "rule", "ground_truth": ...}``, else from the ``answer`` column; with none of them
  ``score`` stops with an error naming the columns there are. ``data_source`` and ``extra_info``
  are the row's columns of those names; without the column ``data_source`` is None and
  ``extra_info`` is ``{}`` (a new dict per sample), as verl passes it. An ``async def``
  ``compute_score`` is called for every sample at once and the calls awaited together
  (``asyncio.gather``), not one after the other; a function that must limit how many run at a time
  (a rate-limited judge) holds its own ``asyncio.Semaphore``.
- **verl batch style**: ``compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs)``
  (verl's ``BatchRewardManager``), recognised by its ``solution_strs`` parameter: called once, by
  keyword, with one list per argument (filled as for the per-sample style), returning a list of
  floats or of dicts with a ``"score"`` key.
- **Batch style**: ``f(batch) -> Tensor (b)``, e.g. a :class:`rlkit.rewards.RewardModel` (a
  sequence classifier as the reward role): a function whose first parameter is named ``batch``
  and whose other parameters all have defaults or are keyword-only (``f(batch, scale=0.1)``,
  ``functools.partial(f, scale=0.5)``). A model itself (a ``torch.nn.Module`` such as an
  ``AutoModelForSequenceClassification``, which TRL's ``reward_funcs`` takes) is refused with an
  error saying to wrap it: ``rk.rewards.RewardModel(model)``.

A TRL- or verl-style function defined with ``async def`` is run to completion (``asyncio``; in a
thread of its own where an event loop is already running, as in Jupyter). When a batched one (TRL
style, verl batch style) raises, the error names the reward but not the sample: an async reward
(often a remote call) is not retried sample by sample to find it. A per-sample verl one's error
names the first sample, in row order, whose call raised.

The texts are the responses (and prompts) decoded with ``skip_special_tokens=True``, as TRL and
verl decode them: a special token the model emits (``<unk>``, ``<pad>``, an EOS in the middle) is
not in the text a reward sees, so "4<unk>6" scores as "46". A reward that must see those tokens reads
the ids: TRL style's ``completion_ids`` keyword, or a batch-style function's
``batch["response_ids"]``. Or replace the batch's ``response_text`` column (``rollout`` writes it;
``score`` decodes only where there is none) before scoring:
``set_column(batch, "response_text", tokenizer.batch_decode(row_tokens(batch["response_ids"],
batch["response_mask"]), skip_special_tokens=False))`` (both from :mod:`rlkit.batch`).

Chat prompts reach TRL-style rewards in TRL's conversational format, as ``GRPOTrainer`` builds it:
for a row whose prompt was a chat conversation, ``prompts[i]`` is that list of ``{"role",
"content"}`` messages (a copy: a reward that edits it changes neither the batch nor the other
rewards' view) and ``completions[i]`` is ``[{"role": "assistant", "content": <response text>}]``;
``completion_ids`` stays ids. Whether a prompt was a conversation is not guessed from its text (a
text prompt may be JSON): it is the batch's ``prompt_messages`` column (:data:`rlkit.batch.PROMPT_MESSAGES`),
which ``rollout`` writes from the prompts :func:`rlkit.load_prompts` read, None on text rows; a batch
without it (``make_batch``) is all text. TRL decides for the whole batch from its first example;
``score`` decides per row, so in a batch that mixes chat and text prompts each row gets its own
format (a text row strings, a chat row lists). verl-style and batch-style rewards are unchanged
(``solution_str`` is the response text), and ``prompt_text`` stays printable (the JSON of the
messages): errors name a sample by that text. Where the tokenizer has a response schema
(transformers 5) TRL parses tool calls out of a completion; ``score`` gives its text as the
``content``.

Several rewards: pass a list or a ``{name: fn}`` dict, with ``weights``; each one's value is kept
as ``reward/<name>`` and ``rewards`` is their weighted sum. In training the weights are a
recipe's ``reward_weights`` (``rk.recipes.get("grpo", reward_weights=[1.0, 0.2])``), which its
steps pass to ``score`` (TRL's ``GRPOConfig.reward_weights``).

A reward returns one number per completion: a list, a tensor or a numeric numpy array (a ``(b, 1)``
column is flattened, as a tensor's is); one number for the whole batch is an error saying so. A
reward that raises, returns NaN/inf, text, or the wrong number of values is an error that names
the reward and the sample (its row, prompt and response).

``None`` follows TRL: a TRL-style function returns ``None`` for a sample it does not apply to (a
math reward on a code prompt, in a mixed dataset). ``reward/<name>`` holds NaN there, and
``rewards`` sums, with their weights, only the functions that scored the sample. Every sample needs
a number from at least one function: where all of them return ``None`` TRL warns and gives the
sample no advantage, while ``score`` stops with an error that names the sample.
"""
from __future__ import annotations

import inspect
import math
import operator
from collections import abc
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from rlkit._checks import is_real
from rlkit.batch import (PROMPT_MESSAGES, RESERVED_COLUMNS, Batch, BatchError, column, columns, row_tokens, shallow_copy,
                         validate)


class RewardError(ValueError):
    """A reward function failed, or returned a bad value; the message names the sample."""


def _is_ndarray(x: Any) -> bool:
    """A numpy array, without importing numpy."""
    return type(x).__module__ == "numpy" and type(x).__name__ == "ndarray"


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _parameters(fn: Callable) -> Mapping[str, inspect.Parameter]:
    """``fn``'s parameters; a ``torch.nn.Module``'s are its ``forward``'s (its own signature is
    ``(*args, **kwargs)``). Raises as ``inspect.signature`` does where there is none."""
    return inspect.signature(fn.forward if isinstance(fn, torch.nn.Module) else fn).parameters


def reward_style(fn: Callable) -> str:
    """'verl', 'verl_batch', 'trl' or 'batch' — how ``score`` calls ``fn``: 'verl_batch' where it
    has a ``solution_strs`` parameter (verl's batched ``compute_score``), 'verl' where it has a
    ``solution_str`` one; 'batch' where its first parameter is named ``batch`` and every other one
    has a default or is keyword-only (``f(batch, scale=0.1)``); else 'trl'."""
    try:
        params = _parameters(fn)
    except (TypeError, ValueError):
        return "trl"
    if "solution_strs" in params:
        return "verl_batch"
    if "solution_str" in params:
        return "verl"
    first, *rest = list(params.values()) or [None]
    if (
        first is not None and first.name == "batch"
        and first.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        and all(p.default is not p.empty or p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in rest)
    ):
        return "batch"
    return "trl"


def _is_async(fn: Callable) -> bool:
    """``fn`` is an ``async def`` function (also behind ``functools.partial`` or a wrapper)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(inspect.unwrap(fn)) or (
        inspect.iscoroutinefunction(getattr(fn, "__call__", None)))


def _await(value: Any) -> Any:
    """``value``, or what it gives when awaited if it is awaitable (an ``async def`` reward's
    result): run on a new event loop, in a thread of its own where this thread already runs one
    (Jupyter), where ``asyncio.run`` would refuse."""
    if not inspect.isawaitable(value):
        return value
    import asyncio

    async def wait():
        return await value

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="rlkit-reward") as pool:
        return pool.submit(asyncio.run, wait()).result()


class LazyRows(abc.Sequence):
    """A per-row column computed on first access, a block of rows at a time, then kept.

    ``score`` hands the decoded texts (and ``completion_ids``) to reward functions in this form
    when the batch does not carry them: a reward split over data-parallel ranks
    (:func:`rlkit.parallel.shard_reward`) then decodes only its own share of the rows, not the
    global batch on every rank. Plain reward functions get ordinary lists
    (:func:`materialize`)."""

    _MISSING = object()

    def __init__(self, n: int, compute: Callable[[int, int], list]):
        self._n, self._compute, self._rows = n, compute, [self._MISSING] * n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index):
        if isinstance(index, slice):
            lo, hi, step = index.indices(self._n)
            if step != 1:
                return [self[i] for i in range(lo, hi, step)]
            todo = [i for i in range(lo, hi) if self._rows[i] is self._MISSING]
            if todo:
                a, b = todo[0], todo[-1] + 1  # one call for the block that is still missing
                self._rows[a:b] = self._compute(a, b)
            return self._rows[lo:hi]
        i = operator.index(index)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"row {index} out of range for {self._n} rows")
        return self[i : i + 1][0]

    def __iter__(self):
        return iter(self[:])


def materialize(values):
    """A plain list of a :class:`LazyRows` (computing what is missing), anything else unchanged."""
    return values[:] if isinstance(values, LazyRows) else values


def _texts(batch: Batch, name: str, tokenizer) -> Sequence[str]:
    """The batch's ``name`` column, else its rows decoded on demand (:class:`LazyRows`)."""
    if name in batch.keys():
        return column(batch, name)
    ids_field, mask_field = ("response_ids", "response_mask") if name == "response_text" else ("prompt_ids", "prompt_mask")
    if tokenizer is None:
        raise BatchError(f"batch has no {name!r} column and no tokenizer was given to decode {ids_field}; pass tokenizer=")

    def decode(lo: int, hi: int) -> list[str]:
        from rlkit.models.tokenizers import decode_batch

        with torch.profiler.record_function("rlkit.score.decode"):  # names the range in a profiler trace
            return decode_batch(tokenizer, row_tokens(batch[ids_field][lo:hi], batch[mask_field][lo:hi]))

    return LazyRows(batch.batch_size[0], decode)


def _texts_if_known(batch: Batch, name: str, tokenizer) -> Sequence[str]:
    """:func:`_texts`, or ``[]`` (errors show ``'?'``) when the batch has neither the column nor a tokenizer."""
    try:
        return _texts(batch, name, tokenizer)
    except BatchError:
        return []


def _printable(value: Any) -> str:
    """``value`` as text: itself where it is a string, else its JSON (a conversation, TRL's
    ``[{"role": "assistant", ...}]`` completion: what a sharded reward's share names), else ``str``."""
    if isinstance(value, str):
        return value
    import json

    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def _sample_desc(batch: Batch | None, i: int, prompts: Sequence[str], completions: Sequence[str], number: int | None = None) -> str:
    """Row ``i``'s prompt and response, clipped, as errors name a sample (``number``: the row's
    number in the whole batch where ``prompts``/``completions`` are a share of it)."""
    p, c = (_printable(prompts[i]) if i < len(prompts) else "?"), (_printable(completions[i]) if i < len(completions) else "?")
    clip = lambda s: s if len(s) <= 80 else s[:77] + "..."  # noqa: E731
    return f"sample {i if number is None else number} (prompt {clip(p)!r}, response {clip(c)!r})"


class TrainerState:
    """What a TRL-style reward gets as ``trainer_state`` (TRL passes its trainer's
    ``transformers.TrainerState``): ``global_step`` only, the batch's ``policy_version`` (the
    number of updates that stepped the weights that sampled it; 0 for a batch without the field).
    TRL's other attributes (``max_steps``, ``epoch``, ...) are not known to ``score``: reading one
    is an ``AttributeError`` saying so, where a made-up value would silently shape the reward."""

    __slots__ = ("global_step",)

    def __init__(self, global_step: int = 0):
        self.global_step = global_step

    def __getattr__(self, name: str):
        if name.startswith("_") or name == "global_step":
            raise AttributeError(name)  # copy/pickle probing, or global_step not set yet: no message to build
        raise AttributeError(
            f"rk.score's trainer_state has only global_step (the batch's policy_version, {self.global_step}); "
            f"TRL's trainer_state.{name} is not known to rk.score: give the reward what it needs another way "
            "(e.g. functools.partial(reward, max_steps=100))"
        )

    def __repr__(self) -> str:
        return f"TrainerState(global_step={self.global_step})"


#: what :func:`_call_trl` passes a TRL-style reward by keyword besides the data columns (and the
#: completions): the names :func:`_check_trl_columns` counts as given
TRL_KEYWORDS = ("prompts", "completion_ids", "trainer_state", "log_metric", "log_extra")


def _trl_extras(batch: Batch, logged: dict[str, list[float]]) -> dict[str, Any]:
    """Stand-ins for the keywords TRL passes every reward besides the data
    (``GRPOTrainer._calculate_rewards``): ``trainer_state``, ``log_metric`` and ``log_extra`` (the
    module docstring says what each does); ``logged`` collects what ``log_metric`` is given."""
    b = batch.batch_size[0]
    step = int(batch["policy_version"].max()) if "policy_version" in batch.keys() and b else 0

    def log_metric(name: str, value: float) -> None:
        """Record ``value`` under ``name`` in the scored batch's ``rollout_metrics`` (TRL's log_metric)."""
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"log_metric({name!r}, {value!r:.60}): the value must be a number") from None
        logged.setdefault(str(name), []).append(number)

    def log_extra(column: str, values: list) -> None:
        """Does nothing: TRL adds ``values`` to its completions table, which rlkit does not keep."""

    return {"trainer_state": TrainerState(step), "log_metric": log_metric, "log_extra": log_extra}


def _by_keyword(fn: Callable, params: Mapping[str, inspect.Parameter], keywords: Iterable[str] = ()) -> bool:
    """TRL calls a reward function only by keyword (``completions=..., prompts=...``): so does
    ``score`` where ``fn`` has a keyword parameter ``completions``, no positional parameter, only
    ``*args`` with ``**kwargs`` (an undecorated wrapper), or a first positional parameter named as
    one of ``keywords`` (the names passed by keyword:
    ``f(completion_ids, **kwargs)``, ``f(prompts, **kwargs)``, ``f(answer, **kwargs)``, where the
    completions given positionally collided with that keyword). Others (``f(responses, answer)``)
    get the completions positionally, as before. One rule for :func:`rlkit.score` and
    :func:`rlkit.parallel.shard_reward`'s wrapper (:func:`call_trl_style`)."""
    if getattr(fn, "reads_row_shares", False):
        return False  # rlkit.parallel.shard_reward's wrapper takes the completions positionally
    P = inspect.Parameter
    p = params.get("completions")
    if p is not None:
        return p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)
    positional = [q for q in params.values() if q.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD, P.VAR_POSITIONAL)]
    if not positional:
        return True
    if positional[0].kind is P.VAR_POSITIONAL and any(q.kind is P.VAR_KEYWORD for q in params.values()):
        # f(*args, **kwargs): a decorator's wrapper without functools.wraps, or a reward reading
        # kwargs["completions"]: what it forwards or reads is what TRL passes, all by keyword
        return True
    return positional[0].kind is P.POSITIONAL_OR_KEYWORD and positional[0].name in set(keywords)


def call_trl_style(fn: Callable, completions, kwargs: Mapping[str, Any]) -> Any:
    """``fn``'s result called as :func:`_by_keyword` says: ``fn(completions, **kwargs)``, or by
    keyword, ``completions=`` included where ``fn`` takes it (a ``completions`` parameter or
    ``**kwargs``)."""
    params = _parameters(fn)
    if not _by_keyword(fn, params, kwargs):
        return fn(completions, **kwargs)
    takes = "completions" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return fn(completions=completions, **kwargs) if takes else fn(**kwargs)


def _conversational(batch: Batch, prompts: Sequence[str], completions: Sequence[str]) -> tuple[Sequence[Any], Sequence[Any]]:
    """``(prompts, completions)`` as TRL passes them: on the rows whose prompt was a chat
    conversation (the batch's ``prompt_messages`` column is a message list, not None) the
    conversation (a deep copy, made when the rows are read) and ``[{"role": "assistant",
    "content": text}]``; on the others the texts. Unchanged (the texts) without the column or
    with no conversation in it. Rows computed on first access (:class:`LazyRows`), so a reward
    split over ranks builds only its own share."""
    if PROMPT_MESSAGES not in batch.keys():
        return prompts, completions
    messages = column(batch, PROMPT_MESSAGES)
    if all(m is None for m in messages):
        return prompts, completions
    import copy

    def prompt_rows(lo: int, hi: int) -> list[Any]:
        texts = prompts[lo:hi] if any(m is None for m in messages[lo:hi]) else [None] * (hi - lo)  # decoded only where needed
        return [t if m is None else copy.deepcopy(m) for m, t in zip(messages[lo:hi], texts)]

    def completion_rows(lo: int, hi: int) -> list[Any]:
        return [c if m is None else [{"role": "assistant", "content": c}] for m, c in zip(messages[lo:hi], completions[lo:hi])]

    n = len(messages)
    return LazyRows(n, prompt_rows), LazyRows(n, completion_rows)


def _check_prompt_messages(batch: Batch) -> None:
    """Raise :class:`BatchError` naming the first row of the batch's ``prompt_messages`` column
    (where it has one) that is neither a conversation nor None: checked before any reward runs,
    where it would otherwise be blamed on the reward, or reach it as a prompt."""
    if PROMPT_MESSAGES not in batch.keys():
        return
    messages = column(batch, PROMPT_MESSAGES)
    from rlkit.data import _is_conversation  # the rule load_prompts reads conversations by

    bad = next((i for i, m in enumerate(messages) if m is not None and not _is_conversation(m)), None)
    if bad is not None:
        raise BatchError(f"column {PROMPT_MESSAGES!r} row {bad} is {type(messages[bad]).__name__} {messages[bad]!r:.60}; each row "
                         "holds its prompt's chat conversation (a non-empty list of {'role': ..., 'content': ...} dicts) or None "
                         "for a text prompt: set it with set_column, or drop it (batch.exclude(...)) to score every row as text")


def _check_trl_columns(fn: Callable, data: Sequence[str], where: str = "") -> None:
    """A ``RewardError`` naming the data column a TRL-style reward requires (a parameter without a
    default) that is not among ``data`` (the batch's, or the prompt set's, data columns): Python's
    "exact_match() missing 1 required positional argument: 'answer'" came after the whole rollout,
    named no fix, and was blamed on sample 0. ``where`` leads the message (``"fit: "``)."""
    P = inspect.Parameter
    if reward_style(fn) != "trl" or getattr(fn, "reads_row_shares", False):
        return
    try:
        params = _parameters(fn)
    except (TypeError, ValueError):
        return
    data = [c for c in data if c not in RESERVED_COLUMNS]
    given = {"completions", *TRL_KEYWORDS, *data}
    required = [p for p in params.values() if p.default is P.empty and p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)]
    if required and required[0].kind is P.POSITIONAL_OR_KEYWORD and not _by_keyword(fn, params, given):
        required = required[1:]  # the completions, passed positionally
    missing = [p.name for p in required if p.name not in given]
    if missing:
        import difflib

        # a misspelt keyword (prompt for prompts, completion for completions) read as a data column
        close = difflib.get_close_matches(missing[0], sorted(given), n=1, cutoff=0.8)
        if close:
            raise RewardError(
                f"{where}reward {_name(fn)!r} takes a parameter {missing[0]!r}, which nothing passes: did you mean "
                f"{close[0]!r}? (rewards receive completions, {', '.join(TRL_KEYWORDS)} and the prompts' data columns "
                f"by name{', here ' + ', '.join(repr(c) for c in data) if data else ''})")
        has = ", ".join(repr(c) for c in data) if data else "none: prompts given as plain strings carry no columns"
        raise RewardError(
            f"{where}reward {_name(fn)!r} needs the column {missing[0]!r}, which the prompts do not have (their data "
            f"columns: {has}). Give the prompts as rows that carry it, e.g. [{{'prompt': ..., {missing[0]!r}: ...}}], a "
            f"JSONL file or a datasets.Dataset with a {missing[0]!r} column (rk.load_prompts), or give {missing[0]!r} a "
            f"default in the reward"
        )


def check_reward_columns(reward: Any, data: Sequence[str], where: str) -> None:
    """:func:`_check_trl_columns` for each function of ``reward``, before a rollout (``fit``)."""
    for fn in _reward_functions(reward).values():
        _check_trl_columns(fn, data, f"{where}: ")


def _call_trl(fn, batch, prompts, completions, logged: dict[str, list[float]]) -> list[Any]:
    # TRL's conversational format on chat rows (texts stay the texts: errors name samples by those)
    prompts, completions = _conversational(batch, prompts, completions)
    params = _parameters(fn)
    has_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    ids, mask = batch["response_ids"], batch["response_mask"]
    available: dict[str, Any] = {
        "prompts": prompts,
        "completion_ids": LazyRows(batch.batch_size[0], lambda lo, hi: row_tokens(ids[lo:hi], mask[lo:hi])),
    }
    for name in columns(batch):
        # the batch's own columns (texts, rollout_metrics) are not data: only per-prompt columns are passed
        if name not in RESERVED_COLUMNS:
            available[name] = column(batch, name)
    # after the columns, as TRL sets them after its own
    available.update(_trl_extras(batch, logged))
    kwargs = {k: v for k, v in available.items() if has_var_kw or k in params}
    if not getattr(fn, "reads_row_shares", False):
        # a user's function gets plain lists; a sharded one (shard_reward) slices its own rows
        kwargs = {k: materialize(v) for k, v in kwargs.items()}
        completions = materialize(completions)
    out = call_trl_style(fn, completions, kwargs)
    # returned as it is: _run_one turns it into one value per completion, and refuses one number
    # with its own message (list() of it here raised a TypeError that was blamed on sample 0)
    out = _await(out)
    # a generator runs here, where an error it raises is the reward's (named, sample by sample)
    return list(out) if isinstance(out, abc.Iterator) else out


def _truth_source(fn, batch) -> str:
    """Where a verl-style ``fn`` reads ``ground_truth``: the ``ground_truth`` column, verl's
    ``reward_model`` column (``{"style": "rule", "ground_truth": ...}``) or ``answer``."""
    cols = columns(batch)
    for name in ("ground_truth", "reward_model", "answer"):
        if name in cols:
            return name
    raise RewardError(
        f"verl-style reward {_name(fn)!r} needs a ground_truth, but the batch has none of the columns 'ground_truth', "
        f"'reward_model' (verl's {{'style': 'rule', 'ground_truth': ...}}) or 'answer' (its columns: {sorted(cols)}); "
        "give the prompts one of them (e.g. rename the reference-answer column to 'ground_truth')"
    )


def _verl_kwargs(fn, batch, i, completions, source: str = "ground_truth") -> dict[str, Any]:
    """Sample ``i``'s arguments of a verl-style ``fn``, as verl's reward managers fill them."""
    cols = set(columns(batch))
    get = lambda name, default=None: column(batch, name)[i] if name in cols else default  # noqa: E731
    truth = get(source)
    if source == "reward_model":
        if not isinstance(truth, Mapping) or "ground_truth" not in truth:
            raise RewardError(
                f"verl-style reward {_name(fn)!r}: the 'reward_model' column of sample {i} "
                f"is {truth!r:.80}, not a dict with a 'ground_truth' key (verl's {{'style': 'rule', 'ground_truth': ...}}); "
                "fix the data, or give a 'ground_truth' column"
            )
        truth = truth["ground_truth"]
    # verl passes extra_info={} where the data has none (a function may write into it): a new one each
    extra = get("extra_info") if "extra_info" in cols else {}
    return dict(data_source=get("data_source"), solution_str=completions[i], ground_truth=truth, extra_info=extra)


def _verl_score(fn, out: Any) -> Any:
    """The number in a verl-style result: the result, or its ``"score"`` where it is a dict."""
    if isinstance(out, Mapping):
        if "score" not in out:
            raise RewardError(f"reward {_name(fn)!r} returned a dict without a 'score' key: {sorted(out)}")
        out = out["score"]
    return out


def _run_verl(fn, batch, prompts, completions) -> list[Any]:
    """A per-sample verl-style ``fn`` over every row; an async one's calls awaited together."""
    name = _name(fn)
    source = _truth_source(fn, batch)
    completions = materialize(completions)  # one decode for the batch, not one per sample
    args = [_verl_kwargs(fn, batch, i, completions, source) for i in range(batch.batch_size[0])]
    if _is_async(fn):
        import asyncio

        calls = []
        try:
            for i, kw in enumerate(args):
                calls.append(fn(**kw))  # a coroutine; only a wrong signature raises here
        except Exception as exc:  # noqa: BLE001 - re-raised with the sample named
            for c in calls:
                c.close()  # never awaited: closed, not left to warn
            raise RewardError(f"reward {name!r} raised {type(exc).__name__}: {exc} on {_sample_desc(batch, i, prompts, completions)}") from exc

        async def together():
            # every sample's call in flight at once (a remote judge's latency paid once, not per
            # sample); errors kept per sample, so the first failing row is the one named
            return await asyncio.gather(*calls, return_exceptions=True)

        outs = _await(together())
        for i, out in enumerate(outs):
            if isinstance(out, BaseException):
                if not isinstance(out, Exception):
                    raise out  # cancellation, KeyboardInterrupt: not a reward's error
                raise RewardError(f"reward {name!r} raised {type(out).__name__}: {out} on {_sample_desc(batch, i, prompts, completions)}") from out
        return [_verl_score(fn, out) for out in outs]
    values = []
    for i, kw in enumerate(args):
        try:
            values.append(_verl_score(fn, _await(fn(**kw))))
        except RewardError:
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised with the sample named
            raise RewardError(f"reward {name!r} raised {type(exc).__name__}: {exc} on {_sample_desc(batch, i, prompts, completions)}") from exc
    return values


def _call_verl_batch(fn, batch, prompts, completions, logged=None) -> list[Any]:
    """verl's batched ``compute_score(data_sources, solution_strs, ground_truths, extra_infos)``,
    called once by keyword as verl's ``BatchRewardManager`` calls it, with the per-sample style's
    arguments as lists (``logged``: unused, the signature :func:`_call_trl` has)."""
    b = batch.batch_size[0]
    if not getattr(fn, "reads_row_shares", False):
        completions = materialize(completions)
    source = _truth_source(fn, batch)
    # every argument but the texts (a sharded fn slices and decodes its own share of LazyRows)
    rows = [_verl_kwargs(fn, batch, i, [None] * b, source) for i in range(b)]
    out = fn(data_sources=[r["data_source"] for r in rows], solution_strs=completions,
             ground_truths=[r["ground_truth"] for r in rows], extra_infos=[r["extra_info"] for r in rows])
    out = _await(out)
    out = list(out) if isinstance(out, abc.Iterator) else out
    if isinstance(out, (list, tuple)):
        out = [_verl_score(fn, v) for v in out]
    return out


def _run_one(fn: Callable, batch: Batch, prompts: Sequence[str], completions: Sequence[str],
             logged: dict[str, list[float]] | None = None) -> torch.Tensor:
    b = batch.batch_size[0]
    style = reward_style(fn)
    name = _name(fn)
    logged = {} if logged is None else logged
    if getattr(fn, "reads_row_shares", False) and _is_async(fn):
        raise RewardError(f"reward {name!r} is an async function, which rlkit.parallel.shard_reward does not run; "
                          "shard a plain function that runs it: def f(*args, **kw): return asyncio.run(reward(*args, **kw))")
    if style == "batch":
        values = _await(fn(batch))
    elif style == "verl":
        values = _run_verl(fn, batch, prompts, completions)
    else:
        call = _call_trl if style == "trl" else _call_verl_batch
        if style == "trl":
            _check_trl_columns(fn, columns(batch))
        try:
            values = call(fn, batch, prompts, completions, logged)
        except Exception as exc:  # noqa: BLE001
            if style == "verl_batch" and isinstance(exc, RewardError):
                raise  # score's own check of the data or the result, naming what is wrong
            if getattr(fn, "reads_row_shares", False):
                # a reward sharded over ranks (rlkit.parallel.shard_reward): its error names the
                # rank that failed, and retrying sample by sample would run collectives that a rank
                # whose reward raised a BaseException (SystemExit) never joins: the job hung
                raise RewardError(f"reward {name!r} raised {type(exc).__name__}: {exc}") from exc
            if _is_async(fn):
                # an async reward is often a remote call: not re-run once per sample to find the one that fails
                raise RewardError(f"reward {name!r} raised {type(exc).__name__}: {exc} (on the whole batch; "
                                  "an async reward is not retried sample by sample to find the failing one)") from exc
            # find the first sample that fails on its own, so the error names it
            for i in range(b):
                try:
                    call(fn, batch[i : i + 1], prompts[i : i + 1], completions[i : i + 1], {})
                except Exception:  # noqa: BLE001
                    raise RewardError(f"reward {name!r} raised {type(exc).__name__}: {exc} on {_sample_desc(batch, i, prompts, completions)}") from exc
            raise RewardError(f"reward {name!r} raised {type(exc).__name__}: {exc} (on the whole batch; every sample alone succeeded)") from exc
    if _is_ndarray(values) and values.dtype.kind in "biuf":
        # a numeric numpy array (a model's predict(...)), as a tensor of the same values: its
        # (b, 1) column was split into one-element arrays, refused per sample, where a tensor passed
        values = torch.from_numpy(values.astype("float32", copy=False).copy())
    if isinstance(values, torch.Tensor) and values.dim() > 1 and values.numel() != b:
        # a (b, 2) tensor was flattened and reported as "returned 2b values"
        raise RewardError(f"reward {name!r} returned a tensor of shape {tuple(values.shape)} for a batch of {b} responses; "
                          f"return one number per completion (shape ({b},))")
    if isinstance(values, abc.Mapping):
        # a dict was read as its keys ("returned 1 values")
        raise RewardError(f"reward {name!r} returned a dict (keys {list(values)[:4]}) for a batch of {b} responses; return "
                          "one number per completion (a list or a tensor); for several scores, give several reward "
                          "functions ({'name': fn, ...}) with weights")
    try:
        values = values.detach().float().flatten().cpu() if isinstance(values, torch.Tensor) else list(values)
    except TypeError:
        raise RewardError(f"reward {name!r} must return one number per completion (a list or a tensor), "
                          f"got {type(values).__name__} {str(values)[:60]!r}") from None
    if len(values) != b:  # before the per-sample checks, whose messages name rows
        raise RewardError(f"reward {name!r} returned {len(values)} values for a batch of {b} responses; return one number per completion")
    if isinstance(values, torch.Tensor):
        tensor, missing = values, torch.zeros(b, dtype=torch.bool)
    else:
        floats = []
        for i, v in enumerate(values):
            if v is None:
                if style in ("verl", "verl_batch"):
                    raise RewardError(f"reward {name!r} returned None for {_sample_desc(batch, i, prompts, completions)}; "
                                      "a verl-style compute_score must return a number (or a dict with a 'score' number)")
                floats.append(math.nan)
                continue
            try:
                if isinstance(v, (str, bytes)):
                    raise TypeError
                floats.append(float(v))
            except (TypeError, ValueError):
                raise RewardError(
                    f"reward {name!r} returned {type(v).__name__} {str(v)[:60]!r} for {_sample_desc(batch, i, prompts, completions)}; "
                    "return numbers (float, int or bool), or None for a sample the reward does not apply to"
                ) from None
        tensor = torch.tensor(floats, dtype=torch.float32)
        missing = torch.tensor([v is None for v in values], dtype=torch.bool)
    bad = (~torch.isfinite(tensor) & ~missing).nonzero().flatten()
    if len(bad):
        i = int(bad[0])
        raise RewardError(f"reward {name!r} returned {tensor[i].item()} for {_sample_desc(batch, i, prompts, completions)} ({len(bad)} non-finite in all); rewards must be finite numbers")
    return tensor


BUILT_IN_REWARDS = ("exact_match", "math_answer", "hash_format")


def _resolve_reward(fn: Any) -> Callable:
    """A reward function, or the name of one of :mod:`rlkit.rewards`'s (``"exact_match"``)."""
    if isinstance(fn, str):
        from rlkit import rewards

        if fn not in BUILT_IN_REWARDS:
            raise RewardError(f"unknown reward {fn!r}; built-in rewards by name: {', '.join(BUILT_IN_REWARDS)} "
                              "(or pass a function, e.g. rk.rewards.format_reward(pattern))")
        return getattr(rewards, fn)
    if not callable(fn):
        raise RewardError(f"a reward must be a function (or a built-in reward's name: {', '.join(BUILT_IN_REWARDS)}), "
                          f"got {type(fn).__name__} {fn!r:.60}")
    if isinstance(fn, torch.nn.Module) and reward_style(fn) == "trl" and not _names_completions(fn):
        # a model (TRL's reward_funcs takes one) would be called on lists of strings and fail deep
        # in its forward, once for the batch and once per sample
        raise RewardError(
            f"reward {type(fn).__name__} is a model (a torch.nn.Module), not a reward function: score calls a reward "
            "with the decoded texts (TRL style), the samples (verl style) or the Batch; wrap a sequence classifier "
            "as rk.rewards.RewardModel(model), which scores the batch's prompt + response ids"
        )
    return fn


def _names_completions(fn: Callable) -> bool:
    """``fn`` has a ``completions`` parameter: written as a TRL-style reward."""
    try:
        return "completions" in _parameters(fn)
    except (TypeError, ValueError):
        return False


def _reward_functions(reward: Any) -> dict[str, Callable]:
    """``{name: function}`` from one reward, a list of them or a ``{name: reward}`` dict."""
    if reward is None:
        raise RewardError("reward is None; pass a reward function, a list of them or a {name: function} dict "
                          f"(built-in: {', '.join(BUILT_IN_REWARDS)})")
    if isinstance(reward, Mapping):
        fns = {str(k): _resolve_reward(v) for k, v in reward.items()}
    elif callable(reward) or isinstance(reward, str):
        fn = _resolve_reward(reward)
        fns = {_name(fn): fn}
    elif isinstance(reward, Iterable):
        fns = {}
        for fn in map(_resolve_reward, reward):
            key, k = _name(fn), 1
            while key in fns:
                k += 1
                key = f"{_name(fn)}_{k}"
            fns[key] = fn
    else:
        raise RewardError(f"reward must be a function, a list of them or a dict, got {type(reward).__name__} {reward!r:.60}")
    if not fns:
        raise RewardError("score needs at least one reward function")
    return fns


def check_reward(reward: Any, where: str, weights: Any = None) -> None:
    """A ``TypeError`` led by ``where`` unless ``reward`` is what :func:`score` takes (and
    ``weights``, where given, fits it, as :func:`score`'s ``weights``: a recipe's
    ``reward_weights``): for the callers that hold a reward until their first step (``fit``,
    ``Pipeline``), where a wrong one would otherwise surface after a whole rollout."""
    try:
        fns = _reward_functions(reward)
    except RewardError as e:
        raise TypeError(f"{where}: reward must be a reward function, a list of them or a dict name -> function "
                        f"(what rk.score takes, e.g. task.reward): {e}") from None
    try:
        _reward_weights(weights, fns)
    except RewardError as e:
        raise TypeError(f"{where}: reward weights {weights!r} do not fit the reward: {e}") from None


def _reward_weights(weights: Any, fns: Mapping[str, Callable]) -> dict[str, float]:
    """One finite weight per reward function (all 1 without ``weights``)."""
    if weights is None:
        return {k: 1.0 for k in fns}
    if isinstance(weights, Mapping):
        missing, extra = set(fns) - set(weights), set(weights) - set(fns)
        if missing or extra:
            raise RewardError(f"weights must name exactly the reward functions {sorted(fns)}; "
                              f"missing {sorted(missing)}, unknown {sorted(map(str, extra))}")
        values = [weights[k] for k in fns]
    elif isinstance(weights, Iterable) and not isinstance(weights, (str, bytes)):
        values = list(weights)
        if len(values) != len(fns):
            raise RewardError(f"weights has {len(values)} values for {len(fns)} reward functions")
    else:
        raise RewardError(f"weights must be a list (one per reward function) or a {{name: weight}} dict, got {weights!r}")
    for k, v in zip(fns, values):
        if not is_real(v) or not math.isfinite(v):
            raise RewardError(f"weight of reward {k!r} must be a finite number, got {v!r}")
    return {k: float(v) for k, v in zip(fns, values)}


def score(
    batch: Batch,
    reward: Callable | Sequence[Callable] | Mapping[str, Callable],
    *,
    weights: Sequence[float] | Mapping[str, float] | None = None,
    tokenizer: Any = None,
) -> Batch:
    """Score every response; returns a new Batch with ``rewards (b)`` and ``reward/<name> (b)``
    for these reward functions (an earlier score's ``reward/*`` columns are dropped)
    (and, where a TRL-style reward called ``log_metric``, the values it logged in the batch's
    ``rollout_metrics``: the module docstring says what TRL's keywords get).

    ``reward``: a function, a list of them, or a ``{name: function}`` dict; a built-in reward may
    be given by name (:data:`BUILT_IN_REWARDS`: ``"exact_match"``, ...). ``weights``: one finite
    number per function (a list, or a dict naming exactly the functions); default 1 each.

    Rewards get the texts of the batch's ``prompt_text`` / ``response_text`` columns, else the ids
    decoded with ``tokenizer`` and ``skip_special_tokens=True`` (as TRL and verl do): special
    tokens a response holds (``"4<unk>6"``) are not in its text (``"46"``); the module docstring
    says how to score them. On rows whose prompt was a chat conversation (the batch's
    ``prompt_messages`` column, which ``rollout`` writes) TRL-style rewards get TRL's
    conversational format: ``prompts[i]`` the message list, ``completions[i]``
    ``[{"role": "assistant", "content": text}]``; text rows, and verl- and batch-style rewards,
    get the texts (the module docstring says more)."""
    validate(batch, require=("response_ids", "response_mask"))
    fns = _reward_functions(reward)
    w = _reward_weights(weights, fns)
    needs_text = any(reward_style(fn) != "batch" for fn in fns.values())
    if any(reward_style(fn) == "trl" for fn in fns.values()):
        _check_prompt_messages(batch)
    # decoded on first access (LazyRows), inside each reward's range: a reward split over ranks
    # decodes only its rows, a batch-style reward none of them (an error naming a sample shows its
    # text where a tokenizer or the text columns can give it)
    text = _texts if needs_text else _texts_if_known
    completions = text(batch, "response_text", tokenizer)
    prompts = text(batch, "prompt_text", tokenizer)
    out = shallow_copy(batch)
    # an earlier score's per-function columns go: a batch scored again (another reward, to compare)
    # kept them, and reward metrics and sample tables reported a function that made no part of rewards
    for stale in [k for k in out.keys() if isinstance(k, str) and k.startswith("reward/")]:
        del out[stale]
    total = torch.zeros(batch.batch_size[0])
    scored = torch.zeros(batch.batch_size[0], dtype=torch.bool)
    logged: dict[str, list[float]] = {}  # what TRL-style rewards give log_metric
    for key, fn in fns.items():
        with torch.profiler.record_function(f"rlkit.score.{key}"):
            values = _run_one(fn, batch, prompts, completions, logged)
        present = ~torch.isnan(values)  # NaN only where the function returned None (_run_one rejects real NaN)
        scored |= present
        out.set(f"reward/{key}", values.to(batch.device) if batch.device is not None else values)
        total += w[key] * torch.where(present, values, 0.0)
    unscored = (~scored).nonzero().flatten()
    if len(unscored):
        i = int(unscored[0])
        which = "the reward function" if len(fns) == 1 else f"every one of the {len(fns)} reward functions"
        raise RewardError(
            f"{_sample_desc(batch, i, prompts, completions)} has no reward: {which} "
            f"returned None for it ({len(unscored)} such sample(s)). None means 'does not apply', so each sample needs a "
            "number from at least one reward; return 0.0 where a score of zero is meant, or add a reward that covers these samples"
        )
    out.set("rewards", total.to(batch.device) if batch.device is not None else total)
    if logged:
        from rlkit.transforms.rollout import rollout_metrics

        # the per-batch metrics every recipe reports with its step's (a new dict: batch keeps its own)
        out.set_non_tensor("rollout_metrics", {**rollout_metrics(batch), **{k: sum(v) / len(v) for k, v in logged.items()}})
    return out
