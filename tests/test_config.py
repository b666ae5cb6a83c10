"""Config loading: every kind of mistake names its field path; env overrides; demo config."""

from __future__ import annotations

import dataclasses
import io

import pytest

from limiter import config
from limiter.errors import ConfigError

BASE = """
[redis]
url = "redis://127.0.0.1:6390/0"

[[classes]]
name = "P0"
share = 0.6
floor = 0.0
max_wait_ms = 2000

[[classes]]
name = "P1"
share = 0.4
floor = 0.3

[[pools]]
name = "llama"
context_tokens = 8192

[[tenants]]
name = "acme"
key_sha256 = ["KEYHASH"]
default_class = "P1"
max_class = "P0"
""".replace("KEYHASH", config.hash_key("secret"))


def _load(tmp_path, text, env=None):
    p = tmp_path / "qos.toml"
    p.write_text(text)
    return config.load(p, env or {})


def test_a_valid_file_loads(tmp_path):
    cfg = _load(tmp_path, BASE)
    assert cfg.class_names() == ["P0", "P1"]
    assert cfg.pool("llama").context_tokens == 8192
    assert cfg.tenants[0].max_class == "P0"
    assert not cfg.demo


@pytest.mark.parametrize(("edit", "path"), [
    (("share = 0.4", "share = 1.4"), "classes[1].share"),
    (("share = 0.4", "share = 0.5"), "classes"),  # shares add up past 1
    (("floor = 0.3", "floor = \"high\""), "classes[1].floor"),
    (("floor = 0.3", "floor = 0.3\nstream_flush_ms = 0"), "classes[1].stream_flush_ms"),
    (("floor = 0.3", "floor = 0.3\nstream_flush_ms = 20000"), "classes[1].stream_flush_ms"),
    # a TTFT allowance per prompt token: negative, past a minute per 1,000 tokens, not a
    # number, or without the base target it adds to
    (("floor = 0.3", "floor = 0.3\nslo_ttft_ms = 500\nslo_ttft_ms_per_1k_prompt_tokens = -1"),
     "classes[1].slo_ttft_ms_per_1k_prompt_tokens"),
    (("floor = 0.3", "floor = 0.3\nslo_ttft_ms = 500\nslo_ttft_ms_per_1k_prompt_tokens = 60001"),
     "classes[1].slo_ttft_ms_per_1k_prompt_tokens"),
    (("floor = 0.3", "floor = 0.3\nslo_ttft_ms = 500\nslo_ttft_ms_per_1k_prompt_tokens = nan"),
     "classes[1].slo_ttft_ms_per_1k_prompt_tokens"),
    (("floor = 0.3", "floor = 0.3\nslo_ttft_ms_per_1k_prompt_tokens = 100"),
     "classes[1].slo_ttft_ms_per_1k_prompt_tokens"),
    # the prompt the base target covers: negative, past any context, or with no allowance
    (("floor = 0.3", "floor = 0.3\nslo_ttft_ms = 500\nslo_ttft_ms_per_1k_prompt_tokens = 100\n"
      "slo_ttft_base_prompt_tokens = -1"), "classes[1].slo_ttft_base_prompt_tokens"),
    (("floor = 0.3", "floor = 0.3\nslo_ttft_ms = 500\nslo_ttft_ms_per_1k_prompt_tokens = 100\n"
      "slo_ttft_base_prompt_tokens = 10000001"), "classes[1].slo_ttft_base_prompt_tokens"),
    (("floor = 0.3", "floor = 0.3\nslo_ttft_ms = 500\nslo_ttft_ms_per_1k_prompt_tokens = 100\n"
      "slo_ttft_base_prompt_tokens = 1.5"), "classes[1].slo_ttft_base_prompt_tokens"),
    (("floor = 0.3", "floor = 0.3\nslo_ttft_ms = 500\nslo_ttft_base_prompt_tokens = 1000"),
     "classes[1].slo_ttft_base_prompt_tokens"),
    # fields passed to the model server: one the service sets itself, not a field's name, twice
    (("context_tokens = 8192", 'context_tokens = 8192\nupstream_fields = ["top_k", "max_tokens"]'),
     "pools[0].upstream_fields[1]"),
    (("context_tokens = 8192", 'context_tokens = 8192\nupstream_fields = ["priority"]'),
     "pools[0].upstream_fields[0]"),
    (("context_tokens = 8192", 'context_tokens = 8192\ntool_calls = "yes"'), "pools[0].tool_calls"),
    (("context_tokens = 8192", 'context_tokens = 8192\nlogprobs = 5'), "pools[0].logprobs"),
    (("context_tokens = 8192", 'context_tokens = 8192\nmax_logprobs = 21'), "pools[0].max_logprobs"),
    (("context_tokens = 8192", 'context_tokens = 8192\nmax_logprobs = -1'), "pools[0].max_logprobs"),
    # vLLM's that carry a prompt or a template nobody counts, or reach past the request
    *[(("context_tokens = 8192", f'context_tokens = 8192\nupstream_fields = ["{name}"]'),
       "pools[0].upstream_fields[0]")
      for name in ("chat_template", "documents", "prompt_embeds", "kv_transfer_params", "vllm_xargs")],
    (("context_tokens = 8192", 'context_tokens = 8192\nupstream_fields = ["top-k"]'),
     "pools[0].upstream_fields[0]"),
    (("context_tokens = 8192", 'context_tokens = 8192\nupstream_fields = ["top_k", "top_k"]'),
     "pools[0].upstream_fields[1]"),
    (("context_tokens = 8192", 'context_tokens = 8192\nupstream_fields = "top_k"'),
     "pools[0].upstream_fields"),
    # an infinite target is no target, which is said by leaving it out
    (("floor = 0.3", "floor = 0.3\nslo_ttft_ms = inf"), "classes[1].slo_ttft_ms"),
    (("floor = 0.3", "floor = 0.3\nslo_tpot_ms = nan"), "classes[1].slo_tpot_ms"),
    # an integer past any float was an OverflowError out of the loader, not a named field
    (("floor = 0.3", "floor = 0.3\nslo_ttft_ms = 500\nslo_ttft_ms_per_1k_prompt_tokens = 1" + "0" * 400),
     "classes[1].slo_ttft_ms_per_1k_prompt_tokens"),
    (('name = "llama"', 'name = "lla{ma}"'), "pools[0].name"),
    # a class name is also part of hash fields: <class>.cost would be class "P1.cost"'s count
    (('name = "P1"', 'name = "P1.cost"'), "classes[1].name"),
    (("context_tokens = 8192", "context_tokens = -5"), "pools[0].context_tokens"),
    (('max_class = "P0"', 'max_class = "P9"'), "tenants[0].max_class"),
    (('default_class = "P1"', 'default_class = "P0"\nbogus = 1'), "tenants[0].bogus"),
    (('url = "redis://127.0.0.1:6390/0"', 'url = "http://x"'), "redis.url"),
    (('key_sha256 = ["', 'key_sha256 = ["zz'), "tenants[0].key_sha256[0]"),
    # a second pool serving the first one's model would never be reached
    (("context_tokens = 8192", 'context_tokens = 8192\n\n[[pools]]\nname = "llama-b"\nmodel = "llama"'),
     "pools[1].model"),
])
def test_each_mistake_names_its_field(tmp_path, edit, path):
    with pytest.raises(ConfigError) as exc:
        _load(tmp_path, BASE.replace(*edit))
    assert exc.value.path == path, str(exc.value)


