"""Loss rows: played chats to rows, rows to TRL's batch tensors, and a batch to micro-batches by length.

Pure tensor code, no TRL (tests/test_rows.py checks that importing this module leaves TRL unloaded):
the RL trainer (``training.trainer``) and the warm start's SFT rows (``warmstart.sft_rows``) build
their rows here, so both see the same token ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from talkmethods.rollout import Chat, Turn

EMPTY_TURN = Turn(seat="-", adapter_on=False, prompt_ids=[], completion_ids=[], text="")


@dataclass
class Row:
    """One loss row: a prompt and a completion; ``scored`` marks the completion tokens the loss counts.

    A row is one trained turn, or a seat's two trained turns packed together: the first turn's
    completion, the partner's reply (attended, not scored), the second turn's completion.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    scored: list[int]
    logprobs: list[float] | None  # the rollout's log-prob per completion token (NaN where not sampled)
    advantage: float
    turns: int = 1

    @classmethod
    def of(cls, turn: Turn, advantage: float) -> Row:
        return cls(
            turn.prompt_ids,
            turn.completion_ids,
            [1] * len(turn.completion_ids),
            turn.logprobs,
            advantage,
            turns=int(bool(turn.completion_ids)),
        )


def to_rows(
    chats: list[Chat], advantages: list[float], trained: list[tuple[bool, ...]], pack: bool = False
) -> list[Row]:
    """The rows of each kept chat's trained turns, every one with its chat's advantage.

    ``pack``: a seat's two trained turns become one row when the first turn (prompt and completion)
    is exactly the start of the second's prompt (``rollout.seat_prompt`` builds it so). The loss is a
    token sum over the scored tokens, and a causal model gives the first turn's tokens the same
    log-probs inside the longer row, so the loss and its gradient are unchanged; the first turn's
    ~450-950 prompt-and-completion tokens are not run twice (~35% of a step's tokens).
    """
    rows = []
    for chat, adv, mask in zip(chats, advantages, trained, strict=True):
        turns = [t for t, on in zip(chat.turns, mask, strict=True) if on]
        if not pack:
            rows += [Row.of(t, adv) for t in turns]
            continue
        for seat in ("A", "B"):
            rows += _seat_rows([t for t in turns if t.seat == seat], adv)
    return rows


def _seat_rows(turns: list[Turn], adv: float) -> list[Row]:
    """One seat's trained turns of a chat: one packed row when the first is a prefix of the second."""
    if len(turns) == 2:
        first, second = turns
        done = first.prompt_ids + first.completion_ids
        if first.completion_ids and second.completion_ids and second.prompt_ids[: len(done)] == done:
            between = second.prompt_ids[len(done) :]
            logprobs = None
            if first.logprobs is not None and second.logprobs is not None:
                logprobs = first.logprobs + [math.nan] * len(between) + second.logprobs
            return [
                Row(
                    first.prompt_ids,
                    first.completion_ids + between + second.completion_ids,
                    [1] * len(first.completion_ids) + [0] * len(between) + [1] * len(second.completion_ids),
                    logprobs,
                    adv,
                    turns=2,
                )
            ]
    return [Row.of(t, adv) for t in turns]


def live_rows(rows: list[Row]) -> tuple[list[Row], int]:
    """The rows whose advantage is not zero, and how many were left out.

    With ``beta = 0`` and no entropy bonus, a row's loss term is its advantage times its tokens'
    (clipped) ratios, so a zero-advantage row adds exactly zero to the loss and to every gradient.
    The loss's normaliser (``num_items_in_batch``) still counts its tokens, so the step is the same;
    leaving it out saves its forward and backward (RAFT's unsolved chats, GRPO's uniform groups).
    What the loss logs from its rows (entropy, the rollout-vs-trainer log-prob gap) then covers the
    rows it ran.
    """
    live = [r for r in rows if r.advantage != 0]
    return live, len(rows) - len(live)


