"""From a TrainConfig to a trained adapter: the TRL/PEFT settings a run maps to, and the resumable run.

``build_trainer`` turns a ``TrainConfig`` into GRPOConfig and LoraConfig, builds the ``TalkTrainer``
and applies the TRL/PEFT patches (``patches.apply_patches``); ``train_run`` trains one (arm, seed)
run, resuming from its last checkpoint (``runs``), and writes its adapter and step log.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch
from trl import GRPOConfig

from talkmethods.atomic import atomic_path
from talkmethods.credit import CREDIT_RULES
from talkmethods.engines.plain import PlainGenerator
from talkmethods.models import load_model, load_tokenizer, pick_device_and_dtype
from talkmethods.problems import read_jsonl
from talkmethods.recipe import TRL_FIXED, TrainConfig
from talkmethods.rollout import judge_by_gold
from talkmethods.training.patches import apply_patches
from talkmethods.training.runs import StepLog, checkpoint_step, jsonable, last_checkpoint, run_key, truncate_log
from talkmethods.training.trainer import TalkTrainer

log = logging.getLogger(__name__)

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rollout_reward(**_):
    """Placeholder for TRL's reward_funcs: team rewards are computed inside the rollout, so this never runs."""
    raise RuntimeError(
        "TalkTrainer scores chats in _generate_and_score_completions; rollout_reward must not be called"
    )


def build_trainer(
    cfg: TrainConfig,
    problems: list[dict],
    work_dir: Path,
    judge=judge_by_gold,
    callbacks=(),
    generator_factory=PlainGenerator,
    peft_model=None,
    adapter: str | None = None,
) -> TalkTrainer:
    """A ready TalkTrainer for ``cfg`` on ``problems``, TRL/PEFT patches applied; checkpoints go to ``work_dir``.

    ``peft_model`` and ``adapter``: a seed cohort's shared model and this seed's adapter in it
    (``training.cohort``); the cohort applies the patches once, for all its trainers.
    """
    from datasets import Dataset

    if cfg.arm not in CREDIT_RULES:
        raise ValueError(f"arm={cfg.arm!r} is not one of {sorted(CREDIT_RULES)}")
    device, dtype = pick_device_and_dtype(cfg.precision)
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, dtype, device) if peft_model is None else peft_model
    n_rows = cfg.problems_per_step * cfg.chats_per_problem
    if n_rows % cfg.micro_batches:
        raise ValueError(
            f"train.micro_batches={cfg.micro_batches} must divide problems_per_step × chats_per_problem = {n_rows}"
        )
    args = GRPOConfig(
        output_dir=str(work_dir),
        seed=cfg.seed,
        max_steps=cfg.steps,
        learning_rate=cfg.learning_rate,
        lr_scheduler_type=cfg.lr_schedule,
        warmup_steps=0,
        weight_decay=0.0,
        per_device_train_batch_size=n_rows // cfg.micro_batches,
        num_generations=cfg.chats_per_problem,
        steps_per_generation=cfg.micro_batches,
        gradient_accumulation_steps=cfg.micro_batches,
        **TRL_FIXED,
        max_completion_length=cfg.sampling.max_new_tokens,
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        logging_steps=1,
        save_strategy="steps",
        save_steps=cfg.save_every,
        save_total_limit=1,
        report_to=[],
        bf16=dtype == torch.bfloat16,
        use_cpu=device.type == "cpu",
        activation_checkpointing=cfg.gradient_checkpointing,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        disable_tqdm=False,
        shuffle_dataset=True,
    )
    dataset = Dataset.from_list([{**p, "prompt": p["shared_question"]} for p in problems])
    trainer = TalkTrainer(
        model=model,
        reward_funcs=[rollout_reward],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora_config(cfg) if peft_model is None else None,
        arm=cfg.arm,
        sampling=cfg.sampling,
        ada_max_replays=cfg.ada_max_replays,
        ada_draw_ahead=cfg.ada_draw_ahead,
        pack_seats=cfg.pack_seats,
        judge=judge,
        callbacks=list(callbacks),
        generator_factory=generator_factory,
    )
    # the PEFT-wrapped model TRL built; Liger's kernels are Triton GPU kernels: a CPU run stays eager
    trainer.liger = cfg.liger_kernels and device.type == "cuda"
    trainer.adapter_name = adapter
    if peft_model is None:
        trainer.lora_layers_fused = apply_patches(trainer.model, liger=trainer.liger)
    return trainer


def lora_config(cfg: TrainConfig):
    """The run's LoRA adapter (PEFT's ``LoraConfig``)."""
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=list(LORA_TARGETS),
        task_type="CAUSAL_LM",
    )


def train_run(cfg: TrainConfig, problems: list[dict], adapter_dir: Path, log_path: Path, work_dir: Path) -> dict:
    """Train one run, resuming from the last checkpoint in ``work_dir``; write the adapter and the step log.

    The checkpoint and the in-progress log live in ``work_dir`` (outside the declared outputs, which
    Snakemake deletes before a rerun); the outputs are written atomically at the end.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    live_log = work_dir / "train_log.jsonl"
    last = last_checkpoint(work_dir, run_key(cfg, problems))
    resumed_from = checkpoint_step(last) if last else 0
    if last:
        log.info("resuming %s seed %d from %s", cfg.arm, cfg.seed, last)
    truncate_log(live_log, resumed_from)
    from talkmethods.engines import ENGINES

    trainer = build_trainer(
        cfg, problems, work_dir, callbacks=[StepLog(live_log)], generator_factory=ENGINES[cfg.engine]
    )
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
    return {
        "resumed_from_step": resumed_from,
        "train_wall_s": time.perf_counter() - t0,
        "steps": trainer.state.global_step,
        "config": jsonable(asdict(cfg)),
    }


def train_stage(params: dict, problems: str, adapter_dir: str, log_path: str, work_dir: str) -> dict:
    """The train stage: one (arm, seed) run from a rule's plain ``params``, resuming from ``work_dir``."""
    cfg = TrainConfig.from_params(params)
    return train_run(cfg, read_jsonl(problems), Path(adapter_dir), Path(log_path), Path(work_dir))
