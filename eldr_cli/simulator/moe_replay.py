"""`eldr bench replay --device cuda`: the replayed decode batches' MoE time, MEASURED, per routing policy.

For each policy the closed-loop replay (:func:`eldr_cli.pipeline.evaluate.replay_batches`) gives the
steady-state (step, decoder) batches and their members' true picks at every MoE layer. A sample of those
batches (``max_steps`` per policy, seeded) is run as the model's MoE layers, layer by layer, with the batch's
real token-to-expert assignment: one TP rank's routed experts (width / TP) as a grouped GEMM over all experts
with per-expert row offsets (``torch._grouped_mm`` bf16, or ``torch._scaled_grouped_mm`` fp8 e4m3), the L
layers of a step captured in one CUDA graph per token count (the plans are copied into its static buffers
before each replay, outside the timed region; each graph checked against the eager step on its first two
plans) and timed with CUDA events: the step's MoE time. Weight banks
rotate over the layers (up to 4 distinct banks) so that one layer's experts are not found in L2 by the next.
On a CPU only a tiny shape runs (for tests), as the per-expert loop launched eagerly: its times are no GPU's.

Only the routed experts are timed: attention, dense layers and shared experts cost the same whatever the
routing, so the difference between policies is all here. Next to each policy's measured time, the cost
model's prediction for the same steps (its per-expert term ``kb * A`` and its whole step).
"""

from __future__ import annotations

import numpy as np

from eldr_cli.errors import EldrError

TINY = {"hidden": 64, "intermediate": 32}
MAX_BANKS = 4


