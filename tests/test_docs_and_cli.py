"""The README's example, the examples/ programs and the exod CLI run and say what they claim."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

import fsm
from exod.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_readme_example_runs_and_prints_what_it_claims():
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    lines = out.getvalue().splitlines()
    assert lines[0] == "running.connecting.joined"
    assert lines[1] == "[('joined', 'failed'), ('failed', 'stopped')]"
    assert lines[2] == "runner exited unexpectedly with code 0"
    assert lines[3] == "InstanceState.BACKING_OFF 3.5"
    assert lines[4] == "30.0"
    assert lines[5].startswith("[StartGeneration(instance_id='demo', generation=1), StartDownload(")


def test_readme_lists_every_handler_of_the_drivers_adapter():
    """#27: a handler the README leaves out is one a reader of the table never writes (`kill_runner` was)."""
    row = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `Driver("))
    listed = re.search(r"`Adapter` handler for each action \(([^)]*)\)", row).group(1)
    handlers = {name for name in vars(fsm.Adapter) if not name.startswith("_")}
    assert set(re.findall(r"`(\w+)`", listed)) == handlers


def test_drive_machines_example_recovers_after_a_kill():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "drive_machines.py")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "runner killed by SIGKILL" in out
    assert re.search(r"t=\s*5\.0\s+instance demo\s+recovering → backing_off", out)
    assert re.search(r"t=\s*7\.0\s+instance demo\s+backing_off → starting", out)  # 2 s backoff
    assert out.rstrip().endswith("instance demo: ready, generation 2, attempts 1")


def test_cli_version_and_machines():
    runner = CliRunner()
    assert runner.invoke(main, ["--version"]).output.strip() == f"exod, version {fsm.__version__}"
    result = runner.invoke(main, ["machines"])
    assert result.exit_code == 0
    rows = {line.split()[0]: line.split()[1:] for line in result.output.splitlines()}
    assert rows["runner"][0] == "RunnerLifecycle" and "warming_up" in rows["runner"]
    assert rows["instance"][0] == "InstanceRetry" and "backing_off" in rows["instance"]
    assert rows["download"][0] == "DownloadLifecycle"


def test_package_imports_as_documented():
    out = subprocess.run(
        [sys.executable, "-c", "import fsm; print(fsm.RunnerLifecycle, fsm.InstanceRetry, fsm.plan)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "fsm.runner.RunnerLifecycle" in out and "fsm.instance.InstanceRetry" in out and "function plan" in out


def test_logs_prints_the_newest_generation_or_one_rank_and_follows(tmp_path):
    logs = tmp_path / "logs" / "m-1"
    logs.mkdir(parents=True)
    for rank, generation in [(0, 1), (1, 1), (0, 2), (1, 2)]:
        (logs / f"rank{rank}-gen{generation}.log").write_text(f"rank {rank} of generation {generation}\n")
    runner = CliRunner()
    newest = runner.invoke(main, ["logs", "m-1", "--state-dir", str(tmp_path)])
    assert (
        newest.exit_code == 0
        and "rank 0 of generation 2" in newest.output
        and "rank 1 of generation 2" in newest.output
    )
    assert "generation 1" not in newest.output
    one = runner.invoke(main, ["logs", "m-1", "--rank", "1", "--generation", "1", "--state-dir", str(tmp_path)])
    assert one.exit_code == 0 and "rank 1 of generation 1" in one.output and "rank 0" not in one.output
    missing = runner.invoke(main, ["logs", "m-2", "--state-dir", str(tmp_path)])
    assert missing.exit_code != 0 and "no runner logs of m-2" in missing.output

    follower = subprocess.Popen(
        [sys.executable, "-m", "exod", "logs", "m-1", "--rank", "0", "--follow", "--state-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert follower.stdout is not None
        assert follower.stdout.readline().startswith("==> ")
        assert follower.stdout.readline() == "rank 0 of generation 2\n"
        with (logs / "rank0-gen2.log").open("a") as log:
            log.write("written later\n")
        assert follower.stdout.readline() == "written later\n"
    finally:
        follower.kill()
        follower.wait()


def test_serve_prints_commands_that_work_as_printed(tmp_path, monkeypatch):
    """`make run` starts .venv/bin/exod, which is not on the PATH: the commands it prints say so."""
    from exod.serve import _command

    script = tmp_path / "venv" / "bin" / "exod"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(sys, "argv", [str(script), "serve"])
    assert _command() == str(script)
    monkeypatch.setenv("PATH", str(script.parent))
    assert _command() == "exod"  # on the PATH, and this one
    monkeypatch.setattr(sys, "argv", ["/somewhere/exod/__main__.py", "serve"])  # python -m exod
    assert _command() == f"{sys.executable} -m exod"
