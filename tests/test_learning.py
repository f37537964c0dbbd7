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
        # rewards that differ within every group: a random model never answers right, and DAPO skips
        # the update of a step whose groups all agree (nothing to learn)
        varied = lambda completions, **_: [float(i % 2) for i in range(len(completions))]  # noqa: E731
        state, metrics = recipe.step(state, task.train.batch_at(0, 4), varied)
        assert state.step == 1 and torch.isfinite(torch.tensor(metrics["actor/pg_loss"])), name
        assert metrics["actor/grad_norm"] > 0, name
        if name == "ppo":
            assert "critic/vf_loss" in metrics


def test_ppo_trains_without_value_clipping_on_single_token_responses():
    """value_clip=None failed at the first update, and one single-token response crashed GAE's
    whitening; the critic must still learn."""
    task = rk.tasks.arithmetic()
    model = rk.models.tiny(task.tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    critic = rk.models.critic(model)
    state = rk.init(model, rk.optim.adamw(lr=1e-2), tokenizer=task.tokenizer, critic=critic)
    before = {k: v.detach().clone() for k, v in critic.named_parameters()}
    recipe = rk.recipes.get("ppo", n=1, max_new_tokens=1, value_clip=None)
    state, metrics = recipe.step(state, task.train.batch_at(0, 1), task.reward)
    assert metrics["critic/vf_clipfrac"] == 0.0 and torch.isfinite(torch.tensor(metrics["critic/vf_loss"]))
    assert max(float((p.detach() - before[k]).abs().max()) for k, p in critic.named_parameters()) > 0


def test_reported_learning_rate_is_the_one_the_step_used():
    task = rk.tasks.arithmetic()
    model = rk.models.tiny(task.tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    spec = rk.optim.adamw(lr=1.0, warmup_steps=2, total_steps=3, schedule="linear")
    used, real = [], torch.optim.AdamW.step

    def spy(self, *a, **k):
        used.append(self.param_groups[0]["lr"])
        return real(self, *a, **k)

    torch.optim.AdamW.step = spy  # before the optimizer is built (torch wraps step at construction)
    try:
        state = rk.init(model, spec, tokenizer=task.tokenizer)
        recipe = rk.recipes.get("rloo", n=2, max_new_tokens=2)
        reported = []
        for i in range(3):
            state, metrics = recipe.step(state, task.train.batch_at(i, 2), task.reward)
            reported.append(metrics["actor/lr"])
    finally:
        torch.optim.AdamW.step = real
    assert used == [spec.lr * spec.lr_factor(i) for i in range(3)]
    assert reported == used  # it reported the next step's rate ([1.0, 1.0, 0.0])
