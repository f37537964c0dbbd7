"""Triton kernels built on first use, so that importing rlkit (and running on CPU) never imports
Triton.

A module defines its kernels inside a function decorated with :func:`lazy_kernels`; the
decorator imports Triton at the first call, puts ``triton`` and ``tl`` into that module's
globals (where ``@triton.jit`` and the kernel bodies look them up) and caches what the
function returns: a dict of kernels, or None for every call when Triton is not importable.
"""
from __future__ import annotations

import functools
from typing import Any, Callable


def lazy_kernels(build: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any] | None]:
    cache: dict[str, Any] = {}

    @functools.wraps(build)
    def kernels() -> dict[str, Any] | None:
        if "kernels" not in cache:
            try:
                import triton
                import triton.language as tl
            except ImportError:
                cache["kernels"] = None
            else:
                build.__globals__.update(triton=triton, tl=tl)
                cache["kernels"] = build()
        return cache["kernels"]

    return kernels
