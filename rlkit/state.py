"""TrainState: everything a run needs to continue, as one immutable value with donation.

``update(state, batch)`` *donates* its input (as JAX's ``donate_argnums``): parameters and
optimizer moments are updated in place for memory, and the old handle refuses further use with
a clear error instead of silently aliasing the new state. Purity is honest, not pretended.

Randomness is explicit and derived: the sampling key of step ``s`` is ``fold_in(seed, s)``, so
``(seed, step)`` is the whole RNG state and a resumed run samples exactly what an uninterrupted
one would.
"""
from __future__ import annotations

import copy
import hashlib
import operator
import warnings
import weakref
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

import torch
from torch import nn

from rlkit._checks import check_seed
from rlkit.optim import OptimizerSpec


class DonatedStateError(RuntimeError):
    """A TrainState was used after it (or a handle sharing its models) was donated to ``update``
    (or to ``rlkit.checkpoint.load``)."""


@dataclass
class _Donation:
    """Whether the models and optimizers of a state were consumed. One is shared by every handle
    :meth:`TrainState.replace` made of the same models and optimizers (they alias one set of
    weights), so donating one handle donates them all."""

    donated: bool = False
    by: str = ""
    reason: str = ""  # set when the call that consumed the state did not finish (see update)
    # rk.fit stopped by an exception (Ctrl-C, a failing reward) after it donated this handle: the
    # run's latest state, which the exception carries, and what stopped it; re-running the cell
    # with this handle then points at it (a DonatedStateError replaced the exception as
    # sys.last_value, so `sys.last_value.state` no longer reached it)
    latest: Any = None
    stopped: str = ""


#: what each consumer did to a donated state, and what to use instead
_USE_INSTEAD = {
    "rlkit.update": ("its parameters were updated in place",
                     "Use the state that call returned: `state, metrics = rk.update(state, batch)` "
                     "(`state, history = rk.fit(state, ...)` when rk.fit ran the update)"),
    "rlkit.checkpoint.load": ("the checkpoint was loaded into its models and optimizers in place",
                              "Use the state load returned: `state = rlkit.checkpoint.load(template, path)` "
                              "(or `state = checkpointer.resume(template)`)"),
    "rlkit.launch": ("the workers' trained state was loaded into its models and optimizers in place",
                     "Use the state the launch returned: `state, history = rk.launch(plan, state, prompts, ...)`"),
    "rlkit.init": ("a new rk.init was given its model, which the new state trains in place with its own optimizer",
                   "Use the state rk.init returned, or for two independent runs give rk.init a copy: "
                   "`rk.init(copy.deepcopy(model), ...)`"),
}

_INTERNAL = {"_donation", "_cache", "replace", "donate", "is_donated", "_check", "_repr_parts"}
#: the in-place trained objects: a replace() that keeps one of them makes an alias of the state
_TRAINED = ("actor", "optimizer", "critic", "critic_optimizer")

#: ``_cache`` entries built from a field's value, which ``replace`` drops when that field gets
#: another object: the rollout engine reads (or holds a copy of) the actor's weights and is stamped
#: with the policy_version, which a replaced actor leaves unchanged, so it would never re-sync
#: and would keep sampling the old model; the hf and vLLM engines also keep the tokenizer.
_DERIVED = {
    "actor": ("engine", "engine_kind", "actor_module", "synced_version"),
    "tokenizer": ("engine", "engine_kind"),
    "ref": ("ref_module",),
    "critic": ("critic_module",),
}
#: ``_cache`` entries that lowering (``Plan.shard``) sets: the models are wrapped for a mesh
_LOWERED = ("dp", "split")

#: every TrainState made, held weakly (nothing here keeps a state or its models alive): rk.init
#: looks here for a live state that already trained the model it is given (:func:`_trained_owners`)
_STATES: "weakref.WeakSet[TrainState]" = weakref.WeakSet()


