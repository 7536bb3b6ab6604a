"""Admin endpoints (``/admin/policy``, ``/admin/workers``, ``/admin/reload``; bearer token) and the same
changes arriving from other replicas through the shared state."""

from __future__ import annotations

import hmac
import logging
from typing import Any

import orjson

from eldr_cli.constraints import validate_parameter
from eldr_cli.errors import EldrError, InvalidParameterError
from eldr_cli.proxy.config import check_worker_url
from eldr_cli.proxy.http import Receive, Refused, Scope, Send, error_body, send_json
from eldr_cli.proxy.parts import AppParts
from eldr_cli.routing import RoutingModel
from eldr_cli.routing.registry import check_policy

log = logging.getLogger("eldr.proxy")


def validate_policy_change(body: dict[str, Any], *, policy: str, tau: float | None) -> tuple[str, float | None]:
    """The (policy name, tau override) a ``POST /admin/policy`` body asks for; keys it leaves out keep the
    current ``policy`` and ``tau``. tau is checked against its declaration (eldr_cli.constraints), as the
    CLI and the config file check it; InvalidParameterError otherwise. The policy name is checked when
    the policy is built. A plain function: local and remote changes can go through the same check."""
    name = body.get("policy", policy)
    if not isinstance(name, str):
        raise InvalidParameterError("policy", f"policy must be a name, got {name!r}")
    try:
        check_policy(name, servable=True)
    except EldrError as e:  # the registry's one message, as the CLI and the config file give it
        raise InvalidParameterError("policy", str(e)) from None
    new_tau = body.get("tau", tau)
    return name, None if new_tau is None else validate_parameter("tau", new_tau)


