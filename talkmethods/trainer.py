"""Training one (arm, seed) run on TRL's GRPO machinery.

``TalkTrainer`` is GRPOTrainer with one seam replaced: ``_generate_and_score_completions`` plays the
4-turn chats, applies the arm's credit rule and returns one row per trained turn with its chat's
advantage (or per seat, its two trained turns packed: ``to_rows``). TRL keeps the loss (``dapo``:
token sum over the generation batch), the optimizer loop, logging, checkpoints and LoRA (through
``peft_config``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from trl import GRPOConfig, GRPOTrainer
from transformers import TrainerCallback

from talkmethods.atomic import atomic_path, write_json, write_text
from talkmethods.credit import ARM_PLANS, CREDIT_RULES, draw_with_replays, seat_plan
from talkmethods.models import ModelSpec, load_model, load_tokenizer, pick_device_and_dtype
from talkmethods.rollout import Chat, PlainGenerator, Sampling, Turn, judge_by_gold, play_chats

log = logging.getLogger(__name__)


def _score_only_valid_positions_on_cpu() -> None:
    """Let TRL's fused LM head score only the completion tokens on a CPU too.

    Off Triton, ``trl.trainer.utils._fused_forward`` scores every position (prompt included) so that
    tile shapes stay fixed for compilers such as Neuron's; in eager CPU mode nothing recompiles, and
    scoring only the valid positions is the same maths at a fraction of the cost (pinned in
    tests/test_trl_contract.py).
    """
    import trl.trainer.utils as trl_utils

    triton_check = trl_utils._use_triton
    if getattr(triton_check, "_talkmethods", False):
        return

    def compact(device: torch.device) -> bool:
        return device.type == "cpu" or triton_check(device)

    compact._talkmethods = True
    trl_utils._use_triton = compact


_score_only_valid_positions_on_cpu()

# KL(rollout || trainer) per sampled token (k3 estimate) above which a step warns that the rollout engine
# samples from other weights than the ones being trained. Measured on the H200 (bf16, the warm-started
# toy-world model, GRPO at lr 1e-4, bench/logp_check.py): fresh rollouts 3.1e-5 median, 6.5e-4 at most
# over 40 steps; rollouts from an adapter k steps old 3.2e-4 (k = 5), 1.0e-3 (k = 10), 2.1e-3 (k = 20).
# The max |gap| is no test: bf16 rounding of tiny probabilities gave fresh steps gaps of up to 1.65 nats.
KL_TOLERANCE = 1e-3

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run depends on (filled from config.yaml through ``params:``)."""

    arm: str
    seed: int
    model: ModelSpec
    steps: int = 80
    problems_per_step: int = 8
    chats_per_problem: int = 4
    learning_rate: float = 1e-4
    lr_schedule: str = "constant"
    lora_r: int = 32
    lora_alpha: int = 64
    lora_dropout: float = 0.0
    sampling: Sampling = field(default_factory=Sampling)
    ada_max_replays: int = 3
    ada_draw_ahead: bool = False
    pack_seats: bool = False
    save_every: int = 10
    precision: str = "auto"
    gradient_checkpointing: bool = False
    engine: str = "fast"
    micro_batches: int = 1


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
    def of(cls, turn: Turn, advantage: float) -> "Row":
        return cls(turn.prompt_ids, turn.completion_ids, [1] * len(turn.completion_ids), turn.logprobs, advantage,
                   turns=int(bool(turn.completion_ids)))


def to_rows(chats: list[Chat], advantages: list[float], trained: list[tuple[bool, ...]], pack: bool = False) -> list[Row]:
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
            return [Row(first.prompt_ids, first.completion_ids + between + second.completion_ids,
                        [1] * len(first.completion_ids) + [0] * len(between) + [1] * len(second.completion_ids),
                        logprobs, adv, turns=2)]
    return [Row.of(t, adv) for t in turns]


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
    out = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
               completion_mask=completion_mask, tool_mask=tool_mask, advantages=advantages)
    if all(r.logprobs is not None for r in rows if r.completion_ids):
        rollout_logps = torch.zeros((n, c_len), dtype=torch.float32)
        for i, r in enumerate(rows):
            if r.completion_ids:
                rollout_logps[i, : len(r.completion_ids)] = torch.tensor(r.logprobs, dtype=torch.float32)
        out["rollout_logps"] = rollout_logps
    return {k: v.to(device) for k, v in out.items()}


