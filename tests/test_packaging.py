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
