"""Prompts: from a list, a JSONL file or a ``datasets`` dataset, tokenized once, batched
deterministically and resumably.

A :class:`Prompts` value is one batch of prompts (text, token ids and per-prompt columns such as
``answer``); a :class:`PromptSet` is the whole data set, which yields ``Prompts`` batches in an
order fixed by ``(seed, epoch)`` so that resuming at ``data_position`` continues exactly.
"""
from __future__ import annotations

import json
import operator
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import torch

from rlkit._checks import int_at_least
from rlkit.batch import RESERVED_COLUMNS, reserved_names


class DataError(ValueError):
    """Bad prompt data; the message names the row and the field."""


@dataclass(frozen=True)
class Prompts:
    """One batch of prompts: ``text[i]``, ``ids[i]`` (unpadded token ids), ``columns[name][i]``."""

    text: list[str]
    ids: list[list[int]]
    columns: dict[str, list[Any]] = field(default_factory=dict)

    def __post_init__(self):
        n = len(self.ids)
        bad = {name: len(v) for name, v in [("text", self.text), *((f"columns[{k!r}]", v) for k, v in self.columns.items())] if len(v) != n}
        if bad:
            raise DataError(f"Prompts has {n} rows of ids but {bad}; every field needs one entry per prompt")

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index) -> "Prompts":
        """``prompts[i]``: row ``i`` as a one-row Prompts; ``prompts[a:b]``: those rows."""
        if not isinstance(index, slice):
            i = operator.index(index)
            n = len(self.ids)
            if not -n <= i < n:
                # without this, iteration (which calls [0], [1], ... until IndexError) never ended
                raise IndexError(f"prompt {index} out of range for {n} prompts")
            i %= n
            index = slice(i, i + 1)
        return Prompts(self.text[index], self.ids[index], {k: v[index] for k, v in self.columns.items()})


def _encode(tokenizer, text: str | list, chat: bool) -> list[int]:
    if chat or isinstance(text, list):
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError("prompt is a list of chat messages but the tokenizer has no chat_template; give plain text prompts or a tokenizer with a chat template")
        messages = text if isinstance(text, list) else [{"role": "user", "content": text}]
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, Mapping) or hasattr(out, "input_ids"):
            # transformers 5 returns a BatchEncoding (input_ids, attention_mask) where 4.x returned the ids
            out = out["input_ids"]
        return [int(t) for t in out]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _rows(source: Any, prompt_key: str) -> list[Mapping[str, Any]]:
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.exists(path):
            raise DataError(f"prompt file {path!r} does not exist")
        rows = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}: line {n} is not valid JSON ({exc.msg}); each line must be one JSON object or string") from exc
                # a line holding a JSON string (or a list of chat messages) is a prompt, as in a list
                rows.append({prompt_key: item} if isinstance(item, (str, list)) else item)
        return rows
    if hasattr(source, "column_names") and hasattr(source, "__getitem__"):  # datasets.Dataset
        return [source[i] for i in range(len(source))]
    if isinstance(source, Mapping):
        if isinstance(source.get(prompt_key), str):  # one row
            return [source]
        # columns: {"prompt": [...], "answer": [...]}
        if prompt_key not in source:
            raise DataError(f"prompt columns {sorted(map(str, source))} have no {prompt_key!r} column; pass prompt_key= to name it")
        lengths = {str(k): len(v) if isinstance(v, (list, tuple)) else None for k, v in source.items()}
        if any(n is None for n in lengths.values()) or len(set(lengths.values())) != 1:
            raise DataError(f"a dict of prompt columns needs one list per column, all of one length; got lengths {lengths}")
        keys = list(source)
        return [{k: source[k][i] for k in keys} for i in range(lengths[str(prompt_key)])]
    rows = []
    for item in source:
        rows.append({prompt_key: item} if isinstance(item, (str, list)) else item)
    return rows


@dataclass
class PromptSet:
    """A tokenized prompt data set. Iterate batches with :meth:`batches`."""

    text: list[str]
    ids: list[list[int]]
    columns: dict[str, list[Any]]

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, index: Sequence[int]) -> Prompts:
        return Prompts([self.text[i] for i in index], [self.ids[i] for i in index], {k: [v[i] for i in index] for k, v in self.columns.items()})

    def order(self, epoch: int, seed: int, shuffle: bool = True) -> list[int]:
        if not shuffle:
            return list(range(len(self)))
        g = torch.Generator().manual_seed(hash((seed, epoch)) & 0x7FFFFFFF)
        return torch.randperm(len(self), generator=g).tolist()

    def batch_at(self, position: int, batch_size: int, *, seed: int = 0, shuffle: bool = True) -> Prompts:
        """The ``position``-th batch of the endless epoch-by-epoch stream (drop_last per epoch)."""
        int_at_least(batch_size, "batch_size")
        int_at_least(position, "position", 0)
        per_epoch = len(self) // batch_size
        if per_epoch == 0:
            raise DataError(f"batch_size={batch_size} is larger than the prompt set ({len(self)} prompts); lower batch_size")
        epoch, k = divmod(position, per_epoch)
        order = self.order(epoch, seed, shuffle)
        return self.take(order[k * batch_size : (k + 1) * batch_size])

    def batches(self, batch_size: int, steps: int, *, seed: int = 0, start: int = 0, shuffle: bool = True) -> Iterator[Prompts]:
        """The batches at stream positions ``start`` .. ``steps - 1``: ``steps`` is the whole run's
        length, so a run resumed at its ``data_position`` gets the batches it has left
        (``steps - start`` of them)."""
        int_at_least(batch_size, "batch_size")
        int_at_least(steps, "steps", 0)
        int_at_least(start, "start", 0)
        return self._batches(batch_size, steps, seed, start, shuffle)

    def _batches(self, batch_size: int, steps: int, seed: int, start: int, shuffle: bool) -> Iterator[Prompts]:
        for position in range(start, steps):
            yield self.batch_at(position, batch_size, seed=seed, shuffle=shuffle)


