"""The fast engine's runtime: ``FastGenerator``, its static buffers, per-seat lanes, CUDA graphs and streams.

``generate`` splits a call into one batch per weight set (``weights.FusedWeights``), prefills each
(``qwen2.prefill_math``, or ``extend_math`` over a lane's cached prefix), then replays each batch's
decode-step graph (``qwen2.decode_math``) until its rows stop; without graphs (a CPU) the same step
runs eagerly.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from talkmethods.engines.fast import attention as da
from talkmethods.engines.fast.qwen2 import (
    ATTENTION_FORMS,
    decode_math,
    extend_math,
    make_extend_layer,
    make_layer_step,
    make_prefill_layer,
    prefill_math,
    visible,
)
from talkmethods.engines.fast.sampler import sample
from talkmethods.engines.fast.weights import Arch, FusedWeights, StackedWeights
from talkmethods.engines.plain import PlainGenerator, check_adapters
from talkmethods.engines.sampling import Sampling, refuse_repetition_penalty

COLUMN_BUCKET = 256  # cache columns attended are rounded up to this (one graph per bucket)
AUTO_SDPA_ROWS = 256  # attention="auto": the fused kernel up to this batch, the two products above
PREFILL_TOKENS = 32_768  # prompt tokens per prefill chunk (bounds activation memory)


def batch_bucket(n: int) -> int:
    """Rows a batch of ``n`` chats is padded to: powers of two up to 512, then multiples of 128."""
    if n <= 512:
        return max(8, 1 << (n - 1).bit_length())
    return -(-n // 128) * 128


class _Slots:
    """Static buffers of one batch size: the KV cache and the decode state a graph reads and writes."""

    def __init__(self, arch: Arch, rows: int, columns: int, steps: int, dtype, device):
        shape = (arch.layers, rows, arch.kv_heads, columns, arch.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # zeros: masked columns must be finite
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.columns, self.steps = columns, steps
        z = dict(dtype=torch.long, device=device)
        self.tok, self.pos, self.pad_start = (torch.zeros(rows, **z) for _ in range(3))
        self.hole = torch.zeros(rows, 2, **z)  # columns [lo, hi) a row skips: a reused prefix's stale tail
        self.col, self.step = torch.zeros(1, **z), torch.zeros(1, **z)
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.u = torch.zeros(steps, rows, device=device)
        self.out_tok = torch.zeros(rows, steps, **z)
        self.out_logp = torch.zeros(rows, steps, device=device)
        # the attention kernel's split counters: a batch's own, so two batches may decode concurrently
        self.counters = torch.zeros(rows * arch.kv_heads, dtype=torch.int32, device=device)


@dataclass
class _Lane:
    """What a lane's last turn left in its cache, for the lane's next turn to continue.

    Row ``i``'s tokens ``tokens[i]`` (its prompt and all of its completion but the last token) have
    their K/V in columns ``[starts[i], starts[i] + len(tokens[i]))``; columns up to ``end`` were written.
    """

    n: int
    starts: list[int]
    tokens: list[list[int]]
    end: int


@dataclass(eq=False)  # a batch is itself: ``_decode`` drops finished ones from a list by identity
class _Batch:
    """One batch on one weight set between ``_begin`` and ``_finish``: ``t`` tokens sampled so far."""

    prompts: list
    weights: FusedWeights
    sampling: Sampling
    lane: tuple | None
    slots: _Slots
    graph: object
    columns: int
    state: _Lane | None
    end: int  # the first column the decode writes (after the prompts)
    t: int = 1


class FastGenerator(PlainGenerator):
    """Rollout engine over fused merged weights and a static KV cache (CUDA graphs on a GPU).

    Same interface as ``PlainGenerator``; also returns per-token log-probs in ``last_logprobs``. A call's
    rows may name any of the model's adapters (a seed cohort's): ``stack_adapters`` picks how they decode.
    A trainer calls ``sync_weights()`` after each optimizer step; an eval builds it once.
    ``graphs``/``compile`` default to on with a GPU; ``attention`` is ``auto`` or one of
    ``qwen2.ATTENTION_FORMS``; ``compile_ends=False`` leaves the step's two ends eager (an A/B).
    """

    def __init__(
        self,
        model,
        tokenizer,
        graphs: bool | None = None,
        compile: bool | None = None,
        attention: str = "auto",
        compile_ends: bool = True,
        stack_adapters: bool = True,
    ):
        super().__init__(model, tokenizer)
        # a call with rows of several adapters (a seed cohort's): one batch over the base weights with each
        # adapter's LoRA as batched products (True), or one batch per adapter's merged copy, the batches on
        # their own streams (False). Three adapters' 32 rows, H100: 3.62 ms a decode step against 4.64, and
        # 6.74 for three lone runs' steps (bench/ab.py cohort-decode)
        self.stack_adapters = stack_adapters
        self._stacked: dict[tuple, StackedWeights] = {}
        device = next(model.parameters()).device
        self.device = device
        self.graphs = device.type == "cuda" if graphs is None else graphs
        compile = self.graphs if compile is None else compile
        self.is_peft = hasattr(model, "disable_adapter")
        # a weight set per adapter the model has (a seed cohort's several; a policy's one, ``default``)
        # and the base model's, keyed by the adapter's name (None: the base)
        self.weights = {None: FusedWeights(model, adapter=None)}
        for name in sorted(getattr(model, "peft_config", {}) or {}) if self.is_peft else []:
            self.weights[name] = FusedWeights(model, adapter=name)
        self.arch = self.weights[None].arch
        self.dtype = self.weights[None].tensors[1].dtype
        self._slots: dict[tuple, _Slots] = {}  # (rows, lane): a lane keeps its own cache
        self._lanes: dict[tuple, _Lane] = {}
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pools: dict[str | None, object] = {}  # a graph memory pool per weight set: their batches may run at once
        self._streams: list = []
        self._capture_streams: dict[str | None, object] = {}
        # The layer is compiled once for all 28 layers (seconds, not minutes), and the step's two ends
        # beside it; shapes become symbolic after the second batch/column size. Sampling is not
        # compiled: it runs as two Triton kernels (``sampler``), plain or top-k/top-p.
        if attention != "auto" and attention not in ATTENTION_FORMS:
            raise ValueError(f"unknown attention form {attention!r}; auto or one of {ATTENTION_FORMS}")
        self.attention = attention
        self.compile_ends = compile_ends
        self._wrap = (lambda f: torch.compile(f, fullgraph=True)) if compile else None
        self._layers: dict[str, object] = {}
        dynamic = (lambda f: torch.compile(f, fullgraph=True, dynamic=True)) if compile else None
        self._prefill_layer = make_prefill_layer(self.arch, dynamic)
        self._extend_layer = make_extend_layer(self.arch, dynamic)
        self.eos = torch.tensor(self.eos_ids, device=device)
        self.captures = 0
        # wall-clock split of the work done so far (synchronised at batch edges only)
        self.timing = {
            "prefill_s": 0.0,
            "decode_s": 0.0,
            "decode_steps": 0,
            "row_steps": 0,
            "capture_s": 0.0,
            "prompt_tokens": 0,
            "reused_tokens": 0,
        }
        if compile:
            from torch import _dynamo

            # one compile per new batch/column shape until dynamo makes them symbolic; sampling settings add a few
            name = "recompile_limit" if hasattr(_dynamo.config, "recompile_limit") else "cache_size_limit"
            setattr(_dynamo.config, name, max(getattr(_dynamo.config, name), 64))

    def _layer_for(self, rows: int):
        """The decode layer for a batch of ``rows``: ``auto`` takes the form measured fastest there.

        On a GPU that is the Triton kernel (``triton``), the fastest at batch 32 and 600 on an H200
        (docs/speed_h200.md); elsewhere one fused attention kernel (``sdpa``) up to ``AUTO_SDPA_ROWS``
        rows and the two products (``matmul``) above, as measured there before the kernel.
        """
        form = self.attention if self.attention != "auto" else self._auto_form(rows)
        if form == "triton" and not da.available(self.device):
            raise ValueError("attention='triton' needs a CUDA device and the triton package")
        if form not in self._layers:
            sms = (
                torch.cuda.get_device_properties(self.device).multi_processor_count
                if self.device.type == "cuda"
                else 132
            )
            self._layers[form] = make_layer_step(self.arch, form, self._wrap, sms, self.compile_ends)
        return self._layers[form]

    def _auto_form(self, rows: int) -> str:
        if da.available(self.device) and da.supports(self.arch.head_dim, self.arch.heads // self.arch.kv_heads):
            return "triton"
        return "sdpa" if rows <= AUTO_SDPA_ROWS else "matmul"

    reuses_turns = True  # ``play_chats`` names each seat's lane (``generate(..., lane=seat)``)

    def sync_weights(self, adapter: str | None = None) -> None:
        """Fold an adapter's current weights into its inference copy (after each optimizer step).

        ``adapter``: the one whose weights moved (a cohort's seed after its step); None: every adapter.
        """
        for name, weights in self.weights.items():
            if name is not None and adapter in (None, name):
                weights.refresh()
        for names, stacked in self._stacked.items():
            if adapter is None or adapter in names:
                stacked.refresh(adapter)

        def moved(key) -> bool:  # a lane's weights: one adapter's (a name), a stack's (a tuple) or the base's
            return adapter is None or key == adapter or (isinstance(key, tuple) and adapter in key)

        self._lanes = {k: v for k, v in self._lanes.items() if not moved(k[1])}  # old K/V are not continued

    def generate(
        self, prompts: list[list[int]], adapter_on: list[bool | str], sampling: Sampling, lane: str | None = None
    ) -> list[list[int]]:
        """Sample a completion per prompt (``PlainGenerator.generate``), keeping K/V per ``lane``.

        A lane is a sequence of turns over the same rows (``play_chats``: a seat). A prompt that starts
        with what its row left in the lane's cache last turn (that prompt and its completion, the
        seat's own words as sampled) has only the rest prefilled: a seat's second turn prefills the
        partner's reply, not the whole dialogue. Other rows (and every row after new weights) are
        prefilled whole. A lane continues once, then starts afresh.
        """
        names = check_adapters(self.model, adapter_on)
        refuse_repetition_penalty(sampling, "fast")
        outs: list = [None] * len(prompts)
        logps: list = [None] * len(prompts)
        # one batch per weight set (base-seat rows run on the base copy, a cohort's seeds each on its
        # own); several decode together, step by step, each on its own CUDA stream when graphs run
        adapters = sorted({n for n in names if n is not None})
        order = [tuple(adapters)] + [None] if self.stack_adapters and len(adapters) > 1 else adapters + [None]
        sets = [(key, [i for i, n in enumerate(names) if n == key]) for key in order if not isinstance(key, tuple)]
        sets = [(key, rows) for key, rows in sets if rows]
        with torch.no_grad():
            batches = [
                self._begin(
                    [prompts[i] for i in rows], self.weights[key], sampling, None if lane is None else (lane, key)
                )
                for key, rows in sets
            ]
            if isinstance(order[0], tuple):  # the adapters' rows as one batch, in equal groups
                rows, batch = self._begin_stacked(prompts, names, order[0], sampling, lane)
                sets, batches = [(order[0], rows), *sets], [batch, *batches]
            self._decode(batches)
            for (_, rows), batch in zip(sets, batches, strict=True):
                toks, lps = self._finish(batch)
                for i, t, lp in zip(rows, toks, lps, strict=True):
                    if i is not None:  # a stacked batch's filler rows are dropped
                        outs[i], logps[i] = t, lp
        self.last_logprobs = logps
        return outs

    def _begin_stacked(self, prompts, names, adapters: tuple, sampling: Sampling, lane: str | None):
        """One batch of every adapter's rows over ``StackedWeights``: group ``s`` (adapter ``s``'s rows,
        then filler rows up to the largest group's bucket) is prefilled on that adapter's merged copy and
        decoded with the others. Returns each batch row's call row (None: a filler) and the batch."""
        groups = [[i for i, n in enumerate(names) if n == a] for a in adapters]
        widest = max(len(g) for g in groups)
        size = batch_bucket(widest) if self.graphs else widest
        rows = [i for g in groups for i in g + [None] * (size - len(g))]
        stacked = self._stacked.get(adapters)
        if stacked is None:
            stacked = self._stacked[adapters] = StackedWeights(self.model, self.weights[None], adapters)
        parts = [(self.weights[a], s * size, (s + 1) * size) for s, a in enumerate(adapters)]
        batch = self._begin(
            [prompts[i] if i is not None else [self.pad_id] for i in rows],
            stacked,
            sampling,
            None if lane is None else (lane, adapters),
            parts=parts,
            filler=[i is None for i in rows],
        )
        return rows, batch

    # -- one batch on one weight set ------------------------------------------------------------

    def _begin(
        self,
        prompts,
        weights: FusedWeights | StackedWeights,
        sampling: Sampling,
        lane: tuple | None = None,
        parts: list | None = None,
        filler: list[bool] | None = None,
    ) -> _Batch:
        """Set a batch up: its cache and graph, its prompts prefilled, its first token sampled.

        ``parts``: (merged weights, first row, end row) that prefill a stacked batch's groups;
        ``filler``: its rows that are no call's (finished from the start, like bucket rows).
        """
        n, steps = len(prompts), sampling.max_new_tokens
        rows = batch_bucket(n) if self.graphs and parts is None else n
        reused = self._continues(self._lanes.pop(lane, None) if lane is not None else None, prompts)
        if reused is None:  # the whole prompts, from column 0
            state, fed, base = None, prompts, 0
        else:  # the rest of each prompt, after the columns the lane's last turn wrote
            state, cached = reused
            fed, base = [p[c:] for p, c in zip(prompts, cached, strict=True)], state.end
        width = max(len(p) for p in fed)
        columns = -(-(base + width + steps) // COLUMN_BUCKET) * COLUMN_BUCKET
        # a lane's first turn leaves room for its next: this turn, the partner's reply, one more turn
        need = base + width + 3 * steps + 64 if lane is not None and state is None else columns
        # a batch's buffers: its lane's, or (no lane) its weight set's, so both sets' batches can run at once
        own = lane if lane is not None else (None, weights.adapter)
        slots = self._slots_for(rows, max(columns, need), steps, own)
        t0 = time.perf_counter()
        graph = self._graph_for(slots, rows, columns, weights, sampling, own) if self.graphs else None
        self.timing["capture_s"] += time.perf_counter() - t0

        padded = fed + [[self.pad_id]] * (rows - n)  # bucket rows: finished from the start
        ids, mask = self.left_pad(padded)
        fed_len = mask.sum(-1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        first = base + width - fed_len  # each row's first fed column
        if state is None:
            slots.pad_start.copy_(first)
            slots.hole.zero_()
            slots.pos.copy_(fed_len)
        else:
            c = torch.tensor(cached + [0] * (rows - n), device=self.device)
            start = torch.tensor(state.starts + [0] * (rows - n), device=self.device)
            keep = c > 0  # rows continuing their cached prefix: skip the stale columns between
            slots.pad_start.copy_(torch.where(keep, start, first))
            slots.hole.copy_(torch.stack([torch.where(keep, start + c, 0), torch.where(keep, first, 0)], 1))
            slots.pos.copy_(c + fed_len)
            positions = positions + c[:, None]
        slots.col.fill_(base + width)
        slots.step.zero_()
        slots.done.copy_(torch.arange(rows, device=self.device) >= n)
        if filler is not None:
            slots.done |= torch.tensor(filler, device=self.device)
        slots.out_tok.fill_(self.pad_id)
        slots.out_logp.zero_()
        slots.u[:steps].uniform_()  # the global (seeded) RNG: reproducible rollouts

        t0 = time.perf_counter()
        logits = torch.cat(
            [
                self._prefill(w, ids[a:b], mask[a:b], slots, a)
                if state is None
                else self._extend(w, ids[a:b], positions[a:b], slots, base, a)
                for w, a, b in parts or [(weights, 0, rows)]
            ]
        )
        self.timing["prompt_tokens"] += sum(len(p) for p in prompts)
        self.timing["reused_tokens"] += 0 if state is None else sum(cached)
        tok, logp = sample(logits, slots.u[0], sampling)
        self._record(slots, tok, logp)
        self._sync()
        self.timing["prefill_s"] += time.perf_counter() - t0
        return _Batch(prompts, weights, sampling, lane, slots, graph, columns, state, base + width)

    def _advance(self, b: _Batch) -> bool:
        """One decode step of ``b``; whether it has more to do (every 16 steps it asks the device)."""
        if b.graph is not None:
            b.graph.replay()
        else:
            self._step(b.slots, b.columns, b.weights, b.sampling)
        b.t += 1
        return b.t < b.sampling.max_new_tokens and not (b.t % 16 == 0 and bool(b.slots.done.all()))

    def _decode(self, batches: list[_Batch]) -> None:
        """Decode the batches to their ends, a step of each in turn.

        With CUDA graphs each batch replays on its own stream, so two batches' steps run at once: at a
        few rows a step's kernels leave most of the GPU idle (a 16-row step costs about a 32-row one).
        Their wall-clock counts once in ``timing["decode_s"]``.
        """
        streams = [None] * len(batches)
        if len(batches) > 1 and self.graphs:
            if len(self._streams) < len(batches):
                self._streams = [torch.cuda.Stream(self.device) for _ in batches]
            streams = self._streams[: len(batches)]
            for stream in streams:
                stream.wait_stream(torch.cuda.current_stream())
        t1 = time.perf_counter()
        live = [(b, stream) for b, stream in zip(batches, streams, strict=True) if b.t < b.sampling.max_new_tokens]
        while live:
            for b, stream in list(live):
                with torch.cuda.stream(stream) if stream is not None else nullcontext():
                    if not self._advance(b):
                        live.remove((b, stream))
        self._sync()
        self.timing["decode_s"] += time.perf_counter() - t1
        for b in batches:
            self.timing["decode_steps"] += b.t - 1
            self.timing["row_steps"] += (b.t - 1) * len(b.prompts)

    def _finish(self, b: _Batch):
        """A decoded batch's completions and log-probs (trimmed); what its lane may continue next turn."""
        prompts, slots, lane, state, n, t = b.prompts, b.slots, b.lane, b.state, len(b.prompts), b.t
        if not bool(slots.out_logp[:n].isfinite().all()):
            raise FloatingPointError("the rollout sampled from non-finite logits: the policy weights hold NaN/inf")
        trimmed = self._trim(slots.out_tok[:n].cpu())
        lps = slots.out_logp[:n].tolist()
        if lane is not None and state is None:  # what the next turn of this lane may continue
            self._lanes[lane] = _Lane(
                n=n,
                starts=slots.pad_start[:n].tolist(),
                tokens=[p + c[:-1] for p, c in zip(prompts, trimmed, strict=True)],
                end=b.end + t - 1,
            )
        return trimmed, [lp[: len(t)] for lp, t in zip(lps, trimmed, strict=True)]

    def _continues(self, state: _Lane | None, prompts) -> tuple[_Lane, list[int]] | None:
        """The lane state and each row's cached length, if any row's prompt continues what is cached."""
        if state is None or state.n != len(prompts):
            return None
        cached = [
            len(t) if len(p) > len(t) and p[: len(t)] == t else 0 for p, t in zip(prompts, state.tokens, strict=True)
        ]
        return (state, cached) if any(cached) else None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _record(self, slots: _Slots, tok, logp) -> None:
        """Store the token sampled at ``slots.step``; advance the state to the next step."""
        tok = torch.where(slots.done, torch.full_like(tok, self.pad_id), tok)
        slots.out_tok.index_copy_(1, slots.step, tok[:, None])
        slots.out_logp.index_copy_(1, slots.step, logp[:, None].float())
        slots.done |= torch.isin(tok, self.eos)
        slots.tok.copy_(tok)
        slots.step += 1

    def _step(self, slots: _Slots, columns: int, weights: FusedWeights, sampling: Sampling) -> None:
        """One decode step, all on the device (captured as one CUDA graph on a GPU)."""
        u = slots.u.index_select(0, slots.step.clamp(max=slots.steps - 1))[0]
        nxt, logp, k, v = decode_math(
            self._layer_for(slots.tok.size(0)),
            weights.tensors,
            weights.inv_freq,
            weights.rope_scale,
            self.arch.eps,
            slots.tok,
            slots.pos,
            slots.col,
            slots.pad_start,
            slots.hole,
            u,
            slots.k[:, :, :, :columns],
            slots.v[:, :, :, :columns],
            sampling,
            slots.counters,
        )
        if k is not None:
            slots.k.index_copy_(3, slots.col, k[:, :, :, None])
            slots.v.index_copy_(3, slots.col, v[:, :, :, None])
        slots.pos += 1
        slots.col += 1
        self._record(slots, nxt, logp)

    def _extend(
        self, weights: FusedWeights, ids, positions, slots: _Slots, base: int, offset: int = 0
    ) -> torch.Tensor:
        """Prefill the new tokens ``ids`` (left-padded) at columns ``base`` on, over the cached prefixes
        (of the batch's rows from ``offset`` on)."""
        width = ids.size(1)
        end = base + width
        cols = torch.arange(end, device=self.device)
        query_col = base + torch.arange(width, device=self.device)
        chunk = max(1, min(PREFILL_TOKENS // width, 4 * PREFILL_TOKENS // end))
        logits = []
        for s in range(0, ids.size(0), chunk):
            r = slice(offset + s, offset + min(s + chunk, ids.size(0)))  # the chunk's rows of the batch
            pad, hole = slots.pad_start[r, None, None], slots.hole[r, None]
            seen = visible(cols, pad, hole[..., :1], hole[..., 1:], query_col[:, None] + 1)
            allowed = seen | (cols == query_col[:, None])  # a padding query sees itself: no softmax row is empty
            logits.append(
                extend_math(
                    weights.tensors,
                    weights.inv_freq,
                    ids[s : s + chunk],
                    positions[s : s + chunk],
                    allowed,
                    slots.k[:, r],
                    slots.v[:, r],
                    base,
                    self.arch,
                    weights.rope_scale,
                    self._extend_layer,
                )
            )
        return torch.cat(logits)

    def _prefill(self, weights: FusedWeights, ids, mask, slots: _Slots, offset: int = 0) -> torch.Tensor:
        """The prompts ``ids`` (left-padded) from column 0, into the cache rows from ``offset`` on."""
        width = ids.size(1)
        chunk = max(1, PREFILL_TOKENS // width)
        logits = []
        for s in range(0, ids.size(0), chunk):
            lg, k, v = prefill_math(
                weights.tensors,
                weights.inv_freq,
                ids[s : s + chunk],
                mask[s : s + chunk],
                self.arch,
                weights.rope_scale,
                self._prefill_layer,
            )
            r = slice(offset + s, offset + min(s + chunk, ids.size(0)))  # the chunk's rows of the batch
            slots.k[:, r, :, :width] = k
            slots.v[:, r, :, :width] = v
            logits.append(lg)
        return torch.cat(logits)

    # -- buffers and graphs -----------------------------------------------------------------------

    def _slots_for(self, rows: int, columns: int, steps: int, lane: tuple | None = None) -> _Slots:
        key = (rows, lane)
        slots = self._slots.get(key)
        if slots is None or slots.columns < columns or slots.steps < steps:
            old = slots
            if old is not None:  # grown: graphs over the old buffers are stale
                self._graphs = {k: g for k, g in self._graphs.items() if k[0] != key}
                # new captures take a fresh pool: capturing into a pool whose graphs are all gone trips
                # the caching allocator's assert (use_count > 0) when any of its blocks is still alive
                self._pools = {}
                del self._slots[key]
            columns = -(-max(columns, 4 * COLUMN_BUCKET, old.columns if old else 0) // COLUMN_BUCKET) * COLUMN_BUCKET
            slots = _Slots(self.arch, rows, columns, max(steps, old.steps if old else 0), self.dtype, self.device)
            if old is not None:  # a lane's cached prefixes move along
                slots.k[..., : old.columns, :].copy_(old.k)
                slots.v[..., : old.columns, :].copy_(old.v)
                del old
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            self._slots[key] = slots
        return slots

    def _graph_for(
        self,
        slots: _Slots,
        rows: int,
        columns: int,
        weights: FusedWeights,
        sampling: Sampling,
        lane: tuple | None = None,
    ):
        key = ((rows, lane), columns, weights.adapter, sampling.temperature, sampling.top_k, sampling.top_p)
        graph = self._graphs.get(key)
        if graph is not None:
            return graph
        pool = self._pools.get(weights.adapter)
        if pool is None:
            pool = self._pools[weights.adapter] = torch.cuda.graph_pool_handle()
        # warm up (compiles on the first shapes) on a side stream, then capture one whole step; the
        # warm-up writes K/V in the last two columns, where no cached prefix lies
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        slots.col.fill_(columns - 2)
        slots.step.zero_()
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(slots, columns, weights, sampling)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # each weight set captures on its own stream: cuBLAS keys its workspace by stream and a graph
        # keeps the one it captured with, so the two sets' graphs, which may run at once, get their own
        capture = self._capture_streams.setdefault(weights.adapter, torch.cuda.Stream(self.device))
        with torch.cuda.graph(graph, pool=pool, stream=capture):
            self._step(slots, columns, weights, sampling)
        self._graphs[key] = graph
        self.captures += 1
        return graph