class TalkTrainer(GRPOTrainer):
    """GRPOTrainer for two seats that talk.

    The seam is ``_generate_and_score_completions``: it runs the arm's 4-turn rollouts (Reinforce-Ada's
    replays included) and returns the loss rows. Around TRL's loss, thin wrappers re-split each batch
    by length (``_prepare_inputs``), skip PEFT's LoRA input casts and compare the rollout's log-probs
    with the loss's own (``compute_loss``, ``_get_per_token_logps_and_entropies``, ``log``).
    """

    def __init__(self, *args, arm: str, sampling: Sampling, ada_max_replays: int = 3, ada_draw_ahead: bool = False,
                 pack_seats: bool = False, judge: Callable[[Turn, dict], bool] = judge_by_gold, generator_factory=PlainGenerator, **kwargs):
        super().__init__(*args, **kwargs)
        if self.args.steps_per_generation != self.args.gradient_accumulation_steps:
            # One optimizer step per generation batch (on-policy): the rows of one rollout are split
            # into `steps_per_generation` micro-batches whose gradients accumulate into one step.
            raise ValueError("TalkTrainer needs steps_per_generation == gradient_accumulation_steps")
        self.arm = arm
        self.plan = ARM_PLANS[arm]
        seat_plan(0, self.num_generations, self.plan.base_b_per_4)  # refuse a group size the arm's split does not fit
        self.credit_rule = CREDIT_RULES[arm]
        self.sampling = sampling
        self.ada_max_replays = ada_max_replays
        self.pack_seats = pack_seats  # a seat's two trained turns as one loss row (see ``to_rows``)
        self.ada_draw_ahead = ada_draw_ahead  # play every replay round up front in one batch (credit.draw_with_replays)
        self.judge = judge
        self.generator_factory = generator_factory
        self.last_rows = 0
        self._generator = None
        self._rollout_logps = None  # the micro-batch's rollout log-probs, while its loss is computed
        self._scored = None  # and which of its completion tokens are the seat's own (tool_mask)
        self._logp_diff = {"max": 0.0, "sum": 0.0, "n": 0, "kl": 0.0}
        self.group_rows = True  # re-split each generation batch by row length (tests switch it off)
        self.lora_layers_fused = fuse_lora_adds(self.model)

    def _get_train_sampler(self, dataset=None):
        """TRL's RepeatSampler, resumable past the first epoch (see ``_replayable``)."""
        return _replayable(super()._get_train_sampler(dataset))

    def _seats(self, n: int) -> list[tuple[bool, bool]]:
        """A always trained; within each problem's chats, the arm's share has a base B (``credit.seat_plan``)."""
        return seat_plan(n, self.num_generations, self.plan.base_b_per_4)

    def _draw_chats(self, problems: list[dict]) -> tuple[list[list[Chat]], dict]:
        if self._generator is None:  # one engine per run: its compiled graphs and buffers are reused
            self._generator = self.generator_factory(self.accelerator.unwrap_model(self.model), self.processing_class)
        generator = self._generator
        generator.sync_weights()  # the policy after the last optimizer step
        g = self.num_generations
        totals = {"gen_s": 0.0, "longest_prompt": 0, "completion_tokens": 0, "turns": 0, "chats_generated": 0}

        def draw(indices: list[int]) -> list[list[Chat]]:
            flat = [problems[i] for i in indices for _ in range(g)]
            chats, stats = play_chats(generator, self.processing_class, flat, self._seats(len(flat)),
                                      self.sampling, self.judge)
            for k, v in stats.items():
                totals[k] = max(totals[k], v) if k == "longest_prompt" else totals[k] + v
            totals["chats_generated"] += len(chats)  # drawing ahead plays chats the rule may never reach
            return [chats[j * g : (j + 1) * g] for j in range(len(indices))]

        max_replays = self.ada_max_replays if self.plan.replay else 0
        by_problem = draw_with_replays(draw, len(problems), per_round=g, max_replays=max_replays,
                                       reward=lambda c: c.reward, ahead=self.ada_draw_ahead)
        return by_problem, totals

    def _generate_and_score_completions(self, inputs: list[dict]) -> dict[str, torch.Tensor]:
        g = self.num_generations
        problems = inputs[::g]  # the sampler repeats each problem num_generations times in a row
        by_problem, stats = self._draw_chats(problems)
        rows, first_rewards, zero_adv = [], [], 0
        for chats in by_problem:
            credit = self.credit_rule([c.reward for c in chats], [not c.b_adapter for c in chats])
            kept = [chats[i] for i in credit.kept]
            rows += to_rows(kept, list(credit.advantages), list(credit.trained_turns), pack=self.pack_seats)
            zero_adv += all(a == 0 for a in credit.advantages)
            first_rewards += chats[:g]
        # split_tensor_dict silently drops rows that do not divide steps_per_generation (DESIGN §2):
        # pad with empty rows (completion_mask 0), which add nothing to the token-sum loss.
        n_real = len(rows)
        n_turns = sum(r.turns for r in rows)
        rows += [Row.of(EMPTY_TURN, 0.0)] * (-len(rows) % self.args.steps_per_generation)
        batch = pad_rows(rows, self.processing_class.pad_token_id, self.accelerator.device)
        batch["num_items_in_batch"] = (batch["completion_mask"] * batch["tool_mask"]).sum()
        self.last_rows = n_real

        m = self._metrics["train"]
        m["talk/reward"].append(sum(c.reward for c in first_rewards) / len(first_rewards))
        m["talk/both_right"].append(sum(c.reward == 1.0 for c in first_rewards) / len(first_rewards))
        m["talk/chats_drawn"].append(float(sum(len(c) for c in by_problem)))
        m["talk/chats_generated"].append(float(stats["chats_generated"]))
        m["talk/zero_adv_share"].append(zero_adv / len(problems))
        m["talk/tokens_per_turn"].append(stats["completion_tokens"] / max(stats["turns"], 1))
        m["talk/rows"].append(float(n_turns))  # trained turns
        m["talk/loss_rows"].append(float(n_real))  # rows of the loss batch (fewer when seats are packed)
        m["talk/longest_prompt"].append(float(stats["longest_prompt"]))
        m["timing/gen_s"].append(stats["gen_s"])
        return batch

    def _prepare_inputs(self, generation_batch):
        """TRL's buffering, with the fresh generation batch re-split by length (``group_by_length``)."""
        spg = self.args.steps_per_generation
        fresh = self.model.training and (self._step % (spg * self.num_iterations) == 0 or self._buffered_inputs is None)
        inputs = super()._prepare_inputs(generation_batch)
        if fresh and self.group_rows:
            rows = {k: torch.cat([b[k] for b in self._buffered_inputs]) if k in ROW_KEYS else v
                    for k, v in self._buffered_inputs[0].items()}
            self._buffered_inputs = group_by_length(rows, spg, width_step_for(self.accelerator.device))
            m = self._metrics["train"]
            m["talk/loss_tokens"].append(float(rows["prompt_mask"].sum() + rows["completion_mask"].sum()))
            m["talk/loss_tokens_padded"].append(float(sum(b["prompt_ids"].numel() + b["completion_ids"].numel()
                                                          for b in self._buffered_inputs)))
            inputs = self._buffered_inputs[self._step % spg]
        return inputs

    # -- rollout vs trainer log-probs: the rows' log-probs as the engine sampled them, against the loss's own

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self._rollout_logps = inputs.get("rollout_logps")
        self._scored = inputs.get("tool_mask")
        hook = model.register_forward_pre_hook(_unscored_labels_hook(self._scored), with_kwargs=True)
        try:
            with lora_inputs_uncast(model, self.args.bf16):
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            hook.remove()
            self._rollout_logps = self._scored = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        rollout, self._rollout_logps = self._rollout_logps, None
        if rollout is not None:
            valid = attention_mask[:, -logits_to_keep:].bool()
            if self._scored is not None:  # not the partner's reply inside a packed row
                valid &= self._scored.bool()
            delta = (out[0].detach().float() - rollout)[valid]  # log p_trainer - log p_rollout per sampled token
            diff = delta.abs()
            if diff.numel():
                d = self._logp_diff
                d["max"] = max(d["max"], diff.max().item() if bool(diff.isfinite().all()) else math.inf)
                d["sum"] += diff.sum().item()
                d["n"] += diff.numel()
                # KL(rollout || trainer) from the rollout's own samples, Schulman's k3 estimator
                # (r - 1) - log r with r = p_trainer / p_rollout: unbiased and never negative.
                d["kl"] += (torch.expm1(delta) - delta).sum().item()
        return out

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        d = self._logp_diff
        if d["n"] and "loss" in logs:  # a training step's log: report its max/mean, then start afresh
            self._metrics["train"]["talk/logp_diff_max"] = [d["max"]]
            self._metrics["train"]["talk/logp_diff_mean"] = [d["sum"] / d["n"]]
            self._metrics["train"]["talk/logp_kl"] = [d["kl"] / d["n"]]
            if not math.isfinite(d["max"]):
                raise FloatingPointError("non-finite log-probs in the rollout or the loss: the adapter holds NaN/inf "
                                         "(a NaN gradient; see CUDNN_NAN_WIDTH); stopping rather than training on noise")
            if d["kl"] / d["n"] > KL_TOLERANCE:
                log.warning("KL(rollout || trainer) is %.2e a token (tolerance %.0e; max |log-prob gap| %.2f nats): the "
                            "rollout engine may be sampling from other weights than the ones being trained",
                            d["kl"] / d["n"], KL_TOLERANCE, d["max"])
            self._logp_diff = {"max": 0.0, "sum": 0.0, "n": 0, "kl": 0.0}
        super().log(logs, start_time)


