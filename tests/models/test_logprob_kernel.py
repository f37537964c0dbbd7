"""The Triton log-prob/entropy kernel (forward and backward) against float64 torch.

Runs where Triton can: on a CUDA machine, or on CPU under Triton's interpreter
(``TRITON_INTERPRET=1``); skipped otherwise (CI has no Triton). ``benchmarks/grpo_step.py
--check`` repeats it at the full vocabulary on GPU."""
import os

import pytest
import torch

pytest.importorskip("triton")
if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from rlkit.models import logprobs as L  # noqa: E402
from rlkit.models import token_logprobs  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("with_entropy_grad", [True, False])
def test_fused_logprobs_entropy_and_gradient_equal_float64_torch(with_entropy_grad):
    torch.manual_seed(0)
    rows, vocab, t = 6, 5000, 0.9  # vocab not a multiple of the kernel's block
    x = (torch.randn(rows, vocab, device=DEVICE) * 2).requires_grad_(True)
    y = torch.randint(0, vocab, (rows,), device=DEVICE)
    lp, ent = L._FusedTokenLogprobs.apply(x, y, t)
    x64 = x.detach().double().requires_grad_(True)
    rlp, rent = token_logprobs(x64, y, temperature=t, with_entropy=True)
    torch.testing.assert_close(lp.detach().double(), rlp.detach().double(), rtol=0, atol=5e-6)
    torch.testing.assert_close(ent.detach().double(), rent.detach().double(), rtol=0, atol=5e-6)
    a, b = torch.randn(rows, device=DEVICE), torch.randn(rows, device=DEVICE)
    ((lp * a) + (ent * b if with_entropy_grad else 0)).sum().backward()
    ((rlp * a.double()) + (rent * b.double() if with_entropy_grad else 0)).sum().backward()
    rel = float((x.grad.double() - x64.grad).norm() / x64.grad.norm())
    assert rel < 1e-5