@dataclass(frozen=True, eq=False)
class TrainState:
    """The training state of one run (models, optimizers, schedules, counters, keys).

    Fields:
    - ``actor``: the policy, a causal LM (possibly FSDP-sharded after lowering).
    - ``optimizer`` / ``scheduler``: the actor's AdamW and LR schedule.
    - ``tokenizer``: tokenizer of the actor (token in, token out; used to decode for rewards).
    - ``ref``: frozen reference policy for KL, or None.
    - ``critic`` / ``critic_optimizer`` / ``critic_scheduler``: value model for PPO, or None.
    - ``step``: number of completed training steps (``update`` calls; a recipe step that trains
      nothing, such as DAPO's after every group was filtered out, counts too); ``policy_version``: version of the actor's
      weights: bumped by one by every ``update`` that took at least one optimizer step (however
      many mini-batch steps it took), stamped on every rollout row; an engine whose version lags
      the state's is re-synced. The optimizer's own step count is ``scheduler.last_epoch``.
    - ``seed``: root of every random key (see :func:`fold_in`).
    - ``data_position``: how many prompt batches the data loader has consumed (for resume).
      :func:`rlkit.fit` advances it; ``update`` does not (it never sees the batches), so a loop of
      your own that checkpoints advances it after each batch,
      ``state = state.replace(data_position=state.data_position + 1)``, and resumes with
      ``task.prompts(..., start=state.data_position)`` (left at 0 the resumed loop replayed the
      first batches).
    - ``extras``: small picklable values recipes carry between steps (e.g. an adaptive KL
      controller); saved in checkpoints.
    """

    actor: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    tokenizer: Any = None
    ref: nn.Module | None = None
    critic: nn.Module | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    critic_scheduler: Any = None
    step: int = 0
    policy_version: int = 0
    seed: int = 0
    data_position: int = 0
    extras: Mapping[str, Any] = field(default_factory=dict)
    optimizer_spec: OptimizerSpec | None = None
    critic_optimizer_spec: OptimizerSpec | None = None  # init's critic_optimizer (else optimizer_spec)
    # caches that follow the state through replace() but are not part of its value:
    # the rollout engine (KV-cache buffers), the data-parallel context set by lowering.
    _cache: dict = field(default_factory=dict, repr=False)
    _donation: _Donation = field(default_factory=_Donation, repr=False)

    def __getattribute__(self, name: str):
        if not name.startswith("__") and name not in _INTERNAL:
            donation = object.__getattribute__(self, "_donation")
            if donation.donated:
                direct = object.__getattribute__(self, "__dict__").get("_donated_here", False)
                error = DonatedStateError(_donated_message(donation, direct))
                error.state = _live_latest(donation)  # as fit's own exception carries it: sys.last_value.state
                raise error
        return object.__getattribute__(self, name)

    def __post_init__(self) -> None:
        _STATES.add(self)

    def __repr__(self) -> str:
        donation = object.__getattribute__(self, "_donation")
        if donation.donated:
            # a notebook still shows (and a debugger inspects) the old handle: describe it, don't raise
            return f"TrainState(<donated to {donation.by}: use the state it returned{'; see .state of the last error' if _live_latest(donation) is not None else ''}>)"
        # a summary, not the fields' own reprs: those printed three module trees, the optimizer's
        # param groups and the tokenizer's token table (110 lines, the step after 4700 characters)
        return "TrainState(" + ",\n           ".join(", ".join(line) for line in self._repr_parts()) + ")"

    def _repr_parts(self) -> list[list[str]]:
        """The lines of :meth:`__repr__`: models, then optimizer and tokenizer, then counters."""
        get = lambda name: object.__getattribute__(self, name)  # noqa: E731 - no donation check: repr never raises
        roles = [f"{role}={_describe_module(get(role)) if get(role) is not None else None}" for role in ("ref", "critic")]
        # a reference or critic gets a line of its own: three model descriptions make a long one
        models = [[f"actor={_describe_module(get('actor'))}"], roles] if get("ref") is not None or get("critic") is not None \
            else [[f"actor={_describe_module(get('actor'))}", *roles]]
        trained = [f"optimizer={_describe_optimizer(get('optimizer'))}"]
        if get("critic_optimizer") is not None:
            trained.append(f"critic_optimizer={_describe_optimizer(get('critic_optimizer'))}")
        trained.append(f"tokenizer={_describe_tokenizer(get('tokenizer'))}")
        counters = [f"step={get('step')}", f"policy_version={get('policy_version')}", f"data_position={get('data_position')}",
                    f"seed={get('seed')}"]
        if get("extras"):
            counters.append(f"extras={sorted(map(str, get('extras')))}")
        if any(k in get("_cache") for k in _LOWERED):
            counters.append("lowered")
        counters.append("live")
        return [*models, trained, counters]

    def _check(self) -> None:
        self.step  # noqa: B018 - raises if donated

    @property
    def is_donated(self) -> bool:
        return object.__getattribute__(self, "_donation").donated

    def replace(self, **changes) -> "TrainState":
        """A new state with ``changes`` (Flax-style); caches follow.

        The new state shares the models and optimizers it does not replace with this one (no copy
        is made), and so its donation: when either is donated (``update`` trains the weights in
        place), both refuse further use, except the successor ``donate`` names (the state the
        consuming call returns). ``snapshot = state.replace()`` is an alias, not a snapshot.

        A new ``actor`` (or ``critic``) without ``optimizer=`` (``critic_optimizer=``) gets a fresh
        AdamW from the state's spec, its moments at zero and its LR schedule continued where the
        old one was: the old optimizer steps the old model's parameters. A ``ref`` that is the
        actor is refused, as :func:`init` refuses it.

        Caches built from a model (or the tokenizer) that ``changes`` replaces do not follow
        (:data:`_DERIVED`): the next rollout builds its engine from the new actor. A lowered
        state refuses a new model: its sharded wrappers cannot be rebuilt here."""
        self._check()
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise TypeError(f"TrainState has no field(s) {sorted(unknown)}; fields: {[f.name for f in fields(self) if not f.name.startswith('_')]}")
        values = {f.name: object.__getattribute__(self, f.name) for f in fields(self) if f.name != "_donation"}
        if "_cache" not in changes:  # a caller passing _cache (lowering) says what it holds
            values["_cache"] = _cache_after(values["_cache"], [k for k in _DERIVED if k in changes and changes[k] is not values[k]])
        new = {k for k in ("actor", "critic", "ref") if k in changes and changes[k] is not values[k]}
        values.update(changes)
        if new:
            _optimizers_follow(values, new, changes)
        donation = object.__getattribute__(self, "_donation")
        if any(values[k] is not None and values[k] is object.__getattribute__(self, k) for k in _TRAINED):
            values["_donation"] = donation  # an alias of these weights: donated with them
        return TrainState(**values)

    def donate(self, by: str, successor: "TrainState | None", *, reason: str = "") -> None:
        """Mark this handle, and every handle sharing its models and optimizers (made by
        :meth:`replace`), as consumed by ``by`` (``update``, ``rlkit.checkpoint.load``).

        ``successor`` (the state the consuming call returns, made by ``replace`` from this one)
        stays usable, now the only handle of the weights; None: no handle stays usable. ``reason`` says why the
        state is unusable when the call did not finish (an exception mid-update)."""
        donation = object.__getattribute__(self, "_donation")
        donation.donated = True
        donation.by = by
        donation.reason = reason
        object.__setattr__(self, "_donated_here", True)
        if successor is not None and object.__getattribute__(successor, "_donation") is donation:
            object.__setattr__(successor, "_donation", _Donation())

    # convenience -----------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.actor.parameters()).device

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def rng(self, *path: int | str, device: torch.device | str | None = None) -> torch.Generator:
        """A fresh generator keyed by ``(seed, step, *path)``: deterministic and resumable."""
        return generator(fold_in(self.seed, self.step, *path), device=device or self.device)


