"""The reference rollout engine: ``model.generate`` over a left-padded batch (CPU, tests, baseline)."""

from __future__ import annotations

import torch

from talkmethods.engines.sampling import Sampling

BASE_ADAPTER = "__base__"  # PEFT's name for "no adapter" in a mixed batch


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

    def sync_weights(self) -> None:
        """Called after each optimizer step; this engine reads the live model, so nothing to do."""

    def generate(
        self, prompts: list[list[int]], adapter_on: list[bool], sampling: Sampling, lane: str | None = None
    ) -> list[list[int]]:
        """Sample one completion per prompt; returns token ids up to and including the first EOS.

        ``lane`` is the ``Generator`` protocol's; this engine keeps nothing between calls and ignores it.
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

    def _generate(self, prompts: list[list[int]], adapter_on: list[bool], sampling: Sampling) -> list[list[int]]:
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
        is_peft = hasattr(self.model, "disable_adapter")
        if is_peft and not all(adapter_on):
            if any(adapter_on):
                kwargs["adapter_names"] = ["default" if on else BASE_ADAPTER for on in adapter_on]
            else:
                with self.model.disable_adapter():
                    out = self.model.generate(**kwargs)
                return self._trim(out[:, width:])
        elif not is_peft and any(adapter_on):
            raise ValueError("adapter requested but the model has no adapter")
        out = self.model.generate(**kwargs)
        return self._trim(out[:, width:])

    def _trim(self, new_tokens: torch.Tensor) -> list[list[int]]:
        rows = []
        for row in new_tokens.tolist():
            cut = next((j + 1 for j, t in enumerate(row) if t in self.eos_ids), len(row))
            rows.append(row[:cut])
        return rows
