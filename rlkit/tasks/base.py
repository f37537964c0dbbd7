"""A Task bundles what a built-in job needs: tokenizer, prompt sets, reward, warm-up examples."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from rlkit.data import PromptSet, Prompts


@dataclass
class Task:
    name: str
    tokenizer: Any
    train: PromptSet
    test: PromptSet
    reward: Callable
    #: (prompt text, target completion text) pairs for a supervised warm-up
    sft_examples: list[tuple[str, str]] = field(default_factory=list)
    max_new_tokens: int = 16
    info: dict[str, Any] = field(default_factory=dict)

    def prompts(self, batch_size: int, steps: int, *, seed: int = 0, start: int = 0) -> Iterator[Prompts]:
        """The training batches at stream positions ``start`` .. ``steps - 1`` (deterministic order;
        ``steps`` is the whole run's length, so a run resumed at ``start`` gets what it has left)."""
        return self.train.batches(batch_size, steps, seed=seed, start=start)