def _live_latest(donation: _Donation) -> "TrainState | None":
    """The latest state of the run that stopped after consuming this handle (see
    :func:`record_stop`), while it is still usable; None otherwise."""
    latest = donation.latest
    if latest is None or object.__getattribute__(latest, "_donation").donated:
        return None
    return latest


def _count(n: int) -> str:
    """``n`` parameters the way model cards write them: 7.3K, 494M, 1.5B."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def _describe_module(module: Any) -> str:
    """``Qwen2ForCausalLM(7.3K params, float32, cpu)``: class, size, dtype and device, not the tree."""
    try:
        params = list(module.parameters())
    except Exception:  # not a module (a state built by hand): its type is what can be said
        return type(module).__name__
    if not params:
        return f"{type(module).__name__}(no params)"
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in params})
    devices = sorted({str(p.device) for p in params})
    return f"{type(module).__name__}({_count(sum(p.numel() for p in params))} params, {'/'.join(dtypes)}, {'/'.join(devices)})"


def _describe_optimizer(optimizer: Any) -> str:
    try:
        return f"{type(optimizer).__name__}(lr={float(optimizer.param_groups[0]['lr']):g})"
    except Exception:
        return type(optimizer).__name__


def _describe_tokenizer(tokenizer: Any) -> str:
    if tokenizer is None:
        return "None"
    try:
        size = len(tokenizer)
    except Exception:
        size = getattr(tokenizer, "vocab_size", None)
    return f"{type(tokenizer).__name__}(vocab={size})" if size is not None else type(tokenizer).__name__


def record_stop(handle: "TrainState", latest: "TrainState | None", exc: BaseException, during: int | None = None) -> None:
    """Note on ``handle`` (the state passed to ``rk.fit``, donated to its first update) that the
    run stopped with ``exc`` and that its latest state is ``latest``: using ``handle`` again (the
    cell run a second time) raises a :class:`DonatedStateError` that says so and carries
    ``latest`` as ``.state``. ``latest=None``: the run stopped inside the update of step
    ``during``, and no consistent state is left; the error says so and names the ways back (it
    had said "use the state that call returned", of which there is none)."""
    donation = object.__getattribute__(handle, "_donation")
    if not donation.donated or latest is handle:
        return
    if latest is None:
        text = str(exc).splitlines()[0] if str(exc) else ""
        donation.by = "rk.fit"
        donation.reason = (f"{type(exc).__name__}{': ' + text[:100] if text else ''} during the update of step {during}"
                           if during is not None else f"{type(exc).__name__} during an update")
        return
    donation.latest = latest
    text = str(exc).splitlines()[0] if str(exc) else ""
    donation.stopped = f"{type(exc).__name__}{': ' + text[:100] if text else ''}"


def _donated_message(donation: _Donation, direct: bool) -> str:
    """The :class:`DonatedStateError` of a handle: what consumed it, and what to use instead."""
    latest = _live_latest(donation)
    if latest is not None:
        return (f"this TrainState was passed to rk.fit, which stopped with {donation.stopped} after step "
                f"{object.__getattribute__(latest, 'step')}; its parameters and optimizer moved on in place, so this "
                "handle can no longer be used. The run's latest state is that exception's .state, and this error's: "
                "`state = sys.last_value.state` in a notebook, then run the cell again")
    if donation.reason:
        return (f"this TrainState was donated to {donation.by}, which did not finish ({donation.reason}): its parameters "
                "and optimizer state were already changed in place, so it (and any handle sharing its models) is not "
                "a consistent state. Restore the last checkpoint (`state = checkpointer.resume(template)`) or start "
                "over from rk.init")
    done, hint = _USE_INSTEAD.get(donation.by, ("its models were changed in place", "Use the state that call returned"))
    if direct:
        return f"this TrainState was donated to {donation.by} and can no longer be used ({done}). {hint}."
    return (f"this TrainState shares its models and optimizer with a state that was donated to {donation.by} "
            f"(replace() makes an alias, not a copy; {done}), so it can no longer be used. {hint}; for a "
            "snapshot, save a checkpoint or copy.deepcopy the models.")


def _shares_parameters(a: nn.Module, b: nn.Module) -> bool:
    """``a`` is ``b`` or holds one of its parameters (a reference that would train with the actor)."""
    return a is b or not {id(p) for p in a.parameters()}.isdisjoint(id(p) for p in b.parameters())


def _holds(optimizer, module) -> bool:
    """Whether ``optimizer`` steps parameters of ``module`` (every one it holds is the module's)."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return bool(held) and held <= {id(p) for p in module.parameters()}


def _optimizers_follow(values: dict, new: set[str], changes: dict) -> None:
    """Keep :meth:`TrainState.replace` from making a state that trains nothing or compares the
    actor with itself. The optimizers stayed bound to the replaced models' parameters: a new actor
    or critic reported gradient norms and never changed (``values`` is updated in place)."""
    actor, ref = values["actor"], values["ref"]
    if ref is not None and _shares_parameters(ref, actor):
        raise ValueError("TrainState.replace: ref is the actor itself (or shares its parameters); the KL to it would stay 0 "
                         "and freezing it would freeze the actor. Pass a frozen copy (copy.deepcopy(actor)) or ref=None")
    for model_key, opt_key, sched_key, spec_key in (("actor", "optimizer", "scheduler", "optimizer_spec"),
                                                    ("critic", "critic_optimizer", "critic_scheduler", "critic_optimizer_spec")):
        model, optimizer = values[model_key], values[opt_key]
        if model_key not in new or opt_key in changes or model is None or (optimizer is not None and _holds(optimizer, model)):
            continue
        spec = values[spec_key] or (values["optimizer_spec"] if model_key == "critic" else None)
        if spec is None:
            continue  # refused below, naming what to pass
        # a fresh AdamW from the state's spec (moments belong to parameters: the old ones are the
        # replaced model's), its schedule continued where the old one was
        old_scheduler = values[sched_key]
        values[opt_key], values[sched_key] = spec.build(model)
        done = getattr(old_scheduler, "last_epoch", 0)
        if done:
            values[sched_key].last_epoch = done
            for group, base in zip(values[opt_key].param_groups, values[sched_key].base_lrs):
                group["lr"] = base * spec.lr_factor(done)
    for model_key, opt_key in (("actor", "optimizer"), ("critic", "critic_optimizer")):
        model, optimizer = values[model_key], values[opt_key]
        if model is not None and (model_key in new or opt_key in changes) and (optimizer is None or not _holds(optimizer, model)):
            raise ValueError(
                f"TrainState.replace: {opt_key} does not hold the parameters of the {model_key} (it was built for the "
                f"replaced one, so the new {model_key} would never train); pass {opt_key}= and "
                f"{opt_key.replace('optimizer', 'scheduler')}= built for it (spec.build({model_key})), "
                "or start over with rk.init")


def _cache_after(cache: dict, changed: list[str]) -> dict:
    """``cache`` without the entries derived from the ``changed`` fields; a new dict, since the
    old state shares the old one and still uses its engine."""
    if not changed:
        return cache
    lowered = [k for k in _LOWERED if k in cache]
    if lowered:
        models = [k for k in changed if k != "tokenizer"]
        if not models:
            return cache  # a lowered engine is the built-in one, which reads no tokenizer
        raise ValueError(
            f"TrainState.replace({models[0]}=...): this state was lowered (Plan.shard wrapped its models for "
            f"distributed training and built the rollout engine from them); those would keep the old model. "
            f"Replace {models[0]} before lowering, then lower the new state"
        )
    stale = {key for name in changed for key in _DERIVED[name]}
    return {k: v for k, v in cache.items() if k not in stale}


def fold_in(seed: int, *path: int | str) -> int:
    """Derive a 63-bit key from a root seed and a path (JAX's ``fold_in``, by hashing).

    ``seed`` and the path's numbers are integers of any kind (Python, numpy, a 0-d torch tensor),
    keyed by their value: ``fold_in(1, np.int64(3)) == fold_in(1, 3)`` (the key hashed their repr,
    so equal numbers gave different keys); path items are those or strings. Anything else (a float,
    None) is a ``TypeError``."""
    h = hashlib.blake2b(repr((_key_int(seed, "seed"),) + tuple(_key_part(p, i) for i, p in enumerate(path))).encode(),
                        digest_size=8)
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def _key_int(value: Any, what: str) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() and not value.is_complex():
        value = value.item()
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"fold_in: {what} must be an integer, got {type(value).__name__} {value!r:.40}; "
                        "pass int(...) of it (a float is refused: 3.0 and 3.5 would need a rule)") from None


