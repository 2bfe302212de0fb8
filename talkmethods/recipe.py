"""The recipe as typed values: what one training run and one eval depend on, and the tables every stage reads.

Defaults live only in ``config.yaml`` (the schema requires every key the code reads); these frozen
dataclasses have none, and are built in one place, ``config.train_params`` / ``config.eval_params``,
whose plain dicts are the rules' ``params:`` (so an edit reruns what it touches) and come back here
through ``from_params`` inside the stage. Torch-free: the Snakefile imports it while planning.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# The eval kinds: which seats carry the trained adapter (A, B), the file a run writes, the card's label.
EVAL_KINDS: dict[str, dict[str, Any]] = {
    "eval": {"seats": (True, True), "file": "eval.json", "label": "held-out (trained A × trained B)"},
    "crossplay": {"seats": (True, False), "file": "crossplay.json", "label": "cross-play (trained A × base B)"},
    "crossplay_bA": {"seats": (False, True), "file": "crossplay_bA.json", "label": "base A × trained B"},
}
BASE_KIND = {"seats": (False, False), "file": "eval.json", "label": "base A × base B"}  # results/base/, once
RUN_EVAL_KINDS = tuple(EVAL_KINDS)  # what every (arm, seed) run is evaluated as

# What the recipe fixes in TRL's GRPO (not config: changing one is another method). The trainer passes
# them to GRPOConfig and the card's Recipe states them.
TRL_FIXED = {"loss_type": "dapo", "beta": 0.0, "num_iterations": 1, "scale_rewards": "none"}


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run depends on (``config.train_params``; the arms: ``credit.ARM_PLANS``)."""

    arm: str
    seed: int
    model: Any  # models.ModelSpec
    steps: int
    problems_per_step: int
    chats_per_problem: int
    learning_rate: float
    lr_schedule: str
    lora_r: int
    lora_alpha: int
    lora_dropout: float
    sampling: Any  # engines.sampling.Sampling
    ada_max_replays: int
    ada_draw_ahead: bool
    pack_seats: bool
    save_every: int
    precision: str
    gradient_checkpointing: bool
    engine: str
    micro_batches: int
    liger_kernels: bool  # Liger's RMSNorm, SwiGLU and RoPE in the training forward, on a CUDA GPU

    @classmethod
    def from_params(cls, params: dict) -> TrainConfig:
        """From a rule's plain ``params`` (``config.train_params``)."""
        from talkmethods.engines.sampling import Sampling
        from talkmethods.models import ModelSpec

        return cls(**{**params, "model": ModelSpec(**params["model"]), "sampling": Sampling(**params["sampling"])})

    def to_params(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class EvalConfig:
    """Everything an eval depends on, whatever its kind (``config.eval_params``)."""

    model: Any  # models.ModelSpec
    sampling: Any  # engines.sampling.Sampling
    chats_per_problem: int
    batch_chats: int
    sample_dialogues: int
    eval_seed: int
    precision: str
    engine: str

    @classmethod
    def from_params(cls, params: dict) -> EvalConfig:
        """From a rule's plain ``params`` (``config.eval_params``)."""
        from talkmethods.engines.sampling import Sampling
        from talkmethods.models import ModelSpec

        return cls(**{**params, "model": ModelSpec(**params["model"]), "sampling": Sampling(**params["sampling"])})
