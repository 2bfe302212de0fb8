"""User-facing errors: one line that names the cause and the knob to change, never a traceback."""

from __future__ import annotations

import sys
from contextlib import contextmanager

OOM_HINT = (
    "GPU out of memory. Lower, in config.yaml: train.problems_per_step (chats per step), "
    "train.max_new_tokens / eval.max_new_tokens (turn length), eval.batch_chats (chats per generate call), "
    "or set train.gradient_checkpointing: true."
)


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types whose message is meant for the user as it is."""
    from talkmethods.config import ConfigError
    from talkmethods.models import ModelError
    from talkmethods.problems import DataError
    from talkmethods.rollout import PromptTooLong

    return (ConfigError, DataError, ModelError, PromptTooLong)


@contextmanager
def friendly_errors():
    """Turn known user errors and GPU out-of-memory into one line on stderr and exit status 2."""
    import torch

    try:
        yield
    except user_errors() as err:
        sys.stderr.write(f"error: {err}\n")
        raise SystemExit(2) from None
    except torch.cuda.OutOfMemoryError as err:
        sys.stderr.write(f"error: {OOM_HINT}\n({str(err).splitlines()[0]})\n")
        raise SystemExit(3) from None
