"""The fast engine's sampler: plain sampling and top-k (with or without top-p) as Triton kernels.

``engines.sampling.sample_with_logprob`` draws a token per row by inverse CDF and returns its
log-prob under ``softmax(logits / T)``. In torch that is ~25 launches a decode step (an fp32 copy of
the logits, a softmax, block sums, two cumulative sums and searches, a log-sum-exp, gathers): on an
H200 at batch 32, 0.18 ms of a 2.10 ms step; these two kernels take 9 µs (docs/speed_h200.md).
Here, for the rule the training rollouts use (no top-k, no top-p):

1. ``_chunk_stats``, a program per (row, chunk of ``CHUNK`` logits): the chunk's max and its sum of
   ``exp(x - max)``;
2. ``_pick``, a program per row: folds those into the row's total mass and log-sum-exp, finds the
   chunk where the cumulative mass reaches ``u`` × total and the token inside it, and writes the
   token and its log-prob.

The same rule as ``engines.sampling.pick_token`` (the first token whose cumulative mass reaches
``u`` × total), summed in another order; a token with no mass is never picked. Only the GPU runs it;
the tests run it under Triton's interpreter on the CPU (``TRITON_INTERPRET=1``) against the torch
rule. ``sample`` picks the kernels where they apply (``handles``) and the torch rule elsewhere.

Eval sampling (top-k 20, then top-p 0.8) is another two kernels, ``sample_top_with_logprob``. In torch
the rule is ~30 launches a step (a block-max pass, two top-k, a softmax, a nucleus, a search, a
log-sum-exp), ~1.4 ms a decode step at an eval's batch of 600 on an H200:

1. ``_chunk_top``, a program per (row, chunk): the chunk's max and sum of ``exp(x - max)`` (as
   ``_chunk_stats``) and the chunk's ``k`` largest logits with their ids, by ``k`` max-and-remove
   passes over the chunk in registers. The row's ``k`` largest are among these ``k`` a chunk;
2. ``_pick_top``, a program per row: the ``k`` largest of those candidates in descending order, a
   softmax over them, the nucleus (``engines.sampling._nucleus``), the inverse-CDF pick with ``u``,
   and the token's log-prob under the whole row's ``softmax(logits / T)`` from the chunks' stats.

Equal logits are ranked by token id (the lower first), where ``torch.topk`` leaves their order
unspecified: tied tokens have equal probability, so which of them a given ``u`` lands on changes no
distribution.
"""

from __future__ import annotations

import torch

from talkmethods.engines import sampling
from talkmethods.engines.fast import attention

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the engine samples in torch
    triton = None

CHUNK = 2048  # logits a first-pass program reads; the second pass scans one chunk per row
MAX_TOP_K = 64  # top-k the kernels take: k max-and-remove passes a chunk (eval's is 20)


def handles(device: torch.device, top_k: int, top_p: float, vocab: int) -> bool:
    """Whether this sampler applies: Triton on ``device`` and plain sampling (no top-k, no top-p)."""
    return attention.available(device) and (top_k == 0 or top_k >= vocab) and top_p >= 1.0


def handles_top(device: torch.device, top_k: int, top_p: float, vocab: int) -> bool:
    """Whether the top-k kernels apply: Triton on ``device`` and a top-k from 2 to ``MAX_TOP_K`` (top-p or not).

    Greedy (top-k 1) stays torch's one ``topk``: the recipe never samples greedily, and under Triton's
    interpreter the kernels would double the greedy engine tests' time."""
    return attention.available(device) and 1 < top_k <= MAX_TOP_K and top_k < vocab


