"""Trace replay shared by the emulated cluster and the simulator: which experts a request's prompt and
each of its decode steps activate, and what a step costs.

A request is matched to a trace row by its prompt text (exact, after stripping surrounding
whitespace), or by a **row reference**: the prompt ``trace-row:<request_id>`` names the row whose
``request_id`` it carries. Imported traces have no prompt text, so the bench client sends row references
for them (``eldr_cli.bench.workload.row_ref``); the proxy forwards the prompt unchanged and its PrefixHash
prefill choice keys on that string, as the simulator does.

**Fallback for unmatched prompts:** the row ``crc32(prompt) mod R`` -- deterministic, so the prefill
signature and the replayed decode picks come from the same row (routing stays self-consistent) and the
emulator and the simulator agree; unmatched requests are counted
(``/metrics`` ``eldr_emulator_unmatched_prompts_total``, simulator metric ``unmatched``).
Decode steps beyond the captured ones wrap around (step ``j`` replays captured step
``j mod decode_steps``): traces are usually capped (e.g. 128 steps) while benches ask for 512; the
requests that wrap are counted (``wrapped_requests`` in the bench and simulator summaries).

With a roofline cost model (``eldr bench cost-model``) a decode step charges every running request's KV
cache at its current context (prompt tokens + tokens generated so far) through ``Roofline.step_ms``;
a measured cost model has no KV term.

Active experts are bit sets: bit ``l * E + e`` of a row of uint64 words says expert ``e`` fired at
layer ``l``; the union over a batch is a bitwise OR and its popcount is the sum over layers of
distinct active experts -- what :meth:`CostModel.step_ms` takes. With expert parallelism
(``cost.ep_ranks`` > 1) a step is charged the busiest rank's experts instead (:func:`charged_counts`).
"""

from __future__ import annotations

import copy
import zlib

import numpy as np

from eldr_cli.artifacts.trace import Trace
from eldr_cli.bench.workload import row_ref
from eldr_cli.costmodel import CostModel, StepTerms, step_ms_from_terms
from eldr_cli.errors import EldrError


