"""Prompt token counts in each pool's own tokens: the pool names its tokenizer.

``[[pools]] tokenizer`` is one of

* ``"bytes"`` (the default): one token per UTF-8 byte plus BOS (:func:`limiter.prompt.count_tokens`),
  the tokenizer of the tiny torch model and of the sim engine;
* the path of a ``tokenizer.json`` (or of a directory holding one, as ``save_pretrained``
  writes it), loaded with the ``tokenizers`` library; a relative path is taken from the
  config file's directory. Chat prompts are counted as the frontend renders them
  (:func:`limiter.prompt.render_chat`): the model's own chat template is not in
  ``tokenizer.json``, so a chat count is an estimate, reconciled with the upstream's
  ``usage`` when the request ends. An earlier answer's thinking that a client sends back
  (a message's ``reasoning``) is not counted: most templates drop it, and counted, it
  refused chats that fit (the context check); the upstream counter sees it where the
  template renders it, and the model server refuses a prompt past its context;
* ``"upstream"``: the model server's ``POST /tokenize`` (vLLM: ``{model, prompt}`` or
  ``{model, messages, add_generation_prompt}`` -> ``{count, tokens, max_model_len}``) at
  ``tokenizer_url`` (default ``[worker] upstream_url``), with the model name the workers send
  (env ``QOS_UPSTREAM_MODEL``, else ``[worker] upstream_model``, else the pool's model). Exact,
  chat template included, at one HTTP round trip per request.

The frontend counts every prompt with it for the admission cost and the context check.
:func:`check` validates a pool's setting at start (every role), so a missing file, an
unreadable tokenizer or an unknown mode is a :class:`ConfigError` naming
``pools[i].tokenizer``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from limiter.errors import ConfigError
from limiter.prompt import ChatMessage, count_tokens

BYTES = "bytes"
UPSTREAM = "upstream"
MODES = (BYTES, UPSTREAM)
FILE_NAME = "tokenizer.json"
CONFIG_FILE_NAME = "tokenizer_config.json"  # beside it (save_pretrained): its special tokens, chat template
TEMPLATE_FILE_NAME = "chat_template.jinja"  # beside it too (newer transformers save the template there)
# Text a loaded tokenizer must encode (words, digits, punctuation, accents, CJK, an emoji).
PROBE_TEXT = "Hello, world! zqxj 0123 caf\u00e9 \u4e2d\u6587 \U0001f600"
THREAD_CHARS = 16_384  # longer prompts are encoded off the event loop
# How long an idle connection to the model server is kept for reuse (here and by the openai
# worker): under the 5 s after which vLLM (uvicorn's timeout_keep_alive) closes one. A POST
# sent on a connection the server is closing fails, and aiohttp retries only idempotent
# methods: a 503 here, a tripped breaker and a spent attempt in the worker.
MODEL_SERVER_KEEPALIVE_S = 3.0


class TokenizerUnavailable(Exception):
    """The upstream's tokenize endpoint could not count a prompt (down, busy, misconfigured)."""


