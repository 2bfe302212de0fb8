"""The warm start: supervised fine-tuning of a small Qwen2 model on ideal dialogues of the task.

A random model never boxes a right answer, so every reward, advantage and replay of the arms would be
zero. The warm start builds a fresh Qwen2-architecture model (seeded random weights), then teaches it
the task with TRL's ``SFTTrainer`` on the *train* problems' ideal dialogues (``dialogue.ideal_dialogue``:
each seat states its facts, then both work the sum and box it). Each training row is one seat's two
turns packed exactly as the RL trainer packs them (``training.rows.to_rows`` over ``rollout.seat_prompts``),
so SFT and RL see the same token ids, and only the seat's own tokens are trained.

Stopped early on purpose: a base that is *partly* right (DESIGN §1b: team accuracy 0.2-0.35) leaves
the arms room to learn and keeps partial credit (one seat right) common. The vocabulary is either
Qwen's full 151,936 rows (the GPU world: the real model's head and embedding cost) or the compact
Qwen vocabulary of the world's text (``vocab.compact_qwen_tokenizer``: on a CPU the full head is
nearly all of a tiny model's cost).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from talkmethods.atomic import atomic_path
from talkmethods.dialogue import SEATS, ideal_dialogue, seat_messages
from talkmethods.rollout import Chat, Turn, seat_prompts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmStartConfig:
    """The warm-started model's architecture and its SFT settings (``model.warmstart`` in config.yaml)."""

    vocab: str  # "compact" (the world's Qwen pieces) or "full" (Qwen2.5's 151,936 rows)
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    steps: int
    batch_size: int
    learning_rate: float
    warmup_steps: int
    slip_rate: float  # share of dialogues in which one seat makes one arithmetic slip (``ideal_dialogue``)
    seed: int
    precision: str


def ideal_chat(problem: dict, tokenizer, slip: tuple[str, int, int] | None = None) -> Chat:
    """The ideal dialogue of ``problem`` as a played chat: the exact prompt and completion ids of every turn."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    texts = ideal_dialogue(problem, slip)
    chat = Chat(problem=problem, a_adapter=True, b_adapter=True)
    for turn, seat in enumerate(SEATS):
        own_last = chat.turns[turn - 2] if turn >= 2 else None
        prompt = seat_prompts(tokenizer, [(seat_messages(problem, turn, texts[:turn]), own_last)], {end})[0]
        completion = tokenizer(texts[turn], add_special_tokens=False)["input_ids"] + [end]
        chat.turns.append(
            Turn(seat=seat, adapter_on=True, prompt_ids=prompt, completion_ids=completion, text=texts[turn])
        )
    return chat


def draw_slips(problems: list[dict], rate: float, seed: int) -> list[tuple[str, int, int] | None]:
    """Per problem: None, or with probability ``rate`` one seat's slip (seat, step, error of ±1 or ±2)."""
    rng = random.Random(seed)
    slips = []
    for problem in problems:
        n_steps = sum(1 for ln in problem["answer"].rpartition("####")[0].splitlines() if ln.strip())
        if rng.random() < rate and n_steps:
            slips.append((rng.choice("AB"), rng.randrange(n_steps), rng.choice((-2, -1, 1, 2))))
        else:
            slips.append(None)
    return slips


def sft_rows(problems: list[dict], tokenizer, slip_rate: float = 0.0, seed: int = 0) -> list[dict]:
    """One SFT row per seat and problem: ``input_ids`` and ``completion_mask`` (1 on the seat's own tokens)."""
    from talkmethods.training.rows import to_rows

    slips = draw_slips(problems, slip_rate, seed)
    chats = [ideal_chat(p, tokenizer, s) for p, s in zip(problems, slips, strict=True)]
    rows = to_rows(chats, [1.0] * len(chats), [(True,) * 4] * len(chats), pack=True)
    return [
        {"input_ids": r.prompt_ids + r.completion_ids, "completion_mask": [0] * len(r.prompt_ids) + r.scored}
        for r in rows
    ]


def world_corpus(problems: list[dict], tokenizer) -> list[str]:
    """Every seat's whole ideal conversation, rendered by the chat template: the compact vocabulary's text."""
    texts = []
    for problem in problems:
        dialogue = ideal_dialogue(problem)
        for seat_turn in (2, 3):
            messages = seat_messages(problem, seat_turn, dialogue[:seat_turn])
            messages.append({"role": "assistant", "content": dialogue[seat_turn]})
            texts.append(tokenizer.apply_chat_template(messages, tokenize=False))
    return texts


