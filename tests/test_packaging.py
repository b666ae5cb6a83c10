"""The built wheel carries lua/ and the registry loads the scripts from the installed copy."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_carries_the_lua_scripts_and_they_load_from_it(tmp_path, redis_server):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, timeout=300)
    (wheel,) = tmp_path.glob("inference_qos-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    lua = {Path(n).name for n in names if n.startswith("limiter/lua/")}
    expected = {p.name for p in (ROOT / "lua").rglob("*.lua")}
    assert expected <= lua, expected - lua
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "import asyncio, redis.asyncio as r\n"
        "from limiter.scripts import lua_dir, Scripts\n"
        f"assert str(lua_dir()).startswith({str(site)!r}), lua_dir()\n"
        f"c = r.from_url({redis_server.url!r})\n"
        "asyncio.run(Scripts(c).load_all())\n"
        "print('ok', lua_dir())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(site)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


def test_the_redis_client_floor_verifies_tls_host_names_by_default():
    """docs/reliability.md says a ``rediss://`` URL verifies the server's host name with no
    option set. redis-py made ``ssl_check_hostname`` default to true in 6.0; under the 5.x
    releases the requirement allowed (``redis>=5.0``), any certificate the CA signed, for
    any host, was accepted."""
    import tomllib

    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == "redis"]
    for old in ("5.0.0", "5.2.1", "5.3.1"):
        assert not req.specifier.contains(old), f"{req} admits redis {old}: no host name check on rediss://"