def _unscored_labels_hook(scored: torch.Tensor | None):
    """A forward pre-hook: the partner's reply inside a packed row gets label -100, so it is not scored.

    TRL labels every attended completion token and its fused LM head projects every labelled
    position onto the 151,936-token vocabulary; the reply's positions are attended but outside the
    loss (``tool_mask`` 0), so projecting them only costs (a third of the head's work in a packed
    step). Their log-probs come back 0 and the loss masks them either way.
    """

    def hook(module, args, kwargs):
        labels = kwargs.get("labels")
        if scored is None or labels is None or not kwargs.get("fused_lm_head") or labels.size(0) != scored.size(0):
            return None
        labels = labels.clone()
        labels[:, labels.size(1) - scored.size(1) :].masked_fill_(scored == 0, -100)
        kwargs["labels"] = labels
        return args, kwargs

    return hook


def lora_inputs_uncast(model, autocast_bf16: bool):
    """Under bf16 autocast, stop PEFT casting each LoRA layer's input to the adapter's fp32.

    PEFT keeps the adapter in fp32 and casts every LoRA input up to it (a full activation copy per
    layer, forward and backward); autocast then casts it straight back to bf16 for the matmul, so the
    round trip changes no number but cost ~0.4 s of each 128-row step on an H200. Without autocast
    (CPU, fp32) nothing is cast either way.
    """
    from peft.helpers import disable_input_dtype_casting

    return disable_input_dtype_casting(model, active=autocast_bf16)