class TokenizerRefused(TokenizerUnavailable):
    """The upstream's tokenize endpoint answered that this prompt cannot be counted (HTTP
    400, 413 or 422: e.g. messages its chat template rejects): the request's fault, and
    retrying it cannot help."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status


# The upstream statuses that refuse the prompt itself. Others (401/403: our API key; 404: no
# such endpoint; 429, 5xx: busy or down) are the deployment's problem, not the request's.
REFUSING_STATUSES = (400, 413, 422)


def tokenizer_file(spec: str, base_dir: str | Path | None = None) -> Path:
    """The ``tokenizer.json`` a path setting names (``spec`` itself, or ``spec/tokenizer.json``)."""
    path = expanded(spec)
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    try:
        is_dir = path.is_dir()
    except OSError:  # a name too long (ENAMETOOLONG), ...: load_file names the field and why
        is_dir = False
    return path / FILE_NAME if is_dir else path


def expanded(spec: str) -> Path:
    """``spec`` as a path, ``~`` expanded; a ``~user`` that names no user stays as written
    (expanduser's RuntimeError was a traceback: the file is then not found, naming the field)."""
    try:
        return Path(spec).expanduser()
    except RuntimeError:
        return Path(spec)


@functools.lru_cache(maxsize=16)
def _load(path: str, mtime_ns: int, size: int) -> Any:
    # mtime_ns and size are unused here on purpose: they are part of the cache key, so a
    # tokenizer.json replaced in place is loaded again instead of served from the cache.
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(path)
    # A tokenizer.json saved while truncation or padding was on keeps it, and the library
    # applies it to every encode: a prompt of any length counted as at most its max_length (a
    # tenant past the context and its quota), or every one as the padded length. transformers
    # (so vLLM) turns both off unless a call asks for them: the whole prompt is counted.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def load_file(path: Path, field: str) -> Any:
    """Load a ``tokenizer.json`` (cached per file version); a ConfigError naming ``field``."""
    try:
        st = path.stat()
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ConfigError(field, f"{str(path)[:200]!r} is neither a tokenizer mode ({', '.join(MODES)}) "
                          f"nor a readable file: {why}") from exc
    try:
        import tokenizers  # noqa: F401
    except ImportError as exc:
        raise ConfigError(field, "a tokenizer.json needs the 'tokenizers' package (pip install tokenizers)") \
            from exc
    try:
        tokenizer = _load(str(path), st.st_mtime_ns, st.st_size)
    except Exception as exc:  # the Rust side raises plain Exceptions for bad JSON and bad models
        raise ConfigError(field, f"cannot load tokenizer {str(path)!r}: {str(exc)[:300]}") from exc
    try:  # one that loads may still fail every prompt (a WordLevel whose unk_token it lacks): now,
        tokenizer.encode(PROBE_TEXT, add_special_tokens=True)  # not as a 500 for each such request
    except Exception as exc:
        raise ConfigError(field, f"tokenizer {str(path)!r} cannot encode text: {str(exc)[:300]}") from exc
    return tokenizer


def check(spec: str, url: str, field: str, worker: Mapping[str, Any], *, read_file: bool = True) -> None:
    """Validate one pool's tokenizer setting (``field`` = ``pools[i].tokenizer``); a file is
    loaded only with ``read_file``."""
    if spec == BYTES:
        if url:
            raise ConfigError(field + "_url", "is only used with tokenizer = \"upstream\"")
        return
    if spec == UPSTREAM:
        where = upstream_url(url, worker)
        if not where.startswith(("http://", "https://")):
            raise ConfigError(field + "_url", "tokenizer = \"upstream\" needs the model server's "
                              "http(s):// URL here (or in [worker] upstream_url)")
        if problem := http_url_problem(where):
            raise ConfigError(field + "_url" if url else "worker.upstream_url", problem)
        return
    if url:
        raise ConfigError(field + "_url", "is only used with tokenizer = \"upstream\"")
    if not spec.strip():
        raise ConfigError(field, f"must be {BYTES!r}, {UPSTREAM!r} or the path of a tokenizer.json")
    if read_file:
        load_file(tokenizer_file(spec), field)


def http_url_problem(url: str) -> str | None:
    """What is wrong with ``url`` as a model server's http(s):// URL, or None: a check of its
    scheme alone passed "http://" (no host), a port that is no number or past 65535, and
    spaces; the worker or frontend then started and failed each request at the server."""
    if not url.startswith(("http://", "https://")):
        return "must start with http:// or https://"
    if any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in url):
        return "must not hold spaces or control characters (percent-encode them)"
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        return "its port must be a number in [1, 65535] (and an IPv6 host in [brackets])"
    if not parts.hostname:
        return "names no host (e.g. http://127.0.0.1:8000)"
    if port == 0:
        return "its port must be a number in [1, 65535]"
    return None


def upstream_url(url: str, worker: Mapping[str, Any]) -> str:
    """Where ``/tokenize`` is served: the pool's ``tokenizer_url``, else the workers' upstream."""
    got = url or str(worker.get("upstream_url") or "")
    base, q, query = got.partition("?")  # a query (a gateway's ?api-key=) stays a query
    return base.rstrip("/").removesuffix("/v1") + q + query


class Counter:
    """Counts a prompt in the pool's tokens."""

    kind = BYTES

    def count_text(self, text: str) -> int:
        return count_tokens(text)

    def max_token_id(self) -> int | None:
        """The largest token id of the model's vocabulary, when this counter knows it (a
        tokenizer.json does; bytes are no model's ids, the model server keeps its own)."""
        return None

    async def count(self, prompt: str, messages: Sequence[ChatMessage] = (),
                    template_kwargs: Mapping[str, Any] | None = None,
                    tools: Sequence[Mapping[str, Any]] = ()) -> int:
        """Tokens of a completion prompt, or of a chat (``messages``; ``prompt`` is its rendering).
        ``template_kwargs``: the request's ``chat_template_kwargs`` for the model server, and
        ``tools`` its tools, which only a counter that applies the model's chat template
        (``/tokenize``) uses: the others count ``prompt``, which renders the tools as JSON."""
        return self.count_text(prompt)

    async def close(self) -> None:
        return None