def _key_part(value: Any, i: int) -> int | str:
    return value if isinstance(value, str) else _key_int(value, f"path item {i}")


def _checked_device(device: torch.device | str, where: str = "") -> torch.device:
    """``device`` as a torch.device, or an error saying what this machine has (torch's own are an
    AssertionError, "Torch not compiled with CUDA enabled", or a list of every device type);
    ``where`` (``"load_model"``) leads the message."""
    lead = f"{where}: " if where else ""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{lead}device={device!r} is not a device; use 'cpu', 'cuda' or 'cuda:N' (e.g. 'cuda:0')") from None
    if dev.type not in ("cpu", "cuda"):
        # torch parses 'mps', 'xla', 'meta' ... and fails later, in model.to(), with a traceback
        backend = getattr(torch, dev.type, None) if dev.type != "meta" else None
        available = getattr(backend, "is_available", None)
        if not (callable(available) and available()):
            raise ValueError(f"{lead}device={device!r}: this torch ({torch.__version__}) has no usable {dev.type!r} device; "
                             "use 'cpu', 'cuda' or 'cuda:N' (e.g. 'cuda:0')")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{lead}device={device!r}, but this torch ({torch.__version__}) sees no CUDA GPU; "
                             "use device='cpu', or install a CUDA build of torch on a machine with a GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{lead}device={device!r}, but only {torch.cuda.device_count()} CUDA GPU(s) are visible "
                             f"(cuda:0 to cuda:{torch.cuda.device_count() - 1}); check CUDA_VISIBLE_DEVICES")
    return dev


