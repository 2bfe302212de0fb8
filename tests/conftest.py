"""Shared fixtures: the offline Qwen tokenizer, tiny problems, and a one-thread torch setting.

The repository root goes on ``sys.path`` so that a bare ``pytest`` (not only ``python -m pytest``)
can import ``talkmethods``.

``tests/no_slurm`` goes first on ``PATH`` for every Snakemake run the suite starts: the SLURM executor
plugin runs ``scontrol show config`` whenever Snakemake starts (it builds the CLI from every installed
plugin), and where SLURM's client is installed but no controller answers (as after the SLURM test) that
waits 9 s, 59 s without a slurm.conf, on every dry run. The stand-in fails at once; the SLURM test
(tests/test_slurm.py) takes it off ``PATH`` and talks to its real cluster.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
NO_SLURM = str(ROOT / "tests" / "no_slurm")
os.environ["PATH"] = os.pathsep.join([NO_SLURM, os.environ.get("PATH", "")])


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """The real Qwen2.5 tokenizer, built offline once per session (do not mutate it)."""
    from talkmethods.models import ModelSpec, load_tokenizer

    return load_tokenizer(ModelSpec("offline-tiny-qwen2"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run the module's tiny-model work on one intra-op thread, then restore the setting.

    On a small shared machine, torch's default of one thread per core is up to 20x slower than a
    single thread for a width-64 model when another process holds a core (OpenMP threads wait for
    each other); one thread also makes float reductions, and so seeded runs, reproducible.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_problems(n: int = 8) -> list[dict]:
    """Hand-made problems whose private facts are distinctive sentences (gold = the sum)."""
    return [
        {
            "id": f"p{i}",
            "facts_a": [f"Zorblax has {17 + i} pebbles.", f"Zorblax keeps them in {3 + i} jars."],
            "facts_b": [f"Quimby has {29 + i} pebbles.", f"Quimby found them near {5 + i} rivers."],
            "shared_question": "How many pebbles do Zorblax and Quimby have together?",
            "gold": str(46 + 2 * i),
        }
        for i in range(n)
    ]


@pytest.fixture()
def problems() -> list[dict]:
    return tiny_problems(8)


def dotted_name(node) -> str:
    """The dotted name of an AST callee (``torch.load``), or "?" for anything else (for source scans)."""
    import ast

    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted_name(node.value)}.{node.attr}"
    return "?"


def train_config(**fields):
    """A ``recipe.TrainConfig`` with config.yaml's value for every field not given (the defaults live there only)."""
    import dataclasses

    from talkmethods.config import load_config, train_params
    from talkmethods.recipe import TrainConfig

    base = TrainConfig.from_params(
        train_params(load_config([str(ROOT / "config.yaml")]), fields["arm"], fields["seed"])
    )
    return dataclasses.replace(base, **fields)


def chat_prompts(tok, n: int = 6) -> list[list[int]]:
    """``n`` chat prompts of growing length ("item i" repeated i + 1 times), tokenised by the template."""
    return [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": f"item {i} " * (i + 1)}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for i in range(n)
    ]
