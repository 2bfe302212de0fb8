"""The eager decode-loop engine: prefill once, then one forward per new token over a KV cache.

It runs the live (PEFT) model, so it needs no weight sync, and samples on the device by the shared
rule (``engines.sampling``). The fallback for models the fast engine refuses (not Qwen2, DoRA).
"""

from __future__ import annotations

import torch

from talkmethods.engines.plain import BASE_ADAPTER, PlainGenerator, check_adapters, routes_rows
from talkmethods.engines.sampling import Sampling, refuse_repetition_penalty, sample_with_logprob


class LoopGenerator(PlainGenerator):
    """Batched decode loop over a KV cache; same interface and trimming as ``PlainGenerator``."""

    def _generate(self, prompts: list[list[int]], adapter_on: list[bool | str], sampling: Sampling) -> list[list[int]]:
        refuse_repetition_penalty(sampling, "loop")
        names = check_adapters(self.model, adapter_on)
        if all(n is None for n in names) and hasattr(self.model, "disable_adapter"):
            with self.model.disable_adapter():
                return self._decode(prompts, names, sampling, peft_mixed=False)
        # PEFT's per-row adapter routing splits every layer's batch: only pay for it in a mixed batch
        return self._decode(prompts, names, sampling, peft_mixed=routes_rows(self.model, names))

    def _decode(self, prompts, names: list[str | None], sampling: Sampling, peft_mixed: bool) -> list[list[int]]:
        from transformers import DynamicCache

        ids, mask = self.left_pad(prompts)
        n, device = ids.size(0), ids.device
        extra = {"adapter_names": [BASE_ADAPTER if a is None else a for a in names]} if peft_mixed else {}
        eos = torch.tensor(self.eos_ids, device=device)
        cache = DynamicCache()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **extra,
        )
        done = torch.zeros(n, dtype=torch.bool, device=device)
        tokens, logps = [], []
        pos = positions[:, -1:]
        for _ in range(sampling.max_new_tokens):
            u = torch.rand(n, device=device)
            nxt, logp = sample_with_logprob(
                out.logits[:, -1, :], sampling.temperature, sampling.top_k, sampling.top_p, u
            )
            nxt = torch.where(done, torch.full_like(nxt, self.pad_id), nxt)
            tokens.append(nxt)
            logps.append(logp)
            done |= torch.isin(nxt, eos)
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=device)], dim=1)
            pos = pos + 1
            out = self.model(
                input_ids=nxt[:, None],
                attention_mask=mask,
                position_ids=pos,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
                **extra,
            )
        trimmed = self._trim(torch.stack(tokens, dim=1))
        lps = torch.stack(logps, dim=1).tolist()
        self.last_logprobs = [lp[: len(t)] for lp, t in zip(lps, trimmed, strict=True)]
        return trimmed
