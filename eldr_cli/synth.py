"""Generated traces with known structure, for tests, benchmarks and a model-free demo.

Each domain prefers its own experts at the *informative* layers; the other layers draw from one
distribution shared by all requests, so they carry no signal. Counts are drawn from multinomials
(prefill) and binomials (decode) around each request's expert distribution. These are generated
figures: real traces come from ``eldr capture``.
"""

from __future__ import annotations

import numpy as np

from eldr_cli.artifacts.trace import Trace


def synthetic_trace(n_requests: int = 1000, num_layers: int = 48, num_experts: int = 128, top_k: int = 8,
                    n_domains: int = 4, informative_layers: list[int] | None = None,
                    domain_weights: list[float] | None = None, decode_steps: int = 128,
                    prompt_tokens: tuple[int, int] = (40, 400), concentration: float = 0.3,
                    request_noise: float = 0.5, with_gates: bool = True, with_picks: bool = False,
                    seed: int = 0) -> Trace:
    import polars as pl

    rng = np.random.default_rng(seed)
    R, L, E, k = n_requests, num_layers, num_experts, top_k
    if informative_layers is None:
        informative_layers = list(range(0, L, 2))
    informative = np.zeros(L, dtype=bool)
    informative[informative_layers] = True
    w = np.asarray(domain_weights if domain_weights is not None else np.ones(n_domains), dtype=float)
    w = w / w.sum()
    domain = rng.choice(n_domains, size=R, p=w)
    shared = rng.dirichlet(np.full(E, 1.0), size=L)                       # [L, E]
    dom_pref = rng.dirichlet(np.full(E, concentration), size=(n_domains, L))  # [D, L, E]
    base = np.where(informative[None, :, None], dom_pref, shared[None])     # [D, L, E]
    noise = rng.dirichlet(np.full(E, 1.0), size=(R, L))                    # [R, L, E]
    q = (1 - request_noise) * base[domain] + request_noise * noise
    q /= q.sum(axis=2, keepdims=True)
    # decode follows the same distribution at informative layers; elsewhere its request-specific
    # part is drawn afresh, so those layers' prefill counts say nothing about decode
    fresh = rng.dirichlet(np.full(E, 1.0), size=(R, L))
    q_dec = np.where(informative[None, :, None], q,
                     (1 - request_noise) * base[domain] + request_noise * fresh)
    q_dec /= q_dec.sum(axis=2, keepdims=True)
    T = rng.integers(prompt_tokens[0], prompt_tokens[1] + 1, size=R)
    prefill = np.empty((R, L, E), dtype=np.int32)
    for r in range(R):
        prefill[r] = rng.multinomial(T[r] * k, q[r])
    steps = np.full(R, decode_steps, dtype=np.int32)
    p_step = np.minimum(1.0, k * q_dec)
    decode = rng.binomial(steps[:, None, None], p_step).astype(np.int32)
    gate_prob = gate_logit = None
    if with_gates:  # gate sums: smoothed versions of the routing distribution plus token noise
        jitter = rng.lognormal(0.0, 0.5, size=(R, L, E))
        gate_prob = (T[:, None, None] * (0.5 * q * jitter + 0.5 / E)).astype(np.float32)
        gate_logit = (T[:, None, None] * np.log(q * jitter + 1e-2)).astype(np.float32)
    picks = offsets = None
    if with_picks:
        # per step: k distinct experts per layer, drawn by Gumbel top-k from q
        S = int(steps.sum())
        picks = np.empty((S, L, k), dtype=np.int16)
        offsets = np.concatenate([[0], np.cumsum(steps)]).astype(np.int64)
        logq = np.log(q_dec + 1e-12)
        for r in range(R):
            g = logq[r][None] + rng.gumbel(size=(steps[r], L, E))
            picks[offsets[r]:offsets[r + 1]] = np.argpartition(-g, k, axis=2)[:, :, :k]
        decode = np.zeros((R, L, E), dtype=np.int32)
        for r in range(R):
            pr = picks[offsets[r]:offsets[r + 1]].astype(np.int64)
            idx = (np.arange(L)[None, :, None] * E + pr).ravel()
            decode[r] = np.bincount(idx, minlength=L * E).reshape(L, E)
    names = [f"d{i}" for i in range(n_domains)]
    n_cal = max(1, int(0.8 * R)) if R > 1 else R
    split = np.where(rng.permutation(R) < n_cal, "calibration", "evaluation")
    requests = pl.DataFrame({
        "request_id": [f"synth-{r}" for r in range(R)],
        "domain": [names[d] for d in domain],
        "language": ["en"] * R,
        "prompt_tokens": T.astype(np.int32),
        "decode_tokens": steps,
        "source": ["synthetic"] * R,
        "split": split.tolist(),
        "prompt": [f"synthetic prompt {r} of domain {names[domain[r]]}" for r in range(R)],
    })
    return Trace(prefill_counts=prefill, decode_counts=decode, decode_steps=steps, requests=requests,
                 model={"model": "synthetic", "family": "synthetic", "num_layers": L, "num_experts": E,
                        "top_k": k, "moe_layer_ids": list(range(L))},
                 prefill_gate_prob=gate_prob, prefill_gate_logit=gate_logit,
                 decode_picks=picks, decode_offsets=offsets)