def generator(key: int, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(key))
    return g


def init(
    model: nn.Module,
    optimizer: OptimizerSpec | None = None,
    *,
    tokenizer: Any = None,
    ref: nn.Module | str | None = None,
    critic: nn.Module | None = None,
    critic_optimizer: OptimizerSpec | None = None,
    seed: int = 0,
    device: torch.device | str | None = None,
    compile: bool | str = "auto",
) -> TrainState:
    """Make the initial TrainState.

    - ``model``: the actor (a Hugging Face causal LM). ``tokenizer`` defaults to
      ``model.rlkit_tokenizer`` when the model was built by :func:`rlkit.models.tiny`.
    - ``ref="copy"`` freezes a deep copy of the actor as the KL reference.
    - ``critic``: a value model (``rlkit.models.critic(model)``) for PPO; trained with
      ``critic_optimizer`` (defaults to the actor's spec).
    - ``compile``: ``torch.compile`` the decoder blocks of actor, reference and critic in place
      (:mod:`rlkit.models.compile`); ``"auto"`` (default) does it on CUDA when Triton is
      importable and the model has at least 20M parameters
      (``rlkit.models.compile.AUTO_MIN_PARAMS``: below that, compiling pays back slowly or
      never), never on CPU. A compiler failure falls back to eager mode with a warning.
    - ``seed``: the root of every rollout's, shuffle's and loss's randomness (explicit generators,
      ``fold_in(seed, ...)``). rk.init also seeds torch's global RNG with ``fold_in(seed, "init")``:
      the one draw rlkit leaves to it is the actor's train-mode dropout in the update (checkpoints
      save and restore that RNG), so a run with dropout repeats from its seed. Your own draws from
      torch's global RNG after rk.init therefore repeat across runs of the same ``seed``, whatever you
      seeded before it: seed them after rk.init, or with a ``torch.Generator`` of your own.
    """
    from rlkit.optim import adamw

    _check_init_args(model, optimizer, tokenizer, ref, critic, critic_optimizer)
    # fold_in hashed 1.5 and "0" as other seeds than 1 and 0; rollout refuses them the same way
    check_seed(seed, "rk.init", " (the root of every rollout's and shuffle's randomness)")
    # after every argument check: a refused call warns of nothing and donates nothing
    owners = _warn_trained_elsewhere(model, ref, critic)
    _warn_dropout(model)
    spec = optimizer or adamw()
    if device is not None:
        model = model.to(_checked_device(device))
    if tokenizer is None:
        tokenizer = getattr(model, "rlkit_tokenizer", None)
    if isinstance(ref, str):
        ref = copy.deepcopy(model)
    if ref is not None:
        ref = ref.to(next(model.parameters()).device).eval().requires_grad_(False)
    opt, sched = spec.build(model)
    _warn_low_precision(model, opt, spec, "actor")
    c_opt = c_sched = None
    if critic is not None:
        critic = critic.to(next(model.parameters()).device)
        c_opt, c_sched = (critic_optimizer or spec).build(critic)
        _warn_low_precision(critic, c_opt, critic_optimizer or spec, "critic")
    from rlkit.models.compile import maybe_compile

    for module in (model, ref, critic):
        maybe_compile(module, compile)
    torch.manual_seed(fold_in(seed, "init"))
    state = TrainState(
        actor=model,
        optimizer=opt,
        scheduler=sched,
        tokenizer=tokenizer,
        ref=ref,
        critic=critic,
        critic_optimizer=c_opt,
        critic_scheduler=c_sched,
        seed=seed,
        optimizer_spec=spec,
        critic_optimizer_spec=(critic_optimizer or spec) if critic is not None else None,
    )
    for owner in owners:
        # the new state trains (or freezes) the owner's module in place: two usable handles of one
        # set of weights is the aliasing donation exists to refuse
        owner.donate("rlkit.init", None)
    return state


