"""The counts payload of the shared state: ``{"c": {"role|url": in-flight}, "v": {name: {"role|url": [int]}}}``
(``v`` only when a stateful policy keeps per-worker vectors), checked on arrival and summed over replicas."""

from __future__ import annotations

from typing import Any

Counts = dict[str, int]
Vectors = dict[str, dict[str, list[int]]]
MAX_VECTOR_LEN = 4096


def parse_counts(p: Any) -> tuple[Counts, Vectors]:
    """Counts and vectors of a verified counts payload, type-checked (raises on anything else)."""
    counts, vectors = p["c"], p.get("v", {})
    if not isinstance(counts, dict) or not isinstance(vectors, dict) \
            or any(type(c) is not int or c < 0 for c in counts.values()) \
            or any(not isinstance(v, list) or len(v) > MAX_VECTOR_LEN or type(sum(v)) is not int  # ints only
                   for per in vectors.values() for v in per.values()):
        raise ValueError("counts must be non-negative integers, vectors lists of at most MAX_VECTOR_LEN integers")
    return counts, vectors


def sum_counts(states: list[tuple[Counts, Vectors]]) -> tuple[Counts, Vectors]:
    """Counts and vectors summed over replicas (vectors element-wise, the shorter zero-padded)."""
    remote: Counts = {}
    vectors: Vectors = {}
    for counts, vecs in states:
        for k, v in counts.items():
            remote[k] = remote.get(k, 0) + v
        for name, per_worker in vecs.items():
            acc = vectors.setdefault(name, {})
            for k, vec in per_worker.items():
                acc[k] = _add(acc.get(k), vec)
    return remote, vectors


def _add(acc: list[int] | None, vec: list[int]) -> list[int]:
    if acc is None:
        return list(vec)
    return [(acc[i] if i < len(acc) else 0) + (vec[i] if i < len(vec) else 0)
            for i in range(max(len(acc), len(vec)))]
