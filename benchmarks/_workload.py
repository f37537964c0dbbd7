"""The benchmark workloads: model shape, prompts, reward and GRPO settings, shared by rlkit and TRL.

Two presets (issue 5):

- ``qwen2.5-0.5b``: Qwen2.5-0.5B's shape with random init in bf16 (a random model costs what a
  trained one does and needs no download); 32 prompts x 8 samples = 256 responses, prompt 64
  tokens, response exactly 256 tokens (EOS ignored), old-policy and reference log-probs
  (beta 0.04), one update epoch.
- ``cpu``: Qwen2 shape with hidden 128, 2 layers, 4 heads, intermediate 512 and a character
  vocabulary, float32 on CPU; 8 prompts x 8 samples, up to 16 new tokens (EOS stops), beta 0.
- ``cpu-bf16``: the ``cpu`` preset with bf16 parameters on both sides (TRL's ``bf16=True`` and
  a bf16 model): whether bf16 products, which this CPU runs faster, make the step faster.

Both sides get the same tokenizer, prompts and reward function, so they do the same work.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import subprocess
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Workload:
    name: str
    n_prompts: int
    n: int  # samples per prompt
    prompt_tokens: int  # exact for the word vocabulary, approximate (characters) for the char one
    max_new_tokens: int
    ignore_eos: bool
    beta: float  # KL coefficient: > 0 means a reference log-prob pass
    # old-policy log-probs: True a separate pass before the update (verl's recompute), "current"
    # the update's own forward detached (TRL's path for one iteration), False the rollout's
    old_logprobs: bool | str
    micro_batch: int  # update micro-batch rows (gradient accumulation over the rest)
    logprob_micro_batch: int | None  # rows per forward-only log-prob pass (None: all at once)
    dtype: torch.dtype
    lr: float = 1e-6
    # queue the log-prob passes before scoring (they never wait for the GPU) and decode and score
    # on the host while the GPU runs them; False times every phase on its own, serially
    overlap: bool = True

    @property
    def rows(self) -> int:
        return self.n_prompts * self.n


PRESETS = {
    "qwen2.5-0.5b": Workload(
        "qwen2.5-0.5b", n_prompts=32, n=8, prompt_tokens=64, max_new_tokens=256, ignore_eos=True, beta=0.04,
        old_logprobs=True, micro_batch=128, logprob_micro_batch=256, dtype=torch.bfloat16,
    ),
    "cpu": Workload(
        "cpu", n_prompts=8, n=8, prompt_tokens=8, max_new_tokens=16, ignore_eos=False, beta=0.0,
        old_logprobs=False, micro_batch=64, logprob_micro_batch=None, dtype=torch.float32,
    ),
}
PRESETS["cpu-bf16"] = dataclasses.replace(PRESETS["cpu"], name="cpu-bf16", dtype=torch.bfloat16)

CPU_ALPHABET = "0123456789+= "


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer of exactly ``vocab_size`` ids: specials 0-3, then ``t4 .. t{V-1}``,
    split on whitespace, so a prompt of ``k`` words is ``k`` tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}
    vocab.update({f"t{i}": i for i in range(4, vocab_size)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        padding_side="left", clean_up_tokenization_spaces=False,
    )


def word_prompts(wl: Workload, vocab: int, rng: random.Random) -> list[str]:
    """``wl.n_prompts`` prompts of exactly ``wl.prompt_tokens`` words of :func:`word_tokenizer`'s
    ``vocab`` ids (4 and up: no specials), drawn from ``rng``."""
    return [" ".join(f"t{rng.randrange(4, vocab)}" for _ in range(wl.prompt_tokens)) for _ in range(wl.n_prompts)]


def build(preset: str, device: torch.device, seed: int = 0):
    """``(workload, model, tokenizer, prompt_texts)``: a fresh random model on ``device``."""
    from rlkit.models import tiny
    from rlkit.models.tokenizers import char_tokenizer

    wl = PRESETS[preset]
    rng = random.Random(seed)
    if preset.startswith("cpu"):
        tok = char_tokenizer(CPU_ALPHABET)
        model = tiny(tok, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                     intermediate_size=512, seed=seed, dtype=wl.dtype)
        texts = [f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=" for _ in range(wl.n_prompts)]
    else:
        tok = word_tokenizer(151936)
        model = tiny(tok, size="qwen2.5-0.5b", seed=seed, dtype=wl.dtype)
        texts = word_prompts(wl, 151936, rng)
    return wl, model.to(device), tok, texts


def reward(completions, **kwargs) -> list[float]:
    """A TRL-style reward (``f(completions, **columns)``): cheap, and varied within a group."""
    return [float(sum(ord(c) for c in text) % 7) / 6.0 for text in completions]


def emit_result(result: dict, path: str | None = None) -> None:
    """Print the benchmarks' one ``RESULT_JSON {...}`` line and, with ``path``, write the same JSON there."""
    import json

    line = json.dumps(result, default=float)
    print("RESULT_JSON " + line, flush=True)
    if path:
        with open(path, "w") as f:
            f.write(line + "\n")


