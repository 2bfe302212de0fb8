"""The reference rollout engine: ``model.generate`` over a left-padded batch (CPU, tests, baseline)."""

from __future__ import annotations

import torch

from talkmethods.engines.sampling import Sampling

BASE_ADAPTER = "__base__"  # PEFT's name for "no adapter" in a mixed batch
DEFAULT_ADAPTER = "default"  # PEFT's name of the adapter a policy trains


def adapter_name(on: bool | str) -> str | None:
    """A row's adapter as PEFT names it: ``True`` is the policy's own (``default``), ``False`` none (the
    base model), a string that named adapter (a seed cohort's ``seed18``)."""
    if on is True:
        return DEFAULT_ADAPTER
    return None if on is False else on


def check_adapters(model, adapter_on) -> list[str | None]:
    """Each row's adapter name; a clear error for an adapter the model does not have."""
    names = [adapter_name(on) for on in adapter_on]
    have = set(getattr(model, "peft_config", {}) or {})
    missing = sorted({n for n in names if n is not None} - have)
    if missing:
        what = f"has adapters {sorted(have)}" if have else "has no adapter"
        raise ValueError(f"adapter {missing[0]!r} requested but the model {what}")
    return names


def routes_rows(model, names: list[str | None]) -> bool:
    """Whether a batch needs PEFT's per-row adapter routing: not when every row is the active adapter's."""
    if not hasattr(model, "disable_adapter"):  # not a PEFT model: every row is the base model
        return False
    return any(n != model.active_adapter for n in names)


class PlainGenerator:
    """Reference engine: ``model.generate`` with a padded batch (CPU, tests, baseline)."""

    reuses_turns = False  # keeps no K/V between calls: ``play_chats`` names no lane

    def __init__(self, model, tokenizer):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = [
            tokenizer.convert_tokens_to_ids("<|im_end|>"),
            tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        ]
        self.pad_id = tokenizer.pad_token_id
        self.last_logprobs: list[list[float]] | None = None  # engines that score their tokens set this

    def sync_weights(self, adapter: str | None = None) -> None:
        """Called after each optimizer step; this engine reads the live model, so nothing to do."""

    def generate(
        self, prompts: list[list[int]], adapter_on: list[bool | str], sampling: Sampling, lane: str | None = None
    ) -> list[list[int]]:
        """Sample one completion per prompt; returns token ids up to and including the first EOS.

        ``adapter_on``: per row, ``True`` (the policy's adapter), ``False`` (the base model) or an
        adapter's name (``adapter_name``). ``lane`` is the ``Generator`` protocol's; this engine keeps
        nothing between calls and ignores it.
        """
        was_training = self.model.training
        self.model.eval()  # PEFT refuses mixed-adapter batches in training mode; LoRA dropout is 0 anyway
        try:
            with torch.no_grad():
                return self._generate(prompts, adapter_on, sampling)
        finally:
            self.model.train(was_training)

    def left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt ids and attention mask, left-padded so every row's next token sits at the same column."""
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        return ids.to(device), mask.to(device)

    def _generate(self, prompts: list[list[int]], adapter_on: list[bool | str], sampling: Sampling) -> list[list[int]]:
        names = check_adapters(self.model, adapter_on)
        ids, mask = self.left_pad(prompts)
        width = ids.size(1)
        # Every knob explicit: generate() would otherwise take what the checkpoint's generation_config
        # sets (Qwen2.5-Instruct ships repetition_penalty 1.05), and sample from another distribution than
        # the one configured, the other engines use and the trainer scores.
        kwargs = dict(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=sampling.max_new_tokens,
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            repetition_penalty=sampling.repetition_penalty,
            min_p=None,
            typical_p=1.0,
            no_repeat_ngram_size=0,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
        )
        if all(n is None for n in names) and hasattr(self.model, "disable_adapter"):
            with self.model.disable_adapter():
                out = self.model.generate(**kwargs)
            return self._trim(out[:, width:])
        if routes_rows(self.model, names):  # PEFT routes each row to its adapter (or none)
            kwargs["adapter_names"] = [BASE_ADAPTER if n is None else n for n in names]
        out = self.model.generate(**kwargs)
        return self._trim(out[:, width:])

    def _trim(self, new_tokens: torch.Tensor) -> list[list[int]]:
        rows = []
        for row in new_tokens.tolist():
            cut = next((j + 1 for j, t in enumerate(row) if t in self.eos_ids), len(row))
            rows.append(row[:cut])
        return rows
