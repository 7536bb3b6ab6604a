"""What a bench sends and when: prompts (JSONL, JSON list, or a trace artifact's requests) and the
arrival schedule (Poisson, or gamma inter-arrivals for burstiness, as `vllm bench serve`).

The schedule of one rate is a pure function of (prompts, rate, warmup, duration, burstiness, seed),
so `bench serve`, `bench sweep` and `bench simulate` send the same requests at the same offsets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eldr_cli.errors import EldrError

ROW_REF_PREFIX = "trace-row:"


def row_ref(request_id) -> str:
    """The prompt that stands for a trace row without text (imported traces): ``trace-row:<request_id>``.
    The emulator replays that row; the simulator keys PrefixHash prefill routing on the same string."""
    return f"{ROW_REF_PREFIX}{request_id}"


@dataclass(frozen=True)
class PromptItem:
    prompt: str
    domain: str | None = None
    request_id: str | None = None


def load_prompts(path: str | Path, split: str | None = None, limit: int | None = None) -> list[PromptItem]:
    """Prompts from a .jsonl (one object per line with "prompt", optional "domain"/"id"), a .json list
    of such objects or strings, or a trace artifact directory (its requests table; ``split`` filters;
    a row without prompt text, as every row of an imported trace, becomes its row reference
    :func:`row_ref`, which only an emulated cluster of that trace understands)."""
    p = Path(path)
    if not p.exists():
        raise EldrError(f"prompts file {p} does not exist")
    items: list[PromptItem] = []
    if p.is_dir():
        from eldr_cli.artifacts.store import Artifact

        art = Artifact(p, kind="trace")
        df = art.table("requests")
        if split and split != "all":
            df = df.filter(df["split"] == split)
        n = df.height
        texts = df["prompt"] if "prompt" in df.columns else [None] * n
        doms = df["domain"] if "domain" in df.columns else [None] * n
        for rid, dom, pr in zip(df["request_id"], doms, texts, strict=True):
            text = str(pr) if pr is not None and str(pr).strip() else row_ref(rid)
            items.append(PromptItem(text, str(dom) if dom is not None else None, str(rid)))
    else:
        text = p.read_text(encoding="utf-8", errors="replace")
        rows: list = []
        if p.suffix == ".json":
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise EldrError(f"{p} is not valid JSON: {e}") from None
            rows = obj if isinstance(obj, list) else []
        else:
            for i, line in enumerate(text.splitlines()):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    raise EldrError(f"{p}:{i + 1} is not a JSON object; expected one "
                                    '{"prompt": ..., "domain": ...} per line') from None
        for i, r in enumerate(rows):
            if isinstance(r, str):
                items.append(PromptItem(r, None, str(i)))
            elif isinstance(r, dict) and isinstance(r.get("prompt"), str) and r["prompt"].strip():
                items.append(PromptItem(r["prompt"], r.get("domain"), str(r.get("id", i))))
    if not items:
        raise EldrError(f"{p} contains no prompts",
                        hint='give a JSONL file with {"prompt": "..."} per line or a trace artifact')
    if limit:
        items = items[:limit]
    return items


def parse_rates(text: str | list) -> list[float]:
    vals = text if isinstance(text, list) else [x for x in str(text).replace(" ", "").split(",") if x]
    out = []
    for v in vals:
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise EldrError(f"rate {v!r} is not a number; give positive req/s like 20,40,60") from None
        if not np.isfinite(f) or f <= 0:
            raise EldrError(f"rate {v!r} is not a positive number of requests per second")
        out.append(f)
    if not out:
        raise EldrError("no request rates given; pass --rates 20,40,60")
    return out


@dataclass
class Schedule:
    """One rate's requests: send offsets (s from the start) and prompt indices; ``warmup`` flags the
    requests sent before ``warmup_s`` (sent, but not measured)."""

    rate: float
    offsets: np.ndarray      # float64 [N], increasing
    prompt_index: np.ndarray  # int64 [N]
    warmup: np.ndarray        # bool [N]
    warmup_s: float
    duration_s: float

    def __len__(self) -> int:
        return int(self.offsets.size)


def build_schedule(n_prompts: int, rate: float, *, duration_s: float, warmup_s: float = 0.0,
                   burstiness: float = 1.0, seed: int = 0) -> Schedule:
    """Arrivals over [0, warmup + duration): gamma inter-arrivals with shape ``burstiness`` and mean
    1/rate (burstiness 1 = Poisson; < 1 burstier, > 1 more regular). Prompts in shuffled passes."""
    if rate <= 0 or duration_s <= 0 or warmup_s < 0 or burstiness <= 0:
        raise EldrError("rate, duration and burstiness must be > 0 and warmup >= 0")
    rng = np.random.default_rng([seed, int(round(rate * 1000))])
    horizon = warmup_s + duration_s
    n_guess = int(rate * horizon * 1.3 + 20)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n_guess)
    t = np.cumsum(gaps)
    while t[-1] < horizon:
        more = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n_guess)
        t = np.concatenate([t, t[-1] + np.cumsum(more)])
    t = t[t < horizon]
    passes = int(np.ceil(max(len(t), 1) / n_prompts)) + 1
    order = np.concatenate([rng.permutation(n_prompts) for _ in range(passes)])[: len(t)]
    return Schedule(rate=float(rate), offsets=t, prompt_index=order.astype(np.int64), warmup=t < warmup_s,
                    warmup_s=float(warmup_s), duration_s=float(duration_s))


class ScaledArrivals:
    """One seed's arrivals for every rate (common random numbers): a unit-rate process (gamma gaps of shape
    ``burstiness``) and a prompt order in shuffled passes, both drawn in fixed blocks from
    ``(seed, block)`` so the sequence is the same however far it is read. The schedule at rate ``r`` is
    that process with its times divided by ``r``: a higher rate sends the same requests closer together,
    so an SLO check over rates (a capacity search) sees load change and nothing else."""

    BLOCK = 4096

    def __init__(self, n_prompts: int, *, seed: int = 0, burstiness: float = 1.0):
        if n_prompts < 1 or burstiness <= 0:
            raise EldrError("arrivals need at least one prompt and burstiness > 0")
        self.n_prompts, self.seed, self.burstiness = int(n_prompts), int(seed), float(burstiness)
        self._t = np.zeros(0)
        self._idx = np.zeros(0, dtype=np.int64)

    def _extend(self, horizon: float) -> None:
        """Draw blocks until the unit-rate process passes ``horizon``."""
        ts, idx = [self._t], [self._idx]
        end, b = (self._t[-1] if self._t.size else 0.0), self._t.size // self.BLOCK
        while end < horizon:
            rng = np.random.default_rng([self.seed, 0x5CA1ED, b])
            t = end + np.cumsum(rng.gamma(shape=self.burstiness, scale=1.0 / self.burstiness, size=self.BLOCK))
            passes = self.BLOCK // self.n_prompts + 1
            idx.append(np.concatenate([rng.permutation(self.n_prompts) for _ in range(passes)])[: self.BLOCK])
            ts.append(t)
            end, b = float(t[-1]), b + 1
        self._t, self._idx = np.concatenate(ts), np.concatenate(idx).astype(np.int64)

    def schedule(self, rate: float, *, duration_s: float, warmup_s: float = 0.0) -> Schedule:
        if rate <= 0 or duration_s <= 0 or warmup_s < 0:
            raise EldrError("rate and duration must be > 0 and warmup >= 0")
        horizon = (warmup_s + duration_s) * rate  # in unit-rate time
        if not self._t.size or self._t[-1] < horizon:
            self._extend(horizon)
        n = int(np.searchsorted(self._t, horizon, side="left"))
        t = self._t[:n] / rate
        return Schedule(rate=float(rate), offsets=t, prompt_index=self._idx[:n].copy(), warmup=t < warmup_s,
                        warmup_s=float(warmup_s), duration_s=float(duration_s))
