"""Tasks as plug-ins: the entry-point registry, a third-party task, options, pinned data files, and the addition
task unchanged."""

import hashlib
import json
import random
import sys
import textwrap

import pytest
from pydantic import ValidationError

from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.protocol.tasks import EvalSettings, Problem, Task, TaskSpec, load_task, registered_tasks, task_options
from swarmrl.runtime.config import dump_toml, load_config
from swarmrl.tasks.addition import AdditionTask
from swarmrl.tasks.data import FileTaskOptions, load_split


def test_builtin_tasks_are_registered_through_the_entry_point_group():
    known = registered_tasks()
    assert {"addition", "addition3", "math", "code"} <= set(known)
    assert known["math"] == "swarmrl.tasks.math:MathTask"
    assert isinstance(load_task(TaskSpec()), AdditionTask)
    assert isinstance(load_task(TaskSpec(name="addition3")), AdditionTask)  # existing configs keep working


def test_unknown_task_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown task 'nope'.*'addition'.*'math'"):
        load_task(TaskSpec(name="nope"))


def test_options_are_validated_and_applied():
    with pytest.raises(ValueError, match="digitz"):
        load_task(TaskSpec(name="addition", options={"digitz": 2}))
    with pytest.raises(ValueError, match="digits"):
        load_task(TaskSpec(name="addition", options={"digits": 0}))
    task = load_task(TaskSpec(name="addition", options={"digits": 2, "eval_size": 50, "max_new_tokens": 5}))
    assert len(task.eval_set()) == 50
    p = task.sample(random.Random(0))
    assert all(len(x) == 2 for x in p.prompt.rstrip("=").split("+"))
    assert task.eval_settings == EvalSettings(max_new_tokens=5)


def test_task_spec_reads_a_bare_name_and_refuses_unknown_fields():
    assert TaskSpec.model_validate("addition3") == TaskSpec(name="addition3")
    with pytest.raises(ValidationError):
        TaskSpec.model_validate({"name": "addition", "opts": {}})
    spec = TaskSpec(name="addition", options={"digits": 2})
    with pytest.raises(ValidationError):
        spec.name = "math"  # frozen: a run's task does not change under it


def test_coordinator_config_takes_a_task_table_or_name_and_checks_it(tmp_path):
    cfg = load_config(CoordinatorConfig, None, ["run.task=addition3"])
    assert cfg.run.task == TaskSpec(name="addition3")
    f = tmp_path / "c.toml"
    f.write_text('[run.task]\nname = "addition"\noptions = { digits = 2 }\n')
    cfg = load_config(CoordinatorConfig, f)
    assert cfg.run.task.options == {"digits": 2}
    again = tmp_path / "again.toml"
    again.write_text(dump_toml(cfg))
    assert load_config(CoordinatorConfig, again).run.task == cfg.run.task
    with pytest.raises(ValueError, match="unknown task"):
        load_config(CoordinatorConfig, None, ["run.task.name=nope"])
    with pytest.raises(ValueError, match="bad options"):
        load_config(CoordinatorConfig, None, ["run.task.options.digits=-1"])


def _fake_dist(root, dist: str, entries: dict[str, str]) -> None:
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[swarmrl.tasks]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()))


THIRD_PARTY = textwrap.dedent('''
    import random
    from pydantic import BaseModel, ConfigDict, Field
    from swarmrl.protocol.tasks import Problem, Task

    class Reverse(Task):
        name = "reverse"

        class Options(BaseModel):
            model_config = ConfigDict(extra="forbid")
            length: int = Field(4, ge=1)

        def _word(self, rng):
            return "".join(rng.choice("abcdef") for _ in range(self.options.length))

        def sample(self, rng):
            while (w := self._word(rng)) in {p.prompt for p in self.eval_set()}:
                pass
            return Problem(prompt=w, answer=w[::-1])

        def eval_set(self):
            rng = random.Random(7)
            return [Problem(prompt=w, answer=w[::-1]) for w in (self._word(rng) for _ in range(3))]

        def reward(self, completion, answer):
            return float(completion.strip() == answer)

    class NotATask:
        pass
''')


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    """A package installed the way pip would: module + dist-info with entry_points.txt, on sys.path."""
    (tmp_path / "thirdtask.py").write_text(THIRD_PARTY)
    _fake_dist(tmp_path, "thirdtask", {"reverse": "thirdtask:Reverse", "broken": "thirdtask:NotATask"})
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("thirdtask", None)


def test_a_third_party_task_registers_through_an_entry_point(third_party):
    assert registered_tasks()["reverse"] == "thirdtask:Reverse"
    task = load_task(TaskSpec(name="reverse", options={"length": 6}))
    assert type(task).__module__ == "thirdtask"
    p = task.sample(random.Random(1))
    assert len(p.prompt) == 6 and p.prompt not in {q.prompt for q in task.eval_set()}
    assert task.reward(p.answer, p.answer) == 1.0 and task.is_correct(p.answer, p.answer)
    assert task.reward(p.prompt + "x", p.answer) == 0.0
    assert task.eval_settings.max_new_tokens == 32  # no option of that name: the interface's default
    with pytest.raises(ValueError, match="length"):
        load_task(TaskSpec(name="reverse", options={"length": 0}))
    with pytest.raises(ValueError, match="not a swarmrl.protocol.tasks.Task subclass"):
        load_task(TaskSpec(name="broken"))


def test_a_name_registered_twice_is_refused(third_party):
    _fake_dist(third_party, "shadow", {"math": "thirdtask:Reverse"})
    with pytest.raises(ValueError, match="'math' is registered twice"):
        load_task(TaskSpec(name="math", options={}))


