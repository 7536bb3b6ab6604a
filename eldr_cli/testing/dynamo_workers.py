"""Stub prefill and decode workers on Dynamo's runtime (tests and the latency benchmark; no model runs).

``python -m eldr_cli.testing.dynamo_workers model DIR`` writes a tiny model directory (a word-level tokenizer and
a config) that Dynamo's frontend loads as the model card; ``prefill`` registers as the model's prefill tier and
answers each request with one token and ``disaggregated_params.kv_transfer_params`` carrying ``eldr_signature``
(the prompt's fake expert counts, :func:`eldr_cli.testing.stub_worker.fake_counts` over its token ids), as
eldr's vLLM plugin does; ``decode`` streams ``max_tokens`` tokens and writes one JSON line per request it
received (its instance id, the request id, the ``kv_transfer_params`` it was handed, how it ended) to ``--log``;
``stats`` prints the answer of every eldr router's ``stats`` endpoint (one JSON line per router instance).

A prompt with the word ``nosig`` gets no signature; with ``badsig``, a malformed one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any, AsyncIterator

WORDS = ["<unk>", "<s>", "</s>", "nosig", "badsig"] + (
    "hello world the a an of to and is in it you that he was for on are with as his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how said each she "
    "which do their time if will way about many then them write would like so these her long make thing see "
    "him two has look more day could go come did number sound no most people my over know water than call "
    "first who may down side been now find any new work part take get place made live where after back little "
    "only round man year came show every good me give our under name very through just form sentence great "
    "think say help low line differ turn cause much mean before move right boy old too same tell does set "
    "three want air well also play small end put home read hand port large spell add even land here must big "
    "high such follow act why ask men change went light kind off need house picture try us again animal point "
    "mother world near build self earth father head stand own page should country found answer school grow "
    "study still learn plant cover food sun four between state keep eye never last let thought city tree "
    "cross farm hard start might story saw far sea draw left late run while press close night real life few "
    "north open seem together next white children begin got walk example ease paper group always music those "
    "both mark often letter until mile river car feet care second book carry took science eat room friend "
    "began idea fish mountain stop once base hear horse cut sure watch color face wood main enough plain girl "
    "usual young ready above ever red list though feel talk bird soon body dog family direct pose leave song "
    "measure door product black short numeral class wind question happen complete ship area half rock order "
    "fire south problem piece told knew pass since top whole king space heard best hour better true during "
    "hundred five remember step early hold west ground interest reach fast verb sing listen six table travel "
    "less morning ten simple several vowel toward war lay against pattern slow center love person money serve "
    "appear road map rain rule govern pull cold notice voice unit power town fine certain fly fall lead cry "
    "dark machine note wait plan figure star box noun field rest correct able pound done beauty drive stood "
    "contain front teach week final gave green oh quick develop ocean warm free minute strong special mind "
    "behind clear tail produce fact street inch multiply nothing course stay wheel full force blue object "
    "decide surface deep moon island foot system busy test record boat common gold possible plane stead dry "
    "wonder laugh thousand ago ran check game shape equate hot miss brought heat snow tire bring yes distant "
    "fill east paint language among").split()
NOSIG, BADSIG, EOS = 3, 4, 2


def write_model(out: str | os.PathLike[str]) -> Path:
    """A model directory Dynamo's frontend can load: tokenizer.json (word level), tokenizer and model config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = {w: i for i, w in enumerate(dict.fromkeys(WORDS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": len(vocab),
        "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": EOS, "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2}))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": EOS}))
    return out


def prefill_answer(token_ids: list[int], shape: tuple[int, int]) -> dict[str, Any]:
    """What the stub prefill answers: one token and the handed-off parameters (with eldr's signature)."""
    from eldr_cli.handoff import SIGNATURE_KEY, encode_counts
    from eldr_cli.testing.stub_worker import fake_counts

    kv: dict[str, Any] = {"do_remote_prefill": True, "remote_engine_id": "stub", "remote_block_ids": [1]}
    if BADSIG in token_ids:
        kv[SIGNATURE_KEY] = {"v": 1, "shape": [1, 1], "dtype": "u1", "encoding": "zlib+b64", "data": "!!"}
    elif NOSIG not in token_ids:
        kv[SIGNATURE_KEY] = encode_counts(fake_counts(" ".join(map(str, token_ids)), shape), len(token_ids))
    return {"token_ids": [5 + len(token_ids) % 50], "disaggregated_params": {"kv_transfer_params": kv},
            "completion_usage": {"prompt_tokens": len(token_ids), "completion_tokens": 1,
                                 "total_tokens": len(token_ids) + 1}}


