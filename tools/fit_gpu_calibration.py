"""Refit eldr_cli/data/gpu/calibration.json from the measured tables beside it.

Per device: the weight-read bandwidth efficiency and compute efficiency shared by every MoE shape, one fixed
cost per measured (model, TP, dtype) shape, chosen to minimise the largest |log(roofline / measured)| over
every row with batch >= 8 (a grid: efficiencies by 0.005 and 0.05, fixed costs by 1 us); decode attention's
KV efficiency and fixed cost likewise from its table. Usage: .venv/bin/python tools/fit_gpu_calibration.py
"""

from __future__ import annotations

import json
import statistics

import numpy as np

from eldr_cli.costmodel import calibration as C
from eldr_cli.costmodel.presets import MODELS, device_facts
from eldr_cli.costmodel.roofline import Roofline, model_facts


def _terms(device: str, rows):
    """Per row: (weight read s at 100% bandwidth, GEMM s at 100% of peak, measured s)."""
    _, bw, tf, _ = device_facts(device)
    out = []
    for key, b, a, ms in rows:
        model, tp, dtype = key.split(" ")
        r = Roofline(model_facts(MODELS[model]), bw, tf, dtype=dtype, tp=int(tp[2:]), efficiency=1.0)
        gemm = 2 * b * r.facts.top_k * r.facts.expert_params / r.gpus / r.flops_per_s
        out.append((a * r.expert_read_bytes / r.bytes_per_s, gemm, ms / 1e3))
    return np.array(out)


def fit_moe(device: str):
    rows = C.moe_rows(device)
    A = _terms(device, rows)
    keys = sorted({r[0] for r in rows})
    idx = np.array([keys.index(r[0]) for r in rows])
    fixed_grid = np.arange(0, 150) * 1e-6
    best = None
    for eff in np.arange(0.50, 1.0, 0.005):
        for ce in np.arange(0.20, 1.001, 0.05):
            core = np.maximum(A[:, 0] / eff, A[:, 1] / ce)
            fixed, worst = [], 0.0
            for j in range(len(keys)):
                s = idx == j
                err = np.abs(np.log((core[s][None, :] + fixed_grid[:, None]) / A[s, 2][None, :])).max(axis=1)
                fixed.append(float(fixed_grid[err.argmin()]) * 1e6)
                worst = max(worst, float(err.min()))
            if best is None or worst < best[0]:
                best = (worst, round(float(eff), 3), round(float(ce), 2), dict(zip(keys, fixed, strict=True)))
    return best


def fit_attention(device: str, eff_default: float):
    rows = C.attention_rows(device)
    if not rows:
        return None
    _, bw, _, _ = device_facts(device)
    A = np.array([(kv / (bw * 1e12), ms / 1e3) for _, _, kv, ms in rows])
    best = None
    for eff in np.arange(0.50, 1.0, 0.005):
        for fx in np.arange(0, 40) * 0.5e-6:
            e = float(np.abs(np.log((A[:, 0] / eff + fx) / A[:, 1])).max())
            if best is None or e < best[0]:
                best = (e, round(float(eff), 3), round(float(fx) * 1e6, 2))
    return best


def main() -> None:
    gpus = {"H100-SXM": "NVIDIA H100 80GB HBM3", "H200": "NVIDIA H200"}
    out = {}
    h100_attn = None
    for dev in ("H100-SXM", "H200"):
        worst, eff, ce, fixed = fit_moe(dev)
        attn = fit_attention(dev, eff)
        notes = f"MoE rows within {np.expm1(worst) * 100:.1f}% (max |log ratio| {worst:.3f})"
        if attn is not None:
            h100_attn = attn
            kv_eff, attn_fixed = attn[1], attn[2]
            notes += f"; attention rows within {np.expm1(attn[0]) * 100:.1f}%"
        else:
            assert h100_attn is not None
            kv_eff, attn_fixed = eff, h100_attn[2]
            notes += ("; decode attention NOT measured on this GPU: KV read at the weight-read efficiency, "
                      "attention's fixed cost the H100's")
        out[dev] = {"gpu": gpus[dev], "weight_efficiency": eff, "kv_efficiency": kv_eff, "compute_efficiency": ce,
                    "attn_fixed_us": attn_fixed, "moe_fixed_us": fixed,
                    "moe_fixed_default_us": statistics.median(fixed.values()), "notes": notes}
        print(dev, out[dev])
    doc = {"source": C.SOURCE, "fit": __doc__.strip().splitlines()[2], "devices": out}
    (C.DATA / "calibration.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
