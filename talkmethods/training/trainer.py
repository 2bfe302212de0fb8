"""The trainer: TRL's GRPOTrainer for two seats that talk (``TalkTrainer``).

TRL keeps the loss (``dapo``: token sum over the generation batch), the optimizer loop, logging,
checkpoints and LoRA (through ``peft_config``). The rows it trains on are built in ``training.rows``,
the TRL/PEFT patches sit in ``training.patches``, and ``training.build`` makes a TalkTrainer from a
TrainConfig.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from contextlib import nullcontext

import torch
from trl import GRPOTrainer

from talkmethods.credit import ARM_PLANS, CREDIT_RULES, draw_with_replays, seat_plan
from talkmethods.engines.plain import PlainGenerator
from talkmethods.engines.sampling import Sampling
from talkmethods.rollout import Chat, Turn, judge_by_gold, play_chats
from talkmethods.training.patches import (
    lora_inputs_uncast,
    packed_rows,
    packed_rows_available,
    replayable,
    right_aligned_rows,
    unscored_labels_hook,
)
from talkmethods.training.rows import (
    EMPTY_TURN,
    ROW_KEYS,
    Row,
    group_by_length,
    live_rows,
    pad_rows,
    to_rows,
    width_step_for,
)

log = logging.getLogger(__name__)

# KL(rollout || trainer) per sampled token (k3 estimate) above which a step warns that the rollout engine
# samples from other weights than the ones being trained. Measured on the H200 (bf16, the warm-started
# toy-world model, GRPO at lr 1e-4, bench/logp_check.py): fresh rollouts 3.1e-5 median, 6.5e-4 at most
# over 40 steps; rollouts from an adapter k steps old 3.2e-4 (k = 5), 1.0e-3 (k = 10), 2.1e-3 (k = 20).
# The max |gap| is no test: bf16 rounding of tiny probabilities gave fresh steps gaps of up to 1.65 nats.
KL_TOLERANCE = 1e-3


class TalkTrainer(GRPOTrainer):
    """GRPOTrainer for two seats that talk. The GRPOTrainer/Trainer methods it overrides, and why:

    - ``__init__``: takes the arm, sampling, judge and rollout engine; refuses an off-policy split.
    - ``_get_train_sampler``: TRL's shuffle made resumable past the first epoch (``patches.replayable``).
    - ``_generate_and_score_completions``: plays the arm's chats, applies its credit rule, returns the loss rows.
    - ``_prepare_inputs``: re-splits TRL's buffered micro-batches by row length (same loss, less padding).
    - ``compute_loss``: keeps the partner's reply out of the LM head and PEFT's LoRA input casts out of the loss;
      runs each row with its pads after its tokens (causal attention, no mask).
    - ``_get_per_token_logps_and_entropies``: compares the loss's log-probs with the rollout's (stale weights).
    - ``log``: reports that comparison once a step; stops on non-finite log-probs.

    The TRL internals they rely on are pinned in tests/test_trl_contract.py: the sampler
    (test_repeat_sampler_shuffles_once_an_epoch_and_trainer_sets_the_epoch), the batch and its split
    (test_generate_and_score_completions_signature, test_prepare_inputs_*), the loss path
    (test_loss_scores_through_get_per_token_logps_and_entropies) and the metrics (test_log_merges_the_metrics_dict).
    """

    def __init__(
        self,
        *args,
        arm: str,
        sampling: Sampling,
        ada_max_replays: int = 3,
        ada_draw_ahead: bool = False,
        pack_seats: bool = False,
        judge: Callable[[Turn, dict], bool] = judge_by_gold,
        generator_factory=PlainGenerator,
        **kwargs,
    ):
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
        self.ada_draw_ahead = (
            ada_draw_ahead  # play every replay round up front in one batch (credit.draw_with_replays)
        )
        self.judge = judge
        self.generator_factory = generator_factory
        self.last_rows = 0
        self._generator = None
        self._rollout_logps = None  # the micro-batch's rollout log-probs, while its loss is computed
        self._scored = None  # and which of its completion tokens are the seat's own (tool_mask)
        self._logp_diff = {"max": 0.0, "sum": 0.0, "n": 0, "kl": 0.0}
        self.group_rows = True  # re-split each generation batch by row length (tests switch it off)
        # each loss row's pads after its tokens, no attention mask (``patches.right_aligned_rows``; the bench switches it)
        self.right_align_rows = True
        # or a micro-batch's rows as one row of real tokens (``patches.packed_rows``; on a CUDA GPU its varlen
        # kernel, on a CPU SDPA a row at a time): off, a step -1% on an H100 (docs/h200_2026-12-04.md, round
        # seventeen) does not pay for a second layout; the bench switches it
        self.pack_rows = False
        # leave zero-advantage rows out of the loss batch (``live_rows``: the same loss and gradient); the share
        # bench switches it off, since random weights score 0 everywhere and its steps would train nothing
        # (exact only while a zero-advantage row's loss is zero: no KL term, no entropy bonus; both off in the recipe)
        self.skip_zero_advantage = self.beta == 0.0 and not self._entropy_bonus_enabled
        self.lora_layers_fused = 0  # set by build.build_trainer (patches.apply_patches)
        self.cohort = None  # a seed cohort's rendezvous (``training.cohort``), set with ``adapter_name``
        self.adapter_name: str | None = None  # this seed's adapter in a cohort's shared model

    def _get_train_sampler(self, dataset=None):
        """TRL's RepeatSampler, resumable past the first epoch (see ``patches.replayable``)."""
        return replayable(super()._get_train_sampler(dataset))

    def _seats(self, n: int) -> list[tuple[bool, bool]]:
        """A always trained; within each problem's chats, the arm's share has a base B (``credit.seat_plan``)."""
        return seat_plan(n, self.num_generations, self.plan.base_b_per_4)

    def _draw_chats(self, problems: list[dict]) -> tuple[list[list[Chat]], dict]:
        if self._generator is None:  # one engine per run (a cohort: its own): its graphs and buffers are reused
            self._generator = (
                self.cohort.generator
                if self.cohort is not None
                else self.generator_factory(self.accelerator.unwrap_model(self.model), self.processing_class)
            )
        generator = self._generator
        # the policy after the last optimizer step (a cohort's seed: its own adapter's)
        generator.sync_weights() if self.cohort is None else generator.sync_weights(self.adapter_name)
        # a cohort's seeds play their chats together (one engine call), each on its own adapter
        play = play_chats if self.cohort is None else self.cohort.chats_of(self.adapter_name)
        g = self.num_generations
        totals = {"gen_s": 0.0, "longest_prompt": 0, "completion_tokens": 0, "turns": 0, "chats_generated": 0}

        def draw(indices: list[int]) -> list[list[Chat]]:
            flat = [problems[i] for i in indices for _ in range(g)]
            chats, stats = play(
                generator, self.processing_class, flat, self._seats(len(flat)), self.sampling, self.judge
            )
            for k, v in stats.items():
                totals[k] = max(totals[k], v) if k == "longest_prompt" else totals[k] + v
            totals["chats_generated"] += len(chats)  # drawing ahead plays chats the rule may never reach
            return [chats[j * g : (j + 1) * g] for j in range(len(indices))]

        max_replays = self.ada_max_replays if self.plan.replay else 0
        by_problem = draw_with_replays(
            draw,
            len(problems),
            per_round=g,
            max_replays=max_replays,
            reward=lambda c: c.reward,
            ahead=self.ada_draw_ahead,
        )
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
        n_turns = sum(r.turns for r in rows)
        # the loss's normaliser (dapo: a token sum over the generation batch) counts every credited turn's tokens
        n_items = sum(sum(r.scored) for r in rows)
        if self.skip_zero_advantage:
            rows, skipped = live_rows(rows)
        else:
            skipped = 0
        # split_tensor_dict silently drops rows that do not divide steps_per_generation (DESIGN §2):
        # pad with empty rows (completion_mask 0), which add nothing to the token-sum loss; at least one a
        # micro-batch, so that every micro-batch's backward writes (zero) gradients and the optimizer steps as before
        n_real = len(rows)
        spg = self.args.steps_per_generation
        rows += [Row.of(EMPTY_TURN, 0.0)] * (max(spg, -(-len(rows) // spg) * spg) - len(rows))
        batch = pad_rows(rows, self.processing_class.pad_token_id, self.accelerator.device)
        batch["num_items_in_batch"] = torch.tensor(n_items, device=self.accelerator.device)
        self.last_rows = n_real

        m = self._metrics["train"]
        m["talk/reward"].append(sum(c.reward for c in first_rewards) / len(first_rewards))
        m["talk/both_right"].append(sum(c.reward == 1.0 for c in first_rewards) / len(first_rewards))
        m["talk/chats_drawn"].append(float(sum(len(c) for c in by_problem)))
        m["talk/chats_generated"].append(float(stats["chats_generated"]))
        m["talk/zero_adv_share"].append(zero_adv / len(problems))
        m["talk/tokens_per_turn"].append(stats["completion_tokens"] / max(stats["turns"], 1))
        m["talk/rows"].append(float(n_turns))  # trained turns
        m["talk/loss_rows"].append(float(n_real))  # rows the loss runs (fewer when seats are packed)
        m["talk/skipped_rows"].append(float(skipped))  # zero-advantage rows it need not run (``live_rows``)
        m["talk/longest_prompt"].append(float(stats["longest_prompt"]))
        m["timing/gen_s"].append(stats["gen_s"])
        return batch

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Trainer's save; a cohort's trainer saves its own adapter only (PEFT's sub-folder named after it),
        so that resuming loads that adapter alone (Trainer's ``_load_from_checkpoint`` reads the sub-folders).
        Contract: tests/test_trl_contract.py::test_trainer_saves_and_resumes_a_peft_model_s_adapters_by_sub_folder."""
        if self.adapter_name is None:
            return super()._save(output_dir, state_dict)
        model = self.model
        model.save_pretrained = functools.partial(
            type(model).save_pretrained, model, selected_adapters=[self.adapter_name]
        )
        try:
            return super()._save(output_dir, state_dict)
        finally:
            del model.save_pretrained

    def _prepare_inputs(self, generation_batch):
        """TRL's buffering, with the fresh generation batch re-split by length (``group_by_length``)."""
        spg = self.args.steps_per_generation
        fresh = self.model.training and (
            self._step % (spg * self.num_iterations) == 0 or self._buffered_inputs is None
        )
        inputs = super()._prepare_inputs(generation_batch)
        if fresh and self.group_rows:
            rows = {
                k: torch.cat([b[k] for b in self._buffered_inputs]) if k in ROW_KEYS else v
                for k, v in self._buffered_inputs[0].items()
            }
            self._buffered_inputs = group_by_length(rows, spg, width_step_for(self.accelerator.device))
            m = self._metrics["train"]
            m["talk/loss_tokens"].append(float(rows["prompt_mask"].sum() + rows["completion_mask"].sum()))
            m["talk/loss_tokens_padded"].append(
                float(sum(b["prompt_ids"].numel() + b["completion_ids"].numel() for b in self._buffered_inputs))
            )
            inputs = self._buffered_inputs[self._step % spg]
        return inputs

    # -- rollout vs trainer log-probs: the rows' log-probs as the engine sampled them, against the loss's own

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self._rollout_logps = inputs.get("rollout_logps")
        self._scored = inputs.get("tool_mask")
        hooks = [model.register_forward_pre_hook(unscored_labels_hook(self._scored), with_kwargs=True)]
        device = self.accelerator.device
        packed = self.pack_rows and (device.type == "cpu" or packed_rows_available(device))
        if self.right_align_rows and not packed:  # after the labels hook: it reads the labels in TRL's layout
            pre, post = right_aligned_rows()
            hooks += [model.register_forward_pre_hook(pre, with_kwargs=True), model.register_forward_hook(post)]
        try:
            with lora_inputs_uncast(model, self.args.bf16), packed_rows(model) if packed else nullcontext():
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            for hook in hooks:
                hook.remove()
            self._rollout_logps = self._scored = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
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
                raise FloatingPointError(
                    "non-finite log-probs in the rollout or the loss: the adapter holds NaN/inf "
                    "(a NaN gradient; see CUDNN_NAN_WIDTH); stopping rather than training on noise"
                )
            if d["kl"] / d["n"] > KL_TOLERANCE:
                log.warning(
                    "KL(rollout || trainer) is %.2e a token (tolerance %.0e; max |log-prob gap| %.2f nats): the "
                    "rollout engine may be sampling from other weights than the ones being trained",
                    d["kl"] / d["n"],
                    KL_TOLERANCE,
                    d["max"],
                )
            self._logp_diff = {"max": 0.0, "sum": 0.0, "n": 0, "kl": 0.0}
        super().log(logs, start_time)
