"""The shipped agent (the real embedded model) on the three real MCP servers: one step of parallel
rehearsal (K=2) each, with shadow execution on forks that leaves the episode's state untouched."""
import pytest

from app import envs
from app.engine import EpisodeRunner
from app.records import RunSettings
from helpers import need_servers

pytestmark = [pytest.mark.slow, pytest.mark.mcp]

# One task per server whose first step is a writing call; seed 1 samples an alternative that differs
# from the greedy call on each (a fixed seed gives the same step every run).
TASKS = ["mcp:git/commit-readme", "mcp:sqlite/deactivate-bob", "mcp:filesystem/write-hello"]


@pytest.mark.parametrize("task_id", TASKS)
def test_one_parallel_step_rehearses_and_shadows_on_a_copy(shipped_policy, task_id):
    need_servers()
    task = envs.load_task(task_id)
    settings = RunSettings(mode="parallel", branches=2, selector="logprob", seed=1, temperature=1.0,
                           tool_choice="required", max_action_tokens=64, max_rehearsal_tokens=48,
                           max_steps_per_turn=1)
    with envs.make_env(task) as env, envs.make_env(task) as replay:
        runner = EpisodeRunner(task, shipped_policy, settings, env=env)
        step = runner.step()
        calls = [b for b in step.branches if b.kind == "call"]
        assert calls, f"no tool call among {[b.action_text for b in step.branches]}"
        assert {b.call.name for b in calls} <= {t.name for t in env.tools()}  # constrained: real tools
        assert all(b.predicted_text and b.predicted_text.startswith("<execution_result>") for b in calls)
        chosen = step.branches[step.chosen]
        assert chosen.actual_source == "committed" and chosen.actual is not None
        others = [b for b in calls if not b.chosen]
        assert all(b.actual_source == "shadow" and b.shadow_state_after is not None for b in others)
        # The episode's folder holds exactly what the committed call alone does to a fresh copy of the
        # task: the alternatives ran on forks only.
        if chosen.kind == "call":
            replay.call(chosen.call.name, chosen.call.arguments)
        assert env.state()[task.category] == replay.state()[task.category]
        assert runner.episode.turn_results and runner.episode.turn_results[0].details.get("checks")
        assert step.shadow_calls == len(others) and step.external_calls == (chosen.kind == "call")