if triton is not None:

    @triton.jit
    def _load_chunk(logits_ptr, stats_ptr, b, c, V, s_lb, temperature, NC, CHUNK: tl.constexpr):
        """Chunk ``c`` of row ``b`` as fp32 ``logits / T`` (-inf past the vocab); stores its max and sum of exp."""
        i = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(logits_ptr + b * s_lb + i, mask=i < V, other=float("-inf")).to(tl.float32) / temperature
        m = tl.max(x, 0)
        tl.store(stats_ptr + (b * NC + c) * 2, m)
        tl.store(stats_ptr + (b * NC + c) * 2 + 1, tl.sum(tl.exp(x - m), 0))
        return x

    @triton.jit
    def _chunk_masses(stats_ptr, b, NC, NCP: tl.constexpr):
        """Row ``b``'s largest chunk max and each chunk's mass relative to it (0 past the ``NC`` chunks)."""
        c = tl.arange(0, NCP)
        ok = c < NC
        m = tl.load(stats_ptr + (b * NC + c) * 2, mask=ok, other=float("-inf"))
        top = tl.max(m, 0)
        w = tl.where(ok, tl.load(stats_ptr + (b * NC + c) * 2 + 1, mask=ok, other=0.0) * tl.exp(m - top), 0.0)
        return top, w

    @triton.jit
    def _chunk_stats(logits_ptr, stats_ptr, V, s_lb, temperature, NC, CHUNK: tl.constexpr):
        _load_chunk(logits_ptr, stats_ptr, tl.program_id(0), tl.program_id(1), V, s_lb, temperature, NC, CHUNK)

    @triton.jit
    def _pick(
        logits_ptr,
        stats_ptr,
        u_ptr,
        tok_ptr,
        logp_ptr,
        V,
        s_lb,
        temperature,
        NC,
        CHUNK: tl.constexpr,
        NCP: tl.constexpr,
    ):
        b = tl.program_id(0)
        c = tl.arange(0, NCP)
        top, w = _chunk_masses(stats_ptr, b, NC, NCP)
        total = tl.sum(w, 0)
        target = tl.load(u_ptr + b) * total
        # the first chunk whose cumulative mass reaches the target; rounding never takes it past the
        # last chunk with mass
        cum = tl.cumsum(w, 0)
        ch = tl.minimum(tl.sum((cum < target).to(tl.int32), 0), tl.max(tl.where(w > 0, c, 0), 0))
        rest = target - tl.sum(tl.where(c < ch, w, 0.0), 0)
        j = tl.arange(0, CHUNK)
        i = ch * CHUNK + j
        x = tl.load(logits_ptr + b * s_lb + i, mask=i < V, other=float("-inf")).to(tl.float32) / temperature
        p = tl.exp(x - top)
        k = tl.minimum(tl.sum((tl.cumsum(p, 0) < rest).to(tl.int32), 0), tl.max(tl.where(p > 0, j, 0), 0))
        tl.store(tok_ptr + b, (ch * CHUNK + k).to(tl.int64))
        tl.store(logp_ptr + b, tl.sum(tl.where(j == k, x, 0.0), 0) - top - tl.log(total))

    @triton.jit
    def _chunk_top(
        logits_ptr, stats_ptr, cv_ptr, ci_ptr, V, s_lb, temperature, NC, CHUNK: tl.constexpr, K: tl.constexpr
    ):
        b = tl.program_id(0)
        c = tl.program_id(1)
        j = tl.arange(0, CHUNK)
        x = _load_chunk(logits_ptr, stats_ptr, b, c, V, s_lb, temperature, NC, CHUNK)
        out = (b * NC + c) * K
        for r in range(K):  # the chunk's k largest, the lower id first among equals
            v = tl.max(x, 0)
            at = tl.min(tl.where(x == v, j, CHUNK), 0)
            tl.store(cv_ptr + out + r, v)
            tl.store(ci_ptr + out + r, tl.minimum(c * CHUNK + at, V - 1))
            x = tl.where(j == at, float("-inf"), x)

    @triton.jit
    def _pick_top(
        stats_ptr,
        cv_ptr,
        ci_ptr,
        u_ptr,
        tok_ptr,
        logp_ptr,
        V,
        NC,
        top_p,
        K: tl.constexpr,
        KP: tl.constexpr,
        NCP: tl.constexpr,
        NCAND: tl.constexpr,
    ):
        b = tl.program_id(0)
        top, w = _chunk_masses(stats_ptr, b, NC, NCP)  # the row's log-sum-exp, from the chunks' stats
        lse = top + tl.log(tl.sum(w, 0))
        # the k largest candidates, descending (the lower id first among equals)
        n = tl.arange(0, NCAND)
        okn = n < NC * K
        cv = tl.load(cv_ptr + b * NC * K + n, mask=okn, other=float("-inf"))
        ci = tl.load(ci_ptr + b * NC * K + n, mask=okn, other=V)
        kk = tl.arange(0, KP)
        vals = tl.full([KP], float("-inf"), tl.float32)
        ids = tl.zeros([KP], tl.int32)
        for r in range(K):
            v = tl.max(cv, 0)
            at = tl.min(tl.where(cv == v, ci, V), 0)
            vals = tl.where(kk == r, v, vals)
            ids = tl.where(kk == r, at, ids)
            cv = tl.where(ci == at, float("-inf"), cv)
        # softmax over the k, the nucleus (the tail outside the smallest set with mass >= top_p), inverse CDF
        p = tl.where(kk < K, tl.exp(vals - tl.max(vals, 0)), 0.0)
        p = p / tl.sum(p, 0)
        p = tl.where(tl.cumsum(p, 0) - p >= top_p, 0.0, p)
        cdf = tl.cumsum(p, 0)
        target = tl.load(u_ptr + b) * tl.max(cdf, 0)
        last = tl.max(tl.where(p > 0, kk, 0), 0)  # rounding never takes the pick past the last token with mass
        k = tl.minimum(tl.sum((cdf < target).to(tl.int32), 0), last)
        tl.store(tok_ptr + b, tl.sum(tl.where(kk == k, ids, 0), 0).to(tl.int64))
        tl.store(logp_ptr + b, tl.sum(tl.where(kk == k, vals, 0.0), 0) - lse)


