"""Learning measurably happens: GRPO raises the reward of a fresh tiny model within seconds."""
import torch

import rlkit as rk


def test_grpo_raises_reward_quickly():
    task = rk.tasks.arithmetic()
    model = rk.models.tiny(task.tokenizer, seed=0)

    def sevens(completions, **_):  # a dense, learnable target: write the digit 7
        return [sum(ch == "7" for ch in c) / 4 for c in completions]

    state = rk.init(model, rk.optim.adamw(lr=1e-3, weight_decay=0.0), tokenizer=task.tokenizer, seed=0)
    recipe = rk.recipes.get("grpo").with_(n=8, max_new_tokens=4)
    rewards = []
    for i in range(24):
        state, metrics = recipe.step(state, task.train.batch_at(i, 8), sevens)
        rewards.append(metrics["reward/mean"])
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert first < 0.2, rewards
    assert last > first + 0.4, rewards  # measured: ~0.05 -> ~0.9
    assert metrics["actor/logprob_gap"] < 1e-4  # engine and trainer agree in fp32


def test_every_recipe_takes_a_step():
    task = rk.tasks.arithmetic()
    for name in rk.recipes.RECIPES:
        model = rk.models.tiny(task.tokenizer, seed=0, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)
        recipe = rk.recipes.get(name).with_(n=4, max_new_tokens=4)
        critic = rk.models.critic(model) if recipe.needs_critic() else None
        state = rk.init(model, rk.optim.adamw(lr=1e-3), tokenizer=task.tokenizer, critic=critic)
        state, metrics = recipe.step(state, task.train.batch_at(0, 4), task.reward)
        assert state.step == 1 and torch.isfinite(torch.tensor(metrics["actor/pg_loss"])), name
        if name == "ppo":
            assert "critic/vf_loss" in metrics
