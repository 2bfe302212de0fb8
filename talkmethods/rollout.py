"""Batched A, B, A, B rollouts: every chat's turn k is one generate call.

A chat is one 4-turn dialogue on one problem. Each seat can run with the LoRA adapter on or off
(or on a named adapter: a seed cohort's), chat by chat, so a trained A can talk to a base B inside
the same batch (one call of a rollout engine, ``talkmethods.engines``, serves both). The exact prompt and completion token ids of every
turn are kept for the loss; decoded text is only shown to the partner and the grader.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from talkmethods.dialogue import FINAL_TURNS, SEATS, seat_messages
from talkmethods.engines import Generator
from talkmethods.engines.sampling import Sampling
from talkmethods.errors import UserError
from talkmethods.grading import grade_answer, team_reward

log = logging.getLogger(__name__)


class PromptTooLong(UserError, ValueError):
    """A seat's prompt outgrew ``max_prompt_tokens``."""


@dataclass
class Turn:
    """One message: who spoke, with or without the adapter, and its exact tokens."""

    seat: str
    adapter_on: bool | str  # True: the policy's adapter; False: the base model; a name: that adapter
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    logprobs: list[float] | None = None  # the rollout engine's log-prob of each completion token


@dataclass
class Chat:
    """One A1 B1 A2 B2 dialogue and its grade."""

    problem: dict
    a_adapter: bool | str
    b_adapter: bool | str
    turns: list[Turn] = field(default_factory=list)
    a_right: bool = False
    b_right: bool = False

    @property
    def reward(self) -> float:
        """Team reward: share of the two final answers that are right (0, 0.5, 1)."""
        return team_reward(self.a_right, self.b_right)

    def seat_adapter(self, seat: str) -> bool | str:
        return self.a_adapter if seat == "A" else self.b_adapter


def judge_by_gold(turn: Turn, problem: dict) -> bool:
    """Default judge: the last ``\\boxed{}`` of a seat's final message equals the gold."""
    return grade_answer(turn.text, problem["gold"])


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


def _prompt_parts(
    tokenizer, messages: list[dict], own_last: Turn | None, stops: set[int]
) -> tuple[list[int], list[str]]:
    """A seat's prompt as token ids kept as they are, then texts to tokenise, in order."""
    end = tokenizer.convert_tokens_to_ids(END_OF_MESSAGE)
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if own_last is None or end is None or end == tokenizer.unk_token_id:
        return [], [full]  # the template's own rendering (``apply_chat_template`` tokenises it so)
    head = tokenizer.apply_chat_template(
        messages[:-1], add_generation_prompt=False, tokenize=False
    )  # through own last message
    cut = head.rfind(END_OF_MESSAGE)
    if not full.startswith(head) or cut < 0:
        return [], [full]
    own = own_last.completion_ids
    if own and own[-1] in stops:  # the sampler's stop token gives way to the template's end of message
        own = own[:-1]
    # both texts start right after a special token, so they tokenise as they would inside the whole
    return own_last.prompt_ids + own + [end], [head[cut + len(END_OF_MESSAGE) :], full[len(head) :]]


def play_chats(
    generator: Generator,
    tokenizer,
    problems: Sequence[dict],
    seats: Sequence[tuple[bool | str, bool | str]],
    sampling: Sampling,
    judge: Callable[[Turn, dict], bool] = judge_by_gold,
) -> tuple[list[Chat], dict]:
    """Play one chat per (problem, (A adapter on?, B adapter on?)) pair, all chats in lockstep.

    Args:
        generator: a rollout engine (``engines.Generator``).
        tokenizer: the model's tokenizer (with its chat template).
        problems: one problem record per chat (repeat a problem for several chats).
        seats: per chat, whether A and B run with the adapter (or which adapter, by name).
        sampling: sampling settings.
        judge: decides whether a seat's final message is right.

    Returns:
        The graded chats and timing/length stats.
    """
    chats = [Chat(problem=p, a_adapter=a, b_adapter=b) for p, (a, b) in zip(problems, seats, strict=True)]
    stats = {"gen_s": 0.0, "longest_prompt": 0, "completion_tokens": 0, "turns": 0}
    stops = set(generator.eos_ids) | {tokenizer.eos_token_id}
    for turn, seat in enumerate(SEATS):
        prompts = seat_prompts(
            tokenizer,
            [
                (
                    seat_messages(chat.problem, turn, [t.text for t in chat.turns]),
                    chat.turns[turn - 2] if turn >= 2 else None,
                )
                for chat in chats
            ],
            stops,
        )
        for ids in prompts:
            if len(ids) > sampling.max_prompt_tokens:
                raise PromptTooLong(
                    f"a seat-{seat} prompt has {len(ids)} tokens, more than max_prompt_tokens="
                    f"{sampling.max_prompt_tokens}: raise it or lower max_new_tokens"
                )
        adapter_on = [c.seat_adapter(seat) for c in chats]
        t0 = time.perf_counter()
        # an engine that keeps K/V across turns continues each seat's last turn (its own words are a prefix)
        lane = {"lane": seat} if generator.reuses_turns else {}
        completions = generator.generate(prompts, adapter_on, sampling, **lane)
        stats["gen_s"] += time.perf_counter() - t0
        logprobs = generator.last_logprobs or [None] * len(completions)
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
