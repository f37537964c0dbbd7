"""Models layer: tokenizers, model building/loading, and the training forward (log-probs, values)."""
from rlkit.models.build import PRESETS, causal_lm_types, critic, disable_dropout, load_model, tiny, tiny_config
from rlkit.models.logprobs import (
    LogprobModule,
    ValueModule,
    response_hidden,
    response_logprobs,
    token_logprobs,
    values_for_response,
)
from rlkit.models.tokenizers import char_tokenizer, load_tokenizer

__all__ = [
    "PRESETS",
    "LogprobModule",
    "ValueModule",
    "causal_lm_types",
    "char_tokenizer",
    "critic",
    "disable_dropout",
    "load_model",
    "load_tokenizer",
    "response_hidden",
    "response_logprobs",
    "tiny",
    "tiny_config",
    "token_logprobs",
    "values_for_response",
]
