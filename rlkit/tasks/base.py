"""A Task bundles what a built-in job needs: tokenizer, prompt sets, reward, warm-up examples."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from rlkit.data import PromptSet, Prompts, _brief


def _tokenizer_repr(tokenizer: Any) -> str:
    """A tokenizer by its kind, name and vocabulary size: a Hugging Face tokenizer's repr lists
    every added token (tens of kB for a chat model's)."""
    parts = [type(tokenizer).__name__]
    name = getattr(tokenizer, "name_or_path", None)
    if isinstance(name, str) and name:
        parts.append(_brief(name))
    try:
        parts.append(f"vocab={len(tokenizer)}")
    except Exception:  # noqa: BLE001 - a tokenizer without a length: its kind and name say enough
        pass
    return f"<{' '.join(parts)}>"


def _reward_repr(reward: Any) -> str:
    """A reward function by its name (``<function exact_match>``); another callable by its clipped repr."""
    name = getattr(reward, "__qualname__", None)
    return f"<{type(reward).__name__} {name}>" if isinstance(name, str) and len(name) <= 80 else _brief(reward)


@dataclass
class Task:
    """What a built-in job needs. Its repr names the prompt sets by size (``PromptSet(n=4000, ...)``)
    and the warm-up examples by count, not row by row."""

    name: str
    tokenizer: Any
    train: PromptSet
    test: PromptSet
    reward: Callable
    #: (prompt text, target completion text) pairs for a supervised warm-up
    sft_examples: list[tuple[str, str]] = field(default_factory=list)
    max_new_tokens: int = 16
    info: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        # the generated repr printed every prompt and example: ~240 kB for the default arithmetic task
        sets = {k: repr(v) if isinstance(v, (PromptSet, Prompts)) else _brief(v) for k, v in (("train", self.train), ("test", self.test))}
        examples = f"<{len(self.sft_examples)} pairs>" if hasattr(self.sft_examples, "__len__") else _brief(self.sft_examples)
        return (f"{type(self).__name__}(name={_brief(self.name)}, tokenizer={_tokenizer_repr(self.tokenizer)}, "
                f"train={sets['train']}, test={sets['test']}, reward={_reward_repr(self.reward)}, "
                f"sft_examples={examples}, max_new_tokens={_brief(self.max_new_tokens)}, info={_brief(self.info)})")

    def prompts(self, batch_size: int, steps: int, *, seed: int = 0, start: int = 0) -> Iterator[Prompts]:
        """The training batches at stream positions ``start`` .. ``steps - 1`` (deterministic order;
        ``steps`` is the whole run's length, so a run resumed at ``start`` gets what it has left).
        Resuming a loop of your own: ``start=state.data_position``, which :func:`rlkit.fit` keeps and
        a plain loop advances itself (``state.replace(data_position=state.data_position + 1)`` per
        batch; see :class:`rlkit.TrainState`)."""
        return self.train.batches(batch_size, steps, seed=seed, start=start)
