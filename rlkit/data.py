"""Prompts: from a list, a file (JSONL, JSON, CSV, Parquet), a ``datasets`` dataset or a pandas
DataFrame, tokenized once, batched deterministically and resumably.

A :class:`Prompts` value is one batch of prompts (text, token ids and per-prompt columns such as
``answer``); a :class:`PromptSet` is the whole data set, which yields ``Prompts`` batches in an
order fixed by ``(seed, epoch)`` so that resuming at ``data_position`` continues exactly.
"""
from __future__ import annotations

import json
import operator
import os
import reprlib
import sys
import warnings
from collections import abc
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import torch

from rlkit._checks import int_at_least, is_int
from rlkit.batch import RESERVED_COLUMNS, reserved_names


class DataError(ValueError):
    """Bad prompt data; the message names the row and the field."""


def _is_array(x: Any) -> bool:
    """A torch tensor or a numpy array (numpy not imported)."""
    return isinstance(x, torch.Tensor) or (type(x).__module__ == "numpy" and type(x).__name__ == "ndarray")


#: a bounded repr for the values a data repr shows (a first prompt, column names, a task's info): a
#: notebook cell, a debugger's variable view or a traceback with locals shows it as it is
_BRIEF = reprlib.Repr()
_BRIEF.maxstring, _BRIEF.maxother, _BRIEF.maxlist, _BRIEF.maxdict, _BRIEF.maxlevel = 60, 60, 8, 8, 2


def _brief(value: Any) -> str:
    return _BRIEF.repr(value)


def _rows_repr(kind: str, n: int, text: Sequence[Any], columns: Mapping[str, Any]) -> str:
    """``kind(n=..., columns=[...], first=...)``: the size and shape of a prompt set or batch, not
    its rows (the generated repr printed every prompt, id row and column: megabytes for a large set)."""
    first = f", first={_brief(text[0])}" if n and len(text) else ""
    return f"{kind}(n={n}, columns={_brief(list(columns))}{first})"


#: the end of the errors about token-id rows given where prompts (text or chat) are read
_IDS_HINT = ("; it looks like token ids: prompts already tokenized go in rk.Prompts(texts, ids) (ids: lists of ints, or "
             "1-d integer tensors or numpy arrays), which rollout takes as they are")


def _id_rows(ids: Any, where: str) -> Any:
    """``ids`` with every tensor / numpy-array row as a list of Python ints (what a tokenizer's
    ``return_tensors=`` gives, and what :func:`rlkit.make_batch` takes). Such rows failed in
    ``rollout`` with "Boolean value of Tensor ... is ambiguous", and a one-token ``tensor([0])`` was
    reported as empty. A 2-d integer tensor or array is its rows. Rows of another kind (lists)
    are left as they are. A tokenizer's whole output (``tokenizer(texts, padding=True,
    return_tensors="pt")``, a mapping with ``input_ids`` and ``attention_mask``) gives each row's
    tokens where its mask is 1: its padded ``input_ids`` alone would make the padding part of
    every shorter prompt."""
    if isinstance(ids, Mapping) and "input_ids" in ids:
        mask = ids.get("attention_mask")
        rows = _id_rows(ids["input_ids"], where)
        if mask is None:
            return rows
        mask = mask.tolist() if _is_array(mask) else list(mask)
        if len(mask) != len(rows) or any(len(m) != len(r) for m, r in zip(mask, rows)):
            raise DataError(f"{where}: ids' attention_mask does not have the shape of its input_ids; give the tokenizer's output "
                            "unchanged, or a list of unpadded rows of token ids")
        return [[t for t, keep in zip(row, m) if keep] for row, m in zip(rows, mask)]
    if _is_array(ids):
        kind = ids.dtype.kind if not isinstance(ids, torch.Tensor) else None
        integral = kind in ("i", "u") if kind is not None else not (ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool)
        if not integral or ids.ndim != 2:
            raise DataError(f"{where}: ids is a {ids.ndim}-d {ids.dtype} {type(ids).__name__}; give a list of rows of integer token ids "
                            "(or a 2-d integer tensor, one row per prompt)")
        return ids.tolist()
    if all(type(row) is list for row in ids):
        return ids  # the usual case: nothing to convert
    rows = list(ids)
    for i, row in enumerate(rows):
        if not _is_array(row):
            continue
        if isinstance(row, torch.Tensor):
            integral = not (row.dtype.is_floating_point or row.dtype.is_complex or row.dtype == torch.bool)
        else:
            integral = row.dtype.kind in ("i", "u")
        if not integral or row.ndim != 1:
            raise DataError(f"{where}: ids row {i} is a {row.ndim}-d {row.dtype} {type(row).__name__}; a row of token ids "
                            "must be a list of ints, or a 1-d integer tensor or numpy array (e.g. tokenizer(text)['input_ids'])")
        rows[i] = [int(t) for t in row.tolist()]
    return rows


