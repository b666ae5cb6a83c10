"""The openai engine in front of an OpenAI-compatible server that others wrote: llmock (a
mock LLM server for testing clients, from PyPI; its own process, its own code), behind
`qos up --engine openai`. The official SDK must get through the gateway what it gets from
llmock directly -- the same text, usage and finish, streamed or not -- and a request sent
while llmock is down must complete once it is back, with no error shown to its client.

llmock streams a chat answer as a role chunk, a chunk per word, a finish chunk and, when
asked, a usage chunk; it ignores ``max_tokens`` and ``continuous_usage_stats`` (so the
worker counts one token per chunk while streaming and takes the final usage at the end).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from limiter.localstack.launcher import spawn, wait_for
from limiter.localstack.redis_server import free_port
from tests.support.up_stack import Up

LLMOCK = str(Path(sys.executable).parent / "llmock")
UPSTREAM_MODEL = "gpt-4o-mini"
MESSAGES = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello through the gateway"}]


class Llmock:
    """``llmock serve`` on a fixed port, so that it can be killed and started again there."""

    def __init__(self) -> None:
        assert Path(LLMOCK).exists(), f"{LLMOCK} is missing: install the dev extra (pip install -e '.[dev]')"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Llmock:
        self.proc = spawn([LLMOCK, "serve", "--host", "127.0.0.1", "--port", str(self.port),
                           "--response-style", "echo", "--log-level", "warning"],
                          {**os.environ}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self._answers, 60, f"llmock to answer GET /v1/models on port {self.port}")
        return self

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[Llmock, int]]:
    upstream = Llmock().start()
    port = free_port()
    up = Up(port, "--engine", "openai", "--upstream-url", upstream.url, "--upstream-model", UPSTREAM_MODEL)
    try:
        up.wait_ready()
        yield upstream, port
    finally:
        up.close()
        upstream.kill()


def _sdk(url: str, key: str = "demo-p1") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def _streamed(client: openai.OpenAI, model: str, **kw: Any) -> tuple[list[str], str | None, Any]:
    """(content pieces, finish_reason, usage) of one streamed chat answer."""
    pieces, finish, usage = [], None, None
    for chunk in client.chat.completions.create(model=model, messages=MESSAGES, stream=True,
                                                stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    return pieces, finish, usage


def test_the_gateway_answers_what_the_upstream_answers(stack: tuple[Llmock, int]) -> None:
    upstream, port = stack
    direct = _sdk(upstream.url).chat.completions.create(model=UPSTREAM_MODEL, messages=MESSAGES,
                                                        max_tokens=64)
    via = _sdk(f"http://127.0.0.1:{port}").chat.completions.create(model="tiny", messages=MESSAGES,
                                                                     max_tokens=64)
    assert "hello through the gateway" in (direct.choices[0].message.content or "")
    assert via.choices[0].message.content == direct.choices[0].message.content
    assert via.choices[0].finish_reason == direct.choices[0].finish_reason == "stop"
    # usage is the upstream's own count, not the gateway's byte estimate
    assert (via.usage.prompt_tokens, via.usage.completion_tokens) == \
        (direct.usage.prompt_tokens, direct.usage.completion_tokens)
    assert via.model == "tiny"  # what the client asked for; llmock was sent UPSTREAM_MODEL

    pieces, finish, usage = _streamed(_sdk(f"http://127.0.0.1:{port}"), "tiny", max_tokens=64)
    assert "".join(pieces) == direct.choices[0].message.content and finish == "stop"
    assert (usage.prompt_tokens, usage.completion_tokens) == \
        (direct.usage.prompt_tokens, direct.usage.completion_tokens)


def test_max_tokens_cuts_an_upstream_that_ignores_it(stack: tuple[Llmock, int]) -> None:
    """llmock sends its whole answer whatever max_tokens says; the gateway stops at 3 tokens
    (3 chunks: llmock gives no per-chunk usage), says ``length`` and charges 3."""
    upstream, port = stack
    direct, _, _ = _streamed(_sdk(upstream.url), UPSTREAM_MODEL, max_tokens=3)
    assert len(direct) > 3  # the upstream does not stop itself
    pieces, finish, usage = _streamed(_sdk(f"http://127.0.0.1:{port}"), "tiny", max_tokens=3)
    assert "".join(pieces) == "".join(direct[:3]) and finish == "length"
    assert usage.completion_tokens == 3


def test_a_request_sent_while_the_upstream_is_down_completes_once_it_is_back(
        stack: tuple[Llmock, int]) -> None:
    upstream, port = stack
    expected = _sdk(upstream.url).chat.completions.create(model=UPSTREAM_MODEL, messages=MESSAGES,
                                                          max_tokens=64).choices[0].message.content
    upstream.kill()
    answer: dict[str, Any] = {}

    def ask() -> None:  # P2: a 60 s max queue wait covers the outage
        try:
            r = _sdk(f"http://127.0.0.1:{port}", "demo-p2").chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=64)
            answer["content"] = r.choices[0].message.content
        except Exception as exc:  # reported below, with what the client saw
            answer["error"] = exc

    client = threading.Thread(target=ask, daemon=True)
    client.start()

    def not_ready() -> bool:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2).close()
            return False
        except urllib.error.HTTPError as exc:
            return exc.code == 503
    # the worker found the upstream unreachable, handed the request back and stopped claiming
    wait_for(not_ready, 60, "/readyz to say not ready while the pool's only worker cannot reach llmock")
    assert client.is_alive() and not answer, answer
    upstream.start()
    client.join(90)
    assert not client.is_alive(), "the request did not complete within 90 s of llmock's restart"
    assert answer.get("content") == expected, answer
