"""The headers the OpenAI Python SDK 3.63.0 sends (LangChain and LiteLLM's openai/ provider
send through it), as captured on Python 3.11.7 for the replay tests of the clients people use
(tests/test_*_clients.py): its async client's, before the per-call ones (retry count, read
timeout, helper method, raw response) each test adds as it captured them."""

from __future__ import annotations

OPENAI_SDK = {"Accept-Encoding": "gzip, deflate", "Connection": "keep-alive", "Accept": "application/json",
              "Content-Type": "application/json", "User-Agent": "AsyncOpenAI/Python 3.63.0",
              "x-stainless-lang": "python", "x-stainless-package-version": "3.63.0",
              "x-stainless-os": "Linux", "x-stainless-arch": "x64", "x-stainless-runtime": "CPython",
              "x-stainless-runtime-version": "3.11.7", "x-stainless-async": "async:asyncio"}
# The same SDK's sync client (OpenAI, not AsyncOpenAI)
OPENAI_SDK_SYNC = {**OPENAI_SDK, "User-Agent": "OpenAI/Python 3.63.0", "x-stainless-async": "false"}
