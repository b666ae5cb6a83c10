"""Every command the README shows runs as written (a README that drifts from the code is a
bug): the HTTP examples against a real `qos up` stack, the redis-cli lines against its Redis,
and `make demo`'s command with a bounded duration."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.qos_up import QOS, start_qos_up, stop_qos_up
from tests.support.redis_server import free_port

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 5)
    return README[start:end]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


@pytest.fixture(scope="module")
def stack():
    port = free_port()
    proc, _ready, redis_url = start_qos_up(port, "--engine", "sim", "--workers", "1")
    yield port, redis_url
    stop_qos_up(proc)


def test_readme_http_examples_run_as_written(stack):
    port, _ = stack
    section = _section("HTTP API")
    shell = _blocks(section, "bash")
    python = _blocks(section, "python")
    assert len(shell) >= 4 and len(python) == 1
    for block in shell:
        script = block.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        out = subprocess.run(["bash", "-e", "-c", script], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, (block, out.stderr)
        assert '"error"' not in out.stdout, (block, out.stdout[:500])
        assert out.stdout.strip(), block
    code = python[0].replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "completion_tokens" in out.stdout


def test_readme_redis_cli_lines_answer(stack):
    """Each documented line names a key the code builds (limiter/keys.py) and answers without
    an error; the policy line reads real fields. A misspelt key answered nothing, without an
    error, and passed (found by a review)."""
    from limiter.keys import PoolKeys

    _, redis_url = stack
    keys = PoolKeys("tiny")
    known = {keys.policy, keys.queued, keys.leases, keys.inflight, keys.decisions}
    for c in ("P0", "P1", "P2"):
        known |= {keys.backlog(c), keys.class_bucket(c), keys.ceil_bucket(c)}
    (block,) = [b for b in _blocks(_section("Redis key layout"), "bash") if "redis-cli" in b]
    for line in block.strip().splitlines():
        cmd = shlex.split(line.split("#")[0])
        assert cmd[0] == "redis-cli"
        assert cmd[2] in known, f"{line}: {cmd[2]} is no key the code writes"
        out = subprocess.run(
            ["redis-cli", "-u", redis_url, *cmd[1:]], capture_output=True, text=True, timeout=10
        )
        assert out.returncode == 0 and "ERR" not in out.stdout, (line, out.stdout, out.stderr)
        if cmd[2] == keys.policy:  # set up at start: every field named is there
            values = out.stdout.splitlines()  # one a field; a missing one an empty line
            assert len(values) == len(cmd) - 3 and all(v.strip() for v in values), (line, out.stdout)


def test_make_demo_command_serves_a_demo_load():
    recipe = re.search(r"^demo:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), flags=re.M).group(1)
    argv = shlex.split(recipe.replace("$(BIN)/qos", QOS))
    assert argv[:2] == [QOS, "up"] and "--demo-load" in argv
    port = free_port()
    proc = subprocess.run(
        [*argv, "--demo-duration", "6", "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "QOS_LOG_LEVEL": "WARNING", "COLUMNS": "160"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "qos up: ready at" in proc.stdout and "demo-p0" in proc.stdout
    table = proc.stdout
    assert "SIMULATED" in table and re.search(r"P0\s*│\s*\d+\s*│\s*[1-9]", table), table[-2000:]
