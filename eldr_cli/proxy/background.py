"""One bounded queue and one thread off the request path (the decision log's writer, the drift watch's
scorer): the request path offers an item and never blocks; the thread handles items in order; ``drain`` waits
until everything offered before it is handled; ``close`` stops the thread after the items already queued."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


class QueueThread:
    """``handle(item)`` for every offered item, on one daemon thread named ``name``; ``on_drain()`` (if given) runs
    on that thread when a :meth:`drain` reaches it (a file flush). ``handle`` must not raise."""

    def __init__(self, name: str, handle: Callable[[Any], None], maxsize: int,
                 on_drain: Callable[[], None] | None = None):
        self.name, self._handle, self._on_drain = name, handle, on_drain
        self._q: queue.Queue[Any] = queue.Queue(maxsize=maxsize)
        self._thread = threading.Thread()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        """Start the thread (again after :meth:`close`)."""
        if not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def offer(self, item: Any) -> bool:
        """Queue ``item`` without blocking; False when the queue is full (the caller counts the loss)."""
        try:
            self._q.put_nowait(item)
        except queue.Full:
            return False
        return True

    def _run(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                if isinstance(item, threading.Event):
                    if self._on_drain is not None:
                        self._on_drain()
                    item.set()
                    continue
                self._handle(item)
            finally:
                self._q.task_done()

    def drain(self, timeout_s: float = 10.0) -> None:
        """Wait (at most ``timeout_s``) until every item queued before this call is handled."""
        if not self._thread.is_alive():
            return
        done = threading.Event()
        try:
            self._q.put(done, timeout=timeout_s)
        except queue.Full:
            return
        done.wait(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread once the items already queued are handled (waits at most ``timeout_s``)."""
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join(timeout_s)
