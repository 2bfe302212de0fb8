"""Rollout engines: an eager decode loop beside the reference ``model.generate`` path, and the sampler.

``LoopGenerator`` runs prefill once, then one forward per new token over a KV cache, and samples on
the device by inverse CDF (``searchsorted`` over the cumulative probabilities) instead of
``torch.multinomial``, which dominates decode time on a CPU at Qwen's 151,936-token vocabulary.
Top-k is applied before top-p so that eval sampling (top-k 20, top-p 0.8) never sorts the vocabulary.
Select an engine with ``train.engine`` / ``eval.engine``: ``fast`` (default; ``fastdecode.py``: merged
weights, static KV cache, CUDA graphs), ``loop`` (this decode loop over the live model) or ``plain``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from talkmethods.rollout import BASE_ADAPTER, PlainGenerator, Sampling, refuse_repetition_penalty

CDF_BLOCK = 128  # long rows are searched in blocks: the inverse CDF and the top-k (see below)

def sample_with_logprob(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                        u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A token per row drawn with the uniforms ``u`` (B,), and its log-prob under ``softmax(logits / T)``.

    The log-prob is the one TRL's loss computes (temperature applied, top-k/top-p not), so the trainer
    can compare the rollout's numbers with its own.
    """
    scaled = logits.float() / temperature
    tok = pick_token(scaled, top_k, top_p, u)
    # a gather and one reduction, not a full (B, V) log_softmax written out
    return tok, scaled.gather(-1, tok[:, None])[:, 0] - torch.logsumexp(scaled, dim=-1)


