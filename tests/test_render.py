"""Branch cards as HTML (pure functions): shadow responses and the fork's state diff, no browser."""
from __future__ import annotations

import json

from scripted import ScriptedPolicy

from app import envs
from app.engine import EpisodeRunner
from app.engine.runner import NOT_EXECUTED_CANNOT_FORK
from app.records import Branch, Call, RunSettings
from app.ui import render


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def card_of(html: str, index: int) -> str:
    start = html.index(f'data-branch="{index}"')
    end = html.find('data-branch="', start + 1)
    return html[start:] if end < 0 else html[start:end]


def test_a_shadow_write_shows_its_response_and_its_fork_diff() -> None:
    policy = ScriptedPolicy([[call("set", key="color", value="blue"), call("delete", key="size"),
                              call("get", key="size")]], predict=lambda text: {"ok": True})
    runner = EpisodeRunner(envs.load_task("mock:kv"), policy,
                           RunSettings(mode="parallel", branches=3, selector="logprob"))
    step = runner.step()
    html = render.branch_cards(step)
    delete, get = card_of(html, 1), card_of(html, 2)
    assert "Actual · shadow" in delete and "&quot;deleted&quot;: &quot;size&quot;" in delete
    assert "Fork state diff: 1 change(s)" in delete and "removed" in delete
    assert "[&#x27;MockKV&#x27;][&#x27;store&#x27;][&#x27;size&#x27;]" in delete
    assert "Fork state: no change." in get  # a read leaves its fork as it was
    committed = card_of(html, 0)
    assert "Actual · committed" in committed and "Fork state" not in committed
    assert "Actual · none" not in html


def test_a_branch_without_an_actual_response_says_why() -> None:
    cannot_fork = Branch(index=1, action_text="x", kind="call", call=Call(name="set", arguments={"key": "a"}),
                         not_executed=NOT_EXECUTED_CANNOT_FORK)
    assert f"not executed: {render.esc(NOT_EXECUTED_CANNOT_FORK)}" in render.branch_card(cannot_fork)
    older = Branch(index=1, action_text="x", kind="call", call=Call(name="set", arguments={"key": "a"}))
    assert "not shadow-executed when this trace was recorded" in render.branch_card(older)
    answer = Branch(index=2, action_text="Done.", kind="answer")
    assert "nothing to rehearse" in render.branch_card(answer) and "Actual ·" not in render.branch_card(answer)


def test_no_fork_diff_without_the_step_state() -> None:
    shadow = Branch(index=1, action_text="x", kind="call", call=Call(name="delete", arguments={"key": "a"}),
                    actual={"deleted": "a"}, actual_source="shadow", shadow_state_after={"MockKV": {"store": {}}})
    assert "Fork state" not in render.branch_card(shadow)
    assert "Fork state diff: 1 change(s)" in render.branch_card(shadow, {"MockKV": {"store": {"a": 1}}})


def test_the_card_says_how_candidates_folded_and_flags_a_diverged_prediction() -> None:
    from app.records import Branch, Call, Metrics, Step
    from app.ui import render

    folded = Branch(index=0, action_text="x", kind="call", call=Call(name="ls"), duplicates=2, chosen=True,
                    predicted={"a": 1}, predicted_text='{"a": 1}', actual=None, actual_source="committed",
                    metrics=Metrics(json_valid=True, exact=False, field_f1=0.0, error_agree=True))
    other = Branch(index=1, action_text="y", kind="call", call=Call(name="pwd"), sampled=True,
                   metrics=Metrics(json_valid=True, exact=True))
    step = Step(index=0, turn=0, branches=[folded, other], chosen=0, kind="call")
    html = render.branch_cards(step)
    assert "4 proposed → 2 unique (b0 proposed 3×)" in html
    assert html.count("prediction diverged") == 1 and html.count("prediction matched") == 1
    assert "null (no output: success)" in html
    assert f'title="{render.METRIC_HELP["surprise"]}"' in html


def test_untrusted_text_cannot_become_markdown_markup() -> None:
    from app.ui.render import md_code, md_fence, md_text

    assert md_text("List my files, then sort them.") == "List my files, then sort them."  # prose unchanged
    hostile = "<img src=x onerror=alert(1)> [a](javascript:x) ![i](http://t/p.png) **b** `c` &lt; $x$"
    escaped = md_text(hostile)
    for opener in ("<", "[", "`", "*", "&", "$"):
        assert opener not in escaped.replace("\\" + opener, "")  # every opener is escaped
    code = md_code("x `` y ` z")
    assert code.startswith("```") and code.endswith("```") and "x `` y ` z" in code
    assert md_code("`edge`") == "`` `edge` ``"
    block = md_fence("a\n```\n<script>alert(1)</script>\n```", "json")
    fence = block.split("\n")[0].removesuffix("json")
    assert len(fence) == 4 and block.endswith("\n" + fence)  # the text's own ``` cannot close it


def test_the_step_header_shows_what_a_step_computed_ahead_took() -> None:
    from app.records import Step

    b = Branch(index=0, action_text="Done.", kind="answer", chosen=True)
    ahead = Step(index=1, turn=0, branches=[b], chosen=0, kind="answer", duration_s=0.02, ahead_s=6.31)
    head = render.step_header(ahead)
    assert "6.3 s (6.3 s computed ahead while the step before was read, 0.0 s at Step)" in head
    assert "0.0 s</div>" not in head
    assert render.step_header(ahead.model_copy(update={"ahead_s": 0.0, "duration_s": 3.04})).endswith("3.0 s</div>")


def test_the_status_of_an_ended_episode_says_why() -> None:
    r = EpisodeRunner(envs.load_task("mock:kv"), ScriptedPolicy([[call("list_keys")]]),
                      RunSettings(mode="none", branches=1))
    r.step()
    assert "Ended" not in render.episode_status(r.episode)
    r.fail("boom <b>*x*</b>")
    status = render.episode_status(r.episode)
    assert "**Ended:** a step failed after 1 step: boom \\<b\\>\\*x\\*\\</b\\>" in status  # escaped: shown as written


def test_the_status_of_a_rehearsal_names_its_source() -> None:
    r = EpisodeRunner(envs.load_task("mock:kv"), ScriptedPolicy([[call("list_keys")]]),
                      RunSettings(mode="none", branches=1))
    r.step()
    assert "Rehearsal" not in render.episode_status(r.episode)
    status = render.episode_status(r.episode.model_copy(update={"source_episode": "abc123"}))
    assert "**Rehearsal** of episode `abc123`" in status and "recorded history" in status
