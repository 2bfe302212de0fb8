"""Training one (arm, seed) run on TRL's GRPO machinery.

- ``rows``: played chats to loss rows and micro-batches (pure tensor code, no TRL).
- ``trainer``: ``TalkTrainer``, GRPOTrainer with the overrides its docstring lists.
- ``patches``: every TRL/PEFT patch, applied by an explicit call, never on import.
- ``runs``: the step log, the run key and the checkpoint a run resumes from.
- ``build``: ``TrainConfig`` to GRPOConfig/LoraConfig and a ``TalkTrainer`` (``build_trainer``); ``train_run``.
"""