def test_a_ttft_allowance_per_prompt_token_loads(tmp_path):
    cfg = _load(tmp_path, BASE.replace("floor = 0.3", "floor = 0.3\nslo_ttft_ms = 500\n"
                                       "slo_ttft_ms_per_1k_prompt_tokens = 100"))
    p1 = cfg.class_config("P1")
    assert p1 is not None and (p1.slo_ttft_ms, p1.slo_ttft_ms_per_1k_prompt_tokens) == (500, 100)
    p0 = cfg.class_config("P0")
    assert p0 is not None and p0.slo_ttft_ms_per_1k_prompt_tokens == 0  # a fixed target by default
    cfg = _load(tmp_path, BASE.replace("floor = 0.3", "floor = 0.3\nslo_ttft_ms = 500\n"
                                       "slo_ttft_ms_per_1k_prompt_tokens = 100\n"
                                       "slo_ttft_base_prompt_tokens = 2000"))
    p1 = cfg.class_config("P1")
    assert p1 is not None and p1.slo_ttft_base_prompt_tokens == 2000
    assert p0.slo_ttft_base_prompt_tokens == 0  # every prompt token counts by default


def test_no_field_the_frontend_implements_can_be_passed_through():
    """``upstream_fields`` may not name a field the frontend reads itself: the client's value
    would be checked and counted one way and sent upstream another."""
    from limiter.config import RESERVED_REQUEST_FIELDS
    from limiter.frontend.openai_api import _CHAT, _COMPLETION

    assert (_CHAT | _COMPLETION) <= RESERVED_REQUEST_FIELDS, (_CHAT | _COMPLETION) - RESERVED_REQUEST_FIELDS