#: share of a model's trainable weights that an AdamW step of size ``lr`` must be able to move
#: in their own dtype; below it, :func:`init` warns that most of the update is rounded away
LOW_PRECISION_MOVABLE = 0.5
# AdamW's eps below which float16 moments (FSDP shards: no master copies) blow up: a gradient whose
# square underflows in float16 (|g| < ~2e-4) leaves v = 0 and the step lr*m/eps
FLOAT16_SAFE_EPS = 1e-4


def movable_fraction(model: nn.Module, lr: float, sample: int = 1 << 20) -> float | None:
    """The share of ``model``'s trainable bf16/fp16 weights that a change of ``lr`` survives in their
    own dtype (a step is kept when it is at least half the spacing of representable numbers at the
    weight: round to nearest), estimated on about ``sample`` evenly spaced elements; None when no
    trainable weight is bf16/fp16. AdamW's steps are about ``lr`` in size, so at lr 1e-6 a bf16
    weight of 0.02 (spacing 1.2e-4) never changes, unless the optimizer keeps float32 master
    copies (``OptimizerSpec.master_weights``, on by default for such weights)."""
    params = [p for p in model.parameters() if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)]
    if not params:
        return None
    total = sum(p.numel() for p in params)
    stride = max(1, total // sample)
    moved = seen = 0
    with torch.no_grad():
        for p in params:
            local = p.detach()
            local = local.to_local() if hasattr(local, "to_local") else local  # FSDP2's DTensor: this rank's shard
            w = local.reshape(-1)[::stride].float().abs()
            if not w.numel():
                continue
            # spacing at |w|: eps * 2**floor(log2|w|); zeros (and subnormals) move with any step
            spacing = torch.finfo(p.dtype).eps * torch.exp2(torch.floor(torch.log2(w.clamp_min(torch.finfo(p.dtype).tiny))))
            moved += int((lr >= spacing / 2).sum())
            seen += w.numel()
    return moved / seen if seen else None


def _warn_low_precision(model: nn.Module, optimizer, spec: OptimizerSpec, role: str) -> None:
    """Warn when ``model`` trains float16 weights (loss-scaled by :func:`rlkit.update`, but float16's
    range still overflows), or when ``optimizer`` steps bf16 weights in their own dtype
    (``master_weights=False``) and most are too large for a step of ``spec.lr`` to change them
    (:func:`movable_fraction`)."""
    from rlkit.optim import MasterWeightAdamW

    master = isinstance(optimizer, MasterWeightAdamW)
    if any(p.requires_grad and p.dtype == torch.float16 for p in model.parameters()):
        # rk.update scales float16 losses (rlkit.transforms.update.LossScale); float16's range still
        # costs what bfloat16's does not, and without master weights its gradients and moments too
        moments = ("" if master else "; and with master_weights=False AdamW's second moment (1-beta2)*g^2 underflows to "
                   "0 in float16, so steps grow to lr*m/eps, hundreds of times lr, and the gradients are unscaled in "
                   "float16, where those below about 6e-8 flush to zero again")
        warnings.warn(
            f"rk.init: the {role}'s trainable weights are float16. rk.update scales their loss dynamically (from 2**16, "
            f"kept in state.extras['loss_scale/{role}']), so small gradients survive the backward pass, but float16's "
            "range still costs: activations above 65504 overflow in the forward pass (a non-finite loss: skipped steps, "
            "then NonFiniteError), and each gradient overflow while the scale settles skips an optimizer step "
            f"({role}/loss_scale_overflows){moments}. Use bfloat16 where the GPU has it (float32's range at the same "
            "memory; model.to(torch.bfloat16)), or float32",
            RuntimeWarning, stacklevel=3,
        )
        return
    if master:
        return
    share = movable_fraction(model, float(spec.lr))
    if share is None or share >= LOW_PRECISION_MOVABLE:
        return
    dtype = next(p.dtype for p in model.parameters() if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16))
    warnings.warn(
        f"rk.init: the {role}'s trainable weights are {str(dtype).replace('torch.', '')} and at lr={spec.lr:g} an "
        f"optimizer step changes only {share:.0%} of them: the rest round back to the same value (the optimizer was "
        "built with master_weights=False, so it keeps no float32 copy). Fix: leave master_weights at None (the default: "
        "float32 master copies of bf16/fp16 weights, rk.optim.MasterWeightAdamW), or train in float32, or raise lr to "
        "where steps are kept (rk.state.movable_fraction(model, lr) measures it)",
        RuntimeWarning, stacklevel=3,
    )


