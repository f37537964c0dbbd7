"""Rollout engines: token ids in, token ids + behaviour log-probs out (see :mod:`rlkit.engines.base`)."""
from rlkit.engines.base import Engine, Generation, SamplingParams
from rlkit.engines.hf_engine import HFEngine
from rlkit.engines.torch_engine import TorchEngine

__all__ = ["Engine", "Generation", "HFEngine", "SamplingParams", "TorchEngine"]
