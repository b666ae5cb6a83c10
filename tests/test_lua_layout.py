"""The Lua layer's structure: includes resolved by the loader, `#!lua` flags, and the proof
that every key any script touches is in its pool's slot."""

from __future__ import annotations

import re
from pathlib import Path

import fakeredis
import pytest
import redis

from limiter.config import demo_config
from limiter.errors import ScriptError
from limiter.keys import PoolKeys
from limiter.scripts import SCRIPT_NAMES, Scripts, load_script, lua_dir, policy_document, script_source
from tests.support.helpers import admit, script_command_args


def _lua_tree(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "include").mkdir()
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def test_includes_resolve_recursively_dependencies_first(tmp_path):
    lua = _lua_tree(tmp_path, {
        "top.lua": "--!flags allow-oom\n--!include c.lua\nreturn 1\n",
        "include/c.lua": "--!include b.lua\n-- c\n",
        "include/b.lua": "--!include a.lua\n-- b\n",
        "include/a.lua": "-- a\n",
    })
    src = load_script("top", lua)
    assert src.splitlines()[0] == "#!lua flags=allow-oom"
    assert src.index("-- a") < src.index("-- b") < src.index("-- c") < src.index("return 1")
    assert "--!include" not in src
    assert load_script("top", lua, shebang=False).startswith("--!flags")


def test_each_include_is_pasted_once_per_script(tmp_path):
    """A diamond (top needs b and c, both need a) and a repeat: a comes once, first."""
    lua = _lua_tree(tmp_path, {
        "top.lua": "--!include b.lua\n--!include c.lua\n--!include a.lua\nreturn 1\n",
        "other.lua": "--!include a.lua\nreturn 2\n",
        "include/a.lua": "-- a\n",
        "include/b.lua": "--!include a.lua\n-- b\n",
        "include/c.lua": "--!include a.lua\n--!include b.lua\n-- c\n",
    })
    src = load_script("top", lua)
    assert [src.count(f"-- {x}") for x in "abc"] == [1, 1, 1]
    assert src.index("-- a") < src.index("-- b") < src.index("-- c")
    assert load_script("other", lua).count("-- a") == 1  # once per script, not once ever


def test_helpers_no_one_calls_are_left_out_of_the_script(tmp_path):
    """An include brings every helper of its file; the script Redis runs keeps those it
    calls, those they call, and nothing else (each helper left in is a closure made on
    every call)."""
    lua = _lua_tree(tmp_path, {
        "top.lua": "--!include h.lua\nlocal function main()\n  return used(1)\nend\nreturn main()\n",
        "include/h.lua": ("local function inner(x)\n  return x + 1\nend\n\n"
                          "local function used(x)\n  return inner(x)\nend\n\n"
                          "local function only_for_dead(x)\n  return x\nend\n\n"
                          "local function dead(x)\n  return only_for_dead(x)\nend\n\n"
                          "local function recursive(n)\n  if n > 0 then return recursive(n - 1) end\nend\n"
                          "-- named in a comment: mentioned(), so kept\n"
                          "local function mentioned()\n  return 0\nend\n"),
    })
    src = load_script("top", lua)
    names = re.findall(r"^local function (\w+)", src, re.MULTILINE)
    # a self-call counts as a use (a conservative rule: it only ever keeps too much)
    assert names == ["inner", "used", "recursive", "mentioned", "main"]
    assert "only_for_dead" not in src and "dead(" not in src


def test_every_top_level_helper_ends_with_an_end_at_column_0():
    """The layout drop_unused_helpers relies on to cut a helper out whole: a top-level
    `local function` runs to the first line that is `end`, with nothing but indented lines,
    blank lines and comments before it."""
    for path in sorted(lua_dir().rglob("*.lua")):
        text = path.read_text()
        # a long string or comment could hold a column-0 `end` or `local function` line
        assert "[[" not in text and "[=" not in text, f"{path.name}: a long string or comment"
        lines = text.split("\n")
        for i, line in enumerate(lines):
            if not line.startswith("local function"):
                continue
            j = i + 1
            while j < len(lines) and lines[j] != "end":
                assert not lines[j] or lines[j][0].isspace() or lines[j].startswith("--"), \
                    f"{path.name}:{j + 1}: a column-0 line inside the helper of line {i + 1}"
                j += 1
            assert j < len(lines), f"{path.name}:{i + 1}: its helper has no column-0 end"


def test_an_include_cycle_is_refused_naming_the_chain(tmp_path):
    lua = _lua_tree(tmp_path, {
        "cyclic.lua": "--!include x.lua\n", "include/x.lua": "--!include y.lua\n",
        "include/y.lua": "--!include x.lua\n",
        "selfish.lua": "--!include s.lua\n", "include/s.lua": "--!include s.lua\n",
    })
    with pytest.raises(ScriptError, match=r"cycle: cyclic -> x\.lua -> y\.lua -> x\.lua"):
        load_script("cyclic", lua)
    with pytest.raises(ScriptError, match=r"cycle: selfish -> s\.lua -> s\.lua"):
        load_script("selfish", lua)