def warn_sharded_low_precision(model: nn.Module, spec: OptimizerSpec, role: str, where: str) -> None:
    """Warn when ``model``'s FSDP-sharded trainable weights are bf16/fp16 (no float32 master copies:
    :class:`rlkit.optim.MasterWeightAdamW` steps plain tensors only, and FSDP keeps float32 shards only
    of a float32 model) and either float16 with an ``eps`` its float16 moments blow up at
    (:data:`FLOAT16_SAFE_EPS`), or most are too large for a step of ``spec.lr`` to change them."""
    if spec.master_weights is False:
        return  # chosen: rk.init warned about it already
    if spec.eps < FLOAT16_SAFE_EPS and any(p.requires_grad and p.dtype == torch.float16 for p in model.parameters()):
        # one process's float16 weights step in MasterWeightAdamW (float32 moments); over shards
        # the moments are float16, which rk.init could not know when it warned
        warnings.warn(
            f"{where}: the {role}'s sharded trainable weights are float16, so its optimizer keeps AdamW's moments in "
            "float16 (no float32 master copies over FSDP shards): the second moment (1-beta2)*g^2 underflows to 0 for "
            f"gradients below about 2e-4, and the step then grows to lr*m/eps (eps={spec.eps:g}), hundreds of times lr. "
            "Fix: give rk.init a float32 model and lower with mixed_precision=True (the default on GPUs): FSDP then keeps "
            f"float32 shards and computes in low precision; or use bfloat16; or set eps >= {FLOAT16_SAFE_EPS:g} (a step "
            "is then at most a few times lr)",
            RuntimeWarning, stacklevel=3,
        )
        return
    share = movable_fraction(model, float(spec.lr))
    if share is None or share >= LOW_PRECISION_MOVABLE:
        return
    warnings.warn(
        f"{where}: the {role}'s sharded trainable weights are bf16/fp16, so its optimizer steps them in their own dtype "
        f"(no float32 master copies over FSDP shards): at lr={spec.lr:g} a step changes only {share:.0%} of them. Fix: "
        "give rk.init a float32 model and lower with mixed_precision=True (the default on GPUs): FSDP then keeps "
        "float32 shards and computes in bf16",
        RuntimeWarning, stacklevel=3,
    )


def _warn_dropout(model: nn.Module) -> None:
    """Warn (once per init) that the actor has dropout on: update's forward runs in training mode,
    rollouts and compute_old_logprobs in eval mode, so its log-probs carry the dropout noise."""
    from rlkit.models.build import active_dropout

    modules, fields = active_dropout(model)
    if not modules and not fields:
        return
    parts = []
    if modules:
        parts.append(f"{len(modules)} module(s) with dropout > 0 (e.g. {', '.join(modules[:3])})")
    if fields:
        parts.append(f"attention dropout in its config ({', '.join(fields)})")
    warnings.warn(
        f"rk.init: the actor has dropout on: {' and '.join(parts)}. rk.update computes its log-probs in training "
        "mode, with dropout, while rollouts and compute_old_logprobs run in eval mode: the training log-probs are "
        "noisy, PPO's ratio is not 1 even on an on-policy batch (a share of the tokens clips on the first step), and "
        "the actor/logprob_gap metrics measure the dropout noise rather than the engine. Fix: "
        "model = rk.models.disable_dropout(model) before rk.init (as TRL's disable_dropout=True), unless you mean "
        "to train with dropout",
        RuntimeWarning, stacklevel=3,
    )


def _trained_owners(module: nn.Module) -> list[tuple["TrainState", str]]:
    """The live (not donated) states that took at least one step and hold ``module`` (or one of its
    parameters) as their actor, critic or reference, with that role: found through the weak
    registry :data:`_STATES`, so only states something else still holds."""
    found = []
    for state in list(_STATES):
        if object.__getattribute__(state, "_donation").donated or object.__getattribute__(state, "step") <= 0:
            continue
        for role in ("actor", "critic", "ref"):
            held = object.__getattribute__(state, role)
            if isinstance(held, nn.Module) and _shares_parameters(module, held):
                found.append((state, role))
                break
    return found