def _pack_bits(active: np.ndarray) -> np.ndarray:
    """bool [N, L*E] -> uint64 [N, W] little-endian bit sets."""
    n, bits = active.shape
    W = max(1, (bits + 63) // 64)
    pad = np.zeros((n, W * 64), dtype=bool)
    pad[:, :bits] = active
    by = np.packbits(pad.reshape(n, W * 8, 8), axis=2, bitorder="little").reshape(n, W * 8)
    return np.ascontiguousarray(by).view("<u8").astype(np.uint64)


def _pack_picks(picks: np.ndarray, L: int, E: int) -> np.ndarray:
    """int [S, L, k] expert ids per step and layer -> uint64 [S, W] bit sets (bit ``l * E + e``), the same
    words as ``_pack_bits`` of the dense [S, L*E] flags without building them (S*L*E bytes: 0.4 GB for a
    1,000-row, 64-step, L=48, E=128 trace). Ids outside [0, E) (padding) are skipped."""
    S = picks.shape[0]
    W = max(1, (L * E + 63) // 64)
    p = picks.astype(np.int64, copy=False)
    bit = np.arange(L, dtype=np.int64)[None, :, None] * E + p          # [S, L, k]
    word = bit >> 6
    word += (np.arange(S, dtype=np.int64) * W)[:, None, None]
    val = np.left_shift(np.uint64(1), (bit & 63).astype(np.uint64))
    valid = (p >= 0) & (p < E)
    if not valid.all():
        word, val = word[valid], val[valid]
    words = np.zeros(S * W, dtype=np.uint64)
    np.bitwise_or.at(words, word.ravel(), val.ravel())
    return words.reshape(S, W)


def charged_counts(masks: np.ndarray, n_layers: int, n_experts: int, ep: int) -> np.ndarray:
    """int [N]: per row of bit sets uint64 [N, W], the experts a step pays for: the popcount (EP 1), or
    summed over layers the max over ``ep`` contiguous ranks (rank r: experts [r*E/ep, (r+1)*E/ep)) of
    the rank's active experts -- the numpy twin of ``simulator.core.busiest_rank_active``."""
    m = np.atleast_2d(np.asarray(masks, dtype="<u8"))
    if ep <= 1:
        return np.bitwise_count(m).sum(axis=1).astype(np.int64)
    bits = np.unpackbits(m.view(np.uint8), axis=1, bitorder="little")[:, :n_layers * n_experts]
    per_rank = bits.reshape(len(m), n_layers, ep, n_experts // ep).sum(axis=3, dtype=np.int64)
    return per_rank.max(axis=2).sum(axis=1)


def prompt_of(body: dict, chat: bool) -> str:
    """The prompt text a request is matched by (chat: the last user message's text)."""
    if chat:
        for m in reversed(body.get("messages") or []):
            if isinstance(m, dict) and m.get("role") == "user":
                c = m.get("content")
                if isinstance(c, list):
                    c = "".join(p.get("text", "") for p in c if isinstance(p, dict))
                return str(c or "")
        return ""
    p = body.get("prompt")
    if isinstance(p, list):
        p = p[0] if p else ""
    return p if isinstance(p, str) else str(p)


class TraceReplay:
    """Per-row prefill expert sets, per-step decode expert sets and the cost of a step."""

    def __init__(self, trace: Trace, cost: CostModel):
        """When ``cost`` is a roofline (``CostModel.load`` of a roofline artifact returns one carrying its
        :class:`~eldr_cli.costmodel.roofline.Roofline`), decode steps charge KV at each request's current
        context."""
        if trace.decode_picks is None or trace.decode_offsets is None:
            raise EldrError(f"trace {trace.path or ''} has no per-step decode picks, which replay needs",
                            hint="capture again (`eldr capture --model M --prompts P --max-new-tokens N` records "
                                 "per-step picks) or `eldr synth-trace --picks`")
        self.trace = trace
        self.cost = cost
        self.roofline = getattr(cost, "roofline", None)
        R, L, E = trace.prefill_counts.shape
        self.n_layers, self.num_experts = L, E
        self.ep = cost.ep_ranks
        self.token_scale = cost.token_scale(trace.model.get("top_k"))
        self.terms = StepTerms._make(float(x) for x in cost.step_terms(L, self.token_scale))  # the step's form
        self.predicted_cost = cost  # what a cost-aware router predicts with (see with_true_cost)
        steps = np.asarray(trace.decode_steps, dtype=np.int64)
        self.offsets = np.asarray(trace.decode_offsets, dtype=np.int64)
        if self.offsets.shape != (R + 1,) or int(self.offsets[-1]) != trace.decode_picks.shape[0]:
            raise EldrError(f"trace {trace.path or ''}: decode_offsets do not index decode_picks")
        self.steps = np.maximum(np.diff(self.offsets), 0)
        if (self.steps == 0).any():
            # a row without captured decode steps replays a single empty step (no experts)
            pass
        del steps
        self.decode_masks = _pack_picks(np.asarray(trace.decode_picks), L, E)  # [S, W]
        self.prefill_masks = _pack_bits((trace.prefill_counts > 0).reshape(R, L * E))  # [R, W]
        self.prompt_tokens = np.maximum(trace.prompt_tokens.astype(np.int64), 1)
        self.domains = trace.column("domain")
        cols = trace.requests.columns
        prompts = trace.column("prompt") if "prompt" in cols else [None] * R
        ids = trace.column("request_id") if "request_id" in cols else np.arange(R)
        self._index: dict[str, int] = {}
        self.rows_without_text = 0
        for r, p in enumerate(prompts):
            if p is not None and str(p).strip():  # imported traces carry "" for every row
                self._index.setdefault(str(p).strip(), r)
            else:
                self.rows_without_text += 1
        for r, i in enumerate(ids):
            self._index.setdefault(row_ref(i), r)
        self.words = self.decode_masks.shape[1]
        # rows with no decode steps: point them at an all-zero mask appended at the end
        self._empty = self.decode_masks.shape[0]
        self.decode_masks = np.vstack([self.decode_masks, np.zeros((1, self.words), dtype=np.uint64)])

    def with_true_cost(self, cost) -> "TraceReplay":
        """This replay with steps timed by ``cost`` while cost-aware routers keep predicting with this one's
        (a GPU that differs from the cost model the router was given): the report's sensitivity."""
        rp = copy.copy(self)
        rp.cost = cost
        rp.terms = StepTerms._make(float(x) for x in cost.step_terms(self.n_layers, self.token_scale))
        return rp

    @property
    def n_rows(self) -> int:
        return int(self.prefill_masks.shape[0])

    def match(self, prompt: str) -> tuple[int, bool]:
        """(trace row, matched?) for a prompt; unmatched prompts get row crc32(prompt) mod R."""
        key = str(prompt).strip()
        r = self._index.get(key)
        if r is not None:
            return r, True
        return zlib.crc32(key.encode("utf-8", "surrogatepass")) % self.n_rows, False

    def prefill_counts(self, row: int) -> np.ndarray:
        return np.asarray(self.trace.prefill_counts[row])

    def step_index(self, rows: np.ndarray, tokens_done: np.ndarray) -> np.ndarray:
        """Index into decode_masks of each request's next decode step."""
        rows = np.asarray(rows, dtype=np.int64)
        st = self.steps[rows]
        idx = self.offsets[rows] + np.asarray(tokens_done, dtype=np.int64) % np.maximum(st, 1)
        return np.where(st > 0, idx, self._empty)

    def decode_active(self, rows, tokens_done) -> int:
        """Sum over layers of distinct experts the batch activates in this decode step."""
        if len(rows) == 0:
            return 0
        u = np.bitwise_or.reduce(self.decode_masks[self.step_index(rows, tokens_done)], axis=0)
        return int(np.bitwise_count(u).sum())

    def prefill_active(self, rows) -> int:
        if len(rows) == 0:
            return 0
        u = np.bitwise_or.reduce(self.prefill_masks[np.asarray(rows, dtype=np.int64)], axis=0)
        return int(np.bitwise_count(u).sum())

    def charged(self, union: np.ndarray) -> int:
        """Experts a step whose union bit set is ``union`` pays for (the busiest rank's under EP)."""
        return int(charged_counts(union, self.n_layers, self.num_experts, self.ep)[0])

    def decode_step_ms(self, rows, tokens_done, recompute_tokens: int = 0) -> tuple[float, int]:
        """(step ms, distinct active experts summed over layers); the time charges :meth:`charged`.
        ``recompute_tokens``: KV of preempted requests recomputed in this step (extra tokens of the step)."""
        if len(rows) == 0:
            a = c = 0
        else:
            u = np.bitwise_or.reduce(self.decode_masks[self.step_index(rows, tokens_done)], axis=0)
            a = int(np.bitwise_count(u).sum())
            c = a if self.ep <= 1 else self.charged(u)
        tokens = len(rows) + recompute_tokens
        ctx = 0.0
        if self.roofline is not None and len(rows):  # each running request reads its KV at its context
            ctx = float((self.prompt_tokens[np.asarray(rows, dtype=np.int64)]
                         + np.asarray(tokens_done, dtype=np.int64)).sum())
        return float(step_ms_from_terms(self.terms, c, tokens, ctx)), a

    def wraps(self, row: int, max_tokens: int) -> bool:
        """Whether a request of ``max_tokens`` on ``row`` decodes past the row's captured steps."""
        return int(self.steps[row]) < int(max_tokens)

    def prefill_step_ms(self, rows) -> tuple[float, int]:
        a = self.prefill_active(rows)
        if self.ep > 1 and len(rows):
            a = self.charged(np.bitwise_or.reduce(self.prefill_masks[np.asarray(rows, dtype=np.int64)], axis=0))
        tokens = int(self.prompt_tokens[np.asarray(rows, dtype=np.int64)].sum()) if len(rows) else 0
        # the batch's prompt tokens as its tokens and no KV read (a roofline's linearisation would charge a
        # reference-context KV read per prompt token)
        return float(step_ms_from_terms(self.terms, a, tokens, 0.0)), a


def prefill_batch(queue_tokens: list[int], max_batched_tokens: int) -> int:
    """How many queued requests (FIFO) one prefill step takes: as many as fit in the token budget,
    at least one. Shared by the emulator and the simulator."""
    n, total = 0, 0
    for t in queue_tokens:
        if n > 0 and total + t > max_batched_tokens:
            break
        n += 1
        total += t
    return n
