"""Rollout engines: token ids in, token ids + behaviour log-probs out (see :mod:`rlkit.engines.base`).

``VLLMEngine`` is resolved lazily (``rlkit.engines.VLLMEngine``), so importing this package never
imports vLLM.
"""
from rlkit.engines.base import Engine, Generation, SamplingParams
from rlkit.engines.hf_engine import HFEngine
from rlkit.engines.torch_engine import TorchEngine

__all__ = ["Engine", "Generation", "HFEngine", "SamplingParams", "TorchEngine", "VLLMEngine"]


def __getattr__(name: str):
    if name == "VLLMEngine":
        from rlkit.engines.vllm_engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(f"module 'rlkit.engines' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))  # VLLMEngine too, for Tab completion