def _lora_forward(self, x, *args, **kwargs):
    """PEFT's vanilla LoRA forward, ``base(x) + s·B(A(x))``, with the scaling applied to the r-wide
    ``A(x)`` and the add fused into the B product (``addmm``): two full-width elementwise passes a layer
    fewer, forward and backward. Anything but a plain single-adapter call goes to PEFT's own forward.
    """
    name = self.active_adapters[0] if len(self.active_adapters) == 1 else None
    if (args or kwargs or self.disable_adapters or self.merged or name not in self.lora_A
            or name in self.lora_variant or not isinstance(self.lora_dropout[name], torch.nn.Identity)
            # without autocast addmm needs one dtype (PEFT's forward casts the input to the adapter's)
            or not (torch.is_autocast_enabled(x.device.type) or x.dtype == self.lora_A[name].weight.dtype
                    == self.lora_B[name].weight.dtype == self.base_layer.weight.dtype)):
        return type(self).forward(self, x, *args, **kwargs)
    result = self.base_layer(x)
    h = self.lora_A[name](x) * self.scaling[name]
    b = self.lora_B[name].weight
    flat = torch.addmm(result.reshape(-1, result.size(-1)), h.reshape(-1, h.size(-1)), b.t())
    return flat.view(result.shape).to(result.dtype)


