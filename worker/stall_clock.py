"""The hang watch's clock (worker/upstream.py, ``upstream_stall_s``): how long a model
server has sent no event on any of its open streams. Pure: the caller passes the time.

A server whose engine hangs keeps its sockets open and may still answer ``/health``; only
its silence tells. A healthy server under load always streams some request's tokens, so
the silence is the server's, not a stream's: one stream in a long prefill beside others
streaming is a busy server. The rules, each from a fault found by a review:

* A spell with no stream open is no silence (an idle worker's next request gets the whole
  of ``stall_s`` before its first token) -- but it does not reset what the streams met
  before it: streams whose clients gave up before ``stall_s``, one after another on a hung
  server, still add up.
* Unless that spell outlasts ``stall_s``: an old cancel's silence, carried for hours, made
  the next long prefill on a healthy server look like a hang.
* Only an event on a stream ends the silence: an HTTP error does not (vLLM's API server
  refuses a prompt past the context with a 400 while its engine hangs).
* The streams open are keyed by request id, each with its attempt: an old attempt ending
  late does not take a newer attempt of the same request off the watch.
"""

from __future__ import annotations

from typing import Any


class StallClock:
    def __init__(self, stall_s: float, now: float) -> None:
        self.stall_s = stall_s  # 0: not watched
        self.streaming: dict[str, Any] = {}  # request id -> its attempt streaming now
        self._heard = now  # the last event, or where the silence counts from
        self._silent_s = 0.0  # the silence the streams met, carried over a spell with none open
        self._idle_since = now

    def opened(self, request_id: str, attempt: Any, now: float) -> None:
        if not self.streaming:
            carried = self._silent_s if now - self._idle_since <= self.stall_s else 0.0
            self._heard = now - carried
        self.streaming[request_id] = attempt

    def closed(self, request_id: str, attempt: Any, now: float) -> None:
        if self.streaming.get(request_id) is not attempt:
            return  # a newer attempt's stream: not this one's to end
        del self.streaming[request_id]
        if not self.streaming:
            self._idle_since = now
            self._silent_s = now - self._heard

    def heard(self, now: float) -> None:
        """An event on a stream (or a probe's generation): the server is not silent."""
        self._heard, self._silent_s = now, 0.0

    def silent_s(self, now: float) -> float:
        return now - self._heard

    def stalled(self, now: float) -> list[str]:
        """The streams to hand back when the server has been silent past ``stall_s`` (the
        clock then starts again), else none."""
        if not self.stall_s or not self.streaming or self.silent_s(now) <= self.stall_s:
            return []
        self.heard(now)
        return list(self.streaming)