def test_an_unknown_include_or_flag_is_refused(tmp_path):
    lua = _lua_tree(tmp_path, {
        "missing.lua": "--!include a.lua\n", "include/a.lua": "--!include nowhere.lua\n",
        "flagged.lua": "--!flags no-such-flag\nreturn 1\n",
    })
    with pytest.raises(ScriptError, match=r"a\.lua: --!include nowhere\.lua: no such file"):
        load_script("missing", lua)
    with pytest.raises(ScriptError, match="unknown --!flags value 'no-such-flag'"):
        load_script("flagged", lua)


# --- the real tree: each file names exactly what it uses --------------------------------
_INCLUDE_LINE = re.compile(r"^--!include (\S+)\s*$", re.MULTILINE)
_TOP_LOCAL = re.compile(r"^local (?:function )?([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)", re.MULTILINE)
# comments and string literals, matched left to right so an apostrophe in a comment is no string
_NOT_CODE = re.compile(r"--[^\n]*|'(?:\\.|[^'\\\n])*'|\"(?:\\.|[^\"\\\n])*\"")


def _code(text: str) -> str:
    return _NOT_CODE.sub(lambda m: "" if m.group(0).startswith("--") else "''", text)


def _top_level_names(text: str) -> set[str]:
    return {n.strip() for m in _TOP_LOCAL.finditer(_code(text)) for n in m.group(1).split(",")}


def _used_names(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w.:])([A-Za-z_]\w*)", _code(text)))  # not fields (r.id, p:x)


def test_every_lua_file_includes_exactly_the_helpers_it_uses():
    """Each script and include lists the include files defining the names it uses itself, no
    more (a stale include) and no fewer (one it only gets through another's includes)."""
    base = lua_dir()
    includes = {p.name: p.read_text() for p in sorted((base / "include").glob("*.lua"))}
    defined_in: dict[str, set[str]] = {}
    for name, text in includes.items():
        if name == "main.lua":  # the trailer every script ends with, no helper
            continue
        for n in _top_level_names(text):
            defined_in.setdefault(n, set()).add(name)
    assert not {n: f for n, f in defined_in.items() if len(f) > 1}, "a name defined in two includes"
    files = {f"include/{n}": t for n, t in includes.items()} | {
        p.name: p.read_text() for p in sorted(base.glob("*.lua"))}
    wrong = {}
    for rel, text in files.items():
        own = _top_level_names(text)
        needed = {f for n in _used_names(text) - own for f in defined_in.get(n, ())} - {Path(rel).name}
        listed = set(_INCLUDE_LINE.findall(text)) - {"main.lua"}
        if needed != listed:
            wrong[rel] = {"missing": sorted(needed - listed), "unused": sorted(listed - needed)}
    assert not wrong, wrong


def test_every_include_opens_with_what_it_holds_and_serves_a_script():
    base = lua_dir()
    pasted = "".join(script_source(n, shebang=False) for n in SCRIPT_NAMES)
    for path in sorted((base / "include").glob("*.lua")):
        text = path.read_text()
        assert text.startswith("-- "), f"{path.name}: no opening comment"
        assert text.splitlines()[0] in pasted, f"{path.name}: no script includes it"


def test_every_script_carries_a_shebang_and_only_terminal_ones_may_run_out_of_memory():
    for name in SCRIPT_NAMES:
        first = script_source(name).splitlines()[0]
        assert first.startswith("#!lua"), name
        oom = name in ("complete", "cancel_request", "release", "reap_expired")
        assert (first == "#!lua flags=allow-oom") == oom, (name, first)


async def test_a_server_without_shebang_support_gets_the_plain_scripts():
    """The embedded fakeredis of `qos up` (and Redis < 7) cannot parse `#!lua`."""
    client = fakeredis.FakeAsyncRedis()
    s = Scripts(client)
    await s.load_all()
    assert s.shebang is False
    cfg = demo_config()
    keys = PoolKeys("tiny")
    assert await s.init_pool(keys, policy_document(cfg, cfg.pool("tiny"))) == 0
    s2 = Scripts(client)  # and without load_all: the first call switches over
    assert await s2.init_pool(keys, policy_document(cfg, cfg.pool("tiny"))) == 0
    assert s2.shebang is False