def check_padding(ids: Sequence[Sequence[int]], tokenizer, where: str) -> None:
    """Refuse prompt rows that end (or begin) with the tokenizer's pad token: the padding of a
    padded id tensor (``tokenizer(texts, padding=True, return_tensors="pt")["input_ids"]``) given as
    prompts. The engine generated after the padding, silently other responses than for the same
    text (and a pad that is also a stop id can end the response at once). A leading pad that is
    also the tokenizer's BOS is a real BOS and passes."""
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    if not is_int(pad):
        return
    bos = getattr(tokenizer, "bos_token_id", None)
    padded = [i for i, row in enumerate(ids) if len(row) and (row[-1] == pad or (row[0] == pad and pad != bos))]
    if not padded:
        return
    shown = ", ".join(map(str, padded[:10])) + (f", ... ({len(padded)} in all)" if len(padded) > 10 else "")
    raise DataError(
        f"{where}: prompt row {padded[0]} begins or ends with the pad token (id {pad}), so its ids hold padding the model "
        f"would take for prompt (rows: {shown}). Give the tokenizer's whole output, rk.Prompts(texts, tokenizer(texts, "
        "padding=True, return_tensors='pt')), whose attention_mask drops the padding, or unpadded rows "
        "(tokenizer(texts)['input_ids']), or the texts alone")


def _check_messages(messages: Any, n: int, where: str) -> list[Any] | None:
    """``messages`` (one chat conversation or None per prompt, or None for no conversation at all)
    as a list, checked: a wrong entry would otherwise reach the rewards as a prompt."""
    if messages is None:
        return None
    if isinstance(messages, (str, bytes)) or not isinstance(messages, abc.Sequence):
        raise DataError(f"{where}: messages must be a list with one entry per prompt (a chat conversation, or None for a "
                        f"text prompt), or None; got {type(messages).__name__} {messages!r:.60}")
    messages = list(messages)
    if len(messages) != n:
        raise DataError(f"{where} has {n} rows of ids but {len(messages)} messages; give one entry per prompt (None for a text prompt)")
    bad = next((i for i, m in enumerate(messages) if m is not None and not _is_conversation(m)), None)
    if bad is not None:
        raise DataError(f"{where}: messages[{bad}] is {messages[bad]!r:.60}; each entry is a chat conversation (a non-empty "
                        "list of {'role': ..., 'content': ...} dicts) or None for a text prompt")
    return messages


@dataclass(frozen=True)
class Prompts:
    """One batch of prompts: ``text[i]``, ``ids[i]`` (unpadded token ids), ``columns[name][i]``.

    An ``ids`` row may be a list of ints, or a 1-d integer tensor or numpy array (converted to a
    list); ``ids`` may be a 2-d integer tensor (one row per prompt). Its repr shows the size, the
    column names and the first prompt (clipped), e.g. ``Prompts(n=8, columns=['answer'], first='27+43=')``.

    ``messages[i]``: the chat conversation prompt ``i`` was (its list of ``{"role", "content"}``
    messages; ``text[i]`` is its JSON), None where it was text; ``messages`` is None where no prompt
    was a conversation. :func:`load_prompts` fills it; ``rollout`` carries it into the batch's
    ``prompt_messages`` column, from which ``rk.score`` gives TRL-style rewards the conversation
    itself, as TRL does. Kept apart from ``text`` so that a text prompt that happens to be JSON
    stays text."""

    text: list[str]
    ids: list[list[int]]
    columns: dict[str, list[Any]] = field(default_factory=dict)
    messages: list[list[dict[str, Any]] | None] | None = None

    def __post_init__(self):
        object.__setattr__(self, "ids", _id_rows(self.ids, "Prompts"))
        n = len(self.ids)
        bad = {name: len(v) for name, v in [("text", self.text), *((f"columns[{k!r}]", v) for k, v in self.columns.items())] if len(v) != n}
        if bad:
            raise DataError(f"Prompts has {n} rows of ids but {bad}; every field needs one entry per prompt")
        object.__setattr__(self, "messages", _check_messages(self.messages, n, "Prompts"))

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        return _rows_repr(type(self).__name__, len(self.ids), self.text, self.columns)

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
        return Prompts(self.text[index], self.ids[index], {k: v[index] for k, v in self.columns.items()},
                       None if self.messages is None else self.messages[index])


