"""torch.compile of the decoder blocks: same numbers, same module tree, and a failing compiler
falls back to eager instead of stopping the run. Uses dynamo's "eager" backend on CPU (the real
inductor path is exercised on GPU by benchmarks/grpo_step.py)."""
import copy

import pytest
import torch

from rlkit.batch import make_batch
from rlkit.models import response_logprobs, tiny
from rlkit.models.compile import ENV, compile_layers, is_compiled, maybe_compile, uncompile_layers
from rlkit.models.tokenizers import char_tokenizer
from rlkit.optim import adamw
from rlkit.state import init

PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
RESPONSES = [[5, 5, 5, 6], [7], [8, 9]]


def _model(seed=0):
    tok = char_tokenizer("0123456789+= ")
    return tiny(tok, hidden_size=64, intermediate_size=128, initializer_range=0.2, seed=seed)


def _args():
    b = make_batch(PROMPTS, RESPONSES, pad_token_id=0)
    return b["prompt_ids"], b["prompt_mask"], b["response_ids"], b["response_mask"]


def _lp_and_grads(model):
    model.zero_grad(set_to_none=True)
    lp, ent = response_logprobs(model, *_args(), with_entropy=True)
    (lp.sum() + ent.sum()).backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_compiled_blocks_give_the_same_logprobs_gradients_and_state_dict():
    eager, compiled = _model(), _model()
    keys = list(compiled.state_dict())
    assert compile_layers(compiled, backend="eager") == compiled.config.num_hidden_layers
    assert is_compiled(compiled) and not is_compiled(eager)
    assert list(compiled.state_dict()) == keys  # no _orig_mod. prefix: checkpoints and sync unchanged
    lp0, g0 = _lp_and_grads(eager)
    lp1, g1 = _lp_and_grads(compiled)
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-6)
    assert g0.keys() == g1.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-7, msg=name)
    uncompile_layers(compiled)
    assert not is_compiled(compiled)


def test_a_failing_compiler_falls_back_to_eager_with_a_warning():
    def broken_backend(gm, example_inputs):
        raise RuntimeError("backend exploded")

    model = _model()
    reference = copy.deepcopy(model)
    compile_layers(model, backend=broken_backend)
    with pytest.warns(RuntimeWarning, match="continuing in eager mode"):
        lp = response_logprobs(model, *_args())[0]
    assert not is_compiled(model)
    torch.testing.assert_close(lp, response_logprobs(reference, *_args())[0], rtol=0, atol=0)