async def test_every_key_every_script_touches_is_in_the_pools_slot(redis_server, scripts, pool, sync_redis):
    """MONITOR shows each command a script runs inside Redis: every key is the pool's."""

    async def run() -> None:
        cfg = demo_config()
        await scripts.init_pool(pool, policy_document(cfg, cfg.pool("tiny")))
        fence, _holder = await scripts.acquire_leader(pool, "ctl", 5000)
        await scripts.set_rates(pool, "ctl", fence, {"why": "test"}, {"P2.ceil": 100.0, "capacity": 20000.0})
        await admit(scripts, pool, cls="P1", request_id="late", max_wait_ms=1, input_tokens=5, max_tokens=5)
        for i, cls in enumerate(("P0", "P1", "P2", "P2")):
            await admit(scripts, pool, cls=cls, request_id=f"m{i}", tenant=f"t{i % 2}", input_tokens=5,
                        max_tokens=5)
        got = await scripts.claim(pool, "w1", 3, kv_room=1000, kv_total=1000)
        a, b, c = got.requests
        await scripts.renew_leases(pool, "w1", [(x.request_id, x.fence) for x in got.requests])
        await scripts.push_tokens(pool, request_id=a.request_id, worker_id="w1", fence=a.fence, offset=0,
                                  token_ids=[1], text="a")
        await scripts.complete(pool, request_id=a.request_id, worker_id="w1", fence=a.fence, outcome="ok",
                               usage_in=5, token_ids=[2], text="b", sample=b"\x80")
        await scripts.release(pool, request_id=b.request_id, worker_id="w1", fence=b.fence)
        await scripts.cancel(pool, c.request_id, c.tenant)
        await scripts.cancel(pool, "m3", "t1")
        await scripts.reap(pool)
        await scripts.release_leader(pool, "ctl", fence)

    seen = await script_command_args(redis_server, run)
    commands = {args[0].lower() for args in seen}
    assert {"hset", "zadd", "xadd", "hincrbyfloat", "zrange", "pexpire", "lpush"} <= commands  # it saw them
    outside = [(args, key) for args in {tuple(a) for a in seen}
               for key in _keys_of(sync_redis, list(args)) if not key.startswith(pool.base)]
    assert not outside, f"keys outside {pool.base}: {outside[:5]}"


def _keys_of(client: redis.Redis, args: list[str]) -> list[str]:
    """Every key a command names, as Redis itself reads its arguments (``COMMAND GETKEYS``):
    all of them, not the first (``DEL a b``, ``ZUNIONSTORE d 2 a b``, ``LMOVE a b``)."""
    if len(args) == 1:  # TIME: no arguments, no key (GETKEYS refuses the question)
        return []
    try:
        return [k.decode() if isinstance(k, bytes) else k for k in client.command_getkeys(*args)]
    except redis.ResponseError as exc:
        if "no key arguments" in str(exc):
            return []
        raise AssertionError(f"Redis could not read the keys of {args[:4]}: {exc}") from exc


def test_a_key_outside_the_slot_is_refused_on_a_cluster(redis_cluster):
    """With `#!lua` and no allow-cross-slot-keys flag, Redis refuses a script that strays."""
    node = redis_cluster.nodes[0].client()
    key = "qos:{x}:policy"
    slot_node = redis.RedisCluster.from_url(redis_cluster.url).get_node_from_key(key)
    target = redis.Redis(host=slot_node.host, port=slot_node.port)
    with pytest.raises(redis.ResponseError, match="do not hash to the same slot"):
        target.eval("#!lua\nredis.call('GET', KEYS[1]); return redis.call('GET', 'qos:{y}:policy')", 1, key)
    node.close()
    target.close()


def test_every_script_header_states_its_contract():
    """The comment a script opens with names its KEYS, every ARGV it reads, its return shape
    and its errors."""
    for name in SCRIPT_NAMES:
        text = (lua_dir() / f"{name}.lua").read_text()
        header = text[:text.index("\n\n")]
        for word in ("KEYS", "ARGV", "Returns", "Errors"):
            assert word in header, (name, word)
        for kind in ("ARGV", "KEYS"):
            read = set(re.findall(rf"\b{kind}\[(\d+)\]", _code(text)))
            stated = set(re.findall(rf"\b{kind}\[(\d+)\]", header))
            if kind == "KEYS" and "lifecycle key list" in header:
                stated = read  # KEYS is include/pool_keys.lua's list
            assert read <= stated, (name, kind, sorted(read - stated))


def test_an_error_after_a_write_still_writes_back_the_bucket_cache(tmp_path, sync_redis):
    """Buckets are cached during a call and written back when main() ends. Redis keeps the
    writes a script made before a runtime error: the buckets' must be kept too, or a record
    says a refund was given that no bucket ever got (a janitor pass that failed halfway)."""
    (tmp_path / "include").symlink_to(lua_dir() / "include")
    (tmp_path / "fail_after_refund.lua").write_text(
        "--!include validate.lua\n--!include bucket.lua\n"
        "local function main()\n"
        "  local b = bucket_get(KEYS[1], 0, 1000, 0)\n"  # new: full (1000), no refill
        "  bucket_debit(b, 30, nil)\n"
        "  bucket_credit(b, 20)\n"
        "  redis.call('HSET', KEYS[2], 'refunded', 20)\n"  # the record's side, written at once
        "  redis.call('HGET', KEYS[2], 'refunded', 'extra')\n"  # a runtime error (wrong arity)
        "end\n--!include main.lua\n")
    src = load_script("fail_after_refund", tmp_path, shebang=False)
    with pytest.raises(redis.ResponseError):
        sync_redis.eval(src, 2, "qos:{t}:bucket:x", "qos:{t}:req:x")
    assert sync_redis.hget("qos:{t}:req:x", "refunded") == b"20"
    bucket = {k.decode(): float(v) for k, v in sync_redis.hgetall("qos:{t}:bucket:x").items()}
    assert bucket["debited"] == 30 and bucket["refunded"] == 20 and bucket["tokens"] == 990
