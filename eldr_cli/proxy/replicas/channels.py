"""The pub/sub side of :class:`eldr_cli.proxy.replicas.shared.RedisState`: run-time changes out (signed, at
the next configuration version, with the snapshot rewritten) and in (verified and versioned by
:mod:`eldr_cli.proxy.replicas.configsync`, then validated by the host like a local change), and the
subscription that also carries the counts messages."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from eldr_cli.proxy.replicas.auth import Envelope
from eldr_cli.proxy.replicas.configsync import CONFIG_TTL_MS, MAX_CONFIG_BYTES, ConfigSync

log = logging.getLogger("eldr.proxy.state")

HEARTBEAT_S = 0.1
CHANGE_KINDS = ("policy", "workers", "reload", "health")


class ChannelsMixin:
    """Needs ``_redis``, ``_host``, ``configs``, ``_channel``, ``_counts_channel``, ``_tasks``, ``ns``,
    ``env``, ``_failed`` and ``_on_counts`` (all set by RedisState)."""

    _redis: Any
    _host: Any
    configs: ConfigSync
    _channel: str
    _counts_channel: str
    _tasks: list[asyncio.Task[None]]
    ns: str
    env: Envelope | None

    def _failed(self, e: BaseException, *, outage: bool = True) -> None: ...

    def _on_counts(self, data: bytes) -> None: ...

    def publish_change(self, action: str, body: dict[str, Any]) -> None:
        """A change applied here: published at the next version, and the snapshot rewritten."""
        if self._redis is None or self._host is None:
            return
        self._spawn_publish(self.configs.seal_change(action, body), self._channel)
        snapshot = self.configs.seal_snapshot(self._host.current_config())
        self._spawn(self._redis.set(self.configs.key, snapshot, px=CONFIG_TTL_MS))

    def _spawn_publish(self, msg: bytes, channel: str) -> None:
        self._spawn(self._publish(msg, channel))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(self._quiet(coro))
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    async def _quiet(self, coro: Any) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a failed write: the next heartbeat repairs it
            self._failed(e, outage=False)

    async def _publish(self, msg: bytes, channel: str) -> None:
        try:
            await asyncio.wait_for(self._redis.publish(channel, msg), timeout=1.0)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._failed(e, outage=False)
            if channel == self._channel:
                log.warning("a run-time change was not shared (Redis unreachable): other replicas keep theirs",
                            extra={"event": "state", "error": str(e)})

    async def _say_goodbye(self, key: str, ttl_ms: int, member: str) -> None:
        """A clean stop: a signed goodbye on the counts channel and in this replica's heartbeat ``key`` (for a
        replica that misses the message; no counts left behind), ``member`` off the registry. The others drop
        this replica at once and refuse its origin from then on (:mod:`eldr_cli.proxy.replicas.peers`). Best
        effort: Redis may be gone."""
        assert self.env is not None
        bye = self.env.seal("bye", {})
        try:
            pipe = self._redis.pipeline(transaction=False)
            pipe.publish(self._counts_channel, bye).set(key, bye, px=ttl_ms).srem(f"{self.ns}:replicas", member)
            await asyncio.wait_for(pipe.execute(), timeout=1.0)
        except Exception:
            pass

    async def _subscribe_loop(self) -> None:
        while True:
            pubsub = None
            try:
                pubsub = self._redis.pubsub()
                await pubsub.subscribe(self._channel, self._counts_channel)
                while True:
                    m = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if m is None or m.get("type") != "message":
                        continue
                    ch = m["channel"].decode() if isinstance(m["channel"], bytes) else m["channel"]
                    if ch == self._counts_channel:
                        self._on_counts(m["data"])
                    else:
                        self._on_message(m["data"])
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._failed(e, outage=False)
                await asyncio.sleep(HEARTBEAT_S)
            finally:
                if pubsub is not None:
                    try:
                        await pubsub.aclose()
                    except Exception:
                        pass

    def _on_message(self, data: bytes) -> None:
        """A run-time change from another replica: verified and versioned here (``configsync``), validated
        by the host like a local one."""
        if len(data) > MAX_CONFIG_BYTES:
            self.configs.env.reject("oversized")
            return
        got = self.configs.open_change(data, CHANGE_KINDS)
        if got is not None and self._host is not None:
            self._host.apply_remote_change(*got)
