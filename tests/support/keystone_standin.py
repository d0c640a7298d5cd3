#!/usr/bin/env python3
"""A Keystone v3 stand-in in front of a tempauth Swift, for tests and local trials.

A real Keystone needs a database and fernet keys. This stdlib-only server answers the
part of the Identity v3 API that clients use to log in:

* ``GET /`` and ``GET /v3``: version discovery.
* ``POST /v3/auth/tokens`` with the ``application_credential`` (id + secret) or the
  ``password`` method. On success it logs in to the Swift proxy with tempauth,
  returns the real tempauth token as ``X-Subject-Token`` and a catalog whose
  ``object-store`` endpoint (public, internal and admin, region ``RegionOne``) is the
  Swift storage URL. A wrong secret or password gets 401.
* ``GET``/``HEAD /v3/auth/tokens``: validates a token that this stand-in issued.

Tempauth user ``account:user`` with key ``key`` appears as Keystone user ``user`` in
project ``account`` with password ``key``. An application credential stands for one
tempauth user. It tests the client side of Keystone auth only: no policy, roles,
revocation or keystoneauth middleware.

Example (CLI)::

    python tests/support/keystone_standin.py --port 5000 \\
        --swift-auth-url http://127.0.0.1:8080/auth/v1.0 \\
        --user test:tester:testing --app-cred my-id:my-secret:test:tester

Example (in a test)::

    with KeystoneStandin("http://127.0.0.1:8080/auth/v1.0",
                         users={"test:tester": "testing"},
                         app_creds={"my-id": ("my-secret", "test:tester")}) as ks:
        auth_url = ks.url  # http://127.0.0.1:PORT/v3
"""

from __future__ import annotations

import argparse
import http.client
import json
import secrets
import signal
import sys
import threading
import time
import urllib.parse
from collections.abc import Mapping
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["KeystoneStandin", "main"]

REGION = "RegionOne"
DOMAIN = {"id": "default", "name": "Default"}


class AuthFailed(Exception):
    """The request's credentials are wrong (answered with 401)."""


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000000Z")


