"""The rollout engines behind ``train.engine`` / ``eval.engine``, and the interface the rollout uses.

``fast`` (the default; ``engines.fast``: merged weights, a static KV cache, CUDA graphs), ``fast-eager``
(the same with its maths uncompiled: no ``torch.compile`` in a process's start), ``loop``
(an eager decode loop over the live model, ``engines.loop``) or ``plain`` (``model.generate``,
``engines.plain``). ``ENGINES`` maps each name to a factory ``(model, tokenizer) -> Generator``; the
fast engine's modules (Triton kernels, compiled maths) are imported only when it is asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from talkmethods.engines.loop import LoopGenerator
from talkmethods.engines.plain import PlainGenerator
from talkmethods.engines.sampling import Sampling


class Generator(Protocol):
    """What ``rollout.play_chats`` and the trainer use of an engine."""

    eos_ids: list[int]  # stop tokens: a completion ends with the first; a seat's next prompt drops it
    reuses_turns: bool  # ``generate`` continues a lane's cached K/V: ``play_chats`` names each seat's lane
    last_logprobs: list[list[float]] | None  # the last call's per-token log-probs, from an engine that scores them

    def generate(
        self, prompts: list[list[int]], adapter_on: list[bool | str], sampling: Sampling, lane: str | None = None
    ) -> list[list[int]]:
        """One completion per prompt, token ids up to and including the first stop token.

        ``adapter_on``: per row, True (the policy's adapter), False (the base model) or the name of
        one of the model's adapters (a seed cohort's).
        """
        ...

    def sync_weights(self, adapter: str | None = None) -> None:
        """Take up the model's current weights (the trainer calls it after each optimizer step);
        ``adapter``: only that adapter's moved."""
        ...


def _fast(model, tokenizer) -> Generator:
    from talkmethods.engines.fast.generator import FastGenerator

    return FastGenerator(model, tokenizer)


def _fast_eager(model, tokenizer) -> Generator:
    """The fast engine without ``torch.compile`` (CUDA graphs kept): no tracing or compiling in a fresh
    process, unfused norms and SwiGLU in every step. H100, 600-chat evals, each its own process (warm
    compile caches): from the process's start to the end of its first eval 36 s against 45, each further
    eval 19.3 s against 16.7-17.9."""
    from talkmethods.engines.fast.generator import FastGenerator

    return FastGenerator(model, tokenizer, compile=False)


ENGINES: dict[str, Callable[..., Generator]] = {
    "plain": PlainGenerator,
    "loop": LoopGenerator,
    "fast": _fast,
    "fast-eager": _fast_eager,
}
