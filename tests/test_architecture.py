"""The layout the README describes: imports point one way, and the UI reaches the engine only
through the service layer. Read from the source (AST), so a lazy in-function import counts too, and a
relative import (`from .x import y`, `from .. import z`) is resolved to the module it names; imports under
`if TYPE_CHECKING:` do not count (they never run), except where a test asks for them (`typing=True`): the engine
has no circle even on paper."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "model_backend")


def modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for f in (root / pkg).rglob("*.py"):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def imports(path: Path, known: dict[str, Path], name: str, packages: tuple[str, ...] = PACKAGES,
            typing: bool = False) -> set[str]:
    """Modules of ours that `path` (module `name`) imports (a name imported from a package counts as its
    submodule; a relative import counts from `name`'s package); `typing`: imports under `if TYPE_CHECKING:` too."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    typing_only = set() if typing else {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                                        and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] in packages}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: up level-1 packages from this module's own
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] in packages:
                out |= {f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names}
    return out


def graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES, typing: bool = False) -> dict[str, set[str]]:
    known = modules(root, packages)
    return {name: imports(path, known, name, packages, typing) - {name} for name, path in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_relative_imports_are_resolved_and_their_circle_found(tmp_path):
    """A package whose modules import each other only relatively: the graph sees every edge, the circle
    is found, and a typing-only import is not an edge."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import thing\n")
    (pkg / "a.py").write_text("def thing():\n    from .sub import b  # lazy, still an edge\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from ..c import helper\nfrom . import d\n")
    (pkg / "sub" / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import a\n")
    (pkg / "c.py").write_text("from pkg.a import thing\n")
    g = graph(tmp_path, ("pkg",))
    assert g == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.sub.b"}, "pkg.sub": set(), "pkg.sub.b": {"pkg.c", "pkg.sub.d"},
                 "pkg.sub.d": set(), "pkg.c": {"pkg.a"}}
    assert cycles(g) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    # Counting typing-only imports, `d`'s import of `a` is an edge, and closes a second way round.
    typed = graph(tmp_path, ("pkg",), typing=True)
    assert typed["pkg.sub.d"] == {"pkg.a"}
    assert cycles(typed) == [["pkg.a", "pkg.c", "pkg.sub.b", "pkg.sub.d"]]


def test_no_import_circles_in_app_or_model_backend():
    g = graph()
    assert "app.engine.runner" in g and "app.cli.main" in g and "model_backend.factory" in g
    assert cycles(g) == []
    # Not even through imports made for type annotations only: no module needs one that needs it back.
    assert cycles(graph(typing=True)) == []


def test_no_import_circle_in_the_engine_even_counting_typing_only_imports():
    """The step planner and the strategies it runs never reach back into the episode runner (issue 40): a
    strategy reads the step's planner, history and episode view from the `StepContext`, whose module imports
    neither the planner nor the runner."""
    g = graph(typing=True)
    engine = {m: {d for d in deps if d.startswith("app.engine")} for m, deps in g.items() if m.startswith("app.engine")}
    assert {"app.engine.runner", "app.engine.planner", "app.engine.context", "app.engine.modes"} <= set(engine)
    assert cycles(engine) == []
    assert not {"app.engine.runner", "app.engine.planner"} & engine["app.engine.context"]
    assert "app.engine.runner" not in engine["app.engine.planner"]
    users = {m for m, deps in engine.items() if "app.engine.runner" in deps}
    assert users <= {"app.engine"}, users  # the package re-exports it; no other engine module needs it


def test_the_ui_reaches_engine_envs_and_models_only_through_the_service_layer():
    g = graph()
    ui = {m: deps for m, deps in g.items() if m.startswith("app.ui")}
    assert ui
    forbidden = ("app.engine", "app.envs", "model_backend", "app.eval", "app.cli", "app.training")
    leaks = {m: sorted(d for d in deps if d.startswith(forbidden)) for m, deps in ui.items()}
    assert {m: d for m, d in leaks.items() if d} == {}


def test_core_modules_depend_on_nothing_above_them():
    g = graph()
    core = ("app.records", "app.formats", "app.divergence", "app.store", "app.config")
    above = ("app.engine", "app.service", "app.ui", "app.cli", "app.eval", "app.training")
    assert {m: sorted(d for d in g[m] if d.startswith(above)) for m in core} == {m: [] for m in core}


def test_sql_on_the_apps_database_lives_in_the_store_only():
    """The README's concept table: SQL is `app/store.py`'s (other modules call its methods; the MCP environments'
    own SQLite files are the servers' databases, not the app's)."""
    pattern = re.compile(r"\bstore\.db\b|\bstore\._(lock|atomic)\b|\.db\.(query|execute)\(|\.db\[")
    found = [f"{path.relative_to(ROOT)}:{n}" for path in sorted((ROOT / "app").rglob("*.py"))
             if path != ROOT / "app" / "store.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []


def test_the_engine_imports_nothing_above_it():
    """Training, eval, the service layer, the UI and the CLI use the engine, never the other way: the replays and
    the Rehearse-prompt rule they share live in the engine (`replay.py`, `history.py`)."""
    g = graph()
    above = ("app.training", "app.eval", "app.service", "app.ui", "app.cli")
    upward = {m: sorted(d for d in deps if d.startswith(above)) for m, deps in g.items() if m.startswith("app.engine")}
    assert {m: d for m, d in upward.items() if d} == {}


def _protocol_members(*protocols: type) -> set[str]:
    """The names a protocol declares: annotated attributes and methods (its own, not `object`'s)."""
    out: set[str] = set()
    for proto in protocols:
        out |= {n for n in getattr(proto, "__annotations__", {}) if not n.startswith("_")}
        out |= {n for n, v in vars(proto).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return out


def capability_probes(source: str, names: set[str]) -> list[str]:
    """`getattr(x, "name", ...)` / `hasattr(x, "name")` calls in `source` whose name is in `names`, as
    `line: code`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in names):
            out.append(f"{node.lineno}: {ast.unparse(node)}")
    return out


def test_the_probe_finder_finds_a_probe():
    src = "def f(env):\n    if hasattr(env, 'close'):\n        env.close()\n    return getattr(env, 'forkable', False)\n"
    assert capability_probes(src, {"close", "forkable"}) == ["2: hasattr(env, 'close')",
                                                             "4: getattr(env, 'forkable', False)"]
    assert capability_probes("getattr(x, name)\nhasattr(y, 'values')\n", {"close"}) == []


def test_no_capability_is_probed_with_getattr_in_app():
    """What an environment, a judge or a policy can do is declared on its protocol (with a default), so
    `app/` calls it: a probe with getattr/hasattr would hide a wrapper that forgot to forward it."""
    from app.envs.base import Environment, Judge
    from model_backend.base import Policy

    names = _protocol_members(Environment, Judge, Policy)
    assert {"forkable", "fork_refusal", "close", "set_turn", "param_names", "judges_whole_episode",
            "supports_scoring", "can_compute_ahead", "inner"} <= names
    found = {str(path.relative_to(ROOT)): probes for path in (ROOT / "app").rglob("*.py")
             if (probes := capability_probes(path.read_text(), names))}
    assert found == {}
