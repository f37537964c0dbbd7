"""The one batch type: a ``tensordict.TensorDict`` with one row per sampled response.

Fields (einops names; ``b`` rows, ``p`` prompt length, ``t`` response length):

==================  ========  =====  =========================================================
field               shape     dtype  meaning
==================  ========  =====  =========================================================
prompt_ids          (b p)     long   prompt tokens, LEFT-padded with the pad id
prompt_mask         (b p)     bool   True on real prompt tokens
response_ids        (b t)     long   sampled tokens, RIGHT-padded with the pad id
response_mask       (b t)     bool   True on generated tokens (stop token included)
logprobs            (b t)     f32    behaviour log-probs from the rollout engine
old_logprobs        (b t)     f32    log-probs recomputed by the trainer before the update
ref_logprobs        (b t)     f32    log-probs of the frozen reference model
values              (b t)     f32    critic values (PPO)
rewards             (b)       f32    sequence-level reward (sum of weighted reward functions)
token_rewards       (b t)     f32    per-token reward (KL-in-reward, overlong penalty, ...)
advantages          (b t)     f32    advantage estimates
returns             (b t)     f32    value targets
group               (b)       long   which prompt a response belongs to (equal id = same prompt)
truncated           (b)       bool   response hit max_new_tokens without a stop token
policy_version      (b)       long   version of the weights that sampled the row
temperature         (b)       f32    temperature the row's ``logprobs`` are at (1.0: greedy)
logprobs_filtered   (b)       bool   ``logprobs`` are of a top-k/top-p filtered distribution
rollout_row         (b)       long   which rollout call sampled the row, and which row of it
reward_baselines    (b)       f32    a baseline reward per row (ReMax: the greedy response's)
reward/<name>       (b)       f32    each named reward function's own score (``rk.score``)
==================  ========  =====  =========================================================

Non-tensor columns (``prompt_text``, ``response_text`` and any per-prompt data such as
``answer``) are stored as ``NonTensorStack`` and follow rows through indexing and ``cat``.
``prompt_messages`` (:data:`PROMPT_MESSAGES`) is one of them: a row's chat conversation (its list
of ``{"role", "content"}`` messages) where its prompt was one, None where it was text; ``rollout``
writes it when its prompts hold a conversation, and ``rk.score`` hands TRL-style rewards TRL's
conversational format for those rows from it (``prompt_text`` stays printable: the JSON of the
messages).

The padded layout is the API; :func:`packed` gives the variable-length view for hot paths.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch
from tensordict import NonTensorStack, TensorDict

from rlkit._checks import is_int, is_real

Batch = TensorDict

#: field -> (rank, dtype kind) for validation; kind: "int", "bool", "float"
FIELDS: dict[str, tuple[int, str]] = {
    "prompt_ids": (2, "int"),
    "prompt_mask": (2, "bool"),
    "response_ids": (2, "int"),
    "response_mask": (2, "bool"),
    "logprobs": (2, "float"),
    "old_logprobs": (2, "float"),
    "ref_logprobs": (2, "float"),
    "values": (2, "float"),
    "rewards": (1, "float"),
    "token_rewards": (2, "float"),
    "advantages": (2, "float"),
    "returns": (2, "float"),
    "group": (1, "int"),
    "truncated": (1, "bool"),
    "policy_version": (1, "int"),
    "temperature": (1, "float"),
    "logprobs_filtered": (1, "bool"),
    "reward_baselines": (1, "float"),
    "rollout_row": (1, "int"),
}
RESPONSE_ALIGNED = {k for k, (rank, _) in FIELDS.items() if rank == 2 and not k.startswith("prompt")}
TEXT_FIELDS = ("prompt_text", "response_text")
#: the per-row column of the chat conversation a row's prompt was (None for a text prompt): kept
#: apart from ``prompt_text`` (the printable JSON of it) so that whether a prompt was a conversation
#: is a fact carried from the data, never guessed from text that looks like JSON
PROMPT_MESSAGES = "prompt_messages"
#: the per-row field of a row's identity, which ``rollout`` records: its rollout call's random key
#: in the high bits, its row in that call (on its generation replica) in the low :data:`ROW_BITS`.
#: ``group`` numbers prompts within one rollout only; :func:`rlkit.concat` reads this to tell rows
#: of one rollout (whose split groups it rejoins) from rows of another (whose groups stay apart)
ROLLOUT_ROW = "rollout_row"
ROW_BITS = 24
#: names a per-prompt data column cannot take: the batch's own fields, and the keywords
#: ``rk.score`` passes TRL-style reward functions besides the columns (``trainer_state``,
#: ``log_metric``, ``log_extra``; ``reward/<name>`` too)
RESERVED_COLUMNS = frozenset(FIELDS) | set(TEXT_FIELDS) | {PROMPT_MESSAGES,
    "rollout_metrics", "prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra"}


def reserved_names(names: Iterable[Any], allow: Iterable[str] = ()) -> list[str]:
    """The ``names`` (sorted) that a batch uses itself (:data:`RESERVED_COLUMNS`, ``reward/...``,
    anything not a string), except those in ``allow``: as a data column such a name would
    overwrite the batch's field or collide with a reward function's keyword."""
    allow = set(allow)
    return sorted(
        str(n) for n in names
        if n not in allow and (not isinstance(n, str) or n in RESERVED_COLUMNS or n.startswith("reward/"))
    )


def check_column_names(names: Iterable[str], where: str, allow: Iterable[str] = ()) -> None:
    """Raise :class:`BatchError` naming those of ``names`` that are :func:`reserved_names`."""
    bad = reserved_names(names, allow)
    if bad:
        raise BatchError(
            f"{where}: column name(s) {bad} are reserved by rlkit's batch ({', '.join(sorted(RESERVED_COLUMNS))}, "
            "reward/...); rename them (e.g. 'ref_answer' or 'meta_group')"
        )


class BatchError(ValueError):
    """A Batch field has the wrong shape, dtype or content. The message names the field."""


def _pad(rows: Sequence[Sequence[int]], pad: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` of ragged token rows padded to the longest, with ``pad`` on the left or
    the right. One tensor from all the tokens, placed with one masked assignment (row-major order
    is each row's tokens in order): a loop of per-row copies took 5 ms for 256 rows of 64 tokens
    on a GPU host, with the GPU idle while the rollout's batch was built."""
    rows = [r.tolist() if isinstance(r, torch.Tensor) or _is_ndarray(r) else r for r in rows]
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    width = int(lengths.max()) if len(rows) else 0
    col = torch.arange(width)
    mask = col[None, :] >= (width - lengths)[:, None] if left else col[None, :] < lengths[:, None]
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    ids[mask] = torch.tensor([t for r in rows for t in r], dtype=torch.long)
    return ids, mask


