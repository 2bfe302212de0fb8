"""Batched A, B, A, B rollouts: every chat's turn k is one generate call.

A chat is one 4-turn dialogue on one problem. Each seat can run with the LoRA adapter on or off,
chat by chat (PEFT's mixed-adapter batches, ``adapter_names=[..., "__base__"]``), so a trained A can
talk to a base B inside the same batch. The exact prompt and completion token ids of every turn
are kept for the loss; decoded text is only shown to the partner and the grader.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from talkmethods.dialogue import FINAL_TURNS, SEATS, seat_messages
from talkmethods.grading import grade_answer, team_reward

log = logging.getLogger(__name__)

BASE_ADAPTER = "__base__"  # PEFT's name for "no adapter" in a mixed batch


class PromptTooLong(ValueError):
    """A seat's prompt outgrew ``max_prompt_tokens``."""


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of one rollout."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_prompt_tokens: int = 2048
    repetition_penalty: float = 1.0  # 1.0 = none; only the plain engine applies another value


def refuse_repetition_penalty(sampling: Sampling, engine: str) -> None:
    """The loop and fast engines sample from softmax(logits / T) with top-k/top-p only: refuse a penalty they would drop."""
    if sampling.repetition_penalty != 1.0:
        raise ValueError(f"the {engine} engine applies no repetition penalty (got {sampling.repetition_penalty}): "
                         "set it to 1.0, or use the plain engine")


@dataclass
class Turn:
    """One message: who spoke, with or without the adapter, and its exact tokens."""

    seat: str
    adapter_on: bool
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    logprobs: list[float] | None = None  # the rollout engine's log-prob of each completion token


@dataclass
class Chat:
    """One A1 B1 A2 B2 dialogue and its grade."""

    problem: dict
    a_adapter: bool
    b_adapter: bool
    turns: list[Turn] = field(default_factory=list)
    a_right: bool = False
    b_right: bool = False

    @property
    def reward(self) -> float:
        """Team reward: share of the two final answers that are right (0, 0.5, 1)."""
        return team_reward(self.a_right, self.b_right)

    def seat_adapter(self, seat: str) -> bool:
        return self.a_adapter if seat == "A" else self.b_adapter


def judge_by_gold(turn: Turn, problem: dict) -> bool:
    """Default judge: the last ``\\boxed{}`` of a seat's final message equals the gold."""
    return grade_answer(turn.text, problem["gold"])


class PlainGenerator:
    """Reference engine: ``model.generate`` with a padded batch (CPU, tests, baseline)."""

    def __init__(self, model, tokenizer):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
        self.pad_id = tokenizer.pad_token_id
        self.last_logprobs: list[list[float]] | None = None  # engines that score their tokens set this

    def sync_weights(self) -> None:
        """Called after each optimizer step; this engine reads the live model, so nothing to do."""

    def generate(self, prompts: list[list[int]], adapter_on: list[bool], sampling: Sampling) -> list[list[int]]:
        """Sample one completion per prompt; returns token ids up to and including the first EOS."""
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
            input_ids=ids, attention_mask=mask, max_new_tokens=sampling.max_new_tokens,
            do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            repetition_penalty=sampling.repetition_penalty, min_p=None, typical_p=1.0, no_repeat_ngram_size=0,
            eos_token_id=self.eos_ids, pad_token_id=self.pad_id,
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


END_OF_MESSAGE = "<|im_end|>"  # ChatML, Qwen's template


def seat_prompt(tokenizer, messages: list[dict], own_last: Turn | None, stops: set[int]) -> list[int]:
    """A seat's prompt: the chat template's rendering, with the seat's own earlier message as its exact tokens.

    A seat's second prompt is its first prompt, its own first completion token for token (closed
    with the template's end-of-message tokens), then the partner's reply and the generation prompt
    as the template renders them. Re-rendering the decoded text instead would re-tokenise the
    seat's own words (sampled tokens are not always the tokenizer's canonical split), so the model
    would continue a message it never wrote. With canonical tokens the two are identical (tested).
    It also makes the first turn's row a prefix of the second's, which the trainer packs into one
    row. A template without ChatML's end-of-message token keeps the plain rendering.
    """
    return seat_prompts(tokenizer, [(messages, own_last)], stops)[0]