class AdminMixin(AppParts):
    """Admin API of :class:`eldr_cli.proxy.app.ProxyApp`."""

    def apply_remote_change(self, action: str, body: dict[str, Any]) -> None:
        """A run-time change another replica made (and validated) applied here too."""
        m = self.metrics
        if action == "health":
            role, url, healthy = body.get("role"), body.get("url"), body.get("healthy")
            if role not in ("prefill", "decode") or not isinstance(url, str) or not isinstance(healthy, bool):
                m.child(m.admin_actions, action, "remote_refused").inc()
                return
            pool = self.state.prefill if role == "prefill" else self.state.decode
            w = pool.find(url)
            if w is not None and w.healthy != bool(body.get("healthy")):
                w.healthy = bool(body.get("healthy"))
                w.fail_streak = w.ok_streak = 0
                to = "up" if w.healthy else "down"
                m.child(m.health_transitions, w.role, w.id, to).inc()
                log.warning(f"worker {to} (seen by another replica)",
                            extra={"event": "health", "worker": w.id, "url": w.url, "to": to, "remote": True})
            return
        handler = {"policy": self._admin_policy, "workers": self._admin_workers,
                   "reload": self._admin_reload}.get(action)
        if handler is None:
            return
        try:
            handler(body)
        except Refused as e:  # same config on every replica: only a diverged replica gets here
            m.child(m.admin_actions, action, "remote_refused").inc()
            log.error("a change made on another replica was refused here", extra={
                "event": "admin", "action": action, "reason": str(e), "remote": True})
            return
        m.child(m.admin_actions, action, "remote_ok").inc()
        log.info("admin (from another replica)", extra={"event": "admin", "action": action, "body": body,
                                                         "remote": True})

    def current_config(self) -> dict[str, Any]:
        """The run-time configuration replicas agree on (the signed snapshot's content)."""
        st = self.state
        return {"policy": st.policy_name, "tau": st.tau_override, "routing": st.routing_path,
                "prefill": [w.url for w in st.prefill], "decode": [w.url for w in st.decode],
                "down": sorted(f"{w.role}|{w.url}" for w in [*st.prefill, *st.decode] if not w.healthy)}

    def adopt_config(self, c: dict[str, Any]) -> None:
        """The cluster's configuration (a newer signed snapshot: changes made while this replica was down,
        or missed): validated like an admin change, then applied in one go."""
        m, st = self.metrics, self.state
        try:
            pools: dict[str, list[str]] = {}
            for role in ("prefill", "decode"):
                urls = c.get(role)
                if not isinstance(urls, list) or not urls or not all(isinstance(u, str) for u in urls):
                    raise Refused(f"{role} must be a non-empty list of URLs")
                for u in urls:
                    check_worker_url(u, role)
                pools[role] = urls
            down = c.get("down", [])
            if not isinstance(down, list) or not all(isinstance(d, str) for d in down):
                raise Refused("down must be a list")
            model = st.model
            if c.get("routing") != st.routing_path:
                if not isinstance(c.get("routing"), str):
                    raise Refused("routing must be a path")
                model = RoutingModel.load(c["routing"])
            name, tau = validate_policy_change(c, policy=st.policy_name, tau=st.tau_override)
            router = st.make(name, len(pools["decode"]), model, tau)
        except (EldrError, Refused) as e:
            m.child(m.admin_actions, "config", "remote_refused").inc()
            log.error("the cluster's configuration was refused here", extra={
                "event": "admin", "action": "config", "reason": str(e), "remote": True})
            return
        for role, urls in pools.items():
            self._sync_pool(st.prefill if role == "prefill" else st.decode, urls)
        for w in [*st.prefill, *st.decode]:
            w.healthy = f"{w.role}|{w.url}" not in down
        st.model, st.routing_path, st.router, st.tau_override = model, c.get("routing"), router, tau
        self._build_dispatch()
        m.child(m.admin_actions, "config", "remote_ok").inc()
        log.info("adopted the cluster's configuration", extra={"event": "admin", "action": "config",
                                                               "remote": True, "policy": name})

    def _sync_pool(self, pool: Any, urls: list[str]) -> None:
        """``pool`` made to hold exactly ``urls``, in that order (kept workers keep their ids and counts)."""
        urls = list(dict.fromkeys(u.rstrip("/") for u in urls))
        for w in list(pool):
            if w.url not in urls:
                pool.remove(w.url)
                self._spawn(self._close_when_drained(w))
        for u in urls:
            if pool.find(u) is None:
                self._open(pool.add(u))
        have = {w.url: w for w in pool}
        pool.workers = [have[u] for u in urls]

    # -- admin ----------------------------------------------------------------------------------
    async def _admin(self, path: str, method: str, scope: Scope, receive: Receive, send: Send) -> None:
        m = self.metrics
        action = path.rsplit("/", 1)[-1]
        if action not in ("policy", "workers", "reload"):
            action = "other"  # bounded label values: the path is client-controlled
        token = self.cfg.admin_token
        if not token:
            m.child(m.admin_actions, action, "disabled").inc()
            return await send_json(send, 403, error_body("admin endpoints are disabled; start the proxy with "
                                                    "ELDR_ADMIN_TOKEN or --admin-token-file", "permission_error", 403))
        auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if not hmac.compare_digest(auth, b"Bearer " + token.encode()):
            m.child(m.admin_actions, action, "unauthorized").inc()
            return await send_json(send, 401, error_body("missing or wrong bearer token", "authentication_error", 401),
                                    [(b"www-authenticate", b"Bearer")])
        if method == "GET":
            return await send_json(send, 200, self._pools())
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if len(raw) > 1 << 20:
                return await send_json(send, 413, error_body("admin body too large", "invalid_request_error", 413))
            if not msg.get("more_body", False):
                break
        try:
            body = orjson.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
        except ValueError as e:
            m.child(m.admin_actions, action, "bad_request").inc()
            return await send_json(send, 400, error_body(f"invalid JSON: {e}", "invalid_request_error", 400))
        handler = {"policy": self._admin_policy, "workers": self._admin_workers,
                   "reload": self._admin_reload}.get(action)
        if handler is None:
            return await send_json(send, 404, error_body(f"no admin action {action!r}", "not_found_error", 404))
        try:
            result = handler(body)
        except Refused as e:
            m.child(m.admin_actions, action, "refused").inc()
            log.warning("admin refused", extra={"event": "admin", "action": action, "reason": str(e)})
            return await send_json(send, e.status, error_body(str(e), "invalid_request_error", e.status))
        m.child(m.admin_actions, action, "ok").inc()
        log.info("admin", extra={"event": "admin", "action": action, "body": body})
        self.state.shared.publish_change(action, body)  # validated and applied here: every replica follows
        return await send_json(send, 200, result)

    def _pools(self) -> dict[str, Any]:
        st = self.state
        return {"policy": st.policy_name, "tau": st.tau_effective(), "routing": st.routing_path,
                "k": None if st.model is None else st.model.n_clusters,
                "prefill": [w.as_dict() for w in st.prefill], "decode": [w.as_dict() for w in st.decode]}

    def _admin_policy(self, body: dict[str, Any]) -> dict[str, Any]:
        st = self.state
        try:
            name, tau = validate_policy_change(body, policy=st.policy_name, tau=st.tau_override)
        except EldrError as e:  # a bad tau, or a name the registry does not hold
            raise Refused(str(e)) from None
        try:
            router = st.make(name, len(st.decode), st.model, tau)
        except EldrError as e:
            raise Refused(str(e)) from None
        st.router, st.tau_override = router, tau
        self._build_dispatch()
        return self._pools()

    def _admin_workers(self, body: dict[str, Any]) -> dict[str, Any]:
        st = self.state
        action, role, url = body.get("action"), body.get("role"), body.get("url")
        if action not in ("add", "remove") or role not in ("prefill", "decode") or not isinstance(url, str) \
                or not url.startswith("http://"):
            raise Refused('expected {"action": "add"|"remove", "role": "prefill"|"decode", "url": "http://..."}')
        if action == "add":
            try:  # the same URL rules as --prefill/--decode at start-up
                check_worker_url(url, "url")
            except EldrError as e:
                raise Refused(str(e)) from None
        pool = st.prefill if role == "prefill" else st.decode
        n_new = len(pool) + (1 if action == "add" else -1)
        if n_new < 1:
            raise Refused(f"refusing to remove the last {role} worker")
        if role == "decode":
            if st.policy_name == "eldr" and st.model is not None and st.model.n_clusters != n_new:
                raise Refused(
                    f"the routing artifact has K={st.model.n_clusters} centroids, the decode pool would have "
                    f"{n_new} workers; send POST /admin/reload {{\"routing\": DIR, \"decode\": [...]}} with an "
                    f"artifact fitted for K={n_new} (or switch policy first)", status=409)
        try:
            if action == "add":
                w = pool.add(url)
                self._open(w)
            else:
                w = pool.remove(url)
                self._spawn(self._close_when_drained(w))
        except ValueError as e:
            raise Refused(str(e), status=409) from None
        if role == "decode":
            st.router = st.make(st.policy_name, len(st.decode), st.model, st.tau_override)
            self._build_dispatch()
        return self._pools()

    def _admin_reload(self, body: dict[str, Any]) -> dict[str, Any]:
        st = self.state
        path = body.get("routing")
        if not isinstance(path, str):
            raise Refused('expected {"routing": "DIR"} (optionally "decode": [urls] to swap the pool at once)')
        try:
            model = RoutingModel.load(path)
        except EldrError as e:
            raise Refused(f"cannot load routing artifact {path}: {e}") from None
        new_urls = body.get("decode")
        if new_urls is not None:
            if not isinstance(new_urls, list) or not new_urls or not all(
                    isinstance(u, str) and u.startswith("http://") for u in new_urls):
                raise Refused('"decode" must be a non-empty list of http:// URLs')
            n = len({u.rstrip("/") for u in new_urls})
        else:
            n = len(st.decode)
        if model.n_clusters != n:
            raise Refused(f"routing artifact {path} has K={model.n_clusters} centroids but the decode pool has "
                           f"{n} workers; refit with `eldr fit --decoders {n}` or pass the matching pool "
                           f"in \"decode\"", status=409)
        try:
            router = st.make(st.policy_name, n, model, st.tau_override)
        except EldrError as e:
            raise Refused(str(e)) from None
        if new_urls is not None:  # swap the decode pool: keep workers that stay, open new, drain removed
            keep = {u.rstrip("/") for u in new_urls}
            for w in list(st.decode):
                if w.url not in keep:
                    st.decode.remove(w.url)
                    self._spawn(self._close_when_drained(w))
            have = {w.url: w for w in st.decode}
            ordered = []
            for u in new_urls:
                u = u.rstrip("/")
                if u in have:
                    ordered.append(have[u])
                elif u not in {w.url for w in ordered}:
                    w = st.decode.add(u)
                    st.decode.workers.remove(w)
                    self._open(w)
                    ordered.append(w)
            st.decode.workers = ordered
        st.model, st.routing_path, st.router = model, path, router
        self._build_dispatch()
        return self._pools()
