"""An engine called directly refuses a prompt plus max_new_tokens past the model's context, as
rk.rollout does (it had generated from positions the model never learned, without a word)."""
import pytest

from rlkit.engines import HFEngine, SamplingParams, TorchEngine
from rlkit.models import tiny


@pytest.mark.parametrize("engine", [TorchEngine.from_model, lambda m: HFEngine(m, 0)], ids=["torch", "hf"])
def test_engine_refuses_positions_past_the_context(tok, engine):
    eng = engine(tiny(tok, hidden_size=32, intermediate_size=64, max_position_embeddings=12).eval())
    prompts = [[1, 2, 3], [1, 2, 3, 4, 5, 6, 7, 8]]
    with pytest.raises(ValueError, match=r"generate: prompt 1 \(8 tokens\) with max_new_tokens=5 needs 13 positions, "
                                         r"over the model's context of 12 tokens"):
        eng.generate(prompts, SamplingParams(max_new_tokens=5))
    # exactly the context is fine
    out = eng.generate(prompts, SamplingParams(max_new_tokens=4, ignore_stop=True))
    assert out.response_ids.shape == (2, 4)