def seat_prompts(tokenizer, seats: list[tuple[list[dict], Turn | None]], stops: set[int]) -> list[list[int]]:
    """``seat_prompt`` for every (messages, own last turn) of a turn, with one batched tokenizer call.

    The fast tokenizer encodes a batch on all cores; one call per prompt cost ~1 s of CPU a
    Reinforce-Ada step (512 prompts), counted in the training step.
    """
    parts = [_prompt_parts(tokenizer, messages, own_last, stops) for messages, own_last in seats]
    texts = [text for _, pieces in parts for text in pieces]
    encoded = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
    prompts = []
    for kept, pieces in parts:
        ids = list(kept)
        for _ in pieces:
            ids += next(encoded)
        prompts.append(ids)
    return prompts


def _prompt_parts(tokenizer, messages: list[dict], own_last: Turn | None, stops: set[int]) -> tuple[list[int], list[str]]:
    """A seat's prompt as token ids kept as they are, then texts to tokenise, in order."""
    end = tokenizer.convert_tokens_to_ids(END_OF_MESSAGE)
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if own_last is None or end is None or end == tokenizer.unk_token_id:
        return [], [full]  # the template's own rendering (``apply_chat_template`` tokenises it so)
    head = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=False, tokenize=False)  # through own last message
    cut = head.rfind(END_OF_MESSAGE)
    if not full.startswith(head) or cut < 0:
        return [], [full]
    own = own_last.completion_ids
    if own and own[-1] in stops:  # the sampler's stop token gives way to the template's end of message
        own = own[:-1]
    # both texts start right after a special token, so they tokenise as they would inside the whole
    return own_last.prompt_ids + own + [end], [head[cut + len(END_OF_MESSAGE) :], full[len(head) :]]


def play_chats(
    generator,
    tokenizer,
    problems: Sequence[dict],
    seats: Sequence[tuple[bool, bool]],
    sampling: Sampling,
    judge: Callable[[Turn, dict], bool] = judge_by_gold,
) -> tuple[list[Chat], dict]:
    """Play one chat per (problem, (A adapter on?, B adapter on?)) pair, all chats in lockstep.

    Args:
        generator: an engine with ``generate(prompts, adapter_on, sampling)``.
        tokenizer: the model's tokenizer (with its chat template).
        problems: one problem record per chat (repeat a problem for several chats).
        seats: per chat, whether A and B run with the adapter.
        sampling: sampling settings.
        judge: decides whether a seat's final message is right.

    Returns:
        The graded chats and timing/length stats.
    """
    chats = [Chat(problem=p, a_adapter=a, b_adapter=b) for p, (a, b) in zip(problems, seats, strict=True)]
    stats = {"gen_s": 0.0, "longest_prompt": 0, "completion_tokens": 0, "turns": 0}
    stops = set(getattr(generator, "eos_ids", ())) | {tokenizer.eos_token_id}
    for turn, seat in enumerate(SEATS):
        prompts = seat_prompts(tokenizer, [(seat_messages(chat.problem, turn, [t.text for t in chat.turns]),
                                             chat.turns[turn - 2] if turn >= 2 else None) for chat in chats], stops)
        for ids in prompts:
            if len(ids) > sampling.max_prompt_tokens:
                raise PromptTooLong(
                    f"a seat-{seat} prompt has {len(ids)} tokens, more than max_prompt_tokens="
                    f"{sampling.max_prompt_tokens}: raise it or lower max_new_tokens"
                )
        adapter_on = [c.seat_adapter(seat) for c in chats]
        t0 = time.perf_counter()
        # an engine that keeps K/V across turns continues each seat's last turn (its own words are a prefix)
        lane = {"lane": seat} if getattr(generator, "reuses_turns", False) else {}
        completions = generator.generate(prompts, adapter_on, sampling, **lane)
        stats["gen_s"] += time.perf_counter() - t0
        logprobs = getattr(generator, "last_logprobs", None) or [None] * len(completions)
        texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
        for chat, p, c, text, on, lp in zip(chats, prompts, completions, texts, adapter_on, logprobs, strict=True):
            chat.turns.append(Turn(seat=seat, adapter_on=on, prompt_ids=p, completion_ids=c, text=text, logprobs=lp))
        stats["longest_prompt"] = max(stats["longest_prompt"], max(len(p) for p in prompts))
        stats["completion_tokens"] += sum(len(c) for c in completions)
        stats["turns"] += len(completions)
    for chat in chats:
        chat.a_right = bool(judge(chat.turns[FINAL_TURNS[0]], chat.problem))
        chat.b_right = bool(judge(chat.turns[FINAL_TURNS[1]], chat.problem))
    return chats, stats
