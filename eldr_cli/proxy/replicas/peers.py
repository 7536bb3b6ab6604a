"""Which other replicas are alive, judged on this replica's clock by what their signed messages say.

A replica's messages carry a sequence number that grows with every message it seals
(:class:`eldr_cli.proxy.replicas.auth.Envelope`), and its origin is one process start (a random id). A
receiver keeps, per origin, the highest number it has verified and when (its own monotonic clock) that
number last grew. An origin counts as alive only while its number grew within ``bound_s``: a captured
message replayed on the channel or written back under the replica's key carries a number already seen, so
it keeps nobody alive, whatever its time stamp says (issue 36: a replayed heartbeat used to keep a stopped
replica's loads for the 5 s time window).

A replica that stops cleanly seals a goodbye (kind ``bye``) with its last number: its receivers drop it at
once and refuse its origin from then on (``ended``), so not even a message they never saw brings it back.
An attacker who suppresses the goodbye gains at most ``bound_s`` after the last number a receiver saw grow,
the same bound as a replica that crashed. What remains: messages a receiver never saw (it started after
them, or its subscription was down) each count once as new, never past the sender's time window.
"""

from __future__ import annotations

import time
from collections.abc import Callable

MEMORY_S = 60.0  # an origin is remembered this long after its last news: its older messages are stale by then


class Peers:
    """Per origin: the highest verified sequence and when it last grew; origins that said goodbye."""

    def __init__(self, bound_s: float, clock: Callable[[], float] = time.monotonic, memory_s: float = MEMORY_S):
        self.bound_s, self.memory_s, self._clock = bound_s, memory_s, clock
        self._top: dict[str, tuple[int, float]] = {}  # origin -> (highest sequence, when it grew)
        self._ended: dict[str, float] = {}  # origin -> when its goodbye arrived

    def grew(self, origin: str, seq: int) -> bool:
        """True when ``seq`` is news from ``origin`` (above every sequence seen from it): its state is to be
        kept. A replayed or reordered older message, or any message of an ended origin: False."""
        if origin in self._ended:
            return False
        top = self._top.get(origin)
        if top is not None and seq <= top[0]:
            return False
        self._top[origin] = (seq, self._clock())
        return True

    def alive(self, origin: str) -> bool:
        """Its sequence grew within ``bound_s`` (and it did not say goodbye)."""
        top = self._top.get(origin)
        return top is not None and origin not in self._ended and self._clock() - top[1] <= self.bound_s

    def end(self, origin: str) -> None:
        """``origin`` said goodbye: dead now, and every later message of it refused."""
        self._ended[origin] = self._clock()
        self._top.pop(origin, None)

    def ended(self, origin: str) -> bool:
        return origin in self._ended

    def forget_old(self) -> None:
        """Drop what is older than ``memory_s``: each entry is made by a verified message, so the memory is
        bounded by the replicas that ran in the last minute."""
        cutoff = self._clock() - self.memory_s
        self._top = {o: t for o, t in self._top.items() if t[1] >= cutoff}
        self._ended = {o: t for o, t in self._ended.items() if t >= cutoff}
