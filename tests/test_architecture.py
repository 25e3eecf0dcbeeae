"""The layout the README describes: imports point one way, and the UI reaches the engine only
through the service layer. Read from the source (AST), so a lazy in-function import counts too;
imports under `if TYPE_CHECKING:` do not (they never run)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "model_backend")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """Modules of ours that `path` imports (a name imported from a package counts as its submodule)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] in PACKAGES}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in PACKAGES:
            out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                    for a in node.names}
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


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


def test_no_import_circles_in_app_or_model_backend():
    g = graph()
    assert "app.engine.runner" in g and "app.cli.main" in g and "model_backend.factory" in g
    assert cycles(g) == []


def test_the_ui_reaches_engine_envs_and_models_only_through_the_service_layer():
    g = graph()
    ui = {m: deps for m, deps in g.items() if m.startswith("app.ui")}
    assert ui
    forbidden = ("app.engine", "app.envs", "model_backend", "app.eval", "app.cli")
    leaks = {m: sorted(d for d in deps if d.startswith(forbidden)) for m, deps in ui.items()}
    assert {m: d for m, d in leaks.items() if d} == {}


def test_core_modules_depend_on_nothing_above_them():
    g = graph()
    core = ("app.records", "app.formats", "app.divergence", "app.store", "app.config")
    above = ("app.engine", "app.service", "app.ui", "app.cli", "app.eval", "app.training")
    assert {m: sorted(d for d in g[m] if d.startswith(above)) for m in core} == {m: [] for m in core}