def test_invalid_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="invalid TOML"):
        _load(tmp_path, "[[classes]\nname=")
    with pytest.raises(ConfigError, match="file not found"):
        config.load(tmp_path / "nope.toml", {})


def test_env_overrides_the_redis_url(tmp_path):
    cfg = _load(tmp_path, BASE, {"QOS_REDIS_URL": "redis://10.0.0.1:7000/0", "QOS_REDIS_CLUSTER": "1"})
    assert cfg.redis.url == "redis://10.0.0.1:7000/0" and cfg.redis.cluster
    with pytest.raises(ConfigError, match="QOS_REDIS_CLUSTER"):
        _load(tmp_path, BASE, {"QOS_REDIS_CLUSTER": "yes"})


def test_demo_config_has_the_documented_keys():
    cfg = config.demo_config()
    hashes = {t.name: t.key_sha256[0] for t in cfg.tenants}
    assert hashes["demo-p0"] == config.hash_key("demo-p0")
    assert [t.max_class for t in cfg.tenants if not t.admin] == ["P0", "P1", "P2"]
    assert any(t.admin for t in cfg.tenants)


def test_cli_config_check_names_the_bad_field(tmp_path, capsys):
    from limiter.cli import main
    p = tmp_path / "bad.toml"
    p.write_text(BASE.replace("share = 0.4", "share = 2"))
    assert main(["config", "check", str(p)]) == 2
    assert "classes[1].share" in capsys.readouterr().err
    p.write_text(BASE)
    assert main(["config", "check", str(p)]) == 0


def test_cli_config_example_is_valid_and_hash_key_prints_the_digest(tmp_path, capsys):
    from limiter.cli import main
    assert main(["config", "example"]) == 0
    example = capsys.readouterr().out
    p = tmp_path / "example.toml"
    p.write_text(example)
    cfg = config.load(p, {})
    assert [c.name for c in cfg.classes] == ["P0", "P1", "P2"] and "[controller]" in example
    assert main(["config", "hash-key", "demo-p0"]) == 0
    assert capsys.readouterr().out.strip() == config.hash_key("demo-p0")


@pytest.mark.parametrize("argv", [["config", "hash-key"], ["config", "hash-key", "-"]])
def test_hash_key_reads_the_key_from_standard_input(argv, capsys, monkeypatch):
    """A key on the command line stays in the shell's history and shows in `ps`."""
    from limiter.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("demo-p0\n"))
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == config.hash_key("demo-p0")
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(argv) == 2
    assert "no key given" in capsys.readouterr().err


@pytest.mark.parametrize("section, line, path", [
    (None, "wroker = 1", "wroker"),
    ("[redis]", "urll = \"redis://x\"", "redis.urll"),
    ("[[classes]]\nname = \"P2\"\nshare = 0.0", "sharee = 0.1", "classes[2].sharee"),
    ("[[pools]]\nname = \"other\"", "lease = 1", "pools[1].lease"),
    ("[[tenants]]\nname = \"t2\"", "rate = 1", "tenants[1].rate"),
    ("[frontend]", "shutdown_grace = 5", "frontend.shutdown_grace"),
    ("[worker]", "drain_timeout = 5", "worker.drain_timeout"),
    ("[controller]", "tick = 2", "controller.tick"),
    ("[controller.capacity]", "gainn = 2", "controller.capacity.gainn"),
])
def test_cli_config_check_rejects_unknown_keys_in_every_section(tmp_path, capsys, section, line, path):
    """A typo anywhere is refused by `qos config check`, named by its path; before, one under
    [frontend], [worker] or [controller] only showed when that role started."""
    from limiter.cli import main
    p = tmp_path / "typo.toml"
    if section is None:  # top level
        text = f"{line}\n{BASE}"
    elif section in BASE:  # a table BASE has already
        text = BASE.replace(section, f"{section}\n{line}", 1)
    else:
        text = BASE + f"\n{section}\n{line}\n"
    p.write_text(text)
    assert main(["config", "check", str(p)]) == 2
    err = capsys.readouterr().err
    assert f"config error: {path}: unknown field" in err, err


