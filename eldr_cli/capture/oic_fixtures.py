"""GENERATED trace trees in the Orders-in-Chaos layout, for tests and the import benchmark.

``<root>/<org>/<model>/<benchmark>/<subject>/<n>.json``: a list whose element 0 is the prefill
pass and elements 1..N one decode step each; each element maps every layer id (string) to a
list of per-token lists of k expert ids, or null for dense layers (here the even layers). Each
subject prefers its own block of experts so domains are distinguishable.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def write_oic_tree(root, *, n_per_subject: int = 3, subjects=(("mmlu", "law"), ("mmlu", "medicine"),
                                                                ("gsm8k", "main")),
                   org: str = "acme", model: str = "Tiny-MoE", num_layers: int = 8, num_experts: int = 16,
                   top_k: int = 2, prompt_tokens: tuple[int, int] = (5, 12), decode_steps: int = 6,
                   seed: int = 0) -> list[dict]:
    """Write the tree; returns the expected content per file (path, layers, prefill/decode picks)."""
    rng = np.random.default_rng(seed)
    moe = [l for l in range(num_layers) if l % 2 == 1]
    written = []
    for si, (bench, subject) in enumerate(subjects):
        d = Path(root) / org / model / bench / subject
        d.mkdir(parents=True, exist_ok=True)
        pref = (np.arange(num_experts) // max(1, num_experts // len(subjects))) == si
        p = np.where(pref, 4.0, 1.0)
        p /= p.sum()
        for n in range(n_per_subject):
            T = int(rng.integers(prompt_tokens[0], prompt_tokens[1] + 1))

            def picks(tokens, p=p):
                # Gumbel top-k: k distinct experts per token drawn by preference p
                g = np.log(p)[None, :] - np.log(-np.log(rng.random((tokens, num_experts))))
                return np.sort(np.argpartition(-g, top_k - 1, axis=1)[:, :top_k], axis=1).tolist()

            pre = {str(l): (picks(T) if l in moe else None) for l in range(num_layers)}
            steps = [{str(l): (picks(1) if l in moe else None) for l in range(num_layers)}
                     for _ in range(decode_steps)]
            f = d / f"{n}.json"
            f.write_text(json.dumps([pre] + steps))
            written.append({"path": f, "domain": subject, "source": bench, "prefill": pre, "steps": steps,
                            "moe_layers": moe})
    return written