def test_the_task_interface_demands_its_methods():
    class Half(Task):
        name = "half"

        def sample(self, rng: random.Random) -> Problem:
            return Problem("q", "a")

    with pytest.raises(TypeError, match="eval_set"):
        Half(Half.Options(), None)  # type: ignore[abstract, arg-type]


# -- the addition task: unchanged -------------------------------------------------------------------------------

# sha256 of the held-out set ("prompt+answer" lines) and of 1000 samples drawn with random.Random(1), computed
# with the former swarmrl.protocol.tasks.Addition (before tasks became plug-ins), which every checkpoint and
# result so far was made with.
ADDITION_EVAL_SHA = "e5f3369132f52ade9c7eeef41889f12c7502d36fa9ebba9643f4883fa3e24f0e"
ADDITION_SAMPLES_SHA = "123e0550483a7f0df7d5ce4e1ae66ac9a7bb1acd7d12ae3c5ec34f40e8152ce6"


def _digest(problems) -> str:
    return hashlib.sha256("\n".join(p.prompt + p.answer for p in problems).encode()).hexdigest()


def test_addition_is_unchanged():
    task = load_task(TaskSpec(name="addition3"))
    assert _digest(task.eval_set()) == ADDITION_EVAL_SHA
    rng = random.Random(1)
    drawn = [task.sample(rng) for _ in range(1000)]
    assert _digest(drawn) == ADDITION_SAMPLES_SHA
    assert not {p.prompt for p in task.eval_set()} & {p.prompt for p in drawn}
    assert [task.reward(c, "579") for c in ["579", " 579 ", "578", "5", "", "12345", "abc"]] == [
        1.0, 1.0, 0.5 * 2 / 3, 0.5 / 3, 0.0, 0.0, 0.0]
    assert task.is_correct(" 579\n", "579") and not task.is_correct("5790", "579")
    assert task.eval_settings.max_new_tokens == 8  # the constant evaluation used before


# -- pinned data files ------------------------------------------------------------------------------------------


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _parse(record) -> Problem:
    return Problem(prompt=record["q"], answer=record["a"])


def test_data_file_must_match_its_pinned_hash(tmp_path):
    sha = _jsonl(tmp_path / "d.jsonl", [{"q": f"q{i}", "a": str(i)} for i in range(20)])
    opts = FileTaskOptions(path="d.jsonl", sha256=sha)
    train, held = load_split(opts, tmp_path, _parse)  # a relative path resolves against the data dir
    assert len(held) == 2 and len(train) == 18
    assert not {p.prompt for p in train} & {p.prompt for p in held}
    assert load_split(opts, tmp_path, _parse) == (train, held)  # the split is fixed by split_seed
    (tmp_path / "d.jsonl").write_text((tmp_path / "d.jsonl").read_text().replace('"a": "3"', '"a": "4"'))
    with pytest.raises(ValueError, match="sha256 .* but the task's options pin"):
        load_split(opts, tmp_path, _parse)
    with pytest.raises(ValueError, match="does not exist"):
        load_split(opts, tmp_path / "elsewhere", _parse)


def test_held_out_file_and_duplicates(tmp_path):
    sha = _jsonl(tmp_path / "train.jsonl", [{"q": f"q{i}", "a": str(i)} for i in range(10)])
    eval_sha = _jsonl(tmp_path / "eval.jsonl", [{"q": "q3", "a": "3"}, {"q": "new", "a": "0"}])
    opts = FileTaskOptions(path=str(tmp_path / "train.jsonl"), sha256=sha, eval_path="eval.jsonl",
                           eval_sha256=eval_sha)
    train, held = load_split(opts, tmp_path, _parse)
    assert [p.prompt for p in held] == ["q3", "new"]
    assert "q3" not in {p.prompt for p in train} and len(train) == 9  # a held-out prompt is never trained on
    with pytest.raises(ValidationError, match="go together"):
        FileTaskOptions(path="x", sha256=sha, eval_path="eval.jsonl")


def test_bad_lines_are_named(tmp_path):
    sha = _jsonl(tmp_path / "d.jsonl", [{"q": "a", "a": "1"}, {"q": "b"}])
    with pytest.raises(ValueError, match="line 2"):
        load_split(FileTaskOptions(path="d.jsonl", sha256=sha), tmp_path, _parse)


def test_task_options_checks_without_reading_data():
    # A config can be checked on a machine without the data: options are validated, nothing is read.
    opts = task_options(TaskSpec(name="math", options={"path": "missing.jsonl", "sha256": "0" * 64}))
    assert opts.path == "missing.jsonl"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="sha256"):
        task_options(TaskSpec(name="math", options={"path": "missing.jsonl", "sha256": "short"}))


def test_evaluation_takes_the_tasks_length():
    import torch

    from swarmrl.trainer.evaluate import correct_count
    from swarmrl.trainer.model import ModelConfig, build_model, build_tokenizer

    seen: list[str] = []

    class Recorder(AdditionTask):
        def is_correct(self, completion: str, answer: str) -> bool:
            seen.append(completion)
            return False

    torch.manual_seed(0)
    tok = build_tokenizer()
    model = build_model(ModelConfig(seed=0), tok)
    lengths = {}
    for n in (2, 5):
        task = Recorder(AdditionTask.Options(digits=2, eval_size=8, max_new_tokens=n))
        seen.clear()
        correct_count(model, tok, task.eval_set(), task)
        lengths[n] = max(len(tok(t, add_special_tokens=False).input_ids) for t in seen)
    assert lengths[2] <= 2 < lengths[5] <= 5