def fuse_lora_adds(model) -> int:
    """Give every vanilla LoRA linear layer of ``model`` the fused forward above; returns how many.

    The same sum as PEFT's (its scaling, 2 in the recipe, is a power of two, so moving it is exact); the
    fused add rounds once where PEFT rounds the LoRA product and then the sum, a bf16 ulp at most.
    Measured on an H200, PEFT's scaling and add passes took ~0.24 s of a 128-row step.
    """
    from types import MethodType

    from peft.tuners.lora.layer import Linear as LoraLinear

    n = 0
    for module in model.modules():
        if type(module) is LoraLinear and "forward" not in vars(module) and module.lora_B:
            if all(m.bias is None for m in module.lora_B.values()):
                module.forward = MethodType(_lora_forward, module)
                n += 1
    return n


ROW_KEYS = {"prompt_ids": "prompt", "prompt_mask": "prompt", "completion_ids": "completion",
            "completion_mask": "completion", "tool_mask": "completion", "rollout_logps": "completion", "advantages": None}


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


def _replayable(sampler):
    """Give TRL's RepeatSampler a ``set_epoch`` that replays its shuffle generator to that epoch's start.

    The sampler draws one ``randperm`` per epoch from its own generator, seeded once with args.seed; HF's
    rng_state.pth holds only the global RNGs, so a resumed process restarts that generator and, from the
    2nd pass over the problems on, would deal them in the 1st pass's order. Trainer calls ``set_epoch``
    before every epoch (through accelerate's DataLoaderShard), resumed or not: an uninterrupted run keeps
    exactly its order, and a resumed one gets the same.
    """
    if getattr(sampler, "shuffle", False) and getattr(sampler, "seed", None) is not None:
        def set_epoch(epoch: int) -> None:
            sampler.generator.manual_seed(sampler.seed)
            for _ in range(epoch):
                torch.randperm(sampler.num_samples, generator=sampler.generator)

        sampler.set_epoch = set_epoch
    return sampler


class StepLog(TrainerCallback):
    """Writes one JSON line per optimizer step (and one log line) to ``path``."""

    KEYS = {
        "talk/reward": "reward", "talk/both_right": "both_right", "talk/chats_drawn": "chats_drawn",
        "talk/chats_generated": "chats_generated",
        "talk/zero_adv_share": "zero_adv_share", "talk/tokens_per_turn": "tokens_per_turn",
        "entropy": "entropy", "loss": "loss", "grad_norm": "grad_norm",
        "talk/rows": "rows", "talk/loss_rows": "loss_rows",
        "talk/longest_prompt": "longest_prompt", "timing/gen_s": "gen_s",
        "talk/logp_diff_max": "logp_diff_max", "talk/logp_diff_mean": "logp_diff_mean", "talk/logp_kl": "logp_kl",
        "talk/loss_tokens": "loss_tokens", "talk/loss_tokens_padded": "loss_tokens_padded",
    }

    def __init__(self, path: Path):
        self.path = path
        self._t0 = time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "talk/reward" not in logs:
            return
        line = {"step": state.global_step}
        line.update({short: logs.get(key) for key, short in self.KEYS.items()})
        line["train_s"] = max(time.perf_counter() - self._t0 - (line["gen_s"] or 0.0), 0.0)
        with open(self.path, "a") as f:
            f.write(json.dumps(line, sort_keys=True) + "\n")
        log.info("step %d reward %.3f chats %d gen %.1fs train %.1fs", line["step"], line["reward"],
                 line["chats_drawn"], line["gen_s"], line["train_s"])


