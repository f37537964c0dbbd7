"""The built-in ``arithmetic`` task: ``"12+34="`` -> ``"46"``, exact-match reward.

Everything is made locally: the prompts (seeded), a character-level tokenizer and the reward.
It is small enough for a laptop CPU to show RL learning within minutes.
"""
from __future__ import annotations

import random

from rlkit._checks import check_seed, int_at_least

from rlkit.data import load_prompts
from rlkit.rewards import exact_match
from rlkit.tasks.base import Task

ALPHABET = "0123456789+-*= "
#: how the imperfect warm-up teacher errs (``teacher_error`` is how often):
#: zero_pad: writes answers zero-padded to one digit more than the longest possible answer, so
#: always with a leading zero ("0046" for 2-digit sums, "-046" for 2-digit differences), which the verifier rejects;
#: verbose: appends a redundant "+0" ("46+0"), which the verifier rejects; random: answers a random number; forgot_carry: adds digit by digit without carrying
TEACHER_NOISE = ("zero_pad", "verbose", "random", "forgot_carry")
OPS = ("+", "-", "*")


def _answer(a: int, b: int, op: str) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def forgot_carry(a: int, b: int) -> int:
    """The classic slip of a weak teacher: add digit by digit, dropping every carry (57+68 -> 15)."""
    out, place = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def arithmetic(
    digits: int = 2,
    ops: str | tuple[str, ...] = "+",
    *,
    n_train: int = 4000,
    n_test: int = 200,
    seed: int = 1234,
    n_sft: int | None = None,
    teacher_error: float = 0.0,
    teacher_noise: str = "verbose",
) -> Task:
    """Arithmetic on random ``digits``-digit operands. ``ops`` any of ``+ - *``; an op given twice
    is drawn twice as often (``"++-"``), and ``n_train + n_test`` may not exceed the distinct
    problems the distinct ops make.

    The test set is disjoint from the training set. ``sft_examples`` (for the warm-up) come
    from the training set, demonstrated by a teacher that errs on each example with probability
    ``teacher_error`` (``0``: a perfect teacher), in the way ``teacher_noise`` names (see
    :data:`TEACHER_NOISE`; the default, ``"verbose"``, appends a redundant ``"+0"``;
    ``"forgot_carry"`` changes only additions that carry). The reward always checks the true
    answer: the default job uses an imperfect teacher so the warm-up learns a mixture of right and
    wrong behaviour, and RL against the verifier has to pick the right one — the situation RL
    post-training is for.
    """
    if not 0.0 <= teacher_error <= 1.0:
        raise ValueError(f"teacher_error must be in [0, 1], got {teacher_error}")
    from rlkit.models.tokenizers import char_tokenizer

    if teacher_noise not in TEACHER_NOISE:
        raise ValueError(f"unknown teacher_noise {teacher_noise!r}; valid: {', '.join(TEACHER_NOISE)}")

    ops = tuple(ops)
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        raise ValueError(f"arithmetic ops must be a subset of {OPS}, got {ops!r}")
    if isinstance(digits, bool) or not isinstance(digits, int) or not 1 <= digits <= 6:
        raise ValueError(f"digits must be an int between 1 and 6, got {digits!r}")
    int_at_least(n_train, "arithmetic: n_train", 1)
    int_at_least(n_test, "arithmetic: n_test", 1)
    check_seed(seed, "arithmetic", " (draws the problems and the teacher's errors)")
    if n_sft is not None:
        int_at_least(n_sft, "arithmetic: n_sft", 0, " or None (every training problem)")
    hi = 10**digits - 1
    # a repeated op weights the draw ("++-": two additions to a subtraction) but adds no problems;
    # counting it made a request for more problems than exist loop forever instead of being refused
    possible = len(set(ops)) * (hi + 1) ** 2
    if n_train + n_test > possible:
        # the test set is taken first: the training set used to come out empty, and fail later
        # as "the prompt set is empty"
        raise ValueError(
            f"arithmetic: n_train={n_train} + n_test={n_test} distinct problems asked for, but {digits}-digit operands "
            f"with ops {''.join(ops)!r} make only {possible} ({len(set(ops))} distinct op(s) x {hi + 1}**2 operand pairs); "
            "lower n_train/n_test, raise digits or add ops"
        )
    rng = random.Random(seed)
    seen: set[tuple[int, int, str]] = set()
    rows = []
    limit = n_train + n_test
    while len(rows) < limit:
        a, b, op = rng.randint(0, hi), rng.randint(0, hi), rng.choice(ops)
        if (a, b, op) in seen:
            continue
        seen.add((a, b, op))
        rows.append({"prompt": f"{a}{op}{b}=", "answer": str(_answer(a, b, op))})
    test_rows, train_rows = rows[:n_test], rows[n_test:]
    tokenizer = char_tokenizer(ALPHABET)
    max_answer = max(len(r["answer"]) for r in rows)
    sft_rows = train_rows if n_sft is None else train_rows[:n_sft]
    teacher = random.Random(seed + 1)

    # one digit more than the longest answer the ops make: every padded answer has a leading zero
    # (the width of 2 * hi left 3-digit sums and most products unpadded, and so correct)
    width = 1 + len(str(max({"+": 2 * hi, "-": hi, "*": hi * hi}[op] for op in ops)))

    def demonstrate(prompt: str, answer: str) -> str:
        if teacher.random() >= teacher_error:
            return answer
        if teacher_noise == "zero_pad":
            return "-" + answer[1:].zfill(width) if answer.startswith("-") else answer.zfill(width)
        if teacher_noise == "verbose":
            return answer + "+0"
        if teacher_noise == "random":
            return str(teacher.randint(0, 2 * hi))
        if "+" not in prompt:
            return answer
        a, b = (int(x) for x in prompt[:-1].split("+"))
        return str(forgot_carry(a, b))

    return Task(
        name="arithmetic",
        tokenizer=tokenizer,
        train=load_prompts(train_rows, tokenizer),
        test=load_prompts(test_rows, tokenizer),
        reward=exact_match,
        sft_examples=[(r["prompt"], demonstrate(r["prompt"], r["answer"])) for r in sft_rows],
        max_new_tokens=max_answer + 2,
        info={"digits": digits, "ops": "".join(ops), "teacher_error": teacher_error, "teacher_noise": teacher_noise},
    )
