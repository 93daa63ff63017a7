"""The reasoning_gym task: items regenerated from the signed options on every role, scored by reasoning-gym's own
scorers, a held-out set training never draws from, options refused with a reason, and mixtures that another
process would generate differently refused when the task loads."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from swarmrl.protocol.tasks import TaskSpec, load_task, registered_tasks, task_options
from swarmrl.tasks.reasoninggym import (
    UNSAFE_SCORERS,
    MixtureRefused,
    ReasoningGymOptions,
    ReasoningGymTask,
    build_mixture,
    item_digest,
)

SUMS = {"chain_sum": {"weight": 1, "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1}},
        "basic_arithmetic": {"weight": 2, "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1,
                                                     "operators": ["+", "-"], "allow_parentheses": False,
                                                     "allow_negation": False, "format_style": "natural"}}}


def spec(**options) -> TaskSpec:
    return TaskSpec(name="reasoning_gym", options={"seed": 3, "size": 100_000, "eval_size": 200,
                                                   "datasets": SUMS, **options})


@pytest.fixture(scope="module")
def task():
    t = load_task(spec())
    yield t
    t.close()


def test_registered_and_loaded_by_name(task):
    assert registered_tasks()["reasoning_gym"] == "swarmrl.tasks.reasoninggym:ReasoningGymTask"
    assert isinstance(task, ReasoningGymTask)


def test_every_role_regenerates_the_same_problems_from_the_options(task):
    again = load_task(spec())  # the verifier's or the trainer's copy, built from the same signed options
    assert again.eval_set() == task.eval_set()
    assert [again.sample(random.Random(s)) for s in range(50)] == [task.sample(random.Random(s)) for s in range(50)]
    # The order the datasets are written in does not change the mixture (a run description may reorder keys).
    reordered = load_task(spec(datasets=dict(reversed(list(SUMS.items())))))
    assert reordered.eval_set() == task.eval_set()
    other = load_task(spec(seed=4))
    assert other.eval_set() != task.eval_set()


def test_both_datasets_are_drawn_and_training_never_draws_a_held_out_question(task):
    held = {p.prompt for p in task.eval_set()}
    assert 0 < len(held) <= 200
    rng = random.Random(0)
    drawn = [task.sample(rng) for _ in range(2000)]
    assert not held & {p.prompt for p in drawn}
    sources = {task.entry(p.answer)["metadata"]["source_dataset"] for p in drawn}
    assert sources == {"chain_sum", "basic_arithmetic"}


def test_reward_is_reasoning_gyms_own_score_of_the_regenerated_item(task):
    mixture = build_mixture(task.options)
    for p in task.eval_set()[:40]:
        index = int(p.answer.split(":")[0])
        entry = mixture[index]
        assert p.prompt == entry["question"] and p.solution == entry["answer"]
        assert p.answer == f"{index}:{item_digest(entry)}"  # the stored answer names the item, not its answer
        assert task.reward(p.solution, p.answer) == 1.0 and task.is_correct(f" {p.solution}\n", p.answer)
        wrong = str(int(entry["answer"]) + 1)
        assert task.reward(wrong, p.answer) == mixture.score_answer(wrong, entry) < 1.0
        longer = p.solution + "0"  # reasoning-gym's partial credit: the answer inside a longer one
        assert task.reward(longer, p.answer) == mixture.score_answer(longer, entry) > 0.0
    for garbage in ["", "   ", "x" * 100_000, "\x00\udcff", "1e999999999", "NaN", "-inf"]:
        assert task.reward(garbage, task.eval_set()[0].answer) == 0.0


def test_an_answer_that_names_another_item_or_none_is_an_error_not_a_score(task):
    p = task.eval_set()[0]
    index, digest = p.answer.split(":")
    with pytest.raises(RuntimeError, match="regenerates differently"):
        task.reward(p.solution, f"{int(index) + 1}:{digest}")
    for bad in ["", "42", "x:1", f"{10**9}:{digest}", "-1:00"]:
        with pytest.raises(ValueError, match="not an answer this task stored"):
            task.reward(p.solution, bad)


def test_tagged_answers_are_read_from_the_last_answer_tag():
    t = load_task(spec(answer_format="tagged", template="{question} Answer in <answer></answer>."))
    p = t.eval_set()[0]
    bare = t.entry(p.answer)["answer"]
    assert p.prompt.endswith("Answer in <answer></answer>.") and p.solution == f"<answer>{bare}</answer>"
    assert t.reward(f"I think... <answer>0</answer> no: <answer>{bare}</answer>", p.answer) == 1.0
    assert t.reward(bare, p.answer) == 0.0  # no tag, no answer


@pytest.mark.parametrize(("options", "reason"), [
    ({"datasets": {"chain_summ": {}}}, "unknown reasoning-gym dataset.*chain_summ.*known:.*chain_sum"),
    ({"datasets": {}}, "datasets"),
    ({"datasets": {"chain_sum": {"config": {"seed": 1}}}}, r"config sets \['seed'\]"),
    ({"datasets": {"chain_sum": {"weight": 0}}}, "weight"),
    ({"eval_size": 100_000}, "leaves none of the 100000 items to train on"),
    ({"template": "no field"}, "must contain {question}"),
    ({"answer_format": "boxed"}, "answer_format"),
])
def test_bad_options_are_refused_with_a_reason(options, reason):
    with pytest.raises(ValueError, match=reason):
        task_options(spec(**options))


def test_a_config_a_dataset_refuses_is_named_at_load():
    with pytest.raises(MixtureRefused, match="datasets.chain_sum: reasoning-gym refuses config"):
        load_task(spec(datasets={"chain_sum": {"config": {"min_terms": 3, "max_terms": 2}}}))
    with pytest.raises(MixtureRefused, match="datasets.chain_sum: reasoning-gym refuses config"):
        load_task(spec(datasets={"chain_sum": {"config": {"no_such_field": 1}}}))


def test_too_few_distinct_problems_for_the_held_out_set_is_said_not_looped_on():
    tiny = {"chain_sum": {"config": {"min_terms": 1, "max_terms": 1, "max_digits": 1}}}  # 10 questions in all
    t = load_task(spec(datasets=tiny, eval_size=500))
    assert len(t.eval_set()) == 10
    with pytest.raises(RuntimeError, match="too few distinct problems"):
        t.sample(random.Random(0))


@pytest.mark.parametrize("dataset", ["ransom_note", "isomorphic_strings"])
def test_a_dataset_another_process_generates_differently_is_refused_at_load(dataset):
    # Real reasoning-gym 0.1.25 datasets whose items change with the interpreter's hash seed (5 of its 105 did in
    # a scan: these two, knight_swap, polynomial_multiplication, word_ladder): the verifier's process would not
    # regenerate what the coordinator's drew.
    with pytest.raises(MixtureRefused, match=f"dataset '{dataset}' does not generate item .* the same way in two "
                                             "processes"):
        load_task(spec(datasets={dataset: {}}, eval_size=10))


def test_the_command_line_says_why_a_mixture_is_refused_in_one_line(tmp_path):
    config = Path(__file__).resolve().parent.parent / "examples" / "reasoning-gym" / "swarm.toml"
    out = subprocess.run([sys.executable, "-m", "swarmrl.cli", "demo", "--config", str(config), "--set",
                          f"run_dir={tmp_path / 'run'}", "--set", 'run.task.options.datasets={"ransom_note": {}}'],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode != 0 and "Traceback" not in out.stdout + out.stderr
    assert "[run.task.options] datasets.ransom_note: reasoning-gym dataset 'ransom_note' does not generate" in \
        out.stdout + out.stderr
    assert not (tmp_path / "run" / "logs").exists()  # refused before any role started


def test_exactly_the_scorers_that_run_the_answer_as_code_are_refused(tmp_path):
    # Every reasoning-gym dataset's own scorer, fed answers that are Python touching a file (bare, and inside list
    # literals, the shapes the scorers eval): those that executed one must be exactly the refused ones.
    from reasoning_gym import create_dataset
    from reasoning_gym.factory import DATASETS

    executed = set()
    for name in sorted(set(DATASETS) - {"composite", "set_order"}):
        marker = tmp_path / name
        code = f"__import__('pathlib').Path({str(marker)!r}).touch()"
        dataset = create_dataset(name, seed=5, size=5)
        for answer in [code, f"[{code}]", f"[[{code}]]"]:
            try:
                dataset.score_answer(answer, dataset[0])
            except Exception:  # the scorer's own parse errors: what matters is whether the code ran
                pass
        if marker.exists():
            executed.add(name)
    assert executed == UNSAFE_SCORERS
    with pytest.raises(ValueError, match=r"\['countdown'\]: the scorer runs the completion as Python code"):
        task_options(spec(datasets={"countdown": {}, **SUMS}))


def test_options_model_documents_every_field():
    for name, field in ReasoningGymOptions.model_fields.items():
        assert field.description, name
