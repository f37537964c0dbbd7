"""A rollout engine over transformers' ``generate``: any causal LM, same :class:`Generation` out.

Slower than :class:`~rlkit.engines.torch_engine.TorchEngine` but covers every architecture
transformers does. Behaviour log-probs come from ``output_scores`` (the scores after the logits
processors, i.e. after temperature / top-k / top-p), normalised with
``compute_transition_scores(..., normalize_logits=True)``; greedy decoding applies no warper, so
it reports the plain log-softmax.

Sampling in ``generate`` draws from the global RNG; a ``torch.Generator`` passed to
:meth:`HFEngine.generate` seeds a forked RNG, so the same generator state gives the same samples
(but not the same samples as TorchEngine, which samples differently).
"""
from __future__ import annotations

import contextlib
import operator
import time
from typing import Mapping, Sequence

import torch
from torch import nn

from rlkit.engines.base import Generation, SamplingParams, check_engine_context, left_pad_prompts, pick_pad_token_id


def _pad_id(tokenizer_or_pad_id, model: nn.Module) -> int:
    """The id prompts and finished rows are padded with: an int as given (refused outside the
    model's embedding rows), else the tokenizer's pad id where the embedding has that row, else
    what the torch engine pads with (:func:`~rlkit.engines.base.pick_pad_token_id`: the config's
    pad or eos). A tokenizer's pad token added without resizing the embeddings (id = vocab size),
    or a negative one, crashed the embedding with a bare ``IndexError``; pads are masked, so any
    id in the vocabulary does."""
    vocab = _embedding_rows(model)
    if isinstance(tokenizer_or_pad_id, bool):
        raise TypeError("HFEngine: pass a tokenizer or an int pad id, got a bool")
    if not isinstance(tokenizer_or_pad_id, int) and hasattr(tokenizer_or_pad_id, "__index__"):
        with contextlib.suppress(TypeError):
            tokenizer_or_pad_id = operator.index(tokenizer_or_pad_id)  # numpy int, 0-d integer tensor
    if isinstance(tokenizer_or_pad_id, int):
        if vocab is not None and not 0 <= tokenizer_or_pad_id < vocab:
            raise ValueError(
                f"HFEngine: pad id {tokenizer_or_pad_id} is outside the model's vocabulary [0, {vocab}) (its input "
                "embedding rows); pass an id in it (pads are masked, so any works, e.g. the eos id) or the tokenizer"
            )
        return tokenizer_or_pad_id
    if tokenizer_or_pad_id is None:
        # e.g. rollout(state, engine="hf") on a state built without a tokenizer
        raise ValueError(
            "HFEngine: no tokenizer (got None), so no pad id to pad prompts with; pass a tokenizer, e.g. "
            "rk.init(model, tokenizer=tokenizer) before rollout(..., engine='hf'), or build HFEngine(model, tokenizer) "
            "or HFEngine(model, pad_id) with the pad id as an int"
        )
    pad = getattr(tokenizer_or_pad_id, "pad_token_id", None)
    if pad is None:
        raise ValueError(
            "HFEngine: the tokenizer has no pad_token_id; set tokenizer.pad_token (e.g. to its eos_token) "
            "or pass the pad id as an int"
        )
    pad = int(pad)
    if vocab is None or 0 <= pad < vocab:
        return pad
    # the tokenizer's pad has no embedding row (added without model.resize_token_embeddings)
    return pick_pad_token_id(getattr(model, "config", None), None, vocab)


def _embedding_rows(model: nn.Module) -> int | None:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    return rows if isinstance(rows, int) else None


def response_mask_from_stops(tokens: torch.Tensor, stop_token_ids: Sequence[int]) -> torch.Tensor:
    """(b t) True up to and including the first stop token of each row (all True without stops)."""
    if not stop_token_ids:
        return torch.ones_like(tokens, dtype=torch.bool)
    is_stop = torch.isin(tokens, torch.tensor(list(stop_token_ids), device=tokens.device))
    stops_before = is_stop.long().cumsum(-1) - is_stop.long()
    return stops_before == 0


