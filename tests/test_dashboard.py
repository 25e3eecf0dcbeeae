"""Dashboard figures from plain rows: each says how many samples it rests on, a tool with no data is marked so
(never drawn as a 0), and an empty figure says "No data"."""
from __future__ import annotations

from app.service import dashboard


def branch(tool: str | None, exact=None, f1=None, agree=None, mode="parallel", step=0, **extra) -> dict:
    measured = exact is not None or f1 is not None
    return {"call_name": tool, "json_valid": (1 if measured else None), "exact": exact, "field_f1": f1,
            "error_agree": agree, "mode": mode, "step_idx": step, "chosen": 0, "kind": "call",
            "actual_source": None, "actual_error": None, "scores": None, **extra}


def texts(fig) -> list[str]:
    return [a.text for a in fig.layout.annotations]


def test_fidelity_says_n_and_tells_no_data_from_a_zero():
    rows = [branch("ls", exact=0, f1=0.0, agree=0), branch("ls", exact=0, f1=0.0, agree=0),
            branch("cd", exact=1, f1=1.0, agree=1),
            branch("mkdir")]  # called, but never rehearsed against an actual response
    fig = dashboard.fidelity_by_tool(rows)
    assert fig.layout.title.text == "Rehearsal fidelity by tool · n=3 rehearsed calls"
    exact = next(t for t in fig.data if t.name == "exact")
    assert list(exact.x) == ["ls (n=2)", "cd (n=1)", "mkdir (n=0)"]
    assert list(exact.y) == [0.0, 1.0, None] and list(exact.text) == ["0.00", "1.00", ""]  # 0 is shown as 0.00
    assert [(a.x, a.text) for a in fig.layout.annotations] == [("mkdir (n=0)", "no data")]


def test_an_empty_figure_says_no_data():
    for fig in (dashboard.fidelity_by_tool([branch("ls")]), dashboard.divergence_by_step([]),
                dashboard.success_and_calls_by_mode([]), dashboard.calibration([]),
                dashboard.annotations_by_label([])):
        assert len(texts(fig)) == 1 and texts(fig)[0].startswith("No data")


def test_success_without_judged_episodes_says_no_data_and_counts_what_it_has():
    unjudged = [{"mode": "parallel", "success": None, "external_calls": 3},
                {"mode": "none", "success": None, "external_calls": 1}]
    fig = dashboard.success_and_calls_by_mode(unjudged)
    assert "success rate · n=0 judged episodes" in texts(fig)
    assert "external calls / episode · n=2 episodes" in texts(fig)
    assert any(t.startswith("No data: no judged episode") for t in texts(fig))

    rehearsal = {"mode": "none", "success": None, "external_calls": 0, "source_episode": "ep1"}  # ran nothing
    mixed = unjudged + [{"mode": "parallel", "success": 0, "external_calls": 2}, rehearsal]
    fig = dashboard.success_and_calls_by_mode(mixed)
    success = fig.data[0]
    assert list(success.x) == ["none (n=0)", "parallel (n=1)"] and list(success.y) == [None, 0.0]
    assert ("none (n=0)", "no data") in [(a.x, a.text) for a in fig.layout.annotations]
    assert "external calls / episode · n=3 episodes" in texts(fig) and list(fig.data[1].y) == [1.0, 2.5]


def test_the_other_titles_say_n():
    div = dashboard.divergence_by_step([branch("ls", f1=0.5, step=0), branch("ls", f1=1.0, step=1)])
    assert div.layout.title.text.endswith("· n=2 compared responses")
    calib = dashboard.calibration([branch("ls", chosen=1, actual_source="committed", actual_error=0,
                                          scores='{"judge": 0.8}')])
    assert calib.layout.title.text.endswith("· n=1 committed calls")
    labels = dashboard.annotations_by_label([{"label": "match", "n": 2}, {"label": None, "n": 1}])
    assert labels.layout.title.text == "Annotations by label · n=3 annotations"