def world_tokenizer(cfg: WarmStartConfig, problems: list[dict]):
    """The tokenizer of the warm-started model: Qwen's own, whole or cut to the world's pieces."""
    from talkmethods.models import offline_qwen_tokenizer

    full = offline_qwen_tokenizer()
    if cfg.vocab == "full":
        return full
    from talkmethods.vocab import compact_qwen_tokenizer

    return compact_qwen_tokenizer(world_corpus(problems, full))


def build_model(cfg: WarmStartConfig, tokenizer):
    """A fresh Qwen2ForCausalLM sized by ``cfg`` for ``tokenizer`` (seeded weights, float32)."""
    from talkmethods.models import QWEN25_VOCAB, small_qwen2

    return small_qwen2(
        QWEN25_VOCAB if cfg.vocab == "full" else len(tokenizer),
        cfg.hidden,
        cfg.layers,
        cfg.heads,
        cfg.kv_heads,
        cfg.intermediate,
        cfg.seed,
        end_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )


def warm_start(cfg: WarmStartConfig, problems: list[dict], out_dir: str | Path) -> dict:
    """SFT a fresh model on the ideal dialogues of ``problems`` and save it (with its tokenizer) to ``out_dir``.

    Args:
        cfg: Architecture and SFT settings.
        problems: Train problems only (held-out problems never reach the warm start).
        out_dir: Model directory, written atomically: a loadable ``from_pretrained`` dir or nothing.

    Returns:
        Statistics for the card: parameters, vocabulary rows, SFT rows and tokens, loss first/last, seconds.
    """
    import tempfile

    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from talkmethods.models import pick_device_and_dtype
    from talkmethods.training.patches import score_only_valid_positions_on_cpu

    score_only_valid_positions_on_cpu()  # SFTTrainer's fused LM head too: only the loss positions on a CPU
    t0 = time.perf_counter()
    device, dtype = pick_device_and_dtype(cfg.precision)
    tokenizer = world_tokenizer(cfg, problems)
    rows = sft_rows(problems, tokenizer, cfg.slip_rate, cfg.seed)
    model = build_model(cfg, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    log.info(
        "warm start: %d problems -> %d SFT rows, vocabulary %d, %.2fM parameters, %d steps",
        len(problems),
        len(rows),
        len(tokenizer),
        n_params / 1e6,
        cfg.steps,
    )
    losses: list[float] = []
    with tempfile.TemporaryDirectory(prefix="warmstart-") as scratch:
        args = SFTConfig(
            output_dir=scratch,
            max_steps=cfg.steps,
            per_device_train_batch_size=cfg.batch_size,
            learning_rate=cfg.learning_rate,
            lr_scheduler_type="cosine",
            warmup_steps=cfg.warmup_steps,
            weight_decay=0.0,
            seed=cfg.seed,
            completion_only_loss=True,
            max_length=None,
            packing=False,
            logging_steps=max(cfg.steps // 20, 1),
            save_strategy="no",
            report_to=[],
            bf16=dtype == torch.bfloat16,
            use_cpu=device.type == "cpu",
            dataloader_num_workers=0,
            disable_tqdm=False,
            activation_checkpointing=False,  # SFTConfig turns it on; a small model only pays its recompute
        )
        trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    model = trainer.model.to(torch.float32)
    with atomic_path(Path(out_dir)) as tmp:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
    return {
        "config": asdict(cfg),
        "problems": len(problems),
        "rows": len(rows),
        "tokens": sum(len(r["input_ids"]) for r in rows),
        "vocab_rows": model.config.vocab_size,
        "parameters": n_params,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "wall_s": round(time.perf_counter() - t0, 1),
        "device": str(device),
    }


def warmstart_stage(params: dict, problems: str, out_model: str, out_stats: str) -> dict:
    """The warm-start stage: SFT on the train problems' ideal dialogues; writes the model dir and its statistics."""
    from talkmethods.atomic import write_json
    from talkmethods.problems import read_jsonl

    stats = warm_start(WarmStartConfig(**params), read_jsonl(problems), out_model)
    write_json(out_stats, stats)
    log.info("warm start: loss %s -> %s in %.0f s", stats["loss_first"], stats["loss_last"], stats["wall_s"])
    return stats