def load_prompts(
    source: Any,
    tokenizer,
    *,
    prompt_key: str = "prompt",
    max_prompt_tokens: int | None = None,
    truncate: bool = False,
    chat: bool = False,
) -> PromptSet:
    """Load prompts from a list of strings/dicts, a JSONL path, or a ``datasets.Dataset``
    (a :class:`PromptSet` or :class:`Prompts`, already tokenized, is taken as it is).

    Every other key of a row (``answer``, ``ground_truth``, ``data_source``...) becomes a column
    that reward functions receive by name. A prompt longer than ``max_prompt_tokens`` is an error
    naming it, unless ``truncate=True`` (keeps the last tokens).
    """
    if max_prompt_tokens is not None:
        int_at_least(max_prompt_tokens, "max_prompt_tokens", hint=" or None (no limit)")
    if isinstance(source, PromptSet):
        return source
    if isinstance(source, Prompts):  # one batch, already tokenized: taken as it is
        return PromptSet(list(source.text), list(source.ids), {k: list(v) for k, v in source.columns.items()})
    if tokenizer is None:
        raise DataError("load_prompts needs a tokenizer to turn prompts into token ids; pass one (e.g. state.tokenizer)")
    rows = _rows(source, prompt_key)
    if not rows:
        raise DataError("the prompt set is empty; give at least one prompt")
    text, ids = [], []
    columns: dict[str, list[Any]] = {}
    keys = None
    for n, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise DataError(f"prompt row {n} is a {type(row).__name__}; rows must be strings, chat message lists or dicts with a {prompt_key!r} key")
        if prompt_key not in row:
            raise DataError(f"prompt row {n} has no {prompt_key!r} field (it has {sorted(row)}); pass prompt_key= to name the prompt column")
        value = row[prompt_key]
        if not isinstance(value, (str, list)):
            raise DataError(f"prompt row {n}: field {prompt_key!r} must be text (or a list of chat messages), got {type(value).__name__} {value!r:.60}")
        if isinstance(value, str) and not value.strip():
            raise DataError(f"prompt row {n}: field {prompt_key!r} is empty")
        tok = _encode(tokenizer, value, chat)
        if max_prompt_tokens is not None and len(tok) > max_prompt_tokens:
            if not truncate:
                raise DataError(f"prompt row {n} has {len(tok)} tokens, over max_prompt_tokens={max_prompt_tokens} ({str(value)[:60]!r}...); raise the limit or pass truncate=True")
            tok = tok[-max_prompt_tokens:]
        others = {k: v for k, v in row.items() if k != prompt_key}
        if keys is None:
            reserved = reserved_names(others)
            if reserved:
                raise DataError(
                    f"prompt columns {reserved} are names rlkit's batch uses itself ({', '.join(sorted(RESERVED_COLUMNS))}, "
                    "reward/...); rename them in the data (e.g. 'ref_answer')"
                )
            keys = set(others)
            columns = {k: [] for k in keys}
        elif set(others) != keys:
            raise DataError(f"prompt row {n} has columns {sorted(others)} but row 0 has {sorted(keys)}; every row needs the same fields")
        for k, v in others.items():
            columns[k].append(v)
        text.append(value if isinstance(value, str) else json.dumps(value))
        ids.append(tok)
    return PromptSet(text, ids, columns)


def as_prompts(prompts: Any, tokenizer) -> Prompts:
    """Accept a Prompts value, a string, a list of strings or dicts, or a dict (one row, or
    columns of equal length) for ``rollout``: what :func:`load_prompts` reads."""
    if isinstance(prompts, Prompts):
        return prompts
    if isinstance(prompts, PromptSet):  # every prompt of the set
        return Prompts(prompts.text, prompts.ids, prompts.columns)
    if isinstance(prompts, str):
        prompts = [prompts]
    if tokenizer is None:
        raise DataError("rollout got text prompts but the state has no tokenizer; pass tokenizer= to rk.init")
    # a dict (one row, or columns) as load_prompts reads it: list() of it was its keys, sampled as prompts
    s = load_prompts(prompts if isinstance(prompts, Mapping) else list(prompts), tokenizer)
    return Prompts(s.text, s.ids, s.columns)
