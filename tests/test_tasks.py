"""The built-in arithmetic task: its imperfect teacher errs as documented, at the rate asked."""
import random

import pytest

import rlkit as rk
from rlkit.tasks.arithmetic import TEACHER_NOISE, forgot_carry

#: sha256 (first 16 hex) of the default teacher's examples and prompts for seed 0, as they were before the zero_pad fix
DEFAULT_JOB_DATA = "394afc65871e5627"


def _no_carry_sum(a: int, b: int) -> int:
    """An independent reference for ``forgot_carry``: the digits of a + b, each taken mod 10, as strings."""
    sa, sb = str(a), str(b)
    width = max(len(sa), len(sb))
    digits = [str((int(x) + int(y)) % 10) for x, y in zip(sa.zfill(width), sb.zfill(width))]
    return int("".join(digits))


def test_forgot_carry_drops_every_carry():
    assert forgot_carry(57, 68) == 15 and forgot_carry(12, 34) == 46 and forgot_carry(99, 1) == 90
    rng = random.Random(0)
    for _ in range(500):
        a, b = rng.randrange(0, 10**5), rng.randrange(0, 10**5)
        assert forgot_carry(a, b) == _no_carry_sum(a, b), (a, b)


@pytest.mark.parametrize("noise", TEACHER_NOISE)
def test_the_teacher_errs_as_its_noise_says(noise):
    task = rk.tasks.arithmetic(digits=2, n_train=400, n_sft=300, teacher_error=1.0, teacher_noise=noise)
    assert task.info["teacher_noise"] == noise
    width = len(str(2 * 99)) + 1  # one digit more than the longest sum: always a leading zero
    wrong = 0
    for prompt, shown in task.sft_examples:
        a, b = (int(x) for x in prompt[:-1].split("+"))
        truth = str(a + b)
        if noise == "verbose":
            assert shown == truth + "+0"
        elif noise == "zero_pad":
            assert shown == truth.zfill(width)
        elif noise == "random":
            assert 0 <= int(shown) <= 2 * 99
        else:
            assert shown == str(forgot_carry(a, b))
        wrong += shown != truth
    # every demonstration is wrong, except where the noise leaves the answer as it is
    # (forgot_carry without a carry, random by chance)
    assert wrong >= {"verbose": 300, "zero_pad": 300, "random": 280, "forgot_carry": 100}[noise], wrong


@pytest.mark.parametrize("ops", ["+", "-", "*", "+-*"])
def test_every_zero_pad_demonstration_is_rejected_by_the_verifier(ops):
    """zero_pad padded to the width of 2 * hi: 3-digit sums (half of them) and most products came
    out unpadded, so correct, although its documentation says the verifier rejects them."""
    for digits in (1, 2):
        task = rk.tasks.arithmetic(digits=digits, ops=ops, n_train=80, n_test=10, teacher_error=1.0, teacher_noise="zero_pad")
        answer = dict(zip(task.train.text, task.train.columns["answer"]))
        shown = [c for _, c in task.sft_examples]
        assert all(c.lstrip("-").startswith("0") and int(c) == int(answer[p]) for p, c in task.sft_examples), shown
        assert task.reward(shown, [answer[p] for p, _ in task.sft_examples]) == [0.0] * len(shown), shown


def test_the_default_teachers_data_is_unchanged():
    """The default job's examples (teacher_error=0.6, the verbose teacher): published accuracies
    were measured on exactly these."""
    import hashlib
    import json

    task = rk.tasks.arithmetic(teacher_error=0.6, n_train=200, n_test=20, seed=0)
    blob = json.dumps([task.sft_examples, task.train.text, task.train.columns, task.test.text]).encode()
    assert hashlib.sha256(blob).hexdigest()[:16] == DEFAULT_JOB_DATA


def test_teacher_error_is_the_rate_of_wrong_demonstrations():
    perfect = rk.tasks.arithmetic(digits=2, n_train=400, n_sft=400, teacher_error=0.0)
    assert all(shown == str(sum(int(x) for x in p[:-1].split("+"))) for p, shown in perfect.sft_examples)
    task = rk.tasks.arithmetic(digits=2, n_train=2000, n_sft=2000, teacher_error=0.6)
    verbose = sum(shown.endswith("+0") for _, shown in task.sft_examples) / 2000
    assert abs(verbose - 0.6) < 4 * (0.6 * 0.4 / 2000) ** 0.5  # 4 standard errors


@pytest.mark.parametrize("kwargs, field", [
    (dict(teacher_error=1.5), "teacher_error"),
    (dict(teacher_noise="loud"), "teacher_noise"),
    (dict(ops="/"), "ops"),
    (dict(digits=0), "digits"),
    (dict(digits=2.5), "digits"),
    (dict(n_train=0), "n_train must be a positive int"),
    (dict(n_test=-1), "n_test must be a positive int"),
    (dict(n_sft=-1), "n_sft must be an int >= 0"),  # took all but the last training problem
    # 1-digit additions make 100 problems: the test set took all of them and the training set
    # failed later as "the prompt set is empty"
    (dict(digits=1), "n_train=4000 \\+ n_test=200 distinct problems asked for, but 1-digit operands with ops '\\+' make only 100"),
])
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        rk.tasks.arithmetic(**kwargs)


def test_a_repeated_op_weights_the_draw_but_makes_no_extra_problems():
    """``ops="++"`` counted 200 possible 1-digit problems where there are 100, so asking for 150
    hung forever in the rejection sampler instead of being refused as ``ops="+"`` is."""
    import threading

    outcome = []

    def build():
        try:
            rk.tasks.arithmetic(digits=1, ops="++", n_train=140, n_test=10)
            outcome.append("returned")
        except ValueError as e:
            outcome.append(e)

    worker = threading.Thread(target=build, daemon=True)  # a daemon: a hang fails the test, not the run
    worker.start()
    worker.join(timeout=20)
    assert outcome, "arithmetic(digits=1, ops='++', n_train=140, n_test=10) did not return within 20 s"
    assert isinstance(outcome[0], ValueError), outcome
    assert "n_train=140 + n_test=10 distinct problems asked for, but 1-digit operands with ops '++' make only 100" in str(outcome[0])
    # every distinct problem can still be asked for, and the repeat still weights the draw
    assert len(rk.tasks.arithmetic(digits=1, ops="++", n_train=90, n_test=10).train) == 90
    task = rk.tasks.arithmetic(digits=2, ops="++-", n_train=3000, n_test=10)
    additions = sum("+" in prompt for prompt, _ in task.sft_examples) / 3000
    assert abs(additions - 2 / 3) < 0.05, additions
