"""Redis with a password, with a least-privilege ACL user, and over TLS: the whole stack.

* ``requirepass``: every role connects with ``redis://:<password>@host:port/0``.
* ACL: the user is created with the exact line documented in docs/reliability.md (read from
  the file, so the documentation cannot drift from what is tested), ``default`` is switched
  off, and frontends, workers and controllers run a load under it that takes every code
  path that talks to Redis: streamed and plain answers, a client that leaves (cancel), a
  queue expiry, the admin status endpoint and ``qos status``, a controller failover
  (``XAUTOCLAIM``), a script cache flush (``NOSCRIPT`` -> ``SCRIPT LOAD``), a worker drain
  (``release``) and a frontend shutdown. Afterwards Redis' ``ACL LOG`` is empty: nothing was
  refused. And the user really is restricted: ``KEYS``, ``FLUSHALL``, ``CONFIG``, ``EVAL``,
  ``SCRIPT FLUSH`` and keys outside ``qos:*`` are refused.
* TLS: a ``redis-server`` with only a TLS port and a certificate from a throwaway CA made
  here; the stack connects with ``rediss://qos:<password>@127.0.0.1:<port>/0?ssl_ca_certs=<ca>``
  (certificate and host name verified); a client without that CA, and a plain-text one, fail.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
import redis.asyncio as aioredis

from limiter.controller.leader import holder_id
from limiter.keys import PoolKeys
from tests.support.redis_server import RedisServer, free_port
from tests.support.reliability_stack import (
    KEY_P1,
    KEY_P2,
    ROOT,
    LiveStack,
    Load,
    base_config,
    call,
    check_outcomes,
    drive,
    server_ledger,
    wait_clean,
)

POOL = PoolKeys("tiny")
PASSWORD = "s3cret-Pw-for-tests"
ADMIN = ("admin", "admin-pw-for-tests")
# These stacks show auth and TLS work, not how soon a dead frontend is noticed: a TTL of 6 s
# (not the fault tests' 1.5 s) keeps a late beat on a loaded machine (a TLS handshake per
# new connection) from turning requests away as "not ready".
FRONTEND_TTL_MS = 6000


def acl_line(password: str) -> list[str]:
    """The documented ``ACL SETUSER`` line, as arguments, with the password filled in."""
    doc = (ROOT / "docs" / "reliability.md").read_text()
    m = re.search(r"^ACL SETUSER qos .+$", doc, re.MULTILINE)
    assert m, "docs/reliability.md must show the ACL line"
    return [password and a.replace(">CHANGE-ME", f">{password}") for a in m.group(0).split()]


def create_acl_user(admin_conn: redis.Redis) -> None:
    """An admin user for the test itself, the documented ``qos`` user, ``default`` off."""
    admin_conn.execute_command("ACL", "SETUSER", ADMIN[0], "on", f">{ADMIN[1]}", "~*", "&*", "+@all")
    args = acl_line(PASSWORD)
    assert args[:3] == ["ACL", "SETUSER", "qos"]
    admin_conn.execute_command(*args)
    admin_conn.execute_command("ACL", "SETUSER", "default", "off")


async def ready_stack(
    stack: LiveStack, admin: aioredis.Redis, frontends: int, workers: int, controllers: int
) -> None:
    for i in range(frontends):
        stack.frontend(f"fe{i}")
    for i in range(workers):
        stack.worker(f"w{i}")
    for i in range(controllers):
        stack.controller(f"ctl{i}")
    await stack.wait_ready(admin)


async def quick_load(stack: LiveStack, admin: aioredis.Redis, n: int, tag: str) -> str:
    via = [p.name for p in stack.of("frontend") if p.running]
    outcomes = await drive(stack, via, Load(n=n, concurrency=8, max_tokens=(5, 30), tag=tag))
    # P2 may be refused (429: it could not start in time) or, past a short max wait, expire (503)
    rep = check_outcomes(outcomes, allowed_codes=("max_wait_exceeded", "queue_timeout"))
    assert rep.kinds["ok"] > n // 2, rep.client_line()
    return rep.client_line()


def logs_clean(stack: LiveStack) -> None:
    for p in stack.procs.values():
        text = p.log.read_text(errors="replace")
        assert "NOPERM" not in text and "NOAUTH" not in text and "WRONGPASS" not in text, (p.name, p.tail())


# --- password -----------------------------------------------------------------------------------


async def test_the_stack_runs_with_a_password(tmp_path: Path) -> None:
    server = RedisServer().start()
    server.client().config_set("requirepass", PASSWORD)
    url = f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"
    admin = aioredis.from_url(url)
    stack = LiveStack(tmp_path, base_config(url, frontend_ttl_ms=FRONTEND_TTL_MS))
    try:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port).ping()
        await ready_stack(stack, admin, 1, 1, 1)
        line = await quick_load(stack, admin, 30, "pw")
        logs_clean(stack)
        print(f"\n[redis password] {line}")
    finally:
        stack.stop()
        await admin.aclose()
        server.stop()


# --- ACL user -------------------------------------------------------------------------------------


async def test_the_whole_stack_runs_under_the_documented_acl_user(tmp_path: Path) -> None:
    server = RedisServer().start()
    create_acl_user(server.client())
    admin = aioredis.from_url(f"redis://{ADMIN[0]}:{ADMIN[1]}@127.0.0.1:{server.port}/0")
    url = f"redis://qos:{PASSWORD}@127.0.0.1:{server.port}/0"
    # P2 waits little: expiries happen
    cfg = base_config(url, frontend_ttl_ms=FRONTEND_TTL_MS, classes={"P2": {"max_wait_ms": 300}})
    stack = LiveStack(tmp_path, cfg)
    try:
        with pytest.raises(redis.AuthenticationError):  # nobody gets in anonymously
            redis.Redis(port=server.port).ping()
        await ready_stack(stack, admin, 2, 2, 2)
        lines = [await quick_load(stack, admin, 40, "a")]
        async with aiohttp.ClientSession() as s:
            # the admin endpoint, and a client that goes away mid-stream (cancel_request)
            async with s.get(
                stack.base("fe0") + "/v1/qos/status", headers={"Authorization": "Bearer x"}
            ) as r:
                assert r.status == 401
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.5):
                    await call(s, stack.base("fe0"), "fe0", KEY_P1, "leaver", max_tokens=3000, timeout_s=30)
            # an expiry (the janitor's path): every worker paused, a P2 request waits out its
            # 300 ms max wait (the load above expired none: its workers kept up)
            workers = [p for p in stack.of("worker") if p.running]
            for w in workers:
                w.send_signal(signal.SIGSTOP)
            try:
                late = await call(s, stack.base("fe0"), "fe0", KEY_P2, "waits", max_tokens=5, timeout_s=30)
            finally:
                for w in workers:
                    w.send_signal(signal.SIGCONT)
            assert (late.status, late.code) == (503, "queue_timeout"), late
        status = subprocess.run(
            [sys.executable, "-m", "limiter.cli", "status", "--json", "--config", str(stack.path)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env=stack.env,
        )
        assert status.returncode == 0, status.stderr
        # controller failover: the standby claims the dead leader's pending samples
        owner = (await admin.get(POOL.leader)).decode().rpartition(":")[0]
        stack.procs[holder_id(owner)].kill9()
        # Redis loses its script cache: every role reloads its scripts (NOSCRIPT -> SCRIPT LOAD)
        await admin.script_flush()
        lines.append(await quick_load(stack, admin, 40, "b"))
        deadline = time.monotonic() + 30
        while (await admin.get(POOL.leader) or b"").decode().startswith(owner + ":"):
            assert time.monotonic() < deadline, "the killed controller's lease to pass to another"
            await asyncio.sleep(0.1)
        # a worker drains (release), a frontend leaves; the rest keep serving
        stack.procs["w1"].send_signal(signal.SIGTERM)
        stack.procs["fe1"].stop()
        lines.append(await quick_load(stack, admin, 20, "c"))
        assert stack.procs["w1"].proc is not None and stack.procs["w1"].proc.wait(20) == 0
        await wait_clean(admin, ["tiny"])
        admitted, _, outcomes = await server_ledger(admin, ["tiny"])
        denied = await admin.execute_command("ACL", "LOG")
        assert denied == [], denied  # not one command or key was refused to the qos user
        logs_clean(stack)
        print(
            f"\n[redis ACL] {' | '.join(lines)}; admitted {admitted}, ended {dict(outcomes['tiny'])}; "
            f"ACL LOG empty"
        )
        assert outcomes["tiny"]["cancelled"] >= 1 and outcomes["tiny"]["expired"] >= 1, outcomes["tiny"]
        # ...and the user can do nothing else
        qos = redis.Redis(port=server.port, username="qos", password=PASSWORD)
        for cmd in (
            ("KEYS", "*"),
            ("FLUSHALL",),
            ("CONFIG", "GET", "*"),
            ("EVAL", "return 1", "0"),
            ("SCRIPT", "FLUSH"),
            ("GET", "other:key"),
            ("SET", "x", "1"),
            ("ACL", "WHOAMI"),
            ("SUBSCRIBE", "qos:x"),
            ("MONITOR",),
            ("SHUTDOWN",),
        ):
            with pytest.raises(redis.ResponseError, match=r"NOPERM|no permissions"):
                qos.execute_command(*cmd)
        assert qos.get(POOL.policy + "-x") is None  # its own key space is fine
        qos.close()
    finally:
        stack.stop()
        await admin.aclose()
        server.stop()


# --- TLS ----------------------------------------------------------------------------------------


@dataclass
class TlsRedis:
    """A redis-server that only listens on a TLS port, with a certificate from our own CA."""

    dir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def ca(self) -> Path:
        return self.dir / "ca.pem"

    def start(self) -> TlsRedis:
        make_certs(self.dir)
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--dir",
                str(self.dir),
                "--tls-cert-file",
                str(self.dir / "server.pem"),
                "--tls-key-file",
                str(self.dir / "server.key"),
                "--tls-ca-cert-file",
                str(self.ca),
                "--tls-auth-clients",
                "no",
                "--loglevel",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with self.client() as c:
                    c.ping()
                    return self
            except (redis.ConnectionError, redis.AuthenticationError, redis.ResponseError):
                time.sleep(0.05)
        raise RuntimeError("TLS redis-server did not start")

    def client(self, **kw: Any) -> redis.Redis:
        return redis.Redis(
            port=self.port, ssl=True, ssl_ca_certs=str(self.ca), socket_connect_timeout=1, **kw
        )

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def make_certs(d: Path) -> None:
    """A throwaway CA and a server certificate for 127.0.0.1 / localhost, signed by it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("qos test CA"))
        .issuer_name(name("qos test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name("127.0.0.1"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    d.mkdir(parents=True, exist_ok=True)
    (d / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (d / "server.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "server.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[TlsRedis]:
    server = TlsRedis(tmp_path / "tls").start()
    yield server
    server.stop()


async def test_the_stack_runs_over_tls_with_a_verified_certificate(
    tls_redis: TlsRedis, tmp_path: Path
) -> None:
    create_acl_user(tls_redis.client())
    ca = tls_redis.ca
    url = f"rediss://qos:{PASSWORD}@127.0.0.1:{tls_redis.port}/0?ssl_ca_certs={ca}&ssl_cert_reqs=required"
    admin = aioredis.from_url(
        f"rediss://{ADMIN[0]}:{ADMIN[1]}@127.0.0.1:{tls_redis.port}/0?ssl_ca_certs={ca}"
    )
    stack = LiveStack(tmp_path, base_config(url, frontend_ttl_ms=FRONTEND_TTL_MS))
    try:
        # the certificate is checked: without our CA the handshake fails; plain text gets nowhere
        with pytest.raises(redis.ConnectionError):
            redis.Redis(port=tls_redis.port, ssl=True, socket_connect_timeout=1).ping()
        with pytest.raises(redis.ConnectionError):
            redis.Redis(port=tls_redis.port, socket_connect_timeout=1, socket_timeout=1).ping()
        await ready_stack(stack, admin, 2, 2, 1)
        line = await quick_load(stack, admin, 40, "tls")
        await wait_clean(admin, ["tiny"])
        admitted, _, outcomes = await server_ledger(admin, ["tiny"])
        assert await admin.execute_command("ACL", "LOG") == []
        logs_clean(stack)
        print(f"\n[redis TLS] {line}; admitted {admitted}, ended {dict(outcomes['tiny'])}")
    finally:
        stack.stop()
        await admin.aclose()
