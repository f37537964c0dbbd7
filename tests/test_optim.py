"""OptimizerSpec's argument checks: each bad value named, every valid spec still built."""
import math

import pytest
import torch

from rlkit.optim import OptimizerSpec, adamw


def test_a_fractional_warmup_is_refused_instead_of_overshooting_the_peak_lr():
    # warmup_steps = 0.1 * 15 = 1.5 made the factor (step + 1) / 1.5 = 1.33 at step 1
    with pytest.raises(ValueError, match=r"warmup_steps must be an int >= 0 .* got float 1\.5"):
        adamw(lr=1e-3, warmup_steps=0.1 * 15, total_steps=15, schedule="cosine")
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 0"):
        adamw(warmup_steps=-1)
    spec = adamw(lr=1e-3, warmup_steps=int(0.1 * 15), total_steps=15, schedule="cosine")
    assert max(spec.lr_factor(i) for i in range(20)) == 1.0


def test_total_steps_must_be_a_positive_int_and_cover_the_warmup():
    for bad in (-5, 0, 10.0, "100"):
        with pytest.raises(ValueError, match=rf"total_steps must be an int >= 1 or None .* got {type(bad).__name__} {bad!r}"):
            adamw(total_steps=bad, schedule="linear")
    with pytest.raises(ValueError, match=r"warmup_steps=10 exceeds total_steps=5: schedule='cosine' would never decay"):
        adamw(lr=1e-3, warmup_steps=10, total_steps=5, schedule="cosine")
    with pytest.raises(ValueError, match="needs total_steps"):
        adamw(schedule="cosine")
    # rlkit.sft.warmup clamps: warmup_steps=min(warmup_steps, steps) (all-warmup runs stay valid)
    spec = adamw(lr=1e-2, weight_decay=0.0, warmup_steps=min(20, 5), total_steps=5, schedule="cosine", min_lr_ratio=0.1)
    assert [spec.lr_factor(i) for i in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    adamw(warmup_steps=10, total_steps=5)  # constant: total_steps unused, nothing to decay
    adamw(warmup_steps=10)


def test_numeric_fields_from_text_are_named_with_their_type():
    for field, value in (("lr", "1e-3"), ("eps", "1e-8"), ("weight_decay", "0.1"), ("min_lr_ratio", "0.1")):
        with pytest.raises(ValueError, match=rf"optimizer {field} must be a number, got str '{value}' \(convert it with float"):
            OptimizerSpec(**{field: value})
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 0.* got str '10'"):
        adamw(warmup_steps="10")
    for field, value, bound in (("eps", -1.0, "> 0"), ("eps", 0.0, "> 0"), ("weight_decay", math.inf, ">= 0")):
        with pytest.raises(ValueError, match=rf"optimizer {field} must be a finite number {bound}"):
            OptimizerSpec(**{field: value})
    with pytest.raises(ValueError, match="optimizer betas must be two numbers in"):
        adamw(betas=(0.9,))
    with pytest.raises(ValueError, match="optimizer betas must be two numbers in"):
        adamw(betas=("0.9", 0.999))
    with pytest.raises(ValueError, match="fused must be True, False or None"):
        adamw(fused="yes")


def test_valid_specs_still_build():
    np = pytest.importorskip("numpy")
    params = [torch.nn.Parameter(torch.zeros(3))]
    for spec in (
        adamw(),
        adamw(lr=3e-4, warmup_steps=10, total_steps=200, schedule="cosine"),
        adamw(lr=1, warmup_steps=2, total_steps=3, schedule="linear", eps=1, weight_decay=0),
        adamw(lr=np.float32(1e-3), warmup_steps=np.int64(2), total_steps=np.int64(6), schedule="cosine", fused=False),
        OptimizerSpec(**{**adamw(lr=1e-2, betas=[0.8, 0.9]).to_dict()}),  # a checkpoint's JSON (a list of betas)
    ):
        optimizer, scheduler = spec.build(params)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(float(spec.lr) * spec.lr_factor(0))