def chat_template_options(messages: Sequence[Mapping[str, Any]]) -> dict[str, bool]:
    """How a conversation is rendered as a prompt, as TRL renders one: a new assistant turn opened
    after it (``add_generation_prompt=True``), or, when it ends with an assistant message (a
    prefill: ``{"role": "assistant", "content": "Let"}``), that message continued
    (``continue_final_message=True``). The prefill was closed and a new assistant turn opened, so a
    dataset ported from TRL trained on other prompts than in TRL."""
    last = messages[-1] if messages else None
    if isinstance(last, Mapping) and last.get("role") == "assistant":
        return {"add_generation_prompt": False, "continue_final_message": True}
    return {"add_generation_prompt": True}


def _encode(tokenizer, text: str | list, chat: bool) -> list[int]:
    if chat or isinstance(text, list):
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError("prompt is a list of chat messages but the tokenizer has no chat_template; give plain text prompts or a tokenizer with a chat template")
        messages = text if isinstance(text, list) else [{"role": "user", "content": text}]
        out = tokenizer.apply_chat_template(messages, tokenize=True, **chat_template_options(messages))
        if isinstance(out, Mapping) or hasattr(out, "input_ids"):
            # transformers 5 returns a BatchEncoding (input_ids, attention_mask) where 4.x returned the ids
            out = out["input_ids"]
        return [int(t) for t in out]
    from rlkit.models.tokenizers import encode_prompt

    # with the tokenizer's leading special tokens (BOS), as TRL and vLLM encode a text prompt; a
    # chat template above writes its own
    return encode_prompt(tokenizer, text)


#: prompt file extensions :func:`load_prompts` reads, and their formats
FILE_FORMATS = {".jsonl": "JSON lines", ".ndjson": "JSON lines", ".json": "JSON", ".csv": "CSV", ".tsv": "TSV", ".parquet": "Parquet"}

#: what :func:`load_prompts` takes, as its errors name it
SOURCES = ("a list of strings, of chat conversations or of dicts with a prompt key, a {column: [values]} dict, "
           f"a {'/'.join(FILE_FORMATS)} path, a datasets.Dataset or a pandas.DataFrame")


