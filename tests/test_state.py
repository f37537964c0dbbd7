import pytest
import torch

import rlkit as rk
from rlkit.state import DonatedStateError


def test_donated_state_refuses_use(tiny_model, char_tok):
    state = rk.init(tiny_model, rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    state2 = state.replace(step=5)
    state.donate("rlkit.update")
    with pytest.raises(DonatedStateError, match="donated to rlkit.update"):
        state.actor
    with pytest.raises(DonatedStateError):
        state.replace(step=1)
    assert state2.step == 5 and state2.actor is tiny_model


def test_rng_is_keyed_by_seed_and_step(tiny_model, char_tok):
    state = rk.init(tiny_model, rk.optim.adamw(lr=1e-3), tokenizer=char_tok, seed=3)
    a = torch.rand(4, generator=state.rng("x"))
    b = torch.rand(4, generator=state.rng("x"))
    c = torch.rand(4, generator=state.replace(step=1).rng("x"))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_lr_schedule_warmup_then_cosine():
    spec = rk.optim.adamw(lr=1.0, warmup_steps=2, total_steps=6, schedule="cosine", min_lr_ratio=0.0)
    factors = [spec.lr_factor(s) for s in range(7)]
    assert factors[:2] == [0.5, 1.0]
    assert factors[2] == pytest.approx(1.0) and factors[6] == pytest.approx(0.0, abs=1e-12)
    assert factors[4] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="total_steps"):
        rk.optim.adamw(lr=1e-3, schedule="cosine")
    with pytest.raises(ValueError, match="lr"):
        rk.optim.adamw(lr=-1.0)


def test_cpu_adamw_takes_the_fused_kernel_with_the_loops_values():
    # the spec picks torch's fused AdamW on CPU (one pass per parameter); it must step as torch's
    # CPU default, the per-parameter loop, up to float rounding
    g = torch.Generator().manual_seed(0)
    shapes = [(40, 16), (16,), (16, 16), (64, 16)]
    base = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    spec = rk.optim.adamw(lr=1e-2, weight_decay=0.1)
    runs = []
    for make in (lambda ps: spec.build(ps)[0], lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False)):
        params = [torch.nn.Parameter(b.clone()) for b in base]
        opt = make(params)
        for step in grads:
            for p, gr in zip(params, step):
                p.grad = gr.clone()
            opt.step()
        runs.append((opt.defaults.get("fused"), [p.detach() for p in params]))
    (fused, ours), (_, loop) = runs
    assert fused is True
    # three steps of lr 1e-2 moved every parameter by about 3e-2; the two agree to ~1e-7
    assert all((a - b).abs().max() > 1e-2 for a, b in zip(ours, base))
    for a, b in zip(ours, loop):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
