"""The README's walk-through ("One export by hand, with curl"), run as a new user would:
its shell blocks as written, in a fresh directory, with only the token pasted in and the
port changed to a free one (which the README itself says how to do, with `--port`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from .procs import FAST_ENV, clean_env, free_port, poll, processes, wait_http

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
ROOT = Path(__file__).resolve().parents[2]
JOBRELAY = f"{sys.executable} -m jobrelay"


def walkthrough() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## One export by hand, with curl", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)```", section, re.S)


def bash(script: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_readme_walkthrough_works_as_written(tmp_path: Path) -> None:
    setup, submit, follow = walkthrough()
    commands = [line.split("  #")[0].strip() for line in setup.strip().splitlines()]
    assert commands[-1] == ".venv/bin/jobrelay up"
    assert "--port" in (ROOT / "README.md").read_text().split("## Your own jobs")[0]
    python_path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    env = clean_env(PYTHONPATH=python_path, **FAST_ENV)  # the embedded default, in tmp_path

    outputs = []
    for command in commands[:-1]:
        ran = bash(command.replace(".venv/bin/jobrelay", JOBRELAY), env, tmp_path)
        assert ran.returncode == 0, (command, ran.stderr)
        outputs.append(ran.stdout)
    token = outputs[-1].strip().splitlines()[-1]
    assert token.startswith("jr_"), outputs[-1]  # shown, so it can be pasted

    port = free_port()
    with processes(tmp_path) as start:
        up = start("up", *commands[-1].split()[1:], "--port", str(port), env=env, cwd=tmp_path)
        wait_http(f"http://127.0.0.1:{port}", up)

        def as_written(block: str) -> str:
            block = re.sub(r"^TOKEN=jr_….*$", f"TOKEN={token}", block, flags=re.M)
            return block.replace("localhost:8000", f"localhost:{port}").replace(
                ".venv/bin/jobrelay", JOBRELAY
            )

        sent = bash(as_written(submit), env, tmp_path)
        assert sent.returncode == 0, sent.stderr
        body, status = sent.stdout.strip().splitlines()
        assert status == "202", sent.stdout  # what the README says curl prints
        job_id = json.loads(body)["jobId"]

        headers = {"Authorization": f"Bearer {token}"}
        poll(
            lambda: (
                httpx.get(f"http://127.0.0.1:{port}/v1/jobs/{job_id}", headers=headers)
                .json()
                .get("state")
                == "succeeded"
            ),
            60,
            f"job {job_id} to succeed\n{up.log()[-2000:]}",
        )
        # The same terminal: TOKEN is still set, and the repeated POST creates nothing.
        followed = bash(as_written(submit + follow), env, tmp_path)
        assert followed.returncode == 0, followed.stderr
        out = followed.stdout
        assert out.count(f'"jobId":"{job_id}"') >= 2, out  # the state and the events
        assert "result_saved" in out and "entry_id,booked_on,description," in out, out
        assert "next: done" in out, out