def _pad_right(rows: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _pad(rows, pad, left=False)


def _pad_left(rows: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _pad(rows, pad, left=True)


def _is_ndarray(x: Any) -> bool:
    """A numpy array, without importing numpy (rows from a tokenizer's ``return_tensors="np"``)."""
    return type(x).__module__ == "numpy" and type(x).__name__ == "ndarray"


def _check_token_rows(rows: Any, name: str) -> None:
    """Each row a sequence of token ids (ints >= 0): a list, or a 1-d integer tensor or numpy
    array. A flat list, text or float ids used to fail in padding with a bare TypeError, or be
    truncated to other tokens without a word."""
    if isinstance(rows, torch.Tensor):
        if rows.dtype.is_floating_point or rows.dtype == torch.bool or rows.dim() != 2:
            raise BatchError(f"{name} must be rows of integer token ids (a list of lists, or a 2-d integer tensor); got a {rows.dim()}-d {rows.dtype} tensor")
        return
    for i, row in enumerate(rows):
        if isinstance(row, torch.Tensor) or _is_ndarray(row):
            integral = row.dtype.kind in "iu" if _is_ndarray(row) else not (row.dtype.is_floating_point or row.dtype.is_complex or row.dtype == torch.bool)
            if not integral or row.ndim != 1:
                raise BatchError(f"{name} row {i} is a {row.ndim}-d {row.dtype} {type(row).__name__}; give 1-d integer token ids")
            row = row.tolist()
        elif isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
            raise BatchError(f"{name} row {i} is {type(row).__name__} {row!r:.40}; give a list of token ids per row "
                             "(tokenize text first; a flat list is one row per id: wrap it as [ids]; other containers: "
                             "convert them with list(...) or .tolist())")
        bad = next((t for t in row if not is_int(t) or t < 0), None)
        if bad is not None:
            raise BatchError(f"{name} row {i} holds {bad!r}; token ids are ints >= 0")


def _check_numbers(values: Any, name: str, *, integral: bool, hint: str):
    if isinstance(values, torch.Tensor):
        if integral and (values.dtype.is_floating_point or values.dtype == torch.bool):
            raise BatchError(f"{name} must hold ints ({hint}); got a {values.dtype} tensor")
        return values
    for i, v in enumerate(values):
        ok = is_int(v) if integral else is_real(v) or (isinstance(v, torch.Tensor) and v.numel() == 1)
        if not ok:
            raise BatchError(f"{name} row {i} is {type(v).__name__} {v!r:.40}; {name} takes {hint}")
    return values


def make_batch(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    *,
    pad_token_id: int = 0,
    group: Sequence[int] | torch.Tensor | None = None,
    logprobs: Sequence[Sequence[float]] | None = None,
    rewards: Sequence[float] | torch.Tensor | None = None,
    columns: Mapping[str, Sequence[Any]] | None = None,
    device: torch.device | str | None = None,
) -> Batch:
    """Build a Batch from lists of token ids (one prompt and one response per row).

    >>> b = make_batch([[5, 6], [7]], [[1, 2, 3], [4]], group=[0, 0], rewards=[1.0, 0.0])
    >>> b["prompt_ids"].tolist(), b["response_mask"].tolist()
    ([[5, 6], [0, 7]], [[True, True, True], [True, False, False]])
    """
    if len(prompt_ids) != len(response_ids):
        raise BatchError(
            f"prompt_ids has {len(prompt_ids)} rows but response_ids has {len(response_ids)}; "
            "give one prompt per response (repeat a prompt for each of its samples)"
        )
    if len(prompt_ids) == 0:
        raise BatchError("prompt_ids is empty: a Batch needs at least one row")
    if not is_int(pad_token_id) or pad_token_id < 0:
        raise BatchError(f"pad_token_id must be a token id (an int >= 0), got {pad_token_id!r}; pass the tokenizer's "
                         "pad_token_id, or its eos_token_id when it has none (pads are masked, any real id will do)")
    _check_token_rows(prompt_ids, "prompt_ids")
    _check_token_rows(response_ids, "response_ids")
    empty = next((i for i, row in enumerate(prompt_ids) if len(row) == 0), None)
    if empty is not None:
        raise BatchError(f"prompt_ids row {empty} is empty; every row needs at least one prompt token (the first response "
                         "token is predicted from the last prompt token: start it with the tokenizer's BOS token)")
    if group is not None:
        group = _check_numbers(group, "group", integral=True,
                               hint="one int per row, equal for the samples of one prompt (map labels to ints first)")
    if rewards is not None:
        rewards = _check_numbers(rewards, "rewards", integral=False, hint="one number per row")
    p_ids, p_mask = _pad_left(prompt_ids, pad_token_id)
    r_ids, r_mask = _pad_right(response_ids, pad_token_id)
    b = len(prompt_ids)
    per_row = {"group": group, "logprobs": logprobs, "rewards": rewards, **{f"columns[{k!r}]": v for k, v in (columns or {}).items()}}
    for name, values in per_row.items():
        if values is not None and len(values) != b:
            raise BatchError(f"{name} has {len(values)} values for {b} rows; give one per response")
    fields: dict[str, Any] = {
        "prompt_ids": p_ids,
        "prompt_mask": p_mask,
        "response_ids": r_ids,
        "response_mask": r_mask,
        "group": torch.as_tensor(group, dtype=torch.long) if group is not None else torch.arange(b),
    }
    if logprobs is not None:
        lp = torch.zeros(r_ids.shape, dtype=torch.float32)
        for i, row in enumerate(logprobs):
            if len(row) != len(response_ids[i]):
                raise BatchError(f"logprobs row {i} has {len(row)} values but response {i} has {len(response_ids[i])} tokens")
            lp[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.float32)
        fields["logprobs"] = lp
    if rewards is not None:
        fields["rewards"] = torch.as_tensor(rewards, dtype=torch.float32)
    batch = TensorDict(fields, batch_size=[b], device=device)
    check_column_names(columns or {}, "make_batch(columns=...)", allow=(*TEXT_FIELDS, PROMPT_MESSAGES))  # the batch's own text columns
    for name, values in (columns or {}).items():
        set_column(batch, name, values)
    validate(batch)
    return batch


def shallow_copy(batch: Batch) -> Batch:
    """A new Batch holding the same field objects: what a transform returns after adding fields.

    ``TensorDict.clone(recurse=False)`` also copies every row of every non-tensor column (one
    ``NonTensorData`` per row): 5 ms for 512 rows and three text columns, paid by each of score,
    advantage and the log-prob passes. Fields are never changed in place by rlkit, so sharing
    them is safe; setting or replacing a field of the copy leaves ``batch`` as it was."""
    return TensorDict({k: batch.get(k) for k in batch.keys()}, batch_size=batch.batch_size, device=batch.device)


def row_tokens(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row's real tokens, ``[ids[i][mask[i]] for every row i]``, as Python lists. For
    right-padded masks (responses) every row is a prefix: one ``tolist`` for the whole batch
    instead of one masked copy per row."""
    mask = mask.bool()
    if mask.shape[1] < 2 or not (mask[:, 1:] & ~mask[:, :-1]).any():
        return [row[:n] for row, n in zip(ids.tolist(), mask.sum(-1).tolist())]
    return [r[m].tolist() for r, m in zip(ids, mask)]


def set_column(batch: Batch, name: str, values: Sequence[Any]) -> None:
    """Attach a non-tensor per-row column (text, answers, metadata), or replace one.

    ``values``: one per row, a list (or any iterable but a string: ``"ab"`` is refused, not split
    into ``'a'`` and ``'b'``).

    ``name`` may be any string but the batch's tensor fields (:data:`FIELDS`), ``reward/...`` and
    the keywords ``rk.score`` passes reward functions (:func:`check_column_names`): a column of
    that name would replace the tensor (or collide with the keyword). The text columns
    (``prompt_text``, ``response_text``), ``prompt_messages`` and ``rollout_metrics`` are the
    batch's own and settable."""
    check_column_names([name], "set_column", allow=(*TEXT_FIELDS, PROMPT_MESSAGES, "rollout_metrics"))
    if isinstance(values, (str, bytes)):
        # list("ab") is two values: a 2-row batch stored 'a' and 'b' without a word
        raise BatchError(f"column {name!r}: values must be a list with one value per row, got the {type(values).__name__} "
                         f"{values!r:.40}; for the same value on every row pass [value] * {batch.batch_size[0]}")
    values = list(values)
    if len(values) != batch.batch_size[0]:
        raise BatchError(f"column {name!r} has {len(values)} values but the batch has {batch.batch_size[0]} rows")
    batch[name] = NonTensorStack(*values)


def column(batch: Batch, name: str) -> list[Any]:
    """A non-tensor column as a plain list (``column(batch, "response_text")``)."""
    if name not in batch.keys():
        raise BatchError(f"batch has no column {name!r}; it has {sorted(batch.keys())}")
    value = batch.get(name)
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if hasattr(value, "tolist"):
        return list(value.tolist())
    return [value] * batch.batch_size[0]


def columns(batch: Batch) -> list[str]:
    """Names of the non-tensor columns."""
    return [k for k in batch.keys() if not isinstance(batch.get(k), torch.Tensor)]


def _kind(t: torch.Tensor) -> str:
    if t.dtype == torch.bool:
        return "bool"
    if t.is_floating_point():
        return "float"
    return "int"


def validate(batch: Batch, require: str | Iterable[str] = ()) -> Batch:
    """Check a Batch's structure; raise :class:`BatchError` naming the bad field.

    Checks: ``batch`` is a TensorDict with one batch dimension; every field in ``require`` is
    present (e.g. ``("rewards",)`` before ``advantage``; a single name may be given as a string,
    ``require="rewards"``); the batch has at least one row; each
    field of :data:`FIELDS` that is present is a tensor of its rank and dtype kind, its width
    equal to ``prompt_ids``' (prompt fields) or ``response_ids``' (response-aligned fields);
    ``rewards`` are finite; and ``response_mask`` is not all False. Returns the batch so calls can
    be chained.

    A batch of 0 rows (what a filter that keeps no row gives: ``batch[mask]`` with ``mask`` all
    False, or :func:`rlkit.recipes.dapo.keep_informative_groups` when every group's rewards agree)
    is refused here, so :func:`rlkit.score`, :func:`rlkit.advantage`, the log-prob passes and
    :func:`rlkit.update`, which all call this first, say so instead of failing inside with an
    error that names neither the batch nor the cause: skip the step for such a batch.

    Not checked here: the masks' padding direction and the token ids' range. The scoring,
    advantage and loss functions take response masks with holes (multi-turn observation tokens);
    the training forward (:func:`rlkit.models.logprobs.response_view`) needs left-padded prompts
    with at least one token per row, right-padded responses and ids in the model's vocabulary,
    and checks those itself. :func:`make_batch` always builds such masks.
    """
    if not isinstance(batch, TensorDict):
        raise BatchError(f"expected a Batch (tensordict.TensorDict), got {type(batch).__name__}; build one with rlkit.make_batch")
    if len(batch.batch_size) != 1:
        raise BatchError(f"a Batch has exactly one batch dimension (one row per response), got batch_size={tuple(batch.batch_size)}")
    if batch.batch_size[0] == 0:
        # every transform indexes, groups or splits the rows: with none they failed inside with an
        # IndexError, "range() arg 3 must not be zero" or a complaint about mini_batch_size 0
        raise BatchError(
            "the batch has no rows (batch_size 0): there is nothing to score, estimate or train on. Skip this step "
            "(e.g. `if batch.batch_size[0] == 0: continue`); a filter kept no row: batch[mask] with mask all False, or "
            "for DAPO (rlkit.recipes.dapo.keep_informative_groups) every group's rewards were equal, so sample more "
            "prompts or responses per step, or check the filter and the reward"
        )
    keys = set(batch.keys())
    if isinstance(require, str):
        require = (require,)  # one field's name: "rewards" was read as the names 'r', 'e', 'w', ...
    for name in require:
        if name not in keys:
            raise BatchError(f"batch has no field {name!r} (fields: {sorted(keys)}); {_how_to_get(name)}")
    b = batch.batch_size[0]
    t = batch["response_ids"].shape[1] if "response_ids" in keys else None
    p = batch["prompt_ids"].shape[1] if "prompt_ids" in keys else None
    for name, (rank, kind) in FIELDS.items():
        if name not in keys:
            continue
        value = batch.get(name)
        if not isinstance(value, torch.Tensor):
            raise BatchError(f"field {name!r} must be a tensor, got {type(value).__name__}")
        if value.dim() != rank:
            raise BatchError(f"field {name!r} must have shape {'(b t)' if rank == 2 else '(b)'}, got {tuple(value.shape)}")
        if _kind(value) != kind:
            raise BatchError(f"field {name!r} must have a {kind} dtype, got {value.dtype}")
        if rank == 2:
            want = p if name.startswith("prompt") else t
            if want is not None and value.shape[1] != want:
                other = "prompt_ids" if name.startswith("prompt") else "response_ids"
                raise BatchError(
                    f"field {name!r} has shape {tuple(value.shape)} but {other} has {want} columns; "
                    f"every response-aligned field must be (b t) = ({b} {want})"
                )
        if name == "rewards":
            bad = ~torch.isfinite(value)
            if bad.any():
                rows = bad.nonzero().flatten()[:5].tolist()
                raise BatchError(f"field 'rewards' is not finite at rows {rows} (values {value[rows].tolist()}); fix the reward function")
    if "response_mask" in keys:
        mask = batch["response_mask"]
        if not mask.any():
            raise BatchError("field 'response_mask' is all False: no response token to train on; check the rollout or the masks you built")
    return batch


def check_same_fields(parts: Sequence[Batch], where: str) -> None:
    """Raise :class:`BatchError` when the batches ``parts`` do not all have the same fields
    (tensors and columns): concatenating them (``torch.cat``) failed with tensordict's bare
    ``KeyError`` naming one key, not which part lacks it or what to do."""
    names = [set(p.keys()) for p in parts]
    every = set().union(*names)
    missing = [(i, sorted(every - keys)) for i, keys in enumerate(names) if every - keys]
    if not missing:
        return
    shown = "; ".join(f"part {i} lacks {lack}" for i, lack in missing[:4]) + ("; ..." if len(missing) > 4 else "")
    lacking = sorted({k for _, lack in missing for k in lack})
    raise BatchError(
        f"{where}: the batches have different fields ({shown}; each of them is present in another part). Drop them "
        f"from every part (batch.exclude(*{lacking})) or add them to every part (e.g. compute the same passes, or "
        "set_column, on each) before concatenating"
    )


def _how_to_get(name: str) -> str:
    return {
        "rewards": "call rlkit.score(batch, reward_fn) first",
        "advantages": "call rlkit.advantage(batch, 'grpo') first",
        "returns": "call rlkit.advantage(batch, 'gae') first (it fills returns)",
        "values": "the PPO recipe fills it from the critic (rk.compute_values)",
        "ref_logprobs": "pass ref=... to rlkit.init or drop the KL penalty",
        "logprobs": "batches from rlkit.rollout carry it; for hand-made batches pass logprobs= to make_batch",
        "group": "pass group= to make_batch (equal ids for samples of the same prompt)",
    }.get(name, "see rlkit.batch for how each field is produced")


def group_size(batch: Batch) -> int:
    """Samples per prompt; raises if groups are not all the same size."""
    group = batch["group"]
    _, counts = torch.unique(group, return_counts=True)
    if (counts != counts[0]).any():
        raise BatchError(
            f"field 'group' has groups of different sizes {sorted(set(counts.tolist()))}; "
            "group estimators need the same number of samples per prompt"
        )
    return int(counts[0])


def response_lengths(batch: Batch) -> torch.Tensor:
    """(b) number of response tokens per row."""
    return batch["response_mask"].sum(-1)


@dataclass(frozen=True)
class Packed:
    """Variable-length view of prompt+response rows, concatenated without padding.

    - input_ids     (n)  long: all rows' prompt then response tokens, back to back
    - position_ids  (n)  long: restart at 0 for each row
    - cu_seqlens    (b+1) int32: row boundaries (flash-attention convention)
    - response_index (m') long: positions in ``input_ids`` holding response tokens (all
      ``m = response_mask.sum()`` of them; with ``drop_last`` every row's last one is left out)
    - predict_index (m)  long: for each response token, row-major over ``response_mask``, the
      position whose output predicts it (the token before it: a row's last prompt token for its
      first response token)
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    response_index: torch.Tensor
    max_seqlen: int
    predict_index: torch.Tensor


def input_response_mask(response_mask: torch.Tensor) -> torch.Tensor:
    """The response tokens a forward needs as inputs to predict every response token: all but
    each row's last (right-padded ``response_mask``). The last one's output would predict the
    token after the response, which nothing scores, and no earlier token attends to it."""
    response_mask = response_mask.bool()
    return torch.cat([response_mask[:, 1:], torch.zeros_like(response_mask[:, :1])], dim=1) & response_mask


def packed(batch: Batch, *, drop_last: bool = False) -> Packed:
    """Pack prompt+response of every row into one padding-free sequence (vectorised).

    ``drop_last``: leave each row's last response token out of the sequence
    (:func:`input_response_mask`). What a forward that only needs the predictions of the response
    tokens (log-probs, values, the training loss) runs on: one token fewer per row, the same
    outputs at ``predict_index``."""
    p_ids, p_mask = batch["prompt_ids"], batch["prompt_mask"].bool()
    r_ids, full_r_mask = batch["response_ids"], batch["response_mask"].bool()
    r_mask = input_response_mask(full_r_mask) if drop_last else full_r_mask
    ids = torch.cat([p_ids, r_ids], dim=1)
    mask = torch.cat([p_mask, r_mask], dim=1)
    is_response = torch.cat([torch.zeros_like(p_mask), r_mask], dim=1)
    flat_mask = mask.flatten()
    input_ids = ids.flatten()[flat_mask]
    lengths = mask.sum(1)
    position_ids = (mask.cumsum(1) - 1).flatten()[flat_mask]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=ids.device)
    cu[1:] = lengths.cumsum(0)
    response_index = is_response.flatten()[flat_mask].nonzero().flatten()
    # response token t of a row is predicted by its segment's position p_len - 1 + t: the row's
    # last r_len positions with drop_last, the positions just before its response tokens without
    r_len = full_r_mask.sum(1)
    first = cu[:-1].long() + p_mask.sum(1) - 1  # each row's last prompt token
    owner = torch.repeat_interleave(torch.arange(len(r_len), device=ids.device), r_len)
    offsets = torch.arange(int(r_len.sum()), device=ids.device) - (r_len.cumsum(0) - r_len)[owner]
    predict_index = first[owner] + offsets
    return Packed(input_ids, position_ids, cu, response_index, int(lengths.max()) if len(lengths) else 0, predict_index)


def unpack_response(values: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Scatter per-response-token values (m,) back into the padded (b t) layout (0 elsewhere)."""
    out = torch.zeros(batch["response_mask"].shape, dtype=values.dtype, device=values.device)
    out[batch["response_mask"]] = values
    return out


def split(batch: Batch, size: int) -> list[Batch]:
    """Consecutive chunks of ``size`` rows (the last may be smaller)."""
    b = batch.batch_size[0]
    return [batch[i : i + size] for i in range(0, b, size)]


def num_chunks(b: int, size: int) -> int:
    return math.ceil(b / size)
