"""The `math` task's reward: equivalent answer forms agree, wrong answers and garbage score 0, hostile
expressions cannot stall it, and GSM8K-style data loads."""

import hashlib
import json
import random
import threading

import pytest

from swarmrl.protocol.tasks import TaskSpec, load_task
from swarmrl.tasks.math import MathTask, gsm8k_answer

ROWS = [
    {"question": "What is 1 divided by 2?", "answer": "1/2"},
    {"problem": "Write one half in LaTeX.", "answer": "\\frac{1}{2}"},
    {"question": "Sam has 3 bags of 6 apples. How many apples?", "answer": "3 bags of 6 is 3*6 = 18.\n#### 18"},
    {"question": "Compute 500+500+234.", "answer": "500+500 = 1000, plus 234.\n#### 1,234"},
    {"question": "What is the square root of 2?", "answer": "\\sqrt{2}"},
] + [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(15)]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    d = tmp_path_factory.mktemp("math")
    (d / "problems.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    sha = hashlib.sha256((d / "problems.jsonl").read_bytes()).hexdigest()
    t = load_task(TaskSpec(name="math", options={"path": "problems.jsonl", "sha256": sha, "eval_fraction": 0.25,
                                                 "template": "Question: {question}\nAnswer:"}), data_dir=d)
    assert isinstance(t, MathTask)
    yield t
    t.close()


HALF = ["1/2", "0.5", "\\frac{1}{2}", "\\boxed{\\frac12}", "The answer is 0.5", "So x = 0.50, i.e. $\\frac{1}{2}$",
        "First 3, then 4; finally \\boxed{1/2}", "2/4", "$\\dfrac{1}{2}$"]


@pytest.mark.parametrize("completion", HALF)
@pytest.mark.parametrize("gold", ["1/2", "0.5", "\\frac{1}{2}"])
def test_equivalent_forms_agree(task, completion, gold):
    assert task.reward(completion, gold) == 1.0
    assert task.is_correct(completion, gold)


WRONG = ["0.51", "1/3", "\\boxed{2}", "-1/2", "The answer is 5", "", "garbage", "½", "\\boxed{}", "0.55",
         "\\boxed{1/3} \\boxed{1/2}",  # two answers are not one answer
         "0.25 0.5 0.75 1"]  # neither is a list of guesses


@pytest.mark.parametrize("completion", WRONG)
def test_wrong_answers_and_garbage_score_zero(task, completion):
    assert task.reward(completion, "1/2") == 0.0
    assert not task.is_correct(completion, "1/2")


def test_other_answers(task):
    assert task.reward("\\boxed{18}", "18") == 1.0
    assert task.reward("She has 18 apples.", "18") == 1.0
    assert task.reward("18.0", "18") == 1.0
    assert task.reward("\\boxed{1234}", "1,234") == 1.0
    assert task.reward("\\boxed{17}", "18") == 0.0
    assert task.reward("$\\sqrt{2}$", "\\sqrt{2}") == 1.0
    assert task.reward("$2^{1/2}$", "\\sqrt{2}") == 1.0
    assert task.reward("1.41", "\\sqrt{2}") == 0.0


def test_gsm8k_answers_are_the_text_after_the_marks():
    assert gsm8k_answer("3 bags of 6 is 18.\n#### 18") == "18"
    assert gsm8k_answer("#### 1,234 ") == "1,234"
    assert gsm8k_answer("\\frac{1}{2}") == "\\frac{1}{2}"


def test_data_loads_with_split_and_template(task):
    problems = {p.prompt: p.answer for p in [*task.eval_set(), *task._train]}
    assert len(problems) == len(ROWS)
    assert problems["Question: Sam has 3 bags of 6 apples. How many apples?\nAnswer:"] == "18"
    assert problems["Question: Compute 500+500+234.\nAnswer:"] == "1,234"
    assert problems["Question: Write one half in LaTeX.\nAnswer:"] == "\\frac{1}{2}"  # "problem" is a question
    held = {p.prompt for p in task.eval_set()}
    assert len(held) == 5
    rng = random.Random(0)
    assert not held & {task.sample(rng).prompt for _ in range(200)}
    assert task.eval_settings.max_new_tokens == 512


def test_a_hostile_expression_scores_zero_and_scoring_goes_on(task):
    # sympy would spend minutes (or all memory) on these; the worker's time limit turns them into 0.
    assert task.reward("\\boxed{9^{9^{9^{9}}}}", "42") == 0.0
    assert task.reward("\\boxed{10000000000!}", "42") == 0.0
    assert task.reward("\\boxed{42}", "42") == 1.0


def test_a_stuck_worker_is_replaced(task):
    checker = task._checker
    checker.equivalent("1", "1")  # make sure a worker runs
    before = checker.restarts
    checker._proc.send_signal(19)  # SIGSTOP: the worker stops answering, like one stuck in C code
    old, checker.hard_timeout_s = checker.hard_timeout_s, 1.0
    try:
        assert checker.equivalent("1/2", "0.5") is False  # no answer in time: 0, and a fresh worker next
    finally:
        checker.hard_timeout_s = old
    assert checker.restarts == before + 1
    assert checker.equivalent("1/2", "0.5") is True


def test_scoring_works_from_any_thread(task):
    # math-verify's own time limits use signal.alarm, which fails outside the main thread; ours do not.
    out = []
    threads = [threading.Thread(target=lambda c=c: out.append(task.reward(c, "1/2"))) for c in ["0.5", "0.25"]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(out) == [0.0, 1.0]