def _warn_trained_elsewhere(model: nn.Module, ref: Any, critic: Any) -> list["TrainState"]:
    """Warn when a model given to :func:`init` belongs to a live TrainState that has trained (step > 0)
    and return those states, which init then donates (the new state trains, or freezes, their module
    in place). The notebook case: re-running a cell ``state = rk.init(model, ...); rk.fit(...)``
    after the first run trained ``model`` in place started a "fresh" run at step 0 from the
    trained weights, silently, and left the old state usable, stepping the same module with its own
    optimizer. Refusing would also refuse starting a second phase from a run's weights on purpose,
    and an untrained model given to init twice (states at step 0) stays allowed: nothing trained it yet."""
    owners: dict[int, TrainState] = {}
    found = []
    for what, module in (("model", model), ("ref", ref), ("critic", critic)):
        if not isinstance(module, nn.Module):
            continue  # None, or ref="copy": a copy is made from the model, checked above
        for state, role in _trained_owners(module):
            if what == role == "ref":
                continue  # one frozen reference shared by two runs: neither changes it
            found.append((what, role, object.__getattribute__(state, "step")))
            owners[id(state)] = state
    if not found:
        return []
    what, role, step = max(found, key=lambda f: f[2])
    given = {"model": "the model", "ref": "the ref model", "critic": "the critic"}[what]
    if what == "ref":
        effect = ("; the new state freezes it as its reference (requires_grad off), which stops that run training it. "
                  "The older state is donated to this call and refuses further use")
    elif role == "ref":
        effect = ("; the new state would train that run's frozen KL reference in place. The older state is donated to "
                  "this call and refuses further use")
    else:
        effect = (f": that run trained its weights in place, so the new state starts at step 0 from weights already "
                  f"trained for {step} step(s), not from where that run began (a cell `state = rk.init(model, ...); "
                  "rk.fit(...)` run a second time does this). Both states would train one module with two optimizers, "
                  "so the older one is donated to this call and refuses further use")
    warnings.warn(
        f"rk.init: {given} is the {role} of another TrainState, still in use at step {step}{effect}. Fix: to continue "
        "that run, keep using its latest state (`state, history = rk.fit(state, ...)`) instead of calling rk.init "
        "again; for runs that each start from the same weights, rebuild the model (re-run "
        "the cell that made it) and give rk.init a copy, `rk.init(copy.deepcopy(model), ...)`, so `model` itself is "
        "never trained; to start a new phase from the trained weights on purpose, pass copy.deepcopy(state.actor)",
        RuntimeWarning, stacklevel=3,
    )
    return list(owners.values())


def _check_init_args(model, optimizer, tokenizer, ref, critic, critic_optimizer) -> None:
    """Clear errors for what :func:`init` cannot use, before anything is moved or frozen (torch's
    and transformers' own errors surface later and name an attribute, not the argument)."""
    import os

    from rlkit._checks import model_of

    if isinstance(model, (str, os.PathLike)):
        raise TypeError(f"rk.init takes a model, not a path ({str(model)!r}); load it with rk.models.load_model(path)")
    model_of(model, "rk.init", accept_state=False)
    for role, module in (("model", model), ("critic", critic)):
        if isinstance(module, nn.Module) and not any(p.requires_grad for p in module.parameters()):
            # AdamW then failed with torch's "optimizer got an empty parameter list", naming neither
            # the argument nor why (a model frozen as a reference, or loaded for inference)
            frozen = any(True for _ in module.parameters())
            raise ValueError(f"rk.init: the {role} has no trainable parameter ("
                             + ("every parameter has requires_grad=False, e.g. a model frozen as a reference"
                                if frozen else "it has no parameters")
                             + f"); rk.init trains it: unfreeze it with {role}.requires_grad_(True), or pass a fresh copy")
    for name, spec in (("optimizer", optimizer), ("critic_optimizer", critic_optimizer)):
        if spec is not None and not isinstance(spec, OptimizerSpec):
            raise TypeError(f"{name} must be an rlkit OptimizerSpec (e.g. rk.optim.adamw(lr=1e-5)), got {type(spec).__name__}")
    if isinstance(tokenizer, (str, os.PathLike)):
        raise TypeError(
            f"tokenizer must be a tokenizer object, not a name or path ({str(tokenizer)!r}); load it with "
            "transformers.AutoTokenizer.from_pretrained(local_dir) (or rk.models.load_tokenizer(local_dir))"
        )
    if isinstance(ref, str):
        if ref != "copy":
            raise ValueError(f"ref must be a model, None or 'copy', got {ref!r}")
    elif ref is not None:
        if not isinstance(ref, nn.Module):
            raise TypeError(f"ref must be a model, None or 'copy' (a frozen copy of the actor), got {type(ref).__name__}")
        if _shares_parameters(ref, model):
            # freezing the reference would freeze the actor too, and the KL to itself is zero
            raise ValueError("ref is the actor itself (or shares its parameters): the reference must stay frozen while "
                             "the actor trains; pass ref='copy' for a frozen snapshot of the actor")
    if isinstance(critic, nn.Module) and _shares_parameters(critic, model):
        # the critic's optimizer would step the actor's weights with the value loss's gradients
        raise ValueError("critic is the actor itself (or shares its parameters): the value model must have its own "
                         "weights; build one with critic=rk.models.critic(model) (a copy of the actor's backbone "
                         "with a scalar head)")
    if critic is not None and not isinstance(critic, nn.Module):
        hint = " (there is no critic='copy', unlike ref)" if isinstance(critic, str) else ""
        raise TypeError(f"critic must be a value model or None, got {type(critic).__name__} {critic!r}{hint}; "
                        "build one with critic=rk.models.critic(model) (the actor's backbone with a scalar head), "
                        "or rk.models.critic(local_dir)")