class HFEngine:
    """Engine protocol over ``model.generate``. ``tokenizer_or_pad_id``: a tokenizer or the pad id.

    A tokenizer whose pad id has no row in the model's input embedding (a pad token added
    without resizing the embeddings, or a negative id) is padded with the id the torch engine
    uses instead (the config's pad or eos: pads are masked, so any id in the vocabulary does);
    an int pad id outside the vocabulary is refused."""

    def __init__(self, model: nn.Module, tokenizer_or_pad_id):
        if not hasattr(model, "generate"):
            raise TypeError(f"HFEngine needs a transformers model with .generate, got {type(model).__name__}")
        self.model = model
        # also generate()'s pad id: transformers feeds it back as the input of finished rows
        self.pad_token_id = _pad_id(tokenizer_or_pad_id, model)
        self.policy_version = 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def load_weights(
        self, weights: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]], *, version: int
    ) -> dict[str, float]:
        """Copy weights (HF names) into the model's parameters; shared tensors are skipped."""
        start = time.perf_counter()
        params = dict(self.model.named_parameters(remove_duplicate=False))
        copied = 0
        for name, tensor in weights.items() if isinstance(weights, Mapping) else weights:
            if type(tensor).__name__ == "DTensor":
                tensor = tensor.full_tensor()
            dst = params.get(name)
            if dst is None:
                raise KeyError(f"load_weights: the model has no parameter {name!r} (it has e.g. {sorted(params)[:3]})")
            if dst.shape != tensor.shape:
                raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the model's is {tuple(dst.shape)}")
            if dst.data_ptr() == tensor.data_ptr() and dst.device == tensor.device:
                continue
            dst.copy_(tensor)
            copied += dst.numel() * dst.element_size()
        self.policy_version = int(version)
        return {"bytes": float(copied), "seconds": time.perf_counter() - start}

    def _generation_config(self, params: SamplingParams):
        from transformers import GenerationConfig

        sample = params.temperature > 0
        fields = dict(
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=0,
            do_sample=sample,
            num_beams=1,
            pad_token_id=self.pad_token_id,
            eos_token_id=None if params.ignore_stop or not params.stop_token_ids else list(params.stop_token_ids),
            output_scores=True,
            return_dict_in_generate=True,
            repetition_penalty=1.0,
        )
        if sample:
            # explicit (0 disables top-k), so transformers' default top_k=50 does not apply
            fields.update(temperature=params.temperature, top_k=max(params.top_k, 0), top_p=params.top_p)
        return GenerationConfig(**fields)

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
    ) -> Generation:
        from transformers import GenerationConfig

        start = time.perf_counter()
        # as TorchEngine: an empty prompt or an id outside the vocabulary named (the embedding's IndexError named neither)
        ids, mask = left_pad_prompts(prompt_ids, self.pad_token_id, self.model.get_input_embeddings().num_embeddings)
        check_engine_context(self.model, prompt_ids, params, "HFEngine.generate")
        mask = mask.long()
        width = ids.shape[1]
        device = self.device
        # rows prompt-major (i * n + j), expanded here so greedy n > 1 works too
        ids = ids.repeat_interleave(params.n, dim=0).to(device)
        mask = mask.repeat_interleave(params.n, dim=0).to(device)

        # A fresh default generation_config: the model's own (e.g. a checkpoint's top_k=20,
        # repetition_penalty=1.1, eos ids) must not leak into the sampling distribution.
        saved = self.model.generation_config
        self.model.generation_config = GenerationConfig(pad_token_id=self.pad_token_id)
        devices = [device] if device.type == "cuda" else []
        # the policy samples without dropout (the actor is in train mode after rk.init and update;
        # generate() does not switch it): a model with dropout sampled noisy tokens whose log-probs
        # were up to 3.4 off the trainer's
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.random.fork_rng(devices=devices):
                if generator is not None:
                    torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device)))
                out = self.model.generate(
                    input_ids=ids, attention_mask=mask, generation_config=self._generation_config(params)
                )
        finally:
            self.model.generation_config = saved
            self.model.train(was_training)

        tokens = out.sequences[:, width:]
        logprobs = self.model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True).float()
        stops = () if params.ignore_stop else params.stop_token_ids
        response_mask = response_mask_from_stops(tokens, stops)
        t = max(int(response_mask.sum(-1).max()), 1)
        tokens, response_mask, logprobs = tokens[:, :t], response_mask[:, :t], logprobs[:, :t]
        tokens = torch.where(response_mask, tokens, torch.full_like(tokens, self.pad_token_id))
        logprobs = torch.where(response_mask, logprobs, torch.zeros_like(logprobs))
        if stops:
            stopped = (torch.isin(tokens, torch.tensor(list(stops), device=tokens.device)) & response_mask).any(-1)
        else:
            stopped = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        seconds = time.perf_counter() - start
        generated = int(response_mask.sum())
        return Generation(
            response_ids=tokens,
            response_mask=response_mask,
            logprobs=logprobs,
            truncated=~stopped,
            prompt_index=torch.arange(len(prompt_ids), device=device).repeat_interleave(params.n),
            metrics={
                "seconds": seconds,
                "tokens": float(generated),
                "tokens_per_second": generated / max(seconds, 1e-9),
            },
        )
