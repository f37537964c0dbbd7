"""rlkit: reinforcement-learning post-training of language models.

A functional core (``rollout``, ``score``, ``advantage``, ``update``) over explicit state and
batch values, and a small scheduler that lowers the same pipeline onto torch.distributed meshes.
"""
__version__ = "0.1.0"

from rlkit.batch import Batch, BatchError, make_batch, validate, packed, column, set_column  # noqa: E402,F401