def pick_token(scaled: torch.Tensor, top_k: int, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF pick from temperature-scaled logits, top-k first, then top-p; ``u``: (B,) uniforms."""
    if top_k and top_k < scaled.size(-1):
        vals, idx = top_k_of(scaled, top_k)  # (B, k), sorted descending
        probs = torch.softmax(vals, dim=-1)
        if top_p < 1.0:
            probs = _nucleus(probs, top_p)
        return idx.gather(-1, _inverse_cdf(probs, u))[:, 0]
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sp, si = torch.sort(probs, dim=-1, descending=True)
        return si.gather(-1, _inverse_cdf(_nucleus(sp, top_p), u))[:, 0]
    return _inverse_cdf(probs, u)[:, 0]


def top_k_of(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k)`` (sorted) for wide rows, through the ``k`` blocks of 128 with the largest maxima.

    Each of the ``k`` largest values is its block's maximum or below it, and a block whose maximum
    is not among the ``k`` largest block maxima holds none of them; so the answer lies in those ``k``
    blocks and one small ``topk`` over their ``128·k`` values finds it. A flat ``topk`` over 151,936
    columns costs ~5 ms a decode step at batch 600 on an H200; this is one max-reduction pass.
    """
    n, width = x.shape
    if width <= 4 * k * CDF_BLOCK:
        return torch.topk(x, k, dim=-1)
    pad = -width % CDF_BLOCK
    blocks = (F.pad(x, (0, pad), value=float("-inf")) if pad else x).view(n, -1, CDF_BLOCK)
    best = blocks.amax(-1).topk(k, dim=-1).indices  # (B, k) blocks
    cand = blocks.gather(1, best[:, :, None].expand(-1, -1, CDF_BLOCK)).view(n, -1)  # (B, k·128)
    vals, j = cand.topk(k, dim=-1)
    return vals, best.gather(-1, j // CDF_BLOCK) * CDF_BLOCK + j % CDF_BLOCK


def _nucleus(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail of descending ``sorted_probs`` outside the smallest set with mass >= top_p."""
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each token
    return sorted_probs.masked_fill(before >= top_p, 0.0)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first index whose cumulative mass reaches ``u`` × total, per row: (B, 1).

    A GPU scan over a 151,936-wide row with few rows is one slow block per row (~0.2 ms a decode
    step at batch 32), so a long row is searched in two levels: the cumulative sums of 128-token
    blocks pick the block, the cumulative sum inside that block picks the token. The same rule as a
    flat cumulative sum, summed in another order.
    """
    n, width = probs.shape
    if width <= 64 * CDF_BLOCK:
        cdf = probs.cumsum(-1)
        return torch.searchsorted(cdf, u[:, None].to(cdf.dtype) * cdf[:, -1:]).clamp_(max=width - 1)
    blocks = F.pad(probs, (0, -width % CDF_BLOCK)).view(n, -1, CDF_BLOCK)
    sums = blocks.sum(-1)  # (B, nb)
    cdf = sums.cumsum(-1)
    target = u[:, None].to(cdf.dtype) * cdf[:, -1:]
    blk = torch.searchsorted(cdf, target).clamp_(max=cdf.size(-1) - 1)  # (B, 1)
    rest = target - (cdf.gather(-1, blk) - sums.gather(-1, blk))
    inner = blocks.gather(1, blk[:, :, None].expand(-1, 1, CDF_BLOCK))[:, 0].cumsum(-1)  # (B, 128)
    last = (inner < inner[:, -1:]).sum(-1, keepdim=True)  # the block's last token with mass (rounding guard)
    j = torch.minimum(torch.searchsorted(inner, rest), last)
    return (blk * CDF_BLOCK + j).clamp_(max=width - 1)


class LoopGenerator(PlainGenerator):
    """Batched decode loop over a KV cache; same interface and trimming as ``PlainGenerator``."""

    def _generate(self, prompts: list[list[int]], adapter_on: list[bool], sampling: Sampling) -> list[list[int]]:
        refuse_repetition_penalty(sampling, "loop")
        is_peft = hasattr(self.model, "disable_adapter")
        if not is_peft and any(adapter_on):
            raise ValueError("adapter requested but the model has no adapter")
        if is_peft and not any(adapter_on):
            with self.model.disable_adapter():
                return self._decode(prompts, [True] * len(prompts), sampling, peft_mixed=False)
        # PEFT's per-row adapter routing splits every layer's batch: only pay for it in a mixed batch
        return self._decode(prompts, adapter_on, sampling, peft_mixed=is_peft and not all(adapter_on))

    def _decode(self, prompts, adapter_on, sampling: Sampling, peft_mixed: bool) -> list[list[int]]:
        from transformers import DynamicCache

        ids, mask = self.left_pad(prompts)
        n, device = ids.size(0), ids.device
        extra = {"adapter_names": ["default" if on else BASE_ADAPTER for on in adapter_on]} if peft_mixed else {}
        eos = torch.tensor(self.eos_ids, device=device)
        cache = DynamicCache()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True, logits_to_keep=1, **extra)
        done = torch.zeros(n, dtype=torch.bool, device=device)
        tokens, logps = [], []
        pos = positions[:, -1:]
        for _ in range(sampling.max_new_tokens):
            u = torch.rand(n, device=device)
            nxt, logp = sample_with_logprob(out.logits[:, -1, :], sampling.temperature, sampling.top_k, sampling.top_p, u)
            nxt = torch.where(done, torch.full_like(nxt, self.pad_id), nxt)
            tokens.append(nxt)
            logps.append(logp)
            done |= torch.isin(nxt, eos)
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=device)], dim=1)
            pos = pos + 1
            out = self.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache,
                             use_cache=True, logits_to_keep=1, **extra)
        trimmed = self._trim(torch.stack(tokens, dim=1))
        lps = torch.stack(logps, dim=1).tolist()
        self.last_logprobs = [lp[: len(t)] for lp, t in zip(lps, trimmed, strict=True)]
        return trimmed


def _fast(model, tokenizer):
    from talkmethods.fastdecode import FastGenerator

    return FastGenerator(model, tokenizer)


ENGINES = {"plain": PlainGenerator, "loop": LoopGenerator, "fast": _fast}
