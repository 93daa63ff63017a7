"""verifiers tasksets as the `verifiers` task and verifiers toolsets as the `verifiers_tools` environment: the same
prompts on every load, rewards as the taskset's own reward functions give them, a toolset that replays, and LLM
judges, sandboxes, verifiers Envs and tasksets or tools that do not replay refused with their reason.

verifiers 0.4.0 moves openai and mcp to older versions than this project's environment has, so it is not installed
by default; these tests skip without it (docs/verifiers.md says how to install it beside the project)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

vf = pytest.importorskip("verifiers.v1", reason="verifiers is not installed: it moves openai and mcp to older "
                         "versions (pip install verifiers==0.4.0 where that is acceptable; docs/verifiers.md)")

from pydantic import Field  # noqa: E402

from swarmrl.protocol.episodes import EnvironmentSpec, load_environment  # noqa: E402
from swarmrl.protocol.tasks import TaskSpec, load_task, registered_tasks  # noqa: E402
from swarmrl.tasks.verifiersenv import VerifiersRefused, VerifiersTask  # noqa: E402
from swarmrl.tasks.verifierstools import VerifiersTools  # noqa: E402

HERE = "tests.test_verifiers_env"


# -- a single-turn taskset over an in-memory dataset, with a rubric of two weighted rewards ---------------------------

class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) <= 3)


class SumConfig(vf.TasksetConfig):
    n: int = 80
    system: str | None = None


class Sums(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        rng = random.Random(7)  # the taskset's own seed: the same rows everywhere
        for _ in range(self.config.n):
            a, b = rng.randint(1, 20), rng.randint(1, 20)
            yield SumTask(SumData(prompt=f"What is {a} + {b}?", answer=str(a + b), system_prompt=self.config.system),
                          self.config.task)


# -- tasksets the swarm must refuse -----------------------------------------------------------------------------------

class JudgedSums(Sums):
    def load(self):
        judged = vf.TaskConfig.model_validate({"judges": [{"id": "reference"}]})
        for task in super().load():
            yield SumTask(task.data, judged)


class BoxTask(SumTask):
    @vf.reward
    async def tests_pass(self, trace: vf.Trace, runtime) -> float:
        return 0.0


class BoxSums(vf.Taskset[BoxTask, SumConfig]):
    def load(self):
        for task in Sums(self.config).load():
            yield BoxTask(task.data, self.config.task)


class ClockSums(Sums):
    def load(self):
        for i, task in enumerate(super().load()):
            yield SumTask(task.data.model_copy(update={"answer": str(time.perf_counter_ns() + i)}), self.config.task)


class SetOrderSums(Sums):
    def load(self):
        words = sorted({f"w{i}" for i in range(50)}, key=lambda w: hash(w))  # the order of a hash: per process
        for task, word in zip(super().load(), words * 2, strict=False):
            yield SumTask(task.data.model_copy(update={"prompt": f"{task.data.prompt} ({word})"}), self.config.task)


def spec(taskset: str = "Sums", **options) -> TaskSpec:
    return TaskSpec(name="verifiers", options={"taskset": f"{HERE}:{taskset}", "size": 80, "eval_size": 20,
                                               **options})


@pytest.fixture(scope="module")
def task():
    return load_task(spec())


def test_registered_and_loaded_by_name(task):
    assert registered_tasks()["verifiers"] == "swarmrl.tasks.verifiersenv:VerifiersTask"
    assert isinstance(task, VerifiersTask)


def test_the_same_prompts_on_every_load_and_training_never_draws_a_held_out_one(task):
    again = load_task(spec())  # the verifier's or the trainer's copy, loaded from the same signed options
    assert again.eval_set() == task.eval_set()
    assert [again.sample(random.Random(s)) for s in range(40)] == [task.sample(random.Random(s)) for s in range(40)]
    rows = list(Sums(SumConfig()))
    assert [p.prompt for p in task.eval_set()] == list(dict.fromkeys(t.data.prompt for t in rows[:20]))
    held = {p.prompt for p in task.eval_set()}
    assert not any(task.sample(random.Random(s)).prompt in held for s in range(200))
    # The answer a coordinator stores names the row and its hash, not the row's reference answer.
    p = task.eval_set()[0]
    assert p.answer.startswith("0:") and rows[0].data.answer not in p.answer.split(":")


def test_rewards_are_the_rubrics_own(task):
    rows = list(Sums(SumConfig()))

    def verifiers_score(row, completion):  # verifiers' own scoring of the same trace, for comparison
        trace = vf.Trace(task=vf.TraceTask(type="SumTask", data=row.data, key=row.key, hash=row.hash),
                         agent=vf.AgentInfo(config=vf.AgentConfig(runtime=vf.SubprocessConfig())),
                         nodes=[vf.MessageNode(message=vf.UserMessage(content=row.data.prompt)),
                                vf.MessageNode(parent=0, message=vf.AssistantMessage(content=completion),
                                               sampled=True)])
        asyncio.run(row.score(trace))
        return trace.reward / 1.5  # normalized by the positive weights, 1 + 0.5

    for i in (0, 1, 30):
        answer = f"{i}:{rows[i].hash[:16]}"
        right = rows[i].data.answer
        for completion in (right, f" {right} ", "I think it is " + right, "0", ""):
            assert task.reward(completion, answer) == pytest.approx(verifiers_score(rows[i], completion))
        assert task.reward(right, answer) == 1.0 and task.is_correct(right, answer)
        assert task.reward("a long wrong answer", answer) == 0.0
    unnormalized = load_task(spec(normalize=False))
    assert unnormalized.reward(rows[0].data.answer, f"0:{rows[0].hash[:16]}") == 1.0  # 1.5, clamped to [0, 1]
    assert unnormalized.reward("0", f"0:{rows[0].hash[:16]}") == 0.5


def test_a_stored_answer_that_names_another_row_is_refused(task):
    with pytest.raises(ValueError, match="not an answer this task stored"):
        task.reward("3", "999:0000000000000000")
    with pytest.raises(RuntimeError, match="loads differently"):
        task.reward("3", "0:0000000000000000")


def test_a_system_prompt_is_prepended_or_refused():
    t = load_task(spec(config={"system": "Answer with a number."}))
    assert t.eval_set()[0].prompt.startswith("Answer with a number.\n\nWhat is ")
    with pytest.raises(VerifiersRefused, match="system_prompt: task 0 has a system prompt"):
        load_task(spec(config={"system": "Answer with a number."}, system_prompt="refuse"))


@pytest.mark.parametrize(("taskset", "reason"), [
    ("JudgedSums", r"config: task SumTask plugs judges \['reference'\]: an LLM judge asks a model over the network"),
    ("BoxSums", "reward 'tests_pass' of task BoxTask reads the rollout's runtime"),
    ("ClockSums", "differ between two loads in one process"),
    ("SetOrderSums", "loads or scores differently in another process"),
])
def test_tasksets_that_cannot_be_replayed_or_trusted_are_refused(taskset, reason):
    with pytest.raises(VerifiersRefused, match=reason):
        load_task(spec(taskset))


def test_classes_that_are_no_taskset_are_refused_with_what_they_are():
    with pytest.raises(VerifiersRefused, match="a verifiers Env owns its rollout"):
        load_task(TaskSpec(name="verifiers", options={"taskset": "verifiers.v1.envs.user_sim:UserSimEnv"}))
    with pytest.raises(VerifiersRefused, match="eval_size: 20 leaves none of the taskset's 10 tasks"):
        load_task(spec(config={"n": 10}))


# -- a toolset as the environment of a multi-turn run -----------------------------------------------------------------

class NotebookState(vf.State):
    notes: dict[str, str] = Field(default_factory=dict)


class Notebook(vf.Toolset[vf.ToolsetConfig, NotebookState]):
    @vf.tool
    async def write(self, key: str, value: str) -> str:
        """Keep a note."""
        self.state.notes[key] = value
        return "ok"

    @vf.tool
    def read(self, key: str) -> str:
        """Read a note back."""
        return self.state.notes.get(key, "no such note")

    @vf.tool
    def add(self, a: int, b: int) -> dict:
        """Add two integers."""
        return {"sum": a + b, "a": a, "b": b}


class ClockTools(vf.Toolset[vf.ToolsetConfig]):
    @vf.tool
    def now(self) -> str:
        """The time."""
        return str(time.perf_counter_ns())


class TaskRowTools(Notebook):
    async def setup_task(self, task) -> None:
        self.secret = task.data.answer


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def tools(toolset: str, **options) -> EnvironmentSpec:
    return EnvironmentSpec(name="verifiers_tools", options={"toolset": f"{HERE}:{toolset}", **options})


def test_a_toolset_answers_tool_calls_from_the_transcript_and_passes_the_replay_check():
    probes = [["Note it.", [call("write", key="x", value="7"), call("read", key="x"), "7"]]]
    env = load_environment(tools("Notebook", probes=probes))  # the replay check runs here, and in another process
    assert isinstance(env, VerifiersTools)
    turns = ["Let me add. " + call("add", a=2, b=40)]
    assert env.reply("What is 2 + 40?", turns, 0) == '{"a": 2, "b": 40, "sum": 42}'
    assert env.reply("What is 2 + 40?", [*turns, "42"], 0) is None  # no tool call: the answer, the episode ends
    # State comes from the transcript alone: the earlier turns' calls are replayed before the last one.
    notes = [call("write", key="x", value="7"), call("read", key="x")]
    assert env.reply("", notes, 0) == "7"
    assert env.reply("", notes[1:], 0) == "no such note"
    assert env.reply("", notes, 1) == env.reply("", notes, 0)
    assert env.reply("", [call("notebook_add", a=1, b=1)], 0) == '{"a": 1, "b": 1, "sum": 2}'  # the prefixed name
    # Hostile turns are answered, never raised on.
    assert env.reply("", [call("add", a="x", b=1)], 0).startswith("error: bad arguments for add")
    assert env.reply("", [call("rm", path="/")], 0).startswith("error: no tool 'rm'")
    assert env.reply("", ["<tool_call>{not json</tool_call>"], 0).startswith("error: a tool call is")
    assert env.reply("", [call("add", a=1, b=1, c=2)], 0).startswith("error: bad arguments for add")


@pytest.mark.parametrize(("toolset", "options", "reason"), [
    ("ClockTools", {}, "answers the same turns differently twice in one process"),
    ("TaskRowTools", {}, r"overrides \['setup_task'\]: its state starts from the world or the task's row"),
    ("Notebook", {"config": {"url": "http://tools.example:8000"}}, "url: the toolset is served elsewhere"),
    ("Notebook", {"config": {"runtime": {"type": "docker"}}}, "runtime DockerConfig: the toolset runs in a sandbox"),
    ("Sums", {}, "is not a verifiers Toolset"),
])
def test_toolsets_that_cannot_be_replayed_are_refused(toolset, options, reason):
    with pytest.raises(ValueError, match=reason):
        load_environment(tools(toolset, **options))


def test_a_verifiers_env_is_refused_as_an_environment_with_why():
    spec_ = EnvironmentSpec(name="verifiers_tools", options={"toolset": "verifiers.v1.envs.user_sim:UserSimEnv"})
    with pytest.raises(VerifiersRefused, match="its async run.. drives the agents"):
        load_environment(spec_)


def test_episodes_with_the_toolset_pass_the_verifiers_check_and_a_faked_tool_answer_is_caught():
    from swarmrl.models.episodes import Episode, episode_problem
    from swarmrl.models.prompts import render_env_turn
    from swarmrl.models.tokenizers import build_bpe_tokenizer
    from swarmrl.protocol.messages import SamplingSpec

    tok = build_bpe_tokenizer(300, corpus_lines=200)
    stop = tok.eos_token_id
    env = load_environment(tools("Notebook"), check=False)  # (replayed above)
    sampling = SamplingSpec(temperature=1.0, max_tokens=64, group_size=2, max_turns=3, max_episode_tokens=400)
    ep = Episode(env=env, tokenizer=tok, sampling=sampling, stops={stop}, prompt_text="What is 2 + 40?",
                 prompt_len=8)
    first = tok(call("add", a=2, b=40), add_special_tokens=False).input_ids + [stop]
    reply = render_env_turn(tok, '{"a": 2, "b": 40, "sum": 42}')
    answer = tok("42", add_special_tokens=False).input_ids + [stop]
    assert ep.after_model_turn([first], len(first), 5).reply_ids == reply
    completion, turns = first + reply + answer, [len(first), len(reply), len(answer)]
    logprobs = [-1.0] * len(first) + [0.0] * len(reply) + [-1.0] * len(answer)
    assert episode_problem(ep, completion, logprobs, turns, "stop", 5) is None
    faked = render_env_turn(tok, '{"a": 2, "b": 40, "sum": 43}')
    bad = first + faked + answer
    assert episode_problem(ep, bad, [-1.0] * len(first) + [0.0] * len(faked) + [-1.0] * len(answer),
                           [len(first), len(faked), len(answer)], "stop", 5) == \
        "environment turn 0: not what the environment answers"


def test_a_task_played_with_a_toolset_tells_the_model_its_tools_in_the_prompt():
    t = load_task(spec(toolset=f"{HERE}:Notebook", config={"system": "Be brief."}, max_turns=3))
    prompt = t.eval_set()[0].prompt
    assert prompt.startswith("Be brief.\n\nYou can call tools. To call one, end your message with <tool_call>")
    assert "\n- add(a: int, b: int): Add two integers.\n" in prompt and prompt.endswith("\n\nWhat is " +
                                                                                      prompt.split("What is ")[-1])
    assert t.eval_settings.max_turns == 3
    rows = list(Sums(SumConfig(system="Be brief.")))
    assert t.reward(rows[0].data.answer, t.eval_set()[0].answer) == 1.0
    with pytest.raises(VerifiersRefused, match=r"\[run.task.options\] toolset: TaskRowTools overrides"):
        load_task(spec(toolset=f"{HERE}:TaskRowTools"))