def _is_conversation(value: Any) -> bool:
    """``value`` is one chat conversation: a non-empty list of dicts (messages)."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, Mapping) for m in value)


def _as_row(item: Any, prompt_key: str) -> Any:
    # a string (or a list of chat messages) is a prompt, as in a list
    return {prompt_key: item} if isinstance(item, (str, list)) else item


def _jsonl_rows(path: str, prompt_key: str) -> tuple[list[Any], list[str]]:
    rows, where = [], []
    with open(path, encoding="utf-8-sig") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}: line {n} is not valid JSON ({exc.msg}); each line must be one JSON object or string") from exc
            rows.append(_as_row(item, prompt_key))
            where.append(f"{path} line {n}")
    return rows, where


def _file_rows(path: str, prompt_key: str) -> tuple[list[Any], list[str]]:
    """The rows of a prompt file, read by its extension (:data:`FILE_FORMATS`), and where each
    one is in the file (``"<path> line <n>"``) for errors to name."""
    if not os.path.exists(path):
        raise DataError(f"prompt file {path!r} does not exist")
    ext = os.path.splitext(path)[1].lower()
    if ext not in FILE_FORMATS:
        raise DataError(
            f"prompt file {path!r} has the extension {ext or '(none)'!r}; rlkit reads prompt files by their extension: "
            + ", ".join(f"{k} ({v})" for k, v in FILE_FORMATS.items())
            + "; rename the file to the extension of its format, or read it yourself and pass the rows (a list of dicts)"
        )
    if FILE_FORMATS[ext] == "JSON lines":
        return _jsonl_rows(path, prompt_key)
    if FILE_FORMATS[ext] == "JSON":
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            if exc.msg == "Extra data":  # one JSON value per line in a .json file, as datasets' json loader reads it
                return _jsonl_rows(path, prompt_key)
            raise DataError(f"{path}: line {exc.lineno} column {exc.colno} is not valid JSON ({exc.msg}); a .json prompt file "
                            "holds a JSON array of rows, or one JSON object per line") from exc
        if isinstance(data, Mapping):  # one row, or {column: [values]}
            rows = _mapping_rows(data, prompt_key)
            return rows, [f"{path} row {i}" for i in range(len(rows))]
        if not isinstance(data, list):
            raise DataError(f"{path} holds a JSON {type(data).__name__}; a .json prompt file holds a JSON array of rows "
                            "(strings, chat conversations or objects with a prompt key) or a {column: [values]} object")
        return [_as_row(item, prompt_key) for item in data], [f"{path} item {i}" for i in range(len(data))]
    if FILE_FORMATS[ext] in ("CSV", "TSV"):
        import csv

        rows, where = [], []
        with open(path, encoding="utf-8-sig", newline="") as f:
            reader = csv.DictReader(f, delimiter="\t" if ext == ".tsv" else ",")
            for row in reader:
                if None in row or None in row.values():  # DictReader's marks of a value too many, or too few
                    raise DataError(f"{path} line {reader.line_num} has {'more' if None in row else 'fewer'} values than the "
                                    f"{len(reader.fieldnames)} columns of its header line; give every line one value per column")
                rows.append(row)
                where.append(f"{path} line {reader.line_num}")
        return rows, where
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading the Parquet file {path!r} needs pyarrow; pip install pyarrow, "
                        "or read it yourself and pass the rows (a list of dicts)") from None
    rows = pq.read_table(path).to_pylist()
    return rows, [f"{path} row {i}" for i in range(len(rows))]


def _mapping_rows(source: Mapping, prompt_key: str) -> list[Mapping[str, Any]]:
    """One dict: one row (its prompt a string or one chat conversation), or columns of equal length."""
    if isinstance(source.get(prompt_key), str) or _is_conversation(source.get(prompt_key)):  # one row
        return [source]
    # columns: {"prompt": [...], "answer": [...]}
    if prompt_key not in source:
        raise DataError(f"prompt columns {sorted(map(str, source))} have no {prompt_key!r} column; name the prompt column with "
                       f"rk.load_prompts(data, tokenizer, prompt_key=...) and pass its result on")
    lengths = {str(k): len(v) if isinstance(v, (list, tuple)) else None for k, v in source.items()}
    if any(n is None for n in lengths.values()) or len(set(lengths.values())) != 1:
        raise DataError(f"a dict of prompt columns needs one list per column, all of one length; got lengths {lengths}")
    keys = list(source)
    return [{k: source[k][i] for k in keys} for i in range(lengths[str(prompt_key)])]


def _plain(value: Any) -> Any:
    """A numpy value (as pandas holds list columns and numbers) or a tensor (a ``datasets.Dataset``
    formatted as torch) as the Python one: a reward comparing ``"3"`` with ``str(tensor(3))``
    scored every correct answer 0."""
    module = type(value).__module__
    return value.tolist() if (module == "numpy" or module.startswith("torch")) and hasattr(value, "tolist") else value


def _rows(source: Any, prompt_key: str) -> tuple[list[Any], list[str] | None]:
    """The rows of ``source``, and where each one is in its file (None when not from a file)."""
    if isinstance(source, (str, os.PathLike)):
        return _file_rows(os.fspath(source), prompt_key)
    pandas, datasets = sys.modules.get("pandas"), sys.modules.get("datasets")
    if pandas is not None and isinstance(source, pandas.DataFrame):  # iterating one yields its column names
        return [{str(k): _plain(v) for k, v in row.items()} for row in source.to_dict("records")], None
    if datasets is not None and isinstance(source, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        raise DataError(f"load_prompts got a {type(source).__name__} of the splits {sorted(source)}; pass one split, "
                        f"e.g. load_prompts(data[{next(iter(source), 'train')!r}], tokenizer)")
    if datasets is not None and isinstance(source, datasets.IterableDataset):
        raise DataError("load_prompts got a streaming datasets.IterableDataset; it reads and tokenizes the whole prompt set "
                        "once, which a stream (maybe endless) does not allow: load the data set without streaming=True, "
                        "or pass a finite part of it, e.g. list(data.take(1000))")
    if hasattr(source, "column_names") and hasattr(source, "__getitem__") and hasattr(source, "__len__"):  # datasets.Dataset
        if callable(getattr(source, "with_format", None)):
            source = source.with_format(None)  # set_format("torch"/"numpy") would hand the rewards tensors and arrays
        rows = (source[i] for i in range(len(source)))
        return [{str(k): _plain(v) for k, v in row.items()} if isinstance(row, Mapping) else row for row in rows], None
    if isinstance(source, Mapping):
        return _mapping_rows(source, prompt_key), None
    if not isinstance(source, abc.Iterable):
        raise DataError(f"load_prompts cannot read a {type(source).__name__}; give {SOURCES}")
    rows = []
    for n, item in enumerate(source):
        if not isinstance(item, (str, list, Mapping)):
            raise DataError(f"load_prompts got a {type(source).__name__} whose item {n} is a {type(item).__name__} "
                            f"({item!r:.60}); rows must be strings, chat conversations or dicts with a {prompt_key!r} key: "
                            f"give {SOURCES}" + (_IDS_HINT if _is_array(item) else ""))
        rows.append(_as_row(item, prompt_key))
    return rows, None


def prompt_fingerprint(prompts) -> str | None:
    """A short digest of a prompt set's size and of the token ids of up to 256 evenly spaced rows
    (``None`` for an object without ``ids``, or an empty one).

    ``fit`` keeps it with ``state.data_position`` (in ``state.extras``), so that a run resumed on
    other prompts is noticed (a position counts batches of one particular set), and the ranks of a
    distributed ``fit`` compare it. Sampling rows keeps a million-prompt set to milliseconds; an
    edit that leaves the size and the sampled rows alone goes unnoticed."""
    import hashlib

    ids = getattr(prompts, "ids", None)
    if not ids:
        return None
    n = len(ids)
    h = hashlib.sha256(str(n).encode())
    for i in sorted({i * n // 256 for i in range(min(n, 256))}):
        h.update(b"|" + ",".join(map(str, ids[i])).encode())
    return h.hexdigest()[:16]


@dataclass
class PromptSet:
    """A tokenized prompt data set. Iterate batches with :meth:`batches`. Its repr shows the size,
    the column names and the first prompt (clipped), e.g.
    ``PromptSet(n=4000, columns=['answer'], first='27+43=')``. ``messages``: as :class:`Prompts`'s
    (each chat prompt's conversation, None for a text one; None when no prompt is a conversation),
    passed on to the batches it yields."""

    text: list[str]
    ids: list[list[int]]
    columns: dict[str, list[Any]]
    # a default, so a set pickled before the field existed reads None (the class attribute)
    messages: list[list[dict[str, Any]] | None] | None = None

    def __post_init__(self):
        self.ids = _id_rows(self.ids, "PromptSet")  # tensor / numpy rows as lists, as Prompts takes them
        self.messages = _check_messages(self.messages, len(self.ids), "PromptSet")

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        return _rows_repr(type(self).__name__, len(self), self.text, self.columns)

    def __getstate__(self) -> dict[str, Any]:
        # without the cached epoch order (len(self) int64s), which is rebuilt on demand
        return {k: v for k, v in self.__dict__.items() if k != "_order_cache"}

    def fingerprint(self) -> str | None:
        """:func:`prompt_fingerprint` of this set."""
        return prompt_fingerprint(self)

    def take(self, index: Sequence[int]) -> Prompts:
        index = list(index)
        return Prompts([self.text[i] for i in index], [self.ids[i] for i in index], {k: [v[i] for i in index] for k, v in self.columns.items()},
                       None if self.messages is None else [self.messages[i] for i in index])

    def order(self, epoch: int, seed: int, shuffle: bool = True) -> list[int]:
        """The prompt indices of epoch ``epoch`` in order (a permutation fixed by ``(seed, epoch)``)."""
        if not shuffle:
            return list(range(len(self)))
        return self._permutation(epoch, seed).tolist()

    def _permutation(self, epoch: int, seed: int) -> torch.Tensor:
        """The shuffled order of ``epoch`` as a tensor, cached for the current ``(seed, epoch)``:
        :meth:`batch_at` runs every step, and rebuilding the permutation (and a list of every index)
        each time cost O(len) per step (50-80 ms with a million prompts), for an order that only
        changes once per epoch."""
        key = (seed, epoch, len(self))
        cached = self.__dict__.get("_order_cache")
        if cached is not None and cached[0] == key:
            return cached[1]
        g = torch.Generator().manual_seed(hash((seed, epoch)) & 0x7FFFFFFF)
        perm = torch.randperm(len(self), generator=g)
        self.__dict__["_order_cache"] = (key, perm)  # one assignment: a reader sees the key with its order
        return perm

    def batch_at(self, position: int, batch_size: int, *, seed: int = 0, shuffle: bool = True) -> Prompts:
        """The ``position``-th batch of the endless epoch-by-epoch stream (drop_last per epoch)."""
        int_at_least(batch_size, "batch_size")
        int_at_least(position, "position", 0)
        per_epoch = len(self) // batch_size
        if per_epoch == 0:
            raise DataError(f"batch_size={batch_size} is larger than the prompt set ({len(self)} prompts); lower batch_size")
        epoch, k = divmod(position, per_epoch)
        if not shuffle:
            return self.take(range(k * batch_size, (k + 1) * batch_size))
        return self.take(self._permutation(epoch, seed)[k * batch_size : (k + 1) * batch_size].tolist())

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
    """Load prompts from a list of strings/dicts, a dict (one row, or ``{column: [values]}``), a
    file, a ``datasets.Dataset`` or a ``pandas.DataFrame`` (a :class:`PromptSet` or
    :class:`Prompts`, already tokenized, is taken as it is).

    A file is read by its extension (:data:`FILE_FORMATS`): ``.jsonl`` one JSON row per line;
    ``.json`` a JSON array of rows (or one object per line, or ``{column: [values]}``); ``.csv`` /
    ``.tsv`` a header line then one row per line (every value a string); ``.parquet`` (needs
    pyarrow). Other extensions are refused. A streaming ``datasets.IterableDataset`` is refused:
    the whole set is read and tokenized once (pass ``list(data.take(n))``).

    A row's prompt is text, or a chat conversation (a list of ``{"role", "content"}`` messages,
    rendered with the tokenizer's chat template; the set keeps the messages, ``messages``, for
    TRL-style rewards, and their JSON as the prompt's ``text``). ``chat=True`` renders text prompts
    as one user message each; they stay text prompts (rewards get the text, as TRL gives them a
    standard, non-conversational dataset's). Text is tokenized with the special tokens the
    tokenizer puts before it (Llama's BOS), as TRL and vLLM tokenize a text prompt, and none after
    (:func:`rlkit.models.tokenizers.encode_prompt`). Every other key of a row (``answer``,
    ``ground_truth``, ``data_source``...) becomes a column that reward functions receive by name.
    A prompt with characters the tokenizer encodes as its unknown token is an error naming the
    row and the characters; one longer than ``max_prompt_tokens`` is an error naming it, unless
    ``truncate=True`` (keeps the last tokens; a text prompt's ``text`` becomes the kept tokens' text,
    a conversation keeps its messages, with a warning). Errors about a row from a file name the file and
    the line.
    """
    if max_prompt_tokens is not None:
        int_at_least(max_prompt_tokens, "max_prompt_tokens", hint=" or None (no limit)")
    if isinstance(source, PromptSet):
        return source
    if isinstance(source, Prompts):  # one batch, already tokenized: taken as it is
        return PromptSet(list(source.text), list(source.ids), {k: list(v) for k, v in source.columns.items()},
                         None if source.messages is None else list(source.messages))
    if tokenizer is None:
        raise DataError("load_prompts needs a tokenizer to turn prompts into token ids; pass one (e.g. state.tokenizer)")
    rows, origins = _rows(source, prompt_key)
    if not rows:
        raise DataError("the prompt set is empty; give at least one prompt")
    from rlkit.models.tokenizers import check_known_characters

    text, ids, messages = [], [], []
    cut_conversations: list[int] = []
    columns: dict[str, list[Any]] = {}
    keys = None
    for n, row in enumerate(rows):
        where = f"prompt row {n}" if origins is None else f"prompt row {n} ({origins[n]})"
        if not isinstance(row, Mapping):
            raise DataError(f"{where} is a {type(row).__name__}; rows must be strings, chat message lists or dicts with a {prompt_key!r} key")
        if prompt_key not in row:
            hint = (" (it looks like one chat message: a conversation, a list of messages, is one prompt; "
                    "pass a list of conversations or {'prompt': messages})") if {"role", "content"} <= set(row) else ""
            raise DataError(f"{where} has no {prompt_key!r} field (it has {sorted(row)}); name the prompt column with "
                            f"rk.load_prompts(data, tokenizer, prompt_key=...) and pass its result on{hint}")
        value = row[prompt_key]
        if not isinstance(value, (str, list)):
            raise DataError(f"{where}: field {prompt_key!r} must be text (or a list of chat messages), got {type(value).__name__} {value!r:.60}")
        if isinstance(value, str) and not value.strip():
            raise DataError(f"{where}: field {prompt_key!r} is empty")
        if isinstance(value, list):
            bad = next((j for j, m in enumerate(value) if not (isinstance(m, Mapping) and "role" in m and "content" in m)), None)
            if not value or bad is not None:
                raise DataError(
                    f"{where}: field {prompt_key!r} is a list, so it must be a chat conversation, a non-empty list of "
                    f"{{'role': ..., 'content': ...}} messages, but "
                    + (f"message {bad} is {value[bad]!r:.60}" if value else "it is empty")
                    + "; give the prompt as text, or as messages with 'role' and 'content'"
                    + (_IDS_HINT if value and all(type(t) is int for t in value) else "")
                )
        tok = _encode(tokenizer, value, chat)
        if getattr(tokenizer, "unk_token_id", None) in tok:
            # encoded as the unknown token: the model cannot tell those characters apart (rlkit.sft checks the same)
            conversation = value if isinstance(value, list) else [{"role": "user", "content": value}]
            shown = value if isinstance(value, str) else tokenizer.apply_chat_template(
                conversation, tokenize=False, **chat_template_options(conversation))
            try:
                check_known_characters(tokenizer, shown, tok, where)
            except ValueError as exc:
                raise DataError(str(exc)) from None
        if max_prompt_tokens is not None and len(tok) > max_prompt_tokens:
            if not truncate:
                raise DataError(f"{where} has {len(tok)} tokens, over max_prompt_tokens={max_prompt_tokens} ({str(value)[:60]!r}...); raise the limit or pass truncate=True")
            tok = tok[-max_prompt_tokens:]
            if isinstance(value, str):
                # the text the model sees: the kept tokens' (a reward and the sample tables got the
                # whole prompt, text the model never saw)
                value = tokenizer.decode(tok, skip_special_tokens=True)
            else:
                cut_conversations.append(n)
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
            raise DataError(f"{where} has columns {sorted(others)} but row 0 has {sorted(keys)}; every row needs the same fields")
        for k, v in others.items():
            columns[k].append(v)
        text.append(value if isinstance(value, str) else json.dumps(value))
        # the conversation itself, so rewards get TRL's format for it without guessing from the text
        # (a text prompt may be JSON); its messages copied as plain dicts, apart from the source's
        messages.append([dict(m) for m in value] if isinstance(value, list) else None)
        ids.append(tok)
    if cut_conversations:
        warnings.warn(
            f"load_prompts: {len(cut_conversations)} chat conversation(s) (row(s) {cut_conversations[:5]}) were cut to their "
            f"last max_prompt_tokens={max_prompt_tokens} tokens, the chat template's start included; their messages (what "
            "TRL-style rewards get) and text still hold the whole conversation. Raise max_prompt_tokens or shorten them",
            RuntimeWarning, stacklevel=2)
    return PromptSet(text, ids, columns, messages if any(m is not None for m in messages) else None)


def as_prompts(prompts: Any, tokenizer) -> Prompts:
    """Accept a Prompts value, a string, one chat conversation (a list of message dicts), a list
    of strings or dicts, or a dict (one row, or columns of equal length) for ``rollout``: what
    :func:`load_prompts` reads."""
    if isinstance(prompts, Prompts):
        return prompts
    if isinstance(prompts, PromptSet):  # every prompt of the set
        return Prompts(prompts.text, prompts.ids, prompts.columns, prompts.messages)
    if isinstance(prompts, str) or (_is_conversation(prompts) and all("role" in m and "prompt" not in m for m in prompts)):
        prompts = [prompts]  # one prompt: a string or one conversation
    if tokenizer is None:
        raise DataError("rollout got text prompts but the state has no tokenizer; pass tokenizer= to rk.init")
    # a dict (one row, or columns) as load_prompts reads it: list() of it was its keys, sampled as prompts
    s = load_prompts(prompts if isinstance(prompts, Mapping) else list(prompts), tokenizer)
    return Prompts(s.text, s.ids, s.columns, s.messages)