def _truncate_log(path: Path, last_step: int) -> None:
    """Keep the log lines of steps <= last_step (a resumed run rewrites the steps after its checkpoint).

    A line cut short by a kill is dropped (it belongs to a step after the checkpoint); the rewrite is atomic.
    """
    if not path.exists():
        return
    keep = []
    for ln in path.read_text().splitlines():
        try:
            if json.loads(ln)["step"] <= last_step:
                keep.append(ln)
        except (ValueError, KeyError, TypeError):
            continue
    write_text(path, "".join(k + "\n" for k in keep))


RUN_KEY = "run_key.json"  # in the work dir: which config and problems its checkpoints belong to


def _run_key(cfg: TrainConfig, problems: list[dict]) -> dict:
    """What a checkpoint is only valid for: the whole TrainConfig and the exact problems."""
    blob = json.dumps(problems, sort_keys=True, ensure_ascii=False).encode()
    return json.loads(json.dumps({"config": _jsonable(asdict(cfg)), "problems_sha256": hashlib.sha256(blob).hexdigest()}))


def _checkpoint_step(path: Path) -> int | None:
    m = re.fullmatch(r"checkpoint-(\d+)", path.name)
    return int(m[1]) if m and path.is_dir() else None


def _complete(ckpt: Path) -> bool:
    """Trainer._save_checkpoint writes trainer_state.json last: without a whole one, a kill cut the save."""
    try:
        return json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == _checkpoint_step(ckpt)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def last_checkpoint(work_dir: Path, key: dict) -> Path | None:
    """The newest complete checkpoint in ``work_dir`` made for ``key``, or None (start afresh).

    Checkpoints cut by a kill mid-save are deleted. Checkpoints of another config or other problems
    (``run_key.json`` differs or is missing) are deleted with the live log, so an edited recipe
    never resumes from a stale run. ``key`` is then recorded for this run.
    """
    ckpts = sorted((s, p) for p in work_dir.glob("checkpoint-*") if (s := _checkpoint_step(p)) is not None)
    key_path = work_dir / RUN_KEY
    try:
        same_run = json.loads(key_path.read_text()) == key
    except (OSError, ValueError):
        same_run = False
    if ckpts and not same_run:
        log.warning("%s holds checkpoints of another config or other problems: starting afresh", work_dir)
        for _, p in ckpts:
            shutil.rmtree(p)
        (work_dir / "train_log.jsonl").unlink(missing_ok=True)
        ckpts = []
    write_json(key_path, key)
    last = None
    for _, p in reversed(ckpts):
        if last is None and _complete(p):
            last = p
        elif not _complete(p):
            log.warning("deleting %s: cut short by a kill while it was being saved", p)
            shutil.rmtree(p)
    return last


def rollout_reward(**_):
    """Placeholder for TRL's reward_funcs: team rewards are computed inside the rollout, so this never runs."""
    raise RuntimeError("TalkTrainer scores chats in _generate_and_score_completions; rollout_reward must not be called")