def child_json(cmd: list[str], tag: str, *, env: dict | None = None) -> dict:
    """Run ``cmd`` in a fresh process and return the JSON of the last stdout line starting with
    ``tag + " "``, with ``"process_s"`` (the child's wall time) added; ``{"error": ...}`` (the exit
    code and the end of its output) when it exits non-zero or prints no such line."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    prefix = tag + " "
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(prefix)]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-3000:]}"}
    out = json.loads(lines[-1][len(prefix):])
    out["process_s"] = wall
    return out


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class GcPauses:
    """``with GcPauses() as gc_pauses:`` counts and times Python's garbage collections (per
    generation) inside the block; ``gc_pauses.summary()`` after it.

    A full (generation 2) collection walks every live container object; in a process holding a
    model, compiled graphs and per-row text columns that can take 100 ms or more, landing in
    whichever phase happens to allocate at that moment."""

    def __enter__(self) -> "GcPauses":
        import gc

        self.stats = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
        self._t0 = 0.0
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        import gc

        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            entry = self.stats[info["generation"]]
            entry[0] += 1
            entry[1] += time.perf_counter() - self._t0

    def summary(self) -> dict:
        return {f"gen{g}": {"count": n, "ms": round(t * 1e3, 1)} for g, (n, t) in self.stats.items()}


class Clock:
    """Wall time of phases, synchronising the device at each boundary (this process only).

    ``clock(name, wait=False)``: the phase ends when the host has queued its work, without waiting
    for the device; the next phase's time then includes the rest (for work meant to overlap)."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, {}
        self._waited = True

    @contextlib.contextmanager
    def __call__(self, name: str, wait: bool = True):
        if self._waited:
            sync(self.device)
        t0 = time.perf_counter()
        with torch.profiler.record_function(name):  # names the phase in a profiler trace (benchmarks/_trace.py)
            yield
        if wait:
            sync(self.device)
        self._waited = wait
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0


def grpo_phases(state, prompts, wl: Workload, clock: Clock, reward_fn, *, beta: float, micro_batch: int, old_pass: bool = True):
    """One GRPO step through rlkit's transforms, each phase timed by ``clock``: rollout -> score ->
    advantage("grpo") -> [old log-probs] -> [ref log-probs when beta] -> update("ppo_clip").

    With ``wl.overlap`` the order is rollout (responses left as token ids) -> [old] -> [ref] ->
    score (decoding the responses) -> advantage -> update, and the middle three are one phase
    ("passes_score"): the passes are queued without waiting for the GPU, so decoding and the
    reward run on the host meanwhile. Nothing waits for the GPU between that phase and the
    update (a recipe's step does not either): "passes_score" is the host's time to queue the
    passes and score, and "update" includes the rest of the passes.

    The old-policy log-probs follow ``wl.old_logprobs``: True a separate pass (where ``old_pass``;
    split placement's rollout ranks skip it), "current" the update's own forward, False the
    rollout's. Returns ``(state, batch, update metrics)``."""
    from rlkit.transforms.advantage import advantage
    from rlkit.transforms.forward import compute_old_logprobs, compute_ref_logprobs
    from rlkit.transforms.rollout import rollout
    from rlkit.transforms.score import score
    from rlkit.transforms.update import update

    def passes(batch, timed: bool):
        """The old-policy and reference passes the workload asks for, each its own phase when ``timed``."""
        for wanted, name, fn in ((wl.old_logprobs is True and old_pass, "old_logprobs", compute_old_logprobs),
                                 (bool(beta), "ref_logprobs", compute_ref_logprobs)):
            if wanted:
                with clock(name) if timed else contextlib.nullcontext():
                    batch = fn(state, batch, micro_batch_size=wl.logprob_micro_batch)
        return batch

    with clock("rollout"):
        batch = rollout(state, prompts, n=wl.n, max_new_tokens=wl.max_new_tokens, ignore_stop=wl.ignore_eos,
                        decode=not wl.overlap)
    if wl.overlap:
        with clock("passes_score", wait=False):
            batch = advantage(score(passes(batch, timed=False), reward_fn, tokenizer=state.tokenizer), "grpo")
    else:
        with clock("score_advantage"):
            batch = advantage(score(batch, reward_fn), "grpo")
        batch = passes(batch, timed=True)
    with clock("update"):
        state, metrics = update(state, batch, loss="ppo_clip", kl=("low_var_kl", beta) if beta else None,
                                micro_batch_size=micro_batch, old="current" if wl.old_logprobs == "current" else "batch")
    return state, batch, metrics
