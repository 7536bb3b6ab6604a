"""`eldr bench serve` and `eldr bench sweep`: drive an OpenAI-compatible endpoint (one vLLM server, or
the eldr proxy over a worker pool) at each request rate, optionally for several decode policies
switched through the proxy's admin endpoint, and write one bench artifact.

The mode recorded is ``real`` unless the workers are an emulated cluster (``--cluster FILE`` written
by `eldr emulate`, or ``--mode emulated``): then the decode step log (batch, active experts, step
time per worker and step) is fetched from the workers after every run and Fig. 13 is drawn.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eldr_cli.bench.client import (
    ClientConfig,
    LiveStats,
    make_session,
    new_event_loop,
    probe,
    run_interruptible,
    run_schedule,
)
from eldr_cli.bench.workload import ROW_REF_PREFIX, PromptItem, build_schedule
from eldr_cli.errors import EldrError

# an admin swap answers in milliseconds once the proxy has loaded its routing artifact; a loaded machine (or a
# routing artifact swapped in) can take seconds
ADMIN_TIMEOUT_S = 60.0


@dataclass
class SweepPlan:
    rates: list[float]
    duration_s: float
    warmup_s: float
    burstiness: float = 1.0
    seed: int = 0
    routers: tuple = ("as-deployed",)
    tau: float | None = None
    admin_token: str | None = None
    drain_timeout_s: float | None = None
    switch: bool = False   # switch the proxy's policy to each router through /admin/policy


def _admin_call(url: str, token: str | None, body: dict | None = None) -> dict:
    """GET /admin/workers (the proxy's pools and policy) or POST /admin/policy, synchronously, so it
    also works after Ctrl-C has abandoned the bench's event loop."""
    import urllib.error
    import urllib.request

    from eldr_cli.bench.client import base_url

    if not token:
        raise EldrError("switching routers needs the proxy's admin token",
                        hint="set ELDR_ADMIN_TOKEN or pass --admin-token-file (the token serve-proxy was started with)")
    path = "/admin/workers" if body is None else "/admin/policy"
    req = urllib.request.Request(base_url(url) + path, method="GET" if body is None else "POST",
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=ADMIN_TIMEOUT_S) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise EldrError(f"the proxy answered {path} with HTTP {e.code}: {e.read()[:300]!r}",
                        hint="check ELDR_ADMIN_TOKEN or --admin-token-file (the token serve-proxy was "
                             "started with)") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise EldrError(f"cannot reach the proxy admin endpoint at {url}: {e}") from None


def _cancel_pending(loop) -> None:
    """After Ctrl-C the bench's tasks are still pending: cancel them and let their cleanup (sessions,
    live view) run, instead of Python printing 'coroutine ignored GeneratorExit' at exit."""
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        try:
            loop.run_until_complete(asyncio.wait(pending, timeout=5))
        except BaseException:  # a second Ctrl-C: give up cleaning up
            pass


def read_cluster_file(path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise EldrError(f"cluster file {p} does not exist", hint="start `eldr emulate --cluster-file FILE` first")
    try:
        info = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise EldrError(f"cluster file {p} is not JSON: {e}") from None
    if not isinstance(info, dict) or not isinstance(info.get("decode"), list):
        raise EldrError(f"cluster file {p} lacks a 'decode' list of worker URLs")
    return info


async def _switch_policy(session, url: str, router: str, tau: float | None, token: str | None) -> dict:
    import aiohttp

    from eldr_cli.bench.client import base_url

    if not token:
        raise EldrError("switching routers needs the proxy's admin token",
                        hint="set ELDR_ADMIN_TOKEN or pass --admin-token-file (the token serve-proxy was started with)")
    body: dict[str, Any] = {"policy": router}
    if tau is not None:
        body["tau"] = tau
    try:
        async with session.post(base_url(url) + "/admin/policy", json=body,
                                headers={"Authorization": f"Bearer {token}"},
                                timeout=aiohttp.ClientTimeout(total=ADMIN_TIMEOUT_S)) as r:
            text = await r.text()
            if r.status != 200:
                raise EldrError(f"the proxy refused policy {router!r} (HTTP {r.status}): {text[:300]}",
                                hint="check ELDR_ADMIN_TOKEN or --admin-token-file and that the proxy has a routing "
                                     "artifact for eldr/domain")
            return json.loads(text)
    except asyncio.TimeoutError:
        raise EldrError(f"the proxy at {url} did not answer POST /admin/policy ({router!r}) within "
                        f"{ADMIN_TIMEOUT_S:g} s", hint="is it overloaded, or stopped? its log says") from None
    except (aiohttp.ClientError, OSError) as e:
        raise EldrError(f"cannot reach the proxy admin endpoint at {url}: {e}") from None


async def _fetch_steps(session, decode_urls: list[str], cursors: dict[str, int]) -> tuple[list[dict], dict]:
    """New step-log rows of every decode worker since ``cursors``, and meta: the model's shape and the
    workers' running totals (``unmatched_total``, ``wrapped_total``: summed over decode workers)."""
    import aiohttp

    rows: list[dict] = []
    meta: dict[str, Any] = {"unmatched_total": 0, "wrapped_total": 0}
    for i, u in enumerate(decode_urls):
        try:
            async with session.get(u + "/eldr/steps", params={"since": str(cursors.get(u, 0))},
                                   timeout=aiohttp.ClientTimeout(total=30)) as r:
                d = await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise EldrError(f"cannot read the step log of emulated worker {u}: {e}") from None
        cursors[u] = d["next"]
        meta.update(n_layers=d.get("n_layers"), num_experts=d.get("num_experts"))
        for k in ("unmatched_total", "wrapped_total"):
            meta[k] += int(d.get(k) or 0)
        st = d["steps"]
        for j in range(len(st.get("t_s", []))):
            rows.append({"worker": i, **{k: st[k][j] for k in st}})
    return rows, meta


def _render(stats: LiveStats, mode: str, finished: list[dict]):
    from rich.console import Group

    from eldr_cli.bench.figures import MODE_LABEL
    from eldr_cli.console import table

    el = max(0.0, time.perf_counter() - stats.started)
    from eldr_cli.console import show_wide

    wide = show_wide(False)  # throughput and schedule lag only where they fit
    cols = ["router", "rate", "time", "sent", "busy", "done", "fail", "TPOT ms"] + (["tok/s", "lag ms"] if wide else [])
    t = table(*cols, title=f"eldr bench -- {MODE_LABEL.get(mode, mode)} (live; busy = in flight)")
    lag = np.median(stats.lag_ms[-500:]) if stats.lag_ms else float("nan")
    tp = np.median(stats.last_tpot_ms[-200:]) if stats.last_tpot_ms else float("nan")
    row = [stats.router, f"{stats.rate:g}", f"{el:.0f}/{stats.horizon_s:.0f}s", f"{stats.sent}/{stats.scheduled}",
           str(stats.in_flight), str(stats.done), f"[red]{stats.failed}[/]" if stats.failed else "0", f"{tp:.1f}"]
    if wide:
        row += [f"{stats.tokens / el:.0f}" if el > 0 else "-", f"{lag:.2f}"]
    t.add_row(*row)
    if not finished:
        return t
    f = table("router", "rate", "done", "failed", "TTFT p50", "TPOT p50", "TPOT p99", title="finished runs")
    for r in finished[-12:]:
        f.add_row(r["router"], f"{r['request_rate']:g}", str(r["completed"]), str(r["failed"]),
                  f"{r['median_ttft_ms'] or float('nan'):.1f}", f"{r['median_tpot_ms'] or float('nan'):.1f}",
                  f"{r['p99_tpot_ms'] or float('nan'):.1f}")
    return Group(t, f)


async def _bench(cfg: ClientConfig, items: list[PromptItem], plan: SweepPlan, mode: str, decode_urls: list[str] | None,
                 live: bool, console) -> tuple[list[dict], list, list, dict]:
    import polars as pl

    from eldr_cli.bench.metrics import requests_frame, summarize

    runs: list[dict[str, Any]] = []
    frames: list[Any] = []
    step_frames: list[Any] = []
    meta: dict[str, Any] = {}
    stats = LiveStats()
    async with make_session(cfg) as session:
        model = await probe(session, cfg)
        meta["model"] = model
        cursors: dict[str, int] = {}
        totals: dict[str, int] = {}
        if decode_urls:
            _, m = await _fetch_steps(session, decode_urls, cursors)  # skip steps from before this bench
            totals = {k: m.pop(k) for k in ("unmatched_total", "wrapped_total")}
            meta.update(m)
        liveview = None
        if live:
            from rich.live import Live

            liveview = Live(_render(stats, mode, runs), console=console, auto_refresh=False, transient=False)
            liveview.start()
        refresher = None

        async def refresh():
            assert liveview is not None  # started only with --live
            while True:
                await asyncio.sleep(0.5)
                liveview.update(_render(stats, mode, runs), refresh=True)

        try:
            if liveview is not None:
                refresher = asyncio.create_task(refresh())
            for router in plan.routers:
                if plan.switch:
                    meta.setdefault("admin", {})[router] = await _switch_policy(session, cfg.url, router, plan.tau,
                                                                               plan.admin_token)
                for rate in plan.rates:
                    sched = build_schedule(len(items), rate, duration_s=plan.duration_s, warmup_s=plan.warmup_s,
                                           burstiness=plan.burstiness, seed=plan.seed)
                    recs = await run_schedule(session, cfg, model, items, sched, router, stats,
                                              drain_timeout_s=plan.drain_timeout_s)
                    df = requests_frame(recs)
                    extra = {}
                    if decode_urls:
                        srows, m = await _fetch_steps(session, decode_urls, cursors)
                        # per run: the emulated decode workers' counters moved by this run's requests
                        # (warm-up included, as the simulator counts them)
                        extra = {"unmatched": m["unmatched_total"] - totals.get("unmatched_total", 0),
                                 "wrapped_requests": m["wrapped_total"] - totals.get("wrapped_total", 0)}
                        totals = {k: m[k] for k in ("unmatched_total", "wrapped_total")}
                        if srows:
                            sdf = pl.DataFrame(srows).with_columns(pl.lit(router).alias("router"),
                                                                    pl.lit(float(rate)).alias("request_rate"))
                            step_frames.append(sdf)
                            nl = meta.get("n_layers") or 1
                            extra |= {"mean_active_experts_per_step":
                                     float(np.mean(sdf["active_experts"].to_numpy()) / nl),
                                     "mean_decode_batch": float(np.mean(sdf["batch"].to_numpy())),
                                     "decode_steps": len(sdf),
                                     "median_step_late_ms": float(np.median(sdf["late_ms"].to_numpy()))}
                    s = summarize(df, request_rate=rate, router=router, mode=mode, burstiness=plan.burstiness,
                                  extra=extra)
                    runs.append(s)
                    frames.append(df)
                    if liveview is None and console is not None:
                        console.print(f"  {router} @ {rate:g} req/s: {s['completed']} done, {s['failed']} failed, "
                                      f"TPOT p50 {s['median_tpot_ms'] or float('nan'):.1f} ms, "
                                      f"TTFT p50 {s['median_ttft_ms'] or float('nan'):.1f} ms")
        finally:
            if refresher is not None:
                refresher.cancel()
            if liveview is not None:
                liveview.update(_render(stats, mode, runs), refresh=True)
                liveview.stop()
    return runs, frames, step_frames, meta


def run_bench(out, *, url: str, prompts, rates: list[float], duration_s: float = 120.0, warmup_s: float = 30.0,
              max_tokens: int = 512, burstiness: float = 1.0, seed: int = 0, timeout_s: float = 600.0,
              domain_header: bool = False, ignore_eos: bool = True, model: str | None = None,
              routers: list[str] | None = None, tau: float | None = None, admin_token: str | None = None,
              mode: str | None = None, cluster_file=None, split: str | None = None, live: bool = True,
              label: str = "", api_key: str | None = None, router_name: str = "as-deployed",
              console=None) -> Path:
    """Run the bench (one router as deployed, or a sweep over ``routers``) and write a bench artifact."""
    import polars as pl

    from eldr_cli.bench.results import MODES, write_bench
    from eldr_cli.bench.workload import load_prompts
    from eldr_cli.routing.registry import check_policy

    if not (url.startswith("http://") or url.startswith("https://")):
        raise EldrError(f"--url {url!r} is not an http(s) URL")
    if duration_s <= 0 or warmup_s < 0 or max_tokens < 1 or timeout_s <= 0 or burstiness <= 0:
        raise EldrError("--duration, --timeout and --burstiness must be > 0, --warmup >= 0, --max-tokens >= 1")
    for r in rates:
        if not r > 0:
            raise EldrError(f"rate {r!r} is not a positive number of requests per second")
    for name in routers or []:
        check_policy(name, servable=True)
    decode_urls = None
    cluster = None
    if cluster_file is not None:
        cluster = read_cluster_file(cluster_file)
        decode_urls = [u.rstrip("/") for u in cluster["decode"]]
        mode = mode or cluster.get("mode", "emulated")
    mode = mode or "real"
    if mode not in MODES or mode == "simulated":
        raise EldrError("--mode must be real or emulated (simulated results come from `eldr bench simulate`)")
    if prompts is None:  # the emulated cluster's own trace rows, its split unless --split says otherwise
        if cluster is None or not cluster.get("trace"):
            raise EldrError("--prompts is required (or --cluster FILE of `eldr emulate`, whose trace rows are sent)")
        prompts, split = cluster["trace"], split or cluster.get("split") or "all"
    items = load_prompts(prompts, split=split)
    refs = sum(it.prompt.startswith(ROW_REF_PREFIX) for it in items)
    if refs and mode != "emulated":
        raise EldrError(f"{refs} of the {len(items)} prompts of {prompts} are trace rows without text (sent as "
                        f"{ROW_REF_PREFIX}<id>), which only an emulated cluster of that trace can answer",
                        hint="pass --cluster FILE of `eldr emulate`, or prompts with text")
    cfg = ClientConfig(url=url, model=model, max_tokens=max_tokens, ignore_eos=ignore_eos, timeout_s=timeout_s,
                       domain_header=domain_header or bool(routers and "domain" in routers), api_key=api_key)
    plan = SweepPlan(rates=list(rates), duration_s=duration_s, warmup_s=warmup_s, burstiness=burstiness, seed=seed,
                     routers=tuple(routers) if routers else (router_name,), tau=tau, admin_token=admin_token,
                     drain_timeout_s=timeout_s + 5, switch=bool(routers))
    found = _admin_call(url, admin_token) if plan.switch else None  # the policy to put back afterwards
    loop = new_event_loop()
    finished = False
    try:
        runs, frames, steps, meta = run_interruptible(loop, _bench(cfg, items, plan, mode, decode_urls,
                                                                    live and console is not None, console))
        finished = True
    finally:
        _cancel_pending(loop)
        loop.close()
        if found is not None:  # on success, error and Ctrl-C alike
            back = {"policy": found["policy"], **({"tau": found.get("tau")} if tau is not None else {})}
            try:
                _admin_call(url, admin_token, back)
                if console is not None:
                    console.print(f"proxy policy restored to {found['policy']}")
            except EldrError as e:
                if finished:
                    raise
                print(f"could not restore the proxy policy {found['policy']!r}: {e}", file=sys.stderr)
    params = {"url": url, "model": meta.get("model"), "rates": list(rates), "duration_s": duration_s,
              "warmup_s": warmup_s, "max_tokens": max_tokens, "burstiness": burstiness, "seed": seed,
              "timeout_s": timeout_s, "ignore_eos": ignore_eos, "domain_header": cfg.domain_header, "tau": tau,
              "n_prompts": len(items), "split": split, "row_references": refs}
    if cluster is not None:
        params["cluster"] = {k: cluster.get(k) for k in ("prefill", "decode", "trace", "cost_model", "model", "split")}
    inputs = {"prompts": prompts}
    steps_df = pl.concat(steps, how="diagonal_relaxed") if steps else None
    return write_bench(out, mode=mode, params=params, runs=runs, requests=pl.concat(frames), steps=steps_df,
                       inputs=inputs, title=label, n_layers=meta.get("n_layers"), num_experts=meta.get("num_experts"))
