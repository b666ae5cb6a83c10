"""limiter/event_loop.py: QOS_EVENT_LOOP picks the roles' event loop; a bad value is refused."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator

import pytest

from limiter.errors import ConfigError
from limiter.event_loop import install_event_loop


@pytest.fixture(autouse=True)
def default_policy() -> Iterator[None]:
    yield
    asyncio.set_event_loop_policy(None)


def test_auto_and_uvloop_use_uvloop_where_it_is_installed() -> None:
    uvloop = pytest.importorskip("uvloop")
    assert install_event_loop({}) == "uvloop"
    assert isinstance(asyncio.get_event_loop_policy(), uvloop.EventLoopPolicy)
    asyncio.set_event_loop_policy(None)
    assert install_event_loop({"QOS_EVENT_LOOP": "UVLOOP"}) == "uvloop"


def test_asyncio_keeps_the_standard_loop() -> None:
    assert install_event_loop({"QOS_EVENT_LOOP": "asyncio"}) == "asyncio"
    assert type(asyncio.get_event_loop_policy()).__module__.startswith("asyncio")


@pytest.mark.parametrize("value", ["tokio", "uv loop", "1"])
def test_a_bad_value_is_refused_by_name_and_changes_nothing(value: str) -> None:
    before = asyncio.get_event_loop_policy()
    with pytest.raises(ConfigError, match=r"QOS_EVENT_LOOP.*auto, uvloop, asyncio"):
        install_event_loop({"QOS_EVENT_LOOP": value})
    assert asyncio.get_event_loop_policy() is before


def test_a_role_refuses_a_bad_value_before_it_starts() -> None:
    """The process exits 2 with the variable named, as for any config error."""
    r = subprocess.run([sys.executable, "-m", "limiter.cli", "controller"], capture_output=True, text=True,
                       timeout=60, env={"QOS_EVENT_LOOP": "tokio", "PATH": "/usr/bin:/bin",
                                        "QOS_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert r.returncode == 2, r.stderr
    assert "QOS_EVENT_LOOP" in r.stderr and "tokio" in r.stderr
