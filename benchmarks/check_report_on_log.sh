#!/usr/bin/env bash
# EMULATED check of `eldr report --decision-log` (issue 30): a GENERATED trace (800 requests, 4 domains, L=8,
# E=32, top-4, 32 decode steps) served by an EMULATED 2P4D cluster through the real proxy (jsq, shadow
# eldr-live, --decision-log-replay --scrape-metrics) at 40 req/s for 30 s; then `eldr report` on the trace and
# on the decision log (jsq vs eldr-live, 3 seeds): do the capacity-gain intervals overlap, and how far is the
# logged TPOT from the cost model? Usage: benchmarks/check_report_on_log.sh [OUTDIR]  (a few minutes)
set -euo pipefail
cd /work/wt30
E=.venv/bin/eldr
O=${1:-/tmp/eldr-report-on-log}; rm -rf $O; mkdir -p $O
$E synth-trace --out $O/trace --requests 800 --layers 8 --experts 32 --top-k 4 --decode-steps 32 --picks --seed 1 >/dev/null
$E fit --trace $O/trace --decoders 4 --out $O/fit --pairs 3000 --no-figures >/dev/null
.venv/bin/python -c "
from eldr_cli.costmodel import CostModel, write_cost_model
write_cost_model('$O/cm', CostModel(a_ms=0.5, b_ms=0.1, c_ms=0.005, source='measured', device='test'))"
$E emulate --prefill 2 --decode 4 --trace $O/trace --cost-model $O/cm --base-port 18930 --cluster-file $O/cluster.json --split evaluation > $O/emu.log 2>&1 &
EMU=$!
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
while [ ! -s $O/cluster.json ]; do kill -0 $EMU; sleep 0.5; done
$E serve-proxy --routing $O/fit --policy jsq --shadow eldr-live --port 18940 --prefill http://127.0.0.1:18930 --prefill http://127.0.0.1:18931 \
  --decode http://127.0.0.1:18932 --decode http://127.0.0.1:18933 --decode http://127.0.0.1:18934 --decode http://127.0.0.1:18935 \
  --cost-model $O/cm --decision-log $O/log.jsonl --decision-log-replay --scrape-metrics 2> $O/proxy.log &
for _ in $(seq 120); do curl -sf http://127.0.0.1:18940/health > /dev/null && break; sleep 0.5; done
$E bench serve --url http://127.0.0.1:18940 --cluster $O/cluster.json --rates 40 --duration 30 --warmup 2 --max-tokens 16 --no-live --out $O/bench > $O/bench.log 2>&1
curl -s http://127.0.0.1:18940/metrics | grep -E "eldr_proxy_shadow_(agree|decisions)_total|drift_flag|decision_log" > $O/metrics.txt || true
curl -s http://127.0.0.1:18940/health > $O/health.json
kill $(jobs -p) 2>/dev/null || true
sleep 1
wc -l $O/log.jsonl
date
$E report --trace $O/trace --fit $O/fit --cost-model $O/cm --routers jsq,eldr-live --seeds 3 --max-tokens 16 --no-progress --out $O/rep-trace > $O/rep-trace.log 2>&1
date
$E report --decision-log $O/log.jsonl --fit $O/fit --cost-model $O/cm --routers jsq,eldr-live --seeds 3 --max-tokens 16 --no-progress --out $O/rep-log > $O/rep-log.log 2>&1
date
.venv/bin/python - <<PY
import json
for n in ("rep-trace", "rep-log"):
    v = json.load(open("$O/%s/report.json" % n))["verdict"]
    print(n, "capacity", {k: (round(c["mean"], 2), c["ci95"]) for k, c in v["capacity_rps"].items()},
          "gain", v["capacity_gain_vs_best_lb_pct"])
d = json.load(open("$O/rep-log/report.json"))["decision_log"]
print({k: d[k] for k in ("rows_used", "rows_skipped", "logged_rate_rps", "arrival_gap_cv", "logged_load_pct_of_capacity")}, "drift", d["drift"]["drifted"])
print("logged TPOT", json.dumps(d["logged_tpot"]))
PY
