"""User-facing errors: one line that names the cause and the knob to change, never a traceback."""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager

OOM_HINT = (
    "GPU out of memory. Lower, in config.yaml: train.problems_per_step (chats per step), "
    "train.max_new_tokens / eval.max_new_tokens (turn length), eval.batch_chats (chats per generate call), "
    "raise train.micro_batches (rows per backward), set train.ada_draw_ahead: false (Reinforce-Ada's replay "
    "rounds one batch at a time), set train.gradient_checkpointing: true, or take the arm out of train.cohort "
    "(a cohort holds every seed's merged weights and decode buffers at once)."
)


class UserError(Exception):
    """An error whose message is meant for the user as it is (config, data, model, a too-long prompt).

    The modules that raise one subclass it here, so this module imports none of them: a stage that
    reports errors depends on no other stage's code.
    """


@contextmanager
def friendly_errors():
    """Turn known user errors into one line on stderr and exit status 2; GPU out-of-memory into exit status 3."""
    import torch

    try:
        yield
    except UserError as err:
        _report(str(err))
        raise SystemExit(2) from None
    except torch.cuda.OutOfMemoryError as err:
        _oom_exit(err)
    except RuntimeError as err:  # cuBLAS / cuDNN workspaces report "CUDA error: out of memory" as a plain RuntimeError
        if "out of memory" not in str(err).lower():
            raise
        _oom_exit(err)


def _oom_exit(err: BaseException):
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    _report(f"{OOM_HINT}\n({first})")
    raise SystemExit(3) from None


def _report(message: str) -> None:
    """``error: message`` on stderr, and in the log files of the root logger (a Snakemake rule's log:)."""
    sys.stderr.write(f"error: {message}\n")
    record = logging.LogRecord("talkmethods", logging.ERROR, __file__, 0, "error: %s", (message,), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
