"""Name -> function registries for algorithm families.

Every place that accepts an algorithm by name also accepts a callable with the same
signature, so a user's own estimator or loss is a first-class citizen.
"""
from __future__ import annotations

import importlib
import sys
import warnings
import weakref
from typing import Any, Callable, Generic, Iterator, TypeVar

F = TypeVar("F", bound=Callable)

#: every Registry made in this process: rk.launch ships the entries user code registered in them
#: (:func:`user_registrations`) and each worker re-registers them (:func:`restore_registrations`)
_REGISTRIES: "weakref.WeakSet[Registry]" = weakref.WeakSet()


def _caller_module() -> str | None:
    """``__name__`` of the module whose code called into this file (this file's frames skipped, and
    typing's: ``Registry[Callable]("kind")`` is made from inside it)."""
    try:
        frame = sys._getframe(1)
    except (AttributeError, ValueError):  # no frame introspection outside CPython
        return None
    while frame is not None and (frame.f_globals is globals() or frame.f_globals.get("__name__") == "typing"):
        frame = frame.f_back
    return frame.f_globals.get("__name__") if frame is not None else None


def _in_rlkit(module: object) -> bool:
    return isinstance(module, str) and (module == "rlkit" or module.startswith("rlkit."))


def _where(fn: object) -> str:
    qualname = getattr(fn, "__qualname__", None)
    if qualname is None:
        return repr(fn)
    module = getattr(fn, "__module__", None)
    return f"{qualname} (module {module})" if module else qualname


def _same_definition(old: object, new: object) -> bool:
    """``new`` is ``old`` or a new definition of it: the same ``__module__`` and ``__qualname__``,
    as a re-run notebook cell or a reloaded module makes. Lambdas are never matched by name: two
    lambdas of one module share the qualname ``<lambda>`` and are not the same function."""
    if old is new:
        return True
    module, qualname = getattr(new, "__module__", None), getattr(new, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or qualname.endswith("<lambda>"):
        return False
    return getattr(old, "__module__", None) == module and getattr(old, "__qualname__", None) == qualname


class Registry(Generic[F]):
    """A catalogue of functions of one family (advantage estimators, policy losses, ...)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._fns: dict[str, F] = {}
        #: the entries registered by code outside rlkit (a notebook, a user's module): a fresh
        #: process (an rk.launch worker) imports rlkit's own entries, but not these. Kept with the
        #: function, so an entry replaced or removed since (``_fns`` swapped) is not taken for one
        self._user: dict[str, F] = {}
        #: the module that made this registry, where a fresh process finds it again
        self.home = _caller_module()
        _REGISTRIES.add(self)

    def register(self, *names: str | F, override: bool = False) -> Callable[[F], F] | F:
        """Decorator: ``@POLICY_LOSSES.register("ppo_clip", "vanilla")``.

        Without names (``@REG.register`` or ``@REG.register()``) the function is registered
        under its ``__name__``: the bare form is what a user writes first, and it used to hand
        back the inner decorator in place of the function and register nothing. Either way the
        decorator returns the function itself, so the decorated name stays a usable function.

        A name already taken is refused, unless it is taken by the same function or by a function
        of the same ``__module__`` and ``__qualname__`` (a re-run notebook cell, a reloaded module:
        the new definition replaces the old one). ``override=True`` replaces whatever the name
        holds, built-in names included.
        """
        if len(names) == 1 and callable(names[0]) and not isinstance(names[0], str):
            return self.register(override=override)(names[0])  # bare @REG.register: the function came as the "name"
        caller = _caller_module()
        for name in names:
            if not isinstance(name, str) or not name:
                raise TypeError(
                    f"{self.kind} names must be non-empty strings, got {name!r}; "
                    f"write @register('name', ...) or a bare @register (registers the function's __name__)"
                )

        def deco(fn: F) -> F:
            if not callable(fn):
                raise TypeError(f"can only register a callable as a {self.kind}, got {type(fn).__name__}")
            keys = names
            if not keys:
                own = getattr(fn, "__name__", None)
                if not isinstance(own, str) or not own.isidentifier():
                    # a lambda ("<lambda>") or a functools.partial has no name a user could type
                    raise TypeError(
                        f"this {self.kind} has no usable __name__ ({own!r}); register it with an explicit name: "
                        f"register('my_name')(fn)"
                    )
                keys = (own,)
            for name in keys:
                if name in self._fns and not override and not _same_definition(self._fns[name], fn):
                    owner = self._fns[name]
                    raise ValueError(
                        f"{self.kind} {name!r} is already registered to {_where(owner)}, a different function from "
                        f"{_where(fn)}; choose another name, or pass override=True to replace it: "
                        f"register({name!r}, override=True)(fn)"
                    )
            user = not _in_rlkit(caller if caller is not None else getattr(fn, "__module__", None))
            for name in keys:  # all names checked first, so a clash registers none of them
                self._fns[name] = fn
                if user:
                    self._user[name] = fn
                else:
                    self._user.pop(name, None)
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

    def user_entries(self) -> dict[str, F]:
        """The entries registered by code outside rlkit (a notebook cell, a user's module), built-in
        names replaced with ``override=True`` included: what a fresh process that imports rlkit
        does not have, and :func:`rlkit.launch` ships to its workers."""
        return {name: fn for name, fn in sorted(self._user.items()) if self._fns.get(name) is fn}

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


def user_registrations() -> list[tuple[str, str, str, Any]]:
    """``(home, kind, name, fn)`` for every entry that code outside rlkit registered in this
    process, in the registries of importable modules (rlkit's own, or a user module's): a worker
    started by :func:`rlkit.launch` imports those modules afresh and would know only the entries
    they register themselves. A registry made in ``__main__`` is left out: it is not importable
    in another process, and reaches a worker with its entries inside the function that uses it."""
    out = []
    for registry in list(_REGISTRIES):
        if registry.home is None or registry.home == "__main__":
            continue
        out.extend((registry.home, registry.kind, name, fn) for name, fn in registry.user_entries().items())
    return sorted(out, key=lambda entry: entry[:3])


def restore_registrations(entries: list[tuple[str, str, str, Any]]) -> None:
    """Register ``entries`` (from :func:`user_registrations` in another process) here, replacing
    whatever their names hold: how an rk.launch worker learns the names its caller registered."""
    for home, kind, name, fn in entries:
        importlib.import_module(home)
        registry = next((r for r in list(_REGISTRIES) if r.home == home and r.kind == kind), None)
        if registry is None:
            warnings.warn(f"no {kind} registry in module {home} in this process; {kind} {name!r} is not registered here",
                          stacklevel=2)
            continue
        registry._fns[name] = fn
        registry._user[name] = fn
