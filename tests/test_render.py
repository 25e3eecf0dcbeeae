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


def test_the_episodes_table_says_the_judged_result_or_why_there_is_none() -> None:
    """The Traces table's success cell: yes/no once judged; otherwise why not (typed instruction, running,
    stopped or interrupted before the end, failed); the adapter by its directory's name."""
    from app.service import INSTRUCTION_PREFIX

    def row(status, success, task_id="bfcl:multi_turn_base_0", adapter=None):
        return {"id": "e1", "task_id": task_id, "mode": "parallel", "branches": 3, "selector": "logprob",
                "model": "embedded", "adapter": adapter, "status": status, "success": success, "n_steps": 2,
                "external_calls": 1, "created_at": "2026-12-06T23:25:01.123"}

    cells = [r[8] for r in render.episode_rows([row("finished", 1), row("finished", 0), row("running", None),
                                                 row("stopped", None), row("interrupted", None),
                                                 row("failed", None), row("finished", None),
                                                 row("finished", None, f"{INSTRUCTION_PREFIX}GorillaFileSystem")])]
    assert cells == ["yes", "no", "not yet: running", "not judged: stopped", "not judged: interrupted",
                     "not judged: failed", "not judged: no judge", "none: a typed instruction"]
    [first] = render.episode_rows([row("finished", 1, adapter="fixtures/adapters/envace-smollm2-135m/")])
    assert first[6] == "envace-smollm2-135m" and first[11] == "2026-12-06 23:25"
    assert len(render.EPISODE_COLUMN_WIDTHS) == len(render.EPISODE_COLUMNS) == len(first)


def test_a_fork_diff_table_shares_its_cards_width() -> None:
    """Fixed layout with a path column of 40%: a long state path wraps inside the card instead of widening it."""
    html = render.changes_table([("['GorillaFileSystem']['root']['contents']['a_very_long_name']", "added", None, 1)])
    assert '<colgroup><col style="width:40%">' in html
    from app.ui.assets import VIEW_CSS
    assert "table-layout: fixed" in VIEW_CSS and "overflow-wrap: anywhere" in VIEW_CSS


def test_the_run_tab_says_the_model_loads_once_and_about_how_long() -> None:
    from app.service import load_note
    from app.service.session import LOAD_SLOW_S

    first = load_note("embedded", loaded=False)
    assert first.startswith("Loading model embedded: once, on the first Step only")
    assert f"up to about {LOAD_SLOW_S // 60} minutes" in first
    assert "Loading" not in load_note("embedded", loaded=True)


def test_a_typed_instructions_branch_says_what_annotating_it_is_for() -> None:
    from app.service import INSTRUCTION_PREFIX, branch_use_note

    note = branch_use_note(f"{INSTRUCTION_PREFIX}GorillaFileSystem")
    assert "never judged" in note and "rehearsal memory" in note and "Act row" in note
    assert branch_use_note("bfcl:multi_turn_base_0") == ""