def _tempauth_login(auth_url: str, user: str, key: str, timeout: float = 10.0) -> tuple[str, str, int]:
    """Log in to tempauth; return (token, storage_url, seconds_left)."""
    parts = urllib.parse.urlsplit(auth_url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("GET", parts.path or "/auth/v1.0", headers={"X-Auth-User": user, "X-Auth-Key": key})
        resp = conn.getresponse()
        resp.read()
        if resp.status in (401, 403):
            raise AuthFailed(f"tempauth refused {user}")
        if resp.status // 100 != 2:
            raise RuntimeError(f"tempauth login at {auth_url} answered {resp.status}")
        token = resp.getheader("X-Auth-Token") or resp.getheader("X-Storage-Token")
        storage_url = resp.getheader("X-Storage-Url")
        expires = int(resp.getheader("X-Auth-Token-Expires") or 86400)
    finally:
        conn.close()
    if not token or not storage_url:
        raise RuntimeError(f"tempauth login at {auth_url} returned no token or storage URL")
    return token, storage_url, expires


class KeystoneStandin:
    """A threaded Keystone v3 stand-in; ``start()``/``stop()`` or use it as a context manager.

    ``users`` maps tempauth ``account:user`` to its key; ``app_creds`` maps an
    application credential id to ``(secret, "account:user")``.
    """

    def __init__(
        self,
        swift_auth_url: str,
        users: Mapping[str, str],
        app_creds: Mapping[str, tuple[str, str]] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.swift_auth_url = swift_auth_url
        self.users = dict(users)
        self.app_creds = dict(app_creds or {})
        for app_id, (_, user) in self.app_creds.items():
            if user not in self.users:
                raise ValueError(f"application credential {app_id} names unknown user {user}")
        self._address = (host, port)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._tokens: dict[str, dict] = {}
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------
    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("KeystoneStandin is not started")
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        """The v3 auth URL, e.g. ``http://127.0.0.1:5000/v3``."""
        return f"http://{self._address[0]}:{self.port}/v3"

    def start(self) -> KeystoneStandin:
        standin = self

        class Handler(_Handler):
            owner = standin

        self._server = ThreadingHTTPServer(self._address, Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.1,), name="keystone-standin", daemon=True
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Run in the calling thread (the CLI); returns after ``shutdown()`` from another thread."""
        if self._server is None:
            self.start()
        assert self._thread is not None
        self._thread.join()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = self._thread = None

    def __enter__(self) -> KeystoneStandin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the API ---------------------------------------------------------
    def _find_user(self, ident: dict) -> str:
        """Map a v3 ``identity`` object to a tempauth ``account:user``; raise AuthFailed."""
        methods = ident.get("methods") or []
        if "application_credential" in methods:
            cred = ident.get("application_credential") or {}
            entry = self.app_creds.get(str(cred.get("id", "")))
            if entry is None or not secrets.compare_digest(entry[0], str(cred.get("secret", ""))):
                raise AuthFailed("wrong application credential id or secret")
            return entry[1]
        if "password" in methods:
            user = (ident.get("password") or {}).get("user") or {}
            name = str(user.get("name") or user.get("id") or "")
            password = str(user.get("password", ""))
            for full, key in self.users.items():
                if name in (full, full.split(":", 1)[1]) and secrets.compare_digest(key, password):
                    return full
            raise AuthFailed("wrong user name or password")
        raise AuthFailed(f"unsupported auth methods {methods}")

    def issue_token(self, body: dict) -> tuple[str, dict]:
        """Return (token, token body) for a ``POST /v3/auth/tokens`` request body."""
        auth = body.get("auth") or {}
        full_user = self._find_user(auth.get("identity") or {})
        scope_project = ((auth.get("scope") or {}).get("project") or {}).get("name")
        account, user = full_user.split(":", 1)
        if scope_project not in (None, account):
            raise AuthFailed(f"user {user} has no role in project {scope_project}")
        token, storage_url, seconds_left = _tempauth_login(self.swift_auth_url, full_user, self.users[full_user])
        now = time.time()
        endpoints = [
            {"id": f"{account}-{iface}", "interface": iface, "region": REGION, "region_id": REGION, "url": storage_url}
            for iface in ("public", "internal", "admin")
        ]
        token_body = {
            "token": {
                "methods": (auth.get("identity") or {}).get("methods", []),
                "issued_at": _iso(now),
                "expires_at": _iso(now + seconds_left),
                "user": {"id": full_user, "name": user, "domain": DOMAIN, "password_expires_at": None},
                "project": {"id": account, "name": account, "domain": DOMAIN},
                "roles": [{"id": "admin", "name": "admin"}, {"id": "member", "name": "member"}],
                "catalog": [{"id": "swift", "type": "object-store", "name": "swift", "endpoints": endpoints}],
            }
        }
        app_cred = ((auth.get("identity") or {}).get("application_credential") or {}).get("id")
        if app_cred:
            token_body["token"]["application_credential"] = {"id": app_cred, "name": app_cred, "restricted": True}
        with self._lock:
            self._tokens[token] = token_body
        return token, token_body

    def lookup_token(self, token: str) -> dict | None:
        with self._lock:
            return self._tokens.get(token)


class _Handler(BaseHTTPRequestHandler):
    owner: KeystoneStandin
    protocol_version = "HTTP/1.1"
    server_version = "keystone-standin/1"

    def log_message(self, format: str, *args: object) -> None:
        sys.stderr.write(f"keystone-standin: {self.address_string()} {format % args}\n")

    def _send_json(self, status: int, body: dict, headers: Mapping[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, status: int, title: str, message: str) -> None:
        self._send_json(status, {"error": {"code": status, "title": title, "message": message}})

    def _base(self) -> str:
        host = self.headers.get("Host") or f"{self.owner._address[0]}:{self.owner.port}"
        return f"http://{host}"

    def _version(self) -> dict:
        return {
            "id": "v3.14",
            "status": "stable",
            "updated": "2020-04-07T00:00:00Z",
            "links": [{"rel": "self", "href": f"{self._base()}/v3/"}],
            "media-types": [{"base": "application/json", "type": "application/vnd.openstack.identity-v3+json"}],
        }

    def do_GET(self) -> None:
        path = urllib.parse.urlsplit(self.path).path.rstrip("/")
        if path == "":
            self._send_json(300, {"versions": {"values": [self._version()]}})
        elif path == "/v3":
            self._send_json(200, {"version": self._version()})
        elif path == "/v3/auth/tokens":
            token = self.headers.get("X-Subject-Token", "")
            if not self.owner.lookup_token(self.headers.get("X-Auth-Token", "")):
                self._error(401, "Unauthorized", "The request you have made requires authentication.")
                return
            body = self.owner.lookup_token(token)
            if body is None:
                self._error(404, "Not Found", "Could not find token.")
            else:
                self._send_json(200, body, {"X-Subject-Token": token})
        else:
            self._error(404, "Not Found", f"{path} is not served by this Keystone stand-in")

    do_HEAD = do_GET

    def do_POST(self) -> None:
        path = urllib.parse.urlsplit(self.path).path.rstrip("/")
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if path != "/v3/auth/tokens":
            self._error(404, "Not Found", f"{path} is not served by this Keystone stand-in")
            return
        try:
            body = json.loads(raw or b"{}")
            token, token_body = self.owner.issue_token(body)
        except (ValueError, AttributeError) as exc:
            self._error(400, "Bad Request", f"malformed auth request: {exc}")
        except AuthFailed as exc:
            self._error(401, "Unauthorized", f"The request you have made requires authentication. ({exc})")
        except (OSError, RuntimeError) as exc:
            self._error(503, "Service Unavailable", f"Swift login failed: {exc}")
        else:
            self._send_json(201, token_body, {"X-Subject-Token": token})


def _parse_user(text: str) -> tuple[str, str]:
    account, user, key = text.split(":", 2)
    return f"{account}:{user}", key


def _parse_app_cred(text: str) -> tuple[str, tuple[str, str]]:
    app_id, secret, account, user = text.split(":", 3)
    return app_id, (secret, f"{account}:{user}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--swift-auth-url", required=True, help="tempauth URL, e.g. http://127.0.0.1:8080/auth/v1.0")
    parser.add_argument(
        "--user", action="append", default=[], metavar="ACCOUNT:USER:KEY", help="a tempauth user (repeatable)"
    )
    parser.add_argument(
        "--app-cred",
        action="append",
        default=[],
        metavar="ID:SECRET:ACCOUNT:USER",
        help="an application credential standing for a tempauth user (repeatable)",
    )
    parser.add_argument(
        "--credentials",
        metavar="FILE",
        help='a JSON file {"users": [...], "app_creds": [...]} of the two forms above: off the command line, '
        "which every local user can read",
    )
    parser.add_argument("--tag", help="ignored; lets a supervisor recognise this process by its command line")
    args = parser.parse_args(argv)
    given = {"users": [], "app_creds": []}
    if args.credentials:
        with open(args.credentials, encoding="utf-8") as file:
            given = json.load(file)
    users = dict(_parse_user(u) for u in [*args.user, *given.get("users", [])])
    app_creds = dict(_parse_app_cred(a) for a in [*args.app_cred, *given.get("app_creds", [])])
    standin = KeystoneStandin(args.swift_auth_url, users, app_creds, host=args.host, port=args.port).start()
    # SIGTERM ends the process cleanly (server socket closed) instead of with a traceback.
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=standin.stop, daemon=True).start())
    print(f"keystone-standin: serving {standin.url}", file=sys.stderr, flush=True)
    try:
        standin.serve_forever()
    except KeyboardInterrupt:
        standin.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