def plans_of(picks: np.ndarray, num_experts: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer of ``picks`` int [n, L, k] (ids outside [0, E): none): (token order [rows], int32 cumulative
    row offsets [E]) -- the tokens grouped by expert, as a grouped GEMM takes them."""
    n, L, k = picks.shape
    out = []
    for layer in range(L):
        ids = picks[:, layer, :].reshape(-1).astype(np.int64)
        tok = np.repeat(np.arange(n), k)
        ok = (ids >= 0) & (ids < num_experts)
        ids, tok = ids[ok], tok[ok]
        o = np.argsort(ids, kind="stable")
        offs = np.cumsum(np.bincount(ids, minlength=num_experts)).astype(np.int32)
        out.append((tok[o], offs))
    return out


def _banks(shape: dict, dtype: str, dev, n_layers: int, seed: int):
    """Up to MAX_BANKS distinct MoE layers (weights drawn once), as functions ``moe(x, plan)``; as many as the
    GPU's free memory holds twice over."""
    import torch

    from eldr_cli.costmodel.moe_layer import _fp8_grouped, moe_form

    E, H, I = shape["num_experts"], shape["hidden"], shape["intermediate"]
    fp8 = dtype == "fp8"
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    n = min(MAX_BANKS, n_layers)
    if dev.type == "cuda":
        bank_bytes = 3 * E * H * I * dt.itemsize
        n = max(1, min(n, int(torch.cuda.mem_get_info()[0] // (2 * bank_bytes))))
    g = torch.Generator(device=dev).manual_seed(seed)

    def w(*s, fan):
        return (torch.randn(*s, generator=g, device=dev, dtype=dt) * fan ** -0.5).to(dt)

    out = []
    for _ in range(n):
        wg, wu, wd = w(E, H, I, fan=H), w(E, H, I, fan=H), w(E, I, H, fan=I)
        out.append(_fp8_grouped(torch.cat([wg, wu], dim=2), wd, I, dev) if fp8 else
                   moe_form(wg, wu, wd, I, "grouped" if dev.type == "cuda" else "loop"))
    return out


class StepTimer:
    """Times one decode step's routed experts over all L layers from its picks (see the module docstring):
    ``timer(picks [n, L, k]) -> ms``. CUDA graphs per token count n on a GPU; eager on a CPU."""

    def __init__(self, shape: dict, n_layers: int, *, device: str = "cuda", dtype: str = "bf16", repeats: int = 3,
                 seed: int = 0):
        import torch

        self.shape, self.L, self.repeats, self.dtype = shape, n_layers, repeats, dtype
        self.dev = torch.device(device)
        if self.dev.type == "cpu":
            torch.set_num_threads(1)  # a tiny shape on a shared CPU: more threads only contend (10x slower here)
        self.banks = _banks(shape, dtype, self.dev, n_layers, seed)
        self.graphs: dict[int, dict] = {}
        self.g = torch.Generator(device=self.dev).manual_seed(seed + 1)

    def _x(self, n: int):
        import torch

        dt = torch.bfloat16 if self.dev.type == "cuda" else torch.float32
        return torch.randn(n, self.shape["hidden"], generator=self.g, device=self.dev, dtype=dt)

    def _graph(self, n: int, k: int):
        """(static x, static orders [L, n*k], static offsets [L, E], replay) for n tokens of top-k."""
        import torch

        E = self.shape["num_experts"]
        x = self._x(n)
        orders = torch.zeros(self.L, n * k, dtype=torch.int64, device=self.dev)
        offs = torch.full((self.L, E), n * k, dtype=torch.int32, device=self.dev)

        def step():
            y = x
            for layer in range(self.L):  # + residual, as a decoder layer adds it: values stay bounded
                y = y + self.banks[layer % len(self.banks)](y, (orders[layer], offs[layer]))
            return y

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = step()
        return {"orders": orders, "offs": offs, "graph": g, "out": out, "step": step, "checked": 0}

    def _check(self, gr: dict) -> None:
        """The graph must run the plan now in its buffers (the grouped GEMM reads its row offsets on the GPU):
        its output equals the same step run eagerly, for the first two plans of each graph."""
        import torch

        gr["graph"].replay()
        got = gr["out"].clone()
        with torch.inference_mode():
            want = gr["step"]()
        if not torch.allclose(got.float(), want.float(), rtol=0.05, atol=0.05):
            raise EldrError("a CUDA graph replayed a stale expert assignment (its output differs from the eager "
                            "step's): this torch's grouped GEMM does not read its offsets on the GPU, so the "
                            "measured replay cannot reuse graphs", hint="report it with the torch version")
        gr["checked"] += 1

    def __call__(self, picks: np.ndarray) -> float:
        import torch

        n, _, k = picks.shape
        plans = plans_of(picks, self.shape["num_experts"])
        if self.dev.type != "cuda":
            return self._cpu(n, plans)
        if any(len(p[0]) != n * k for p in plans):  # padded picks: rows differ from n*k, no shared graph
            raise EldrError("the trace's decode picks have padding (ids outside the experts); a measured replay "
                            "needs every token's top-k")
        if n not in self.graphs:
            with torch.inference_mode():
                self.graphs[n] = self._graph(n, k)
        gr = self.graphs[n]
        gr["orders"].copy_(torch.from_numpy(np.stack([p[0] for p in plans])))
        gr["offs"].copy_(torch.from_numpy(np.stack([p[1] for p in plans])))
        if gr["checked"] < 2:
            self._check(gr)
        from eldr_cli.costmodel.decode_step import _cuda_median

        return _cuda_median(gr["graph"].replay, self.repeats, warmup=1)  # one replay warms a captured graph

    def _cpu(self, n: int, plans) -> float:
        import torch

        from eldr_cli.costmodel.decode_step import _wall_median

        x = self._x(n)
        routes = []
        for order, offs in plans:
            starts = np.r_[0, offs[:-1]]
            routes.append([(e, torch.from_numpy(order[s:t]))
                           for e, (s, t) in enumerate(zip(starts, offs, strict=True)) if t > s])

        def step():
            y = x
            for layer, r in enumerate(routes):
                y = y + self.banks[layer % len(self.banks)](y, r)
            return y

        with torch.inference_mode():
            return _wall_median(step, self.repeats)


def sample_batches(trace, rec: dict, max_steps: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Up to ``max_steps`` steady-state (step, decoder) batches of a replay record (seeded sample, in step
    order), each as its members' rows of the trace's decode picks."""
    steady = rec["step"] < int(rec["drained_step"])
    if not steady.any():
        steady = np.ones_like(rec["step"], dtype=bool)
    K = int(rec["decoder"].max(initial=0)) + 1
    key = rec["step"][steady] * K + rec["decoder"][steady]
    rows = np.asarray(trace.decode_offsets, dtype=np.int64)[rec["request"][steady]] + rec["request_step"][steady]
    ctx = np.asarray(trace.prompt_tokens, dtype=np.int64)[rec["request"][steady]] + rec["request_step"][steady] + 1
    o = np.argsort(key, kind="stable")
    starts = np.flatnonzero(np.r_[True, key[o][1:] != key[o][:-1]])
    groups = np.split(o, starts[1:])
    pick = np.sort(np.random.default_rng(seed).choice(len(groups), size=min(max_steps, len(groups)), replace=False))
    return [(rows[groups[i]], ctx[groups[i]]) for i in pick]


def _interval(x: np.ndarray) -> list[float]:
    """The 95% t-interval of the mean of ``x``."""
    from scipy import stats

    if len(x) < 2:
        return [float(x.mean()), float(x.mean())] if len(x) else [float("nan")] * 2
    h = float(stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x)))
    return [float(x.mean()) - h, float(x.mean()) + h]


def measure_policy(trace, rec: dict, timer: StepTimer, *, cost=None, max_steps: int = 100, seed: int = 0) -> dict:
    """One policy's sampled steps timed: per step its MoE ms, charged experts (summed over layers), batch and
    the cost model's prediction (its whole step and its per-expert term); means and 95% intervals."""
    from eldr_cli.simulator.replay import _pack_picks, charged_counts

    L, E = trace.num_layers, trace.num_experts
    ep = int(getattr(cost, "ep_ranks", 1)) if cost is not None else 1
    seen: dict[bytes, float] = {}
    steps = []
    for rows, ctx in sample_batches(trace, rec, max_steps, seed):
        picks = np.asarray(trace.decode_picks[np.sort(rows)], dtype=np.int64)
        key = picks.tobytes()
        if key not in seen:  # a distinct (batch, active set) is timed once
            seen[key] = timer(picks)
        union = np.bitwise_or.reduce(_pack_picks(picks, L, E), axis=0)[None]
        A = int(charged_counts(union, L, E, ep)[0])
        s = {"ms": seen[key], "active": A, "batch": len(rows), "context": int(ctx.sum())}
        if cost is not None:
            s["pred_step_ms"] = float(cost.step_ms(A, L, len(rows), cost.token_scale(trace.top_k), context=ctx))
            s["pred_expert_ms"] = float(cost.step_terms(L, cost.token_scale(trace.top_k))[1] * A)
        steps.append(s)
    ms = np.array([s["ms"] for s in steps])
    out = {"steps_timed": len(steps), "distinct_timed": len(seen),
           "mean_batch": float(np.mean([s["batch"] for s in steps])),
           "active_per_step": float(np.mean([s["active"] for s in steps])), "moe_ms": float(ms.mean()),
           "moe_ms_ci95": _interval(ms), "moe_ms_per_step": ms.tolist()}
    if cost is not None:
        out["pred_step_ms"] = float(np.mean([s["pred_step_ms"] for s in steps]))
        out["pred_expert_ms"] = float(np.mean([s["pred_expert_ms"] for s in steps]))
    return out


def compare(results: list[dict]) -> list[dict]:
    """Per batch size, each policy's measured MoE time against the best load balancer's (lowest measured):
    the difference (ms per step) with its 95% Welch interval, and the cost model's predicted difference."""
    from scipy import stats

    from eldr_cli.routing import LOAD_BALANCERS

    out = []
    for B in sorted({r["batch_size"] for r in results}):
        at = {r["policy"]: r["measured"] for r in results if r["batch_size"] == B and "measured" in r}
        lbs = [p for p in LOAD_BALANCERS if p in at]
        if not lbs:
            continue
        best = min(lbs, key=lambda p: at[p]["moe_ms"])
        x = np.array(at[best]["moe_ms_per_step"])
        for p, m in at.items():
            y = np.array(m["moe_ms_per_step"])
            d = float(y.mean() - x.mean())
            se = float(np.sqrt(y.var(ddof=1) / len(y) + x.var(ddof=1) / len(x))) if min(len(x), len(y)) > 1 else 0.0
            row = {"batch_size": B, "policy": p, "best_lb": best, "delta_ms": d, "delta_pct": float(100 * d / x.mean()),
                   "delta_ci95": [d - 1.96 * se, d + 1.96 * se] if se else [d, d]}
            if se:
                vy, vx = y.var(ddof=1) / len(y), x.var(ddof=1) / len(x)
                df = se ** 4 / (vy ** 2 / (len(y) - 1) + vx ** 2 / (len(x) - 1))
                h = float(stats.t.ppf(0.975, df)) * se
                row["delta_ci95"] = [d - h, d + h]
            if "pred_expert_ms" in m:
                row["pred_delta_expert_ms"] = m["pred_expert_ms"] - at[best]["pred_expert_ms"]
                row["pred_delta_step_ms"] = m["pred_step_ms"] - at[best]["pred_step_ms"]
            out.append(row)
    return out


class MeasuredReplay:
    """The ``measure`` hook of :func:`eldr_cli.pipeline.replay.run_replay`: ``hook(trace, rec) -> measured``.
    Checks the device, dtype and shape request at construction (before anything is written); builds the
    step timer at the first call, once the trace's layers, experts and top-k are known."""

    def __init__(self, *, device: str, model: str | None = None, tp: int = 1, dtype: str = "bf16",
                 tiny: bool = False, cost_model=None, max_steps: int = 100, repeats: int = 3, seed: int = 0):
        from eldr_cli.costmodel.moe_layer import resolve_backend, resolve_device

        self.device = resolve_device(device)
        if dtype not in ("bf16", "fp8"):
            raise EldrError(f"unknown --dtype {dtype!r} for a measured replay; expected bf16 or fp8")
        if self.device == "cpu" and not tiny:
            raise EldrError("a measured replay times the model's MoE layers on a GPU; on a CPU that would time "
                            "nothing a GPU serves", hint="use --device cuda on a GPU, or --tiny (a tiny layer "
                                                         "shape, for tests) on a CPU")
        if self.device == "cpu" and dtype == "fp8":
            raise EldrError("--dtype fp8 needs a CUDA GPU", hint="use --dtype bf16 with --tiny on a CPU")
        if self.device == "cuda":
            resolve_backend("grouped", "graph", "cuda", "fp8" if dtype == "fp8" else "bfloat16")
        if not tiny and not model:
            raise EldrError("a measured replay needs the model whose MoE layers to run", hint="give --model "
                            "(a preset such as Llama-4-Maverick, or a config.json) and --tp")
        self.shape = None if tiny else self._shape(model, tp)
        self.tp, self.dtype, self.tiny = tp, dtype, tiny
        self.max_steps, self.repeats, self.seed = max_steps, repeats, seed
        self.cost, self.cost_params = None, {}
        if cost_model is not None:
            from eldr_cli.artifacts.store import Artifact
            from eldr_cli.costmodel import CostModel

            self.cost, self.cost_params = CostModel.load(cost_model), Artifact(cost_model).params
        self.timer: StepTimer | None = None

    @staticmethod
    def _shape(model, tp):
        from eldr_cli.costmodel.decode_step import layer_shape

        return layer_shape(model, tp)

    def _check(self, trace) -> dict:
        from eldr_cli.costmodel import model_mismatch

        why = model_mismatch(self.cost_params, trace.num_layers, trace.num_experts)
        if why:
            raise EldrError(f"--cost-model {why}", hint="give the cost model of the trace's model")
        if self.tiny:
            return {**TINY, "num_experts": trace.num_experts, "top_k": trace.top_k, "model": "tiny", "tp": 1}
        s = self.shape or {}
        want, got = (s["n_layers"], s["num_experts"], s["top_k"]), (trace.num_layers, trace.num_experts, trace.top_k)
        if want != got:
            raise EldrError(f"the trace has L={got[0]}, E={got[1]}, top-{got[2]}; {s['model']} has {want[0]} MoE "
                            f"layers, {want[1]} experts, top-{want[2]}", hint="give the --model the trace was "
                                                                               "captured from")
        return s

    def __call__(self, trace, rec: dict) -> dict:
        if self.timer is None:
            self.shape = self._check(trace)
            self.timer = StepTimer(self.shape, trace.num_layers, device=self.device, dtype=self.dtype,
                                   repeats=self.repeats, seed=self.seed)
        return measure_policy(trace, rec, self.timer, cost=self.cost, max_steps=self.max_steps, seed=self.seed)

    def facts(self) -> dict:
        from eldr_cli.costmodel.moe_layer import device_label

        s = self.shape or {}
        banks = len(self.timer.banks) if self.timer else 0
        how = ("grouped GEMM over all experts with the batch's real token-to-expert assignment per layer, "
               f"{'fp8 e4m3 (torch._scaled_grouped_mm)' if self.dtype == 'fp8' else 'bf16 (torch._grouped_mm)'}, "
               "a step's layers in one CUDA graph per token count, CUDA events") if self.device == "cuda" else \
            "per-expert loop over the batch's real assignment, launched eagerly, float32, the wall clock (a TINY shape)"
        return {"label": "MEASURED" if not self.tiny else "MEASURED (tiny shape: not a GPU's cost)",
                "device": device_label(self.device), "model": s.get("model"), "tp": s.get("tp", self.tp),
                "hidden": s.get("hidden"), "intermediate_per_rank": s.get("intermediate"), "dtype": self.dtype,
                "timed": how, "weight_banks": banks, "max_steps": self.max_steps, "repeats": self.repeats,
                "what": "routed experts only (attention, dense layers, shared experts do not depend on routing)",
                "cost_model": None if self.cost is None else {"source": self.cost.source, "device": self.cost.device}}