def _check(logits: torch.Tensor, u: torch.Tensor) -> tuple[int, int]:
    """(rows, vocab) of logits the kernels can read: the vocab contiguous and a uniform per row."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1 or u.shape != (rows,):
        raise ValueError(
            "the Triton sampler takes (rows, vocab) logits with the vocab contiguous and a uniform per row"
        )
    return rows, vocab


def sample_with_logprob(
    logits: torch.Tensor, temperature: float, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sampling.sample_with_logprob(logits, temperature, 0, 1.0, u)``: (B,) tokens (int64) and log-probs (fp32)."""
    rows, vocab = _check(logits, u)
    chunks = -(-vocab // CHUNK)
    stats = torch.empty(rows, chunks, 2, dtype=torch.float32, device=logits.device)
    tok = torch.empty(rows, dtype=torch.long, device=logits.device)
    logp = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _chunk_stats[(rows, chunks)](logits, stats, vocab, logits.stride(0), float(temperature), chunks, CHUNK=CHUNK)
    _pick[(rows,)](
        logits,
        stats,
        u,
        tok,
        logp,
        vocab,
        logits.stride(0),
        float(temperature),
        chunks,
        CHUNK=CHUNK,
        NCP=max(16, triton.next_power_of_2(chunks)),
    )
    return tok, logp


def sample_top_with_logprob(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sampling.sample_with_logprob(logits, temperature, top_k, top_p, u)`` for 0 < top_k <= ``MAX_TOP_K``."""
    rows, vocab = _check(logits, u)
    if not 0 < top_k <= min(MAX_TOP_K, vocab):
        raise ValueError(f"the top-k kernels take 0 < top_k <= {MAX_TOP_K} and the vocabulary (got {top_k})")
    chunks = -(-vocab // CHUNK)
    stats = torch.empty(rows, chunks, 2, dtype=torch.float32, device=logits.device)
    cv = torch.empty(rows, chunks, top_k, dtype=torch.float32, device=logits.device)
    ci = torch.empty(rows, chunks, top_k, dtype=torch.int32, device=logits.device)
    tok = torch.empty(rows, dtype=torch.long, device=logits.device)
    logp = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _chunk_top[(rows, chunks)](
        logits, stats, cv, ci, vocab, logits.stride(0), float(temperature), chunks, CHUNK=CHUNK, K=top_k
    )
    _pick_top[(rows,)](
        stats,
        cv,
        ci,
        u,
        tok,
        logp,
        vocab,
        chunks,
        float(top_p) if top_p < 1.0 else 2.0,  # 2: no nucleus (mass before a token never reaches it)
        K=top_k,
        KP=max(16, triton.next_power_of_2(top_k)),
        NCP=max(16, triton.next_power_of_2(chunks)),
        NCAND=max(16, triton.next_power_of_2(chunks * top_k)),
    )
    return tok, logp


def sample(logits: torch.Tensor, u: torch.Tensor, settings: sampling.Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """``sampling.sample_with_logprob`` under ``settings``, through the kernels where they run."""
    if handles(logits.device, settings.top_k, settings.top_p, logits.size(-1)):
        return sample_with_logprob(logits, settings.temperature, u)
    if handles_top(logits.device, settings.top_k, settings.top_p, logits.size(-1)):
        return sample_top_with_logprob(logits, settings.temperature, settings.top_k, settings.top_p, u)
    return sampling.sample_with_logprob(logits, settings.temperature, settings.top_k, settings.top_p, u)