class StubDecode:
    """Streams ``max_tokens`` tokens, ``delay_s`` apart; logs each request as it ends."""

    def __init__(self, name: str, log: str | None, delay_s: float, instance_id: int):
        self.name, self.delay_s, self.instance_id = name, delay_s, instance_id
        self.log = open(log, "a", buffering=1) if log else None

    async def generate(self, request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        stop = request.get("stop_conditions") or {}
        n = int(stop.get("max_tokens") or 8)
        pr = request.get("prefill_result") or {}
        row = {"worker": self.name, "instance_id": str(self.instance_id),
               "request_id": context.id() if context is not None else None,
               "kv_transfer_params": (pr.get("disaggregated_params") or {}).get("kv_transfer_params"),
               "token_ids": list(request.get("token_ids") or []), "max_tokens": stop.get("max_tokens"), "sent": 0,
               "ended": "cancelled", "t_start": time.time()}
        try:
            for i in range(n):
                if context is not None and context.is_stopped():
                    return
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                row["sent"] = i + 1
                last = i == n - 1
                yield {"token_ids": [5 + (i * 7) % 200], **({"finish_reason": "length"} if last else {})}
            row["ended"] = "done"
        finally:
            row["t_end"] = time.time()
            if self.log is not None:
                self.log.write(json.dumps(row) + "\n")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eldr_cli.testing.dynamo_workers")
    p.add_argument("role", choices=["model", "prefill", "decode", "stats"])
    p.add_argument("path", nargs="?", help="model: the directory to write")
    p.add_argument("--model-path", default=None)
    p.add_argument("--model-name", default="stub")
    p.add_argument("--endpoint", default=None, help="NAMESPACE.COMPONENT.ENDPOINT")
    p.add_argument("--name", default="stub")
    p.add_argument("--log", default=None)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--shape", default="4x16", help="the signature's LxE")
    return p.parse_args(argv)


async def _serve(a: argparse.Namespace) -> None:
    from dynamo.llm import ModelInput, ModelType, WorkerType, register_model
    from dynamo.runtime import DistributedRuntime

    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, os.environ.get("DYN_DISCOVERY_BACKEND", "etcd"),
                                 os.environ.get("DYN_REQUEST_PLANE", "tcp"))
    for sig in (signal.SIGINT, signal.SIGTERM):  # leave discovery gracefully
        loop.add_signal_handler(sig, runtime.shutdown)
    if a.role == "stats":  # one call to an eldr router's stats endpoint, printed as JSON
        client = await runtime.endpoint(a.endpoint or "dynamo.eldr.stats").client()
        await asyncio.wait_for(client.wait_for_instances(), 30)
        for iid in sorted(client.instance_ids()):
            async for out in await client.direct({}, iid):
                print(json.dumps(out.data() if hasattr(out, "data") else out), flush=True)
        runtime.shutdown()
        return
    if a.role == "prefill":
        ep = runtime.endpoint(a.endpoint or "dynamo.prefill.generate")
        shape = tuple(int(x) for x in a.shape.split("x"))
        await register_model(model_input=ModelInput.Tokens, model_type=ModelType.Prefill, endpoint=ep,
                             model_path=a.model_path, model_name=a.model_name, worker_type=WorkerType.Prefill,
                             needs=[[WorkerType.Decode]])

        async def prefill(request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
            yield prefill_answer(list(request.get("token_ids") or []), (shape[0], shape[1]))

        await ep.serve_endpoint(prefill)
        return
    ep = runtime.endpoint(a.endpoint or "eldr-decode.backend.generate")
    # registered as a decode tier, as a vLLM decode worker is: in its own namespace the frontend does not watch
    await register_model(model_input=ModelInput.Tokens, model_type=ModelType.Chat | ModelType.Completions,
                         endpoint=ep, model_path=a.model_path, model_name=a.model_name,
                         worker_type=WorkerType.Decode, needs=[[WorkerType.Prefill]])
    stub = StubDecode(a.name, a.log, a.delay_ms / 1000.0, ep.connection_id())
    await ep.serve_endpoint(stub.generate, graceful_shutdown=True)


def main(argv: list[str] | None = None) -> None:
    a = _parse(argv)
    if a.role == "model":
        print(write_model(a.path or "stub-model"))
        return
    import uvloop

    uvloop.run(_serve(a))


if __name__ == "__main__":
    main()
