"""The fast engine's sampler: plain sampling (temperature only) as two Triton kernels, else the torch rule.

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


def handles(device: torch.device, top_k: int, top_p: float, vocab: int) -> bool:
    """Whether this sampler applies: Triton on ``device`` and plain sampling (no top-k, no top-p)."""
    return attention.available(device) and (top_k == 0 or top_k >= vocab) and top_p >= 1.0


if triton is not None:

    @triton.jit
    def _chunk_stats(logits_ptr, stats_ptr, V, s_lb, temperature, NC, CHUNK: tl.constexpr):
        b = tl.program_id(0)
        c = tl.program_id(1)
        i = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(logits_ptr + b * s_lb + i, mask=i < V, other=float("-inf")).to(tl.float32) / temperature
        m = tl.max(x, 0)
        tl.store(stats_ptr + (b * NC + c) * 2, m)
        tl.store(stats_ptr + (b * NC + c) * 2 + 1, tl.sum(tl.exp(x - m), 0))

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
        ok = c < NC
        m = tl.load(stats_ptr + (b * NC + c) * 2, mask=ok, other=float("-inf"))
        top = tl.max(m, 0)
        w = tl.where(ok, tl.load(stats_ptr + (b * NC + c) * 2 + 1, mask=ok, other=0.0) * tl.exp(m - top), 0.0)
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


def sample_with_logprob(
    logits: torch.Tensor, temperature: float, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sampling.sample_with_logprob(logits, temperature, 0, 1.0, u)``: (B,) tokens (int64) and log-probs (fp32)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1 or u.shape != (rows,):
        raise ValueError(
            "the Triton sampler takes (rows, vocab) logits with the vocab contiguous and a uniform per row"
        )
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


def sample(logits: torch.Tensor, u: torch.Tensor, settings: sampling.Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """``sampling.sample_with_logprob`` under ``settings``; plain sampling through the two kernels where they run."""
    if handles(logits.device, settings.top_k, settings.top_p, logits.size(-1)):
        return sample_with_logprob(logits, settings.temperature, u)
    return sampling.sample_with_logprob(logits, settings.temperature, settings.top_k, settings.top_p, u)
