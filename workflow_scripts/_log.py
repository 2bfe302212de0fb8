"""Send a script's logging (and warnings) to the rule's log file."""

import logging
import sys

import talkmethods  # noqa: F401  (first: its CUDA allocator default must precede torch's import, in use_threads)


def use_threads(n: int) -> None:
    """Give torch the rule's threads, no more: parallel jobs must not oversubscribe the cores."""
    import torch

    torch.set_num_threads(max(int(n), 1))


def to_rule_log(path: str) -> None:
    handler = logging.FileHandler(path, mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler, logging.StreamHandler(sys.stderr)], force=True)
    logging.captureWarnings(True)
