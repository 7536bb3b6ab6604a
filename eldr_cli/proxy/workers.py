"""Upstream workers, their load state and health (the prefill-side PrefixHash choice is a routing policy:
:mod:`eldr_cli.routing.prefill`).

Worker ids are stable for the life of the proxy: ``p<n>`` / ``d<n>`` handed out in order of
addition and never reused. The decode pool's *position* i is the worker the policies (and the
routing artifact's centroid i) call worker i.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eldr_cli.proxy.upstream import HttpPool

DOWN_LOAD = 1 << 30  # load shown to policies for a worker marked down


@dataclass(eq=False)
class Worker:
    id: str
    role: str                      # "prefill" | "decode"
    url: str
    healthy: bool = True
    inflight: int = 0              # requests dispatched by this proxy and not yet finished
    remote_inflight: int = 0       # other replicas' last published in-flight (shared state; 0 when local)
    remote_vectors: dict[str, list[int]] = field(default_factory=dict)  # name -> other replicas' sum
    scraped_running: int | None = None  # vllm:num_requests_running from the worker's /metrics
    scraped_tpot_ms: float | None = None  # mean vllm:time_per_output_token_seconds between the last two scrapes
    tpot_totals: tuple[float, float] | None = None  # (sum s, count) at the last scrape
    fail_streak: int = 0
    ok_streak: int = 0
    removed: bool = False
    session: HttpPool | None = field(default=None, repr=False)  # one keep-alive pool per upstream
    salt: int = 0

    def pool(self) -> HttpPool:
        """The worker's connection pool; a worker already closed (removed and drained) cannot connect."""
        if self.session is None:
            from eldr_cli.proxy.upstream import UpstreamError

            raise UpstreamError("connect", f"{self.role} worker {self.id} ({self.url}) is closed")
        return self.session

    def load(self, use_scraped: bool = False) -> int:
        """In-flight requests over all proxy replicas (this one's exact, the others' last published)."""
        inflight = self.inflight + self.remote_inflight
        if use_scraped and self.scraped_running is not None:
            return max(inflight, self.scraped_running)
        return inflight

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "role": self.role, "url": self.url, "healthy": self.healthy,
                "inflight": self.inflight, "cluster_inflight": self.inflight + self.remote_inflight,
                "scraped_running": self.scraped_running}


class WorkerPool:
    """An ordered set of workers of one role."""

    def __init__(self, role: str, urls: list[str]):
        self.role = role
        self.workers: list[Worker] = []
        self._next_id = 0
        for u in urls:
            self.add(u)

    def __len__(self) -> int:
        return len(self.workers)

    def __iter__(self) -> Iterator[Worker]:
        return iter(self.workers)

    def find(self, url: str) -> Worker | None:
        url = url.rstrip("/")
        for w in self.workers:
            if w.url == url:
                return w
        return None

    def add(self, url: str) -> Worker:
        url = url.rstrip("/")
        if self.find(url) is not None:
            raise ValueError(f"{self.role} worker {url} is already in the pool")
        wid = f"{self.role[0]}{self._next_id}"
        self._next_id += 1
        w = Worker(id=wid, role=self.role, url=url, salt=zlib.crc32(wid.encode()))
        self.workers.append(w)
        return w

    def remove(self, url: str) -> Worker:
        w = self.find(url)
        if w is None:
            raise ValueError(f"no {self.role} worker {url.rstrip('/')} in the pool")
        self.workers.remove(w)
        w.removed = True
        return w

    def loads(self, use_scraped: bool = False) -> list[int]:
        return [w.load(use_scraped) if w.healthy else DOWN_LOAD for w in self.workers]

    def healthy(self) -> list[Worker]:
        return [w for w in self.workers if w.healthy]
