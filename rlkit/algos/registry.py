"""Name -> function registries for algorithm families.

Every place that accepts an algorithm by name also accepts a callable with the same
signature, so a user's own estimator or loss is a first-class citizen.
"""
from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A catalogue of functions of one family (advantage estimators, policy losses, ...)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._fns: dict[str, F] = {}

    def register(self, *names: str) -> Callable[[F], F]:
        """Decorator: ``@POLICY_LOSSES.register("ppo_clip", "vanilla")``."""

        def deco(fn: F) -> F:
            for name in names:
                if name in self._fns and self._fns[name] is not fn:
                    raise ValueError(f"{self.kind} {name!r} is already registered to {self._fns[name].__qualname__}")
                self._fns[name] = fn
            return fn

        return deco

    def get(self, name_or_fn: str | F) -> F:
        """Resolve a registered name, or return a user callable unchanged."""
        if callable(name_or_fn):
            return name_or_fn
        if not isinstance(name_or_fn, str):
            raise TypeError(
                f"{self.kind} must be a name (one of {self.names()}) or a callable, got {type(name_or_fn).__name__}"
            )
        try:
            return self._fns[name_or_fn]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name_or_fn!r}; valid names: {', '.join(self.names())} "
                f"(or pass your own function with the same signature)"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._fns)

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
