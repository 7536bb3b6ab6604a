"""How a replica reaches Redis: URL, ACL user and password, TLS with server verification, key prefix.

``--state redis://[USER[:PASS]@]HOST:PORT[/DB]`` or ``rediss://...`` (TLS). The password is best kept
off the command line: ``$ELDR_STATE_PASSWORD`` or ``--state-password-file`` (mode 600) win over one in
the URL. ``--state-ca-file`` is the CA bundle that verifies the server's certificate (default: the
system's); the host name in the URL must match the certificate. ``--state-prefix`` namespaces every
key and channel, so two deployments can share one Redis (with their own keys and ACL users).
"""

from __future__ import annotations

import logging
import os
import re
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from eldr_cli.errors import EldrError
from eldr_cli.proxy.replicas.auth import read_secret_file

log = logging.getLogger("eldr.proxy.state")

PASSWORD_ENV = "ELDR_STATE_PASSWORD"
_PREFIX = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def parse_state_url(value: str | None) -> str:
    """``local`` or a ``redis[s]://[USER[:PASS]@]HOST:PORT[/DB]`` URL, checked; EldrError naming --state."""
    if value is None or value == "local":
        return "local"
    try:
        u = urlsplit(value)
        port = u.port
        db = u.path.strip("/")
    except ValueError as e:
        raise EldrError(f"--state {redact(value)!r} is not a valid URL: {e}") from None
    if u.scheme not in ("redis", "rediss") or not u.hostname or port is None or (db and not db.isdigit()):
        raise EldrError(f"--state must be 'local' or redis[s]://[USER[:PASS]@]HOST:PORT[/DB], got {redact(value)!r}")
    return value


def redact(url: str) -> str:
    """The URL without its password (for banners, logs and errors)."""
    try:
        u = urlsplit(url)
        if u.password is None:
            return url
        user = f"{u.username}:" if u.username else ":"
        return u._replace(netloc=f"{user}***@{u.hostname}:{u.port}").geturl()
    except ValueError:
        return "<unparsable URL>"


def check_prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise EldrError(f"--state-prefix must be 1-64 letters, digits, '_', '.' or '-', got {prefix!r}")
    return prefix


@dataclass(frozen=True)
class StateConn:
    """Everything needed to open a Redis client; built (and checked) at start-up."""

    url: str
    prefix: str = "eldr"
    password: str | None = None   # from env or file; None -> the URL's own (or none)
    ca_file: str | None = None

    @property
    def namespace(self) -> str:
        # pub/sub channels are server-wide, not per database: the database number is part of every name
        return f"{self.prefix}:{urlsplit(self.url).path.strip('/') or '0'}"

    def client_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"socket_timeout": 0.5, "socket_connect_timeout": 0.5, "health_check_interval": 0}
        if self.password is not None:
            kw["password"] = self.password
        if urlsplit(self.url).scheme == "rediss":
            kw.update(ssl_cert_reqs="required", ssl_check_hostname=True, ssl_ca_certs=self.ca_file)
        return kw


def build_state_conn(url: str, prefix: str, password_file: str | None, ca_file: str | None) -> StateConn:
    """Reads the password (file, then env) and checks the CA bundle; EldrError naming the option."""
    password = None
    if password_file:
        password = read_secret_file(password_file, "--state-password-file").decode()
    elif os.environ.get(PASSWORD_ENV):
        password = os.environ[PASSWORD_ENV]
    tls = urlsplit(url).scheme == "rediss"
    if ca_file:
        if not tls:
            raise EldrError("--state-ca-file needs a rediss:// (TLS) --state URL")
        try:
            ssl.create_default_context(cafile=ca_file)
        except FileNotFoundError:
            raise EldrError(f"--state-ca-file {ca_file} does not exist") from None
        except (ssl.SSLError, OSError, ValueError) as e:
            raise EldrError(f"--state-ca-file {ca_file} holds no usable CA certificate (PEM): {e}") from None
    return StateConn(url, check_prefix(prefix), password, ca_file)


def check_state_reachable(conn: StateConn, timeout_s: float = 2.0) -> None:
    """Before the banner: a refused password or an unverifiable server certificate is a start-up error
    naming the option; a Redis that does not answer at all is not (the replica starts on local counts
    and shares once Redis answers, like any later outage)."""
    import redis
    from redis.exceptions import AuthenticationError, ConnectionError, ResponseError, TimeoutError

    kw = conn.client_kwargs()
    kw.update(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    client = redis.Redis.from_url(conn.url, **kw)
    try:
        client.ping()
    except (AuthenticationError, ResponseError) as e:
        if "WRONGPASS" in str(e) or "NOAUTH" in str(e) or isinstance(e, AuthenticationError) \
                or "password" in str(e).lower():
            raise EldrError(f"--state {redact(conn.url)}: Redis refused the user or password ({e})",
                            hint="check the URL's user, $ELDR_STATE_PASSWORD or --state-password-file") from None
        raise EldrError(f"--state {redact(conn.url)}: Redis answered with an error: {e}") from None
    except (ConnectionError, TimeoutError, OSError) as e:
        text = f"{e} {e.__cause__ or ''} {e.__context__ or ''}"
        if "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text \
                or "match" in text and "hostname" in text.lower():
            raise EldrError(f"--state-ca-file: the Redis server's certificate at {redact(conn.url)} cannot be "
                            f"verified ({e})", hint="pass the CA that signed it with --state-ca-file") from None
        if "wrong version number" in text or "unexpected eof" in text.lower() and conn.url.startswith("rediss"):
            raise EldrError(f"--state {redact(conn.url)}: no TLS handshake ({e}); is the server plain redis://?") \
                from None
        log.warning("shared state unreachable at start-up: routing on this replica's counts until Redis answers",
                    extra={"event": "state", "to": "local", "error": f"{type(e).__name__}: {e}"})
    finally:
        client.close()