def pad_rows(rows: list[Row], pad_id: int, device) -> dict[str, torch.Tensor]:
    """Left-pad prompts and right-pad completions into TRL's batch tensors.

    ``completion_mask`` is every completion token (attended); ``tool_mask`` (TRL's name for tokens
    inside a completion that the loss skips) zeroes the partner's reply inside a packed row.
    """
    n = len(rows)
    p_len = max(max(len(r.prompt_ids) for r in rows), 1)
    c_len = max(max(len(r.completion_ids) for r in rows), 1)
    prompt_ids = torch.full((n, p_len), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((n, p_len), dtype=torch.long)
    completion_ids = torch.full((n, c_len), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((n, c_len), dtype=torch.long)
    tool_mask = torch.zeros((n, c_len), dtype=torch.long)
    for i, r in enumerate(rows):
        p, c = r.prompt_ids, r.completion_ids
        if p:
            prompt_ids[i, p_len - len(p) :] = torch.tensor(p)
            prompt_mask[i, p_len - len(p) :] = 1
        if c:
            completion_ids[i, : len(c)] = torch.tensor(c)
            completion_mask[i, : len(c)] = 1
            tool_mask[i, : len(c)] = torch.tensor(r.scored)
    advantages = torch.tensor([r.advantage for r in rows], dtype=torch.float32)  # (B,)
    out = dict(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        tool_mask=tool_mask,
        advantages=advantages,
    )
    if all(r.logprobs is not None for r in rows if r.completion_ids):
        rollout_logps = torch.zeros((n, c_len), dtype=torch.float32)
        for i, r in enumerate(rows):
            if r.completion_ids:
                rollout_logps[i, : len(r.completion_ids)] = torch.tensor(r.logprobs, dtype=torch.float32)
        out["rollout_logps"] = rollout_logps
    return {k: v.to(device) for k, v in out.items()}


ROW_KEYS = {
    "prompt_ids": "prompt",
    "prompt_mask": "prompt",
    "completion_ids": "completion",
    "completion_mask": "completion",
    "tool_mask": "completion",
    "rollout_logps": "completion",
    "advantages": None,
}


# pytorch#196678: on H100/H200 with torch 2.11, cuDNN's SDPA backward (the default with a padding mask)
# returns NaN dQ when the sequence length is 64 mod 128 and a query row is fully masked (a left pad),
# and one NaN gradient poisons the adapter (seen once in a GPU bench run). No micro-batch has that width.
CUDNN_NAN_WIDTH = (128, 64)
WIDTH_STEP = 32  # micro-batch widths are multiples of this: cuDNN builds one attention plan per shape


def width_step_for(device: torch.device) -> int:
    """The micro-batch width step on ``device``: ``WIDTH_STEP`` where cuDNN attention runs, else 1."""
    return WIDTH_STEP if device.type == "cuda" else 1


def micro_batch_width(width: int, step: int = 1) -> int:
    """``width`` rounded up to a multiple of ``step`` that is not 64 mod 128 (``CUDNN_NAN_WIDTH``).

    On a GPU ``step`` is ``WIDTH_STEP``: fewer distinct shapes, so cuDNN's per-shape attention plans
    are built in a run's first steps and reused after (~1.5% more padding on ~1,000-token rows).
    """
    width = -(-width // step) * step
    if width % CUDNN_NAN_WIDTH[0] == CUDNN_NAN_WIDTH[1]:
        width += step
    return width


def group_by_length(batch: dict[str, torch.Tensor], chunks: int, width_step: int = 1) -> list[dict[str, torch.Tensor]]:
    """Split a generation batch into ``chunks`` micro-batches of rows of similar length, each trimmed.

    TRL splits the shuffled batch into equal row counts, each padded to the longest row of the
    whole batch; chat turns range from ~450 to ~1,200 tokens, so a third of those tokens are padding.
    Here rows are sorted by length, cut into contiguous groups that balance rows × longest row (the
    memory and time of a micro-batch), and each group drops the columns that are padding in all of
    its rows. The loss is a token sum over the whole batch (normalised by ``num_items_in_batch``),
    so which rows share a micro-batch does not change it.
    """
    unknown = [k for k, v in batch.items() if k not in ROW_KEYS and isinstance(v, torch.Tensor) and v.dim() > 0]
    if unknown:
        raise ValueError(f"group_by_length does not know how to split {unknown}")
    p_len = batch["prompt_mask"].sum(1)
    c_len = batch["completion_mask"].sum(1)
    order = torch.argsort(p_len + c_len, stable=True)
    if int((c_len > 0).sum()) >= chunks:  # the empty filler rows (no loss tokens) only add padding: drop them
        order = order[c_len[order] > 0]
    lengths = (p_len + c_len)[order].tolist()
    bounds = _balanced_cuts([max(n, 1) for n in lengths], chunks)
    out = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        rows = order[a:b]
        keep_p = max(int(p_len[rows].max()), 1)
        keep_c = max(int(c_len[rows].max()), 1)
        keep_p += micro_batch_width(keep_p + keep_c, width_step) - (keep_p + keep_c)  # more left-pad columns
        part = {}
        for key, value in batch.items():
            kind = ROW_KEYS.get(key)
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                part[key] = value
            elif kind == "prompt":
                value = F.pad(value, (max(keep_p - value.size(1), 0), 0))  # zeros: a masked pad column
                part[key] = value[rows.to(value.device), value.size(1) - keep_p :]  # left-padded
            elif kind == "completion":
                part[key] = value[rows.to(value.device), :keep_c]  # right-padded
            else:
                part[key] = value[rows.to(value.device)]
        out.append(part)
    return out


def _balanced_cuts(lengths: list[int], chunks: int) -> list[int]:
    """Cut points of ascending ``lengths`` into ``chunks`` non-empty runs minimising max(rows × longest)."""
    n = len(lengths)
    if n < chunks:
        raise ValueError(f"{n} rows cannot fill {chunks} micro-batches")

    def cuts(budget: int) -> list[int] | None:
        ends, j = [n], n
        while j > 0:
            top = lengths[j - 1]  # the longest row of the run that ends at j
            take = max(1, min(j, budget // top))
            j -= take
            ends.append(j)
        return ends[::-1] if len(ends) - 1 <= chunks else None

    lo, hi = max(lengths), n * max(lengths)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if cuts(mid) is not None else (mid + 1, hi)
    bounds = cuts(lo)
    while len(bounds) - 1 < chunks:  # split the run with the most rows; never raises the max cost
        runs = [(bounds[i + 1] - bounds[i], i) for i in range(len(bounds) - 1)]
        size, i = max(runs)
        bounds.insert(i + 1, bounds[i] + size // 2)
    return bounds