def build_trainer(cfg: TrainConfig, problems: list[dict], work_dir: Path, judge=judge_by_gold,
                  callbacks=(), generator_factory=PlainGenerator) -> TalkTrainer:
    """A ready TalkTrainer for ``cfg`` on ``problems``; checkpoints go to ``work_dir``."""
    from datasets import Dataset
    from peft import LoraConfig

    if cfg.arm not in CREDIT_RULES:
        raise ValueError(f"arm={cfg.arm!r} is not one of {sorted(CREDIT_RULES)}")
    device, dtype = pick_device_and_dtype(cfg.precision)
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, dtype, device)
    n_rows = cfg.problems_per_step * cfg.chats_per_problem
    if n_rows % cfg.micro_batches:
        raise ValueError(f"train.micro_batches={cfg.micro_batches} must divide problems_per_step × chats_per_problem = {n_rows}")
    args = GRPOConfig(
        output_dir=str(work_dir), seed=cfg.seed, max_steps=cfg.steps, learning_rate=cfg.learning_rate,
        lr_scheduler_type=cfg.lr_schedule, warmup_steps=0, weight_decay=0.0,
        per_device_train_batch_size=n_rows // cfg.micro_batches, num_generations=cfg.chats_per_problem,
        steps_per_generation=cfg.micro_batches, gradient_accumulation_steps=cfg.micro_batches, num_iterations=1, beta=0.0, loss_type="dapo", scale_rewards="none",
        max_completion_length=cfg.sampling.max_new_tokens, temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p, logging_steps=1, save_strategy="steps", save_steps=cfg.save_every,
        save_total_limit=1, report_to=[], bf16=dtype == torch.bfloat16, use_cpu=device.type == "cpu",
        activation_checkpointing=cfg.gradient_checkpointing, remove_unused_columns=False,
        dataloader_num_workers=0, disable_tqdm=False, shuffle_dataset=True,
    )
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM")
    dataset = Dataset.from_list([{**p, "prompt": p["shared_question"]} for p in problems])
    return TalkTrainer(
        model=model, reward_funcs=[rollout_reward], args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=lora,
        arm=cfg.arm, sampling=cfg.sampling, ada_max_replays=cfg.ada_max_replays, ada_draw_ahead=cfg.ada_draw_ahead,
        pack_seats=cfg.pack_seats, judge=judge,
        callbacks=list(callbacks), generator_factory=generator_factory,
    )


def train_run(cfg: TrainConfig, problems: list[dict], adapter_dir: Path, log_path: Path, work_dir: Path) -> dict:
    """Train one run, resuming from the last checkpoint in ``work_dir``; write the adapter and the step log.

    The checkpoint and the in-progress log live in ``work_dir`` (outside the declared outputs, which
    Snakemake deletes before a rerun); the outputs are written atomically at the end.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    live_log = work_dir / "train_log.jsonl"
    last = last_checkpoint(work_dir, _run_key(cfg, problems))
    resumed_from = _checkpoint_step(last) if last else 0
    if last:
        log.info("resuming %s seed %d from %s", cfg.arm, cfg.seed, last)
    _truncate_log(live_log, resumed_from)
    from talkmethods.engine import ENGINES

    trainer = build_trainer(cfg, problems, work_dir, callbacks=[StepLog(live_log)],
                            generator_factory=ENGINES[cfg.engine])
    t0 = time.perf_counter()
    if last and resumed_from >= cfg.steps:
        # Training had finished (the job died writing its outputs). Trainer.train would run one step
        # more before checking max_steps: load the final adapter weights instead, as its resume does.
        trainer.model.load_adapter(str(last), "default", is_trainable=True)
        trainer.state.global_step = resumed_from
    else:
        trainer.train(resume_from_checkpoint=str(last) if last else None)
    with atomic_path(adapter_dir) as tmp:
        trainer.model.save_pretrained(str(tmp))
    with atomic_path(log_path) as tmp:
        shutil.copyfile(live_log, tmp)
    return {"resumed_from_step": resumed_from, "train_wall_s": time.perf_counter() - t0,
            "steps": trainer.state.global_step, "config": _jsonable(asdict(cfg))}


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