class FileCounter(Counter):
    kind = "file"

    def __init__(self, tokenizer: Any, config_path: Path | None = None,
                 template_path: Path | None = None) -> None:
        self.tokenizer = tokenizer
        self.config_path = config_path  # the tokenizer_config.json beside it, where there is one
        self.template_path = template_path  # the chat_template.jinja beside it, where there is one
        self._max_id: int | None = None
        self._info: dict[str, Any] | None = None

    def count_text(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def max_token_id(self) -> int | None:
        if self._max_id is None:  # (its added tokens too: a chat template's specials are ids)
            self._max_id = max(self.tokenizer.get_vocab(with_added_tokens=True).values(), default=0)
        return self._max_id

    async def count(self, prompt: str, messages: Sequence[ChatMessage] = (),
                    template_kwargs: Mapping[str, Any] | None = None,
                    tools: Sequence[Mapping[str, Any]] = ()) -> int:
        if len(prompt) > THREAD_CHARS:  # the Rust encoder releases the GIL
            return await asyncio.to_thread(self.count_text, prompt)
        return self.count_text(prompt)

    async def encode(self, text: str, add_special_tokens: bool) -> tuple[list[int], list[str]]:
        """``text``'s token ids and their token strings (vLLM's ``/tokenize``)."""
        def run() -> tuple[list[int], list[str]]:
            enc = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
            return list(enc.ids), list(enc.tokens)

        return await asyncio.to_thread(run) if len(text) > THREAD_CHARS else run()

    async def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids, special tokens kept (vLLM's ``/detokenize``)."""
        def run() -> str:
            return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

        return await asyncio.to_thread(run) if len(ids) > THREAD_CHARS else run()

    def info(self) -> dict[str, Any]:
        """What vLLM's ``GET /tokenizer_info`` answers: the tokenizer's configuration (its
        special tokens, its chat template), read from the ``tokenizer_config.json`` that
        ``save_pretrained`` writes beside ``tokenizer.json``, and the ``chat_template.jinja``
        it writes there (newer transformers: the config then holds none; where both are, the
        file wins, as transformers loads them); only the class without either. Read once, as
        the tokenizer itself is (at start): a config of megabytes was parsed on the event loop
        at every call."""
        if self._info is None:
            self._info = self._read_info()
        return self._info

    def _read_info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        if self.config_path is not None:
            try:
                # (NaN, Infinity: Python's json writes them, no JSON holds them: null here)
                config = json.loads(self.config_path.read_text(encoding="utf-8"), parse_constant=_null)
            except (OSError, ValueError, RecursionError):
                config = None
            if isinstance(config, dict):
                for key, value in config.items():
                    if key == "added_tokens_decoder":
                        continue  # (the vocabulary's added tokens: the tokenizer.json has them)
                    out[key] = _added_tokens_as_text(value, key.endswith(("_token", "_tokens")))
        if self.template_path is not None:
            try:
                out["chat_template"] = self.template_path.read_text(encoding="utf-8")
            except (OSError, ValueError):
                pass
        return out


def _added_tokens_as_text(value: Any, special: bool) -> Any:
    """A saved AddedToken (``{"__type": "AddedToken", "content": ...}`` anywhere; an object with
    a ``content`` under a special token's key) as its text, as vLLM answers the AddedToken
    objects transformers loads them as; the rest as it is."""
    if isinstance(value, list):
        return [_added_tokens_as_text(v, special) for v in value]
    if isinstance(value, dict):
        if isinstance(value.get("content"), str) and (special or value.get("__type") == "AddedToken"):
            return value["content"]
        return {k: _added_tokens_as_text(v, special) for k, v in value.items()}
    return value


class UpstreamCounter(Counter):
    """vLLM's ``POST /tokenize``; raises :class:`TokenizerUnavailable` when it cannot answer,
    :class:`TokenizerRefused` when it refuses the prompt."""

    kind = UPSTREAM

    def __init__(self, base_url: str, model: str, timeout_s: float = 5.0, api_key: str = "") -> None:
        self.base_url = base_url
        self.url = self.url_of("/tokenize")
        self.model = model
        self.timeout_s = timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: Any = None

    async def count(self, prompt: str, messages: Sequence[ChatMessage] = (),
                    template_kwargs: Mapping[str, Any] | None = None,
                    tools: Sequence[Mapping[str, Any]] = ()) -> int:
        import aiohttp

        session = self._open()
        body: dict[str, Any] = {"model": self.model}
        if messages:
            body.update(messages=[m.to_dict() for m in messages], add_generation_prompt=True)
            if isinstance(template_kwargs, Mapping) and template_kwargs:  # the template served with
                body["chat_template_kwargs"] = dict(template_kwargs)
            if tools:  # vLLM's template renders them into the prompt (its /tokenize takes them)
                body["tools"] = list(tools)
        else:
            body["prompt"] = prompt
        try:
            # (no redirects followed: see worker/upstream.py REDIRECT_ADVICE; a 3xx is a 503 here)
            async with session.post(self.url, json=body, headers=self.headers,
                                    allow_redirects=False) as resp:
                if resp.status != 200:
                    text = (await read_bounded(resp))[:200]
                    if resp.status in REFUSING_STATUSES:
                        raise TokenizerRefused(resp.status, text)
                    raise TokenizerUnavailable(f"HTTP {resp.status}: {text}")
                data = json.loads(await read_bounded(resp))
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise TokenizerUnavailable(f"{type(exc).__name__}: {exc}") from exc
        n = data.get("count") if isinstance(data, dict) else None
        if isinstance(n, list) and len(n) == 1:  # some servers answer [n]
            n = n[0]
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise TokenizerUnavailable(f"no token count in the answer: {str(data)[:200]}")
        return n

    def url_of(self, path: str) -> str:
        """The model server's ``path``, before the URL's query: appended to the whole URL,
        "/tokenize" went into a query such as a gateway's ?api-key= and the count was asked of
        the wrong path."""
        base, q, query = self.base_url.partition("?")
        return base + path + q + query

    def _open(self) -> Any:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                connector=aiohttp.TCPConnector(keepalive_timeout=MODEL_SERVER_KEEPALIVE_S))
        return self._session

    async def relay(self, path: str, body: Mapping[str, Any] | None) -> tuple[int, Any]:
        """(status, JSON, or the start of a body that is none) of the model server's ``path``
        (``/tokenize``, ``/detokenize``: a POST of ``body`` with its ``model`` the served name;
        ``/tokenizer_info``: a GET for None). :class:`TokenizerUnavailable` when it cannot be
        asked."""
        import aiohttp

        url = self.url_of(path)
        session = self._open()
        try:
            if body is None:
                call = session.get(url, headers=self.headers, allow_redirects=False)
            else:
                call = session.post(url, json={**body, "model": self.model}, headers=self.headers,
                                    allow_redirects=False)
            async with call as resp:
                text = await read_bounded(resp)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise TokenizerUnavailable(f"{type(exc).__name__}: {exc}") from exc
        try:  # (an error's body may be any text: a plain "404: Not Found")
            return resp.status, json.loads(text, parse_constant=_null)
        except ValueError:
            return resp.status, text[:300]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


# The most of a model server's tokenizer answer read: a 1 MiB body's tokens with their texts
# are ~20 MiB of JSON. A broken server or proxy sending without end was read whole, held in
# the frontend's memory (each tokenizer call, and each prompt counted, one at a time).
MAX_ANSWER_BYTES = 64 << 20


async def read_bounded(resp: Any, limit: int | None = None) -> str:
    """``resp``'s body as text (UTF-8, bad bytes replaced), :class:`TokenizerUnavailable` past
    ``limit`` bytes (default ``MAX_ANSWER_BYTES``)."""
    limit = MAX_ANSWER_BYTES if limit is None else limit
    chunks, size = [], 0
    async for chunk in resp.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > limit:
            raise TokenizerUnavailable(f"its answer passed {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


def _null(_constant: str) -> None:
    return None


def counter_for(spec: str, url: str, worker: Mapping[str, Any], pool_model: str,
                env: Mapping[str, str] | None = None, timeout_s: float = 5.0) -> Counter:
    """The counter a validated pool setting names."""
    env = os.environ if env is None else env
    if spec == BYTES:
        return Counter()
    if spec == UPSTREAM:
        # the name the workers send (worker/cli.py: the env over the config), so the count is
        # of the model that serves: the config first counted with one model, served another
        model = str(env.get("QOS_UPSTREAM_MODEL") or worker.get("upstream_model") or pool_model)
        key = env.get("QOS_UPSTREAM_API_KEY", "")
        return UpstreamCounter(upstream_url(url, worker), model, timeout_s, key)
    path = tokenizer_file(spec)
    config, template = path.with_name(CONFIG_FILE_NAME), path.with_name(TEMPLATE_FILE_NAME)
    return FileCounter(load_file(path, "tokenizer"), config if config.is_file() else None,
                       template if template.is_file() else None)