def test_cli_config_check_validates_the_role_sections(tmp_path, capsys):
    from limiter.cli import main
    p = tmp_path / "roles.toml"
    p.write_text(BASE + "\n[worker]\ndrain_timeout_s = -1\n")
    assert main(["config", "check", str(p)]) == 2
    assert "worker.drain_timeout_s" in capsys.readouterr().err
    p.write_text(BASE + "\n[frontend]\nshutdown_grace_s = 5\n[worker]\ndrain_timeout_s = 5\n"
                 "[controller]\ntick_s = 2\n")
    assert main(["config", "check", str(p)]) == 0


def test_cli_config_check_takes_a_pool_for_openai_workers_whose_engine_is_a_flag(tmp_path, capsys):
    """docs/worker.md runs `qos worker --engine openai --upstream-url ...` (and `qos up --engine
    openai`): the engine is a flag, not in [worker]. `qos config check` checked [worker] as a torch
    worker and refused the file ("pools[0].tokenizer: ... only the openai engine can serve it"),
    although every worker started with it accepts it."""
    from limiter.cli import main
    from worker.settings import load_settings

    p = tmp_path / "openai.toml"
    text = BASE.replace('context_tokens = 8192\n', 'context_tokens = 8192\ntokenizer = "upstream"\n'
                        'tokenizer_url = "http://127.0.0.1:8001"\n')
    p.write_text(text)
    cfg = config.load(p, {})
    load_settings(cfg, {"engine": "openai", "upstream_url": "http://127.0.0.1:8001"})  # the worker takes it
    assert main(["config", "check", str(p)]) == 0, capsys.readouterr().err
    # a file that names a step engine for it is still refused, naming the pool's tokenizer
    p.write_text(text + '\n[worker]\nengine = "sim"\n')
    assert main(["config", "check", str(p)]) == 2
    assert "pools[0].tokenizer" in capsys.readouterr().err
    # and an error of the section itself is still the one named
    p.write_text(text + '\n[worker]\nmax_seqs = 0\n')
    assert main(["config", "check", str(p)]) == 2
    assert "worker.max_seqs" in capsys.readouterr().err


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("rediss://user:s3cr%2Ft@h:6380/0?ssl_cert_reqs=none", "rediss://user:***@h:6380/0?ssl_cert_reqs=none"),
    ("redis://h:1/0?db=0&password=abc", "redis://h:1/0?db=0&password=***"),
    ("unix:///tmp/r.sock?password=x", "unix:///tmp/r.sock?password=***"),
    ("redis://:pa/ss?w@h:6379", "redis://:***@h:6379"),  # unencoded '/' and '?' in the password
    # the passphrase of the TLS client key (SSLConnection's ssl_password), and a query option's
    # name percent-encoded (redis-py decodes it: still the password): printed as they were
    ("rediss://h:6380/0?ssl_keyfile=/k.pem&ssl_password=topsecret",
     "rediss://h:6380/0?ssl_keyfile=/k.pem&ssl_password=***"),
    ("redis://h:1/0?pass%77ord=topsecret", "redis://h:1/0?pass%77ord=***"),
])
def test_a_redis_url_is_printed_without_its_password(url, shown):
    """`qos up`'s ready line printed the whole Redis URL, password included."""
    assert config.redacted_url(url) == shown


def test_demo_is_not_a_field_of_a_file(tmp_path):
    """QosConfig.demo marks the built-in demo config; a file with `demo = true` made the
    frontend say "serving the demo config" and `qos up` print demo keys the file lacked."""
    p = tmp_path / "qos.toml"
    p.write_text("demo = true\n" + BASE)
    with pytest.raises(ConfigError) as err:
        config.load(p, env={})
    assert err.value.path == "demo"
    assert config.load(None, env={}).demo  # the demo config itself


