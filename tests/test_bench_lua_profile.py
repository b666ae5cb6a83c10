"""`qos bench lua-profile`: the cut copies of a script, and a tiny real run (structure only,
never speed)."""

from __future__ import annotations

import shutil

import pytest

from limiter.bench import callgrind
from limiter.bench import lua_profile as lp
from limiter.cli import build_parser
from limiter.scripts import lua_dir
from tests.support.helpers import admit, dump_all


def test_every_cut_line_is_in_its_script_once(tmp_path) -> None:
    """A script edited under a cut line refuses the profile by name, instead of cutting
    somewhere else (or nowhere)."""
    for script, lines in lp.CUTS.items():
        copies = lp.cut_copies(script, tmp_path / script)
        assert list(copies) == [line.strip() for line in lines] + [lp.WHOLE]
        for line, copy in zip(lines, copies.values(), strict=False):
            text = (copy / f"{script}.lua").read_text()
            assert text.count(lp.CUT_REPLY) == 1 and f"{lp.CUT_REPLY}\n{line}\n" in text
    edited = tmp_path / "edited"
    shutil.copytree(lua_dir(), edited)
    (edited / "admit.lua").write_text((edited / "admit.lua").read_text().replace(
        "  local p = load_policy(K_POLICY)\n", "  local policy = load_policy(K_POLICY)\n"))
    with pytest.raises(ValueError, match=r"admit\.lua does not hold the line 'local p = load_policy"):
        lp.cut_copies("admit", tmp_path / "again", edited)
    with pytest.raises(ValueError, match="no cuts for 'release'"):
        lp.cut_copies("release", tmp_path / "none")


async def test_a_cut_copy_returns_at_its_cut_and_writes_nothing_before_it(tmp_path, aredis, pool,
                                                                          sync_redis) -> None:
    copies = lp.cut_copies("admit", tmp_path)
    cut = lp._CutScripts(aredis, lua=copies["local key = P_REQUEST .. r.id"])
    before = dump_all(sync_redis)
    with pytest.raises(lp._Cut):
        await admit(cut, pool, request_id="cut-1")
    assert dump_all(sync_redis) == before
    whole = lp._CutScripts(aredis, lua=copies[lp.WHOLE])
    assert (await admit(whole, pool, request_id="whole-1")).depth == 1


@pytest.mark.parametrize(("script", "rounds"),
                         [("admit", 2), ("claim", 1), ("complete", 1), ("push_tokens", 1)])
async def test_tiny_run(script: str, rounds: int) -> None:
    assert sorted(lp.CUTS) == ["admit", "claim", "complete", "push_tokens"]
    segments = await lp.profile(script, requests=8, rounds=rounds)
    assert [s.until for s in segments] == [line.strip() for line in lp.CUTS[script]] + [lp.WHOLE]
    for s in segments:
        assert len(s.rounds) == rounds and s.best == min(s.rounds) > 0, s
    assert segments[0].added == segments[0].best
    assert sum(s.added for s in segments) == pytest.approx(segments[-1].best)


def test_cli_parses_and_refuses_bad_figures() -> None:
    parse = build_parser().parse_args
    args = parse(["bench", "lua-profile", "--script", "admit", "complete", "--rounds", "2"])
    assert args.script == ["admit", "complete"] and args.rounds == 2 and args.requests == lp.DEFAULT_REQUESTS
    assert args.func(parse(["bench", "lua-profile", "--requests", "12"])) == 2
    assert args.func(parse(["bench", "lua-profile", "--rounds", "0"])) == 2
    with pytest.raises(SystemExit):
        parse(["bench", "lua-profile", "--script", "release"])


@pytest.mark.skipif(callgrind.missing() is not None, reason=f"no valgrind: {callgrind.missing()}")
async def test_instructions_are_counted_for_every_cut() -> None:
    """--instructions: every cut's instructions per call, the pieces adding up to the whole
    script's; the fixed part (before the argument checks) is well under the whole push of 8
    requests (~15 % of it)."""
    # 64 requests, 8 calls a cut: Lua's GC step (~1M instructions every 50 script calls, counted
    # in whichever call it falls) would be half a call's count with 2 calls a cut
    segments = await lp.profile("push_tokens", requests=64, rounds=1, instructions=True)
    assert [s.until for s in segments] == [line.strip() for line in lp.CUTS["push_tokens"]] + [lp.WHOLE]
    assert all(s.best_instructions and s.best_instructions > 0 for s in segments), segments
    assert sum(s.added_instructions or 0 for s in segments) == pytest.approx(segments[-1].best_instructions)
    assert segments[0].best_instructions < 0.5 * segments[-1].best_instructions
    lp.render("push_tokens", segments)


async def test_instructions_are_refused_with_a_server_given() -> None:
    with pytest.raises(ValueError, match="private server"):
        await lp.profile("admit", requests=8, redis_url="redis://127.0.0.1:1/0", instructions=True)