def test_init_compiles_on_auto_only_where_it_pays(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    state = init(_model(), adamw(lr=1e-3), ref="copy")  # CPU: auto means off
    assert not is_compiled(state.actor) and not is_compiled(state.ref)
    monkeypatch.setenv(ENV, "1")  # forced on (nothing runs here, so no C++ toolchain is needed)
    state = init(_model(), adamw(lr=1e-3), ref="copy")
    assert is_compiled(state.actor) and is_compiled(state.ref)
    monkeypatch.setenv(ENV, "0")
    assert not maybe_compile(_model(), "auto")
    assert maybe_compile(_model(), True) is True  # an explicit True ignores the auto rule
    with pytest.raises(ValueError, match="compile must be True, False or 'auto'"):
        init(_model(), adamw(lr=1e-3), compile="yes")


class _FakeParam:
    def __init__(self, n, cuda=True):
        self.n, self.is_cuda = n, cuda

    def numel(self):
        return self.n


class _FakeModel:
    def __init__(self, sizes, cuda=True):
        self.sizes, self.cuda = sizes, cuda

    def parameters(self):
        return iter(_FakeParam(n, self.cuda) for n in self.sizes)


def test_auto_leaves_models_too_small_to_pay_for_compiling_eager(monkeypatch):
    import rlkit.models.compile as C

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(C.importlib.util, "find_spec", lambda name: object())  # as if Triton were installed
    half = C.AUTO_MIN_PARAMS // 2
    assert C.auto_enabled(_FakeModel([half, half]))  # the sum counts, not the largest tensor
    assert not C.auto_enabled(_FakeModel([half, half - 1]))
    assert not C.auto_enabled(_FakeModel([C.AUTO_MIN_PARAMS], cuda=False))  # never on CPU
    monkeypatch.setenv(ENV, "1")
    assert C.auto_enabled(_FakeModel([10]))  # the override compiles any size
    assert C.AUTO_MIN_PARAMS > sum(p.numel() for p in _model().parameters())  # the tiny test models stay eager


def test_compile_layers_names_the_problem_for_a_model_without_blocks():
    with pytest.raises(ValueError, match="found no decoder blocks"):
        compile_layers(torch.nn.Linear(2, 2))


def test_blocks_stay_compiled_through_the_variants_a_grpo_run_meets(monkeypatch):
    # actor and reference (requires_grad differs), update and log-prob passes (grad mode), shared
    # and unshared prompts, packed and padded layouts: each is one compiled variant of the block
    # class's one forward; past dynamo's default limit of 8 the blocks would silently run eagerly
    from rlkit.models import logprobs as L

    torch._dynamo.reset()
    runs = []

    def backend(gm, example_inputs):
        def run(*args):
            runs.append(1)
            return gm.forward(*args)

        return run

    actor, ref = _model(), _model().requires_grad_(False)
    for m in (actor, ref):
        compile_layers(m, backend=backend)
    prompts = [[5, 6, 7]] * 2 + [[8, 9]] * 2
    b = make_batch(prompts, [[5, 5], [7], [8, 9, 9], [4]], pad_token_id=0)
    args = [b[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")]
    variants = 0
    for model in (actor, ref):
        for grad in (True, False):
            for share in (True, False):
                for layout in ("packed", "padded"):
                    if model is ref and grad:
                        continue
                    monkeypatch.setattr(L, "SHARE_PROMPTS", share)
                    before = len(runs)
                    with torch.set_grad_enabled(grad):
                        response_logprobs(model, *args, layout=layout)
                    assert len(runs) > before, f"variant {variants} ran eagerly"
                    variants += 1
    assert variants > 8
    torch._dynamo.reset()


def test_fsdp_sharded_blocks_keep_their_integer_attributes_static():
    # FSDP2 marks the blocks "FSDP-managed"; dynamo then sources their attributes from an FSDP
    # module, and under dynamic=True an int such as head_dim became a graph input (a symbol).
    # On an H200 that made the fused rotary / shared-prompt kernels 6-8x slower. compile_layers
    # uses automatic dynamic shapes: the token count becomes dynamic, head_dim stays a constant.
    import torch.distributed as dist

    from rlkit.models.logprobs import LogprobModule
    from rlkit.parallel.fsdp import shard_model
    from rlkit.parallel.mesh import device_mesh

    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append({n.name: n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"})
        return gm.forward

    model = _model()
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    compile_layers(model, backend=backend)
    module = shard_model(LogprobModule(model), device_mesh(device_type="cpu"))
    try:
        with torch.no_grad():
            for prompts, responses in ((PROMPTS, RESPONSES), (PROMPTS[:2], [[5, 6, 7, 8, 9, 1], [2]])):
                b = make_batch(prompts, responses, pad_token_id=0)
                module(b["prompt_ids"], b["prompt_mask"], b["response_ids"], b["response_mask"])
        assert len(graphs) == 2, "the second length should recompile once, with a dynamic token count"
        dynamic_tokens = False
        for graph in graphs:
            assert not [n for n in graph if "head_dim" in n], f"head_dim is a graph input: {list(graph)}"
            cos = next(v for n, v in graph.items() if "position_embeddings" in n)
            assert isinstance(cos.shape[-1], int) and cos.shape[-1] == head_dim
            dynamic_tokens |= isinstance(cos.shape[1], torch.SymInt)
        assert dynamic_tokens
    finally:
        torch._dynamo.reset()
        if dist.is_initialized():
            dist.destroy_process_group()