def test_a_key_that_is_not_utf8_is_hashed_as_the_bytes_sent(capsys):
    """argv and stdin carry a key's non-UTF-8 bytes as surrogates: `qos config hash-key` died of
    a UnicodeEncodeError (found by a review of what operators see). Its digest is of the
    bytes, the one the frontend's lookup computes for the same key in a header."""
    import hashlib

    from limiter.cli import main
    from limiter.frontend.auth import KeyRing

    key = b"caf\xe9".decode("utf-8", "surrogateescape")  # what argv holds for those bytes
    assert main(["config", "hash-key", key]) == 0
    digest = capsys.readouterr().out.strip()
    assert digest == hashlib.sha256(b"caf\xe9").hexdigest()
    cfg = dataclasses.replace(config.demo_config(), tenants=(config.TenantConfig(
        name="latin1", key_sha256=(digest,), default_class="P1", max_class="P1"),))
    assert KeyRing(cfg).lookup(key).name == "latin1"


def test_a_key_on_standard_input_that_is_not_utf8_is_hashed_as_its_bytes(tmp_path):
    """Under a UTF-8 locale Python decodes stdin strictly: a key of other bytes was a
    UnicodeDecodeError traceback (found by a review of the operator paths, 2026-12-06)."""
    import hashlib
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict"}
    proc = subprocess.run([sys.executable, "-m", "limiter.cli", "config", "hash-key"], input=b"caf\xe9\n",
                          capture_output=True, timeout=60, env=env)
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr, proc.stderr[-800:]
    assert proc.stdout.decode().strip() == hashlib.sha256(b"caf\xe9").hexdigest()


@pytest.mark.parametrize("spec", [
    "tok\\u0000enizer.json",  # a NUL: Path.stat()'s ValueError ("embedded null byte")
    "x" * 300,  # a name past NAME_MAX: Path.is_dir()'s OSError ENAMETOOLONG
    "~no-such-user-qos/tokenizer.json",  # expanduser()'s RuntimeError
])
def test_a_tokenizer_path_that_cannot_name_a_file_is_a_config_error(tmp_path, capsys, spec):
    """Each was a traceback out of `qos config check` (and every role's start), not an error
    naming pools[0].tokenizer."""
    from limiter.cli import main

    text = BASE.replace('context_tokens = 8192\n', f'context_tokens = 8192\ntokenizer = "{spec}"\n')
    with pytest.raises(ConfigError, match=r"pools\[0\]\.tokenizer"):
        _load(tmp_path, text)
    assert main(["config", "check", str(tmp_path / "qos.toml")]) == 2
    assert "pools[0].tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["http://", "http://127.0.0.1:abc", "http://127.0.0.1:99999"])
def test_a_tokenizer_url_with_no_host_or_a_bad_port_is_a_config_error(tmp_path, url):
    text = BASE.replace('context_tokens = 8192\n', 'context_tokens = 8192\ntokenizer = "upstream"\n'
                        f'tokenizer_url = "{url}"\n')
    with pytest.raises(ConfigError, match=r"pools\[0\]\.tokenizer_url"):
        _load(tmp_path, text)


def test_cli_config_check_of_an_empty_path_is_an_error_not_the_demo_config(capsys):
    """`qos config check ""` checked the demo config (an empty path read as none given) and
    printed ': ok', as if the file had been checked."""
    from limiter.cli import main

    assert main(["config", "check", ""]) == 2
    err = capsys.readouterr().err
    assert "no file" in err and "Traceback" not in err, err


def test_a_reader_that_goes_away_early_is_no_traceback():
    """`qos status --json | head -3` (or any reader that stops early): the write into the
    closed pipe was a BrokenPipeError traceback, and another one as Python flushed stdout at
    exit. Now the command ends quietly with the shell's status for SIGPIPE (141), as `yes |
    head` does."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes
    try:
        proc = subprocess.run([sys.executable, "-m", "limiter.cli", "config", "example"], stdout=write,
                              stderr=subprocess.PIPE, timeout=60)
    finally:
        os.close(write)
    assert b"Traceback" not in proc.stderr and b"Exception ignored" not in proc.stderr, proc.stderr[-800:]
    assert proc.returncode == 141
