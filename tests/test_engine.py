"""The decode-loop engine against the reference ``model.generate`` path, and its sampler."""

from __future__ import annotations

import pytest
import torch

from talkmethods.engine import LoopGenerator, sample_with_logprob
from talkmethods.models import ModelSpec, load_model
from talkmethods.rollout import PlainGenerator, Sampling

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = Sampling(max_new_tokens=10, top_k=1)


def sample_next(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """The engines' sampling rule, one uniform per row drawn from ``generator``."""
    u = torch.rand(logits.size(0), generator=generator)
    return sample_with_logprob(logits, sampling.temperature, sampling.top_k, sampling.top_p, u)[0]


@pytest.fixture(scope="module")
def peft_model():
    """The tiny model with a LoRA adapter whose B matrices are non-zero, so the adapter changes outputs."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load_model(ModelSpec("offline-tiny-qwen2"), torch.float32),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.eval()


def _prompts(tok, n=6):
    return [list(tok.apply_chat_template([{"role": "user", "content": f"item {i} " * (i + 1)}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False))
            for i in range(n)]


@pytest.mark.parametrize("adapter_on", [[False] * 6, [True] * 6, [True, False] * 3])
def test_loop_matches_generate_token_for_token_when_greedy(peft_model, qwen_tokenizer, adapter_on):
    prompts = _prompts(qwen_tokenizer)  # different lengths: left padding is exercised
    plain = PlainGenerator(peft_model, qwen_tokenizer).generate(prompts, adapter_on, GREEDY)
    loop = LoopGenerator(peft_model, qwen_tokenizer).generate(prompts, adapter_on, GREEDY)
    assert loop == plain
    if adapter_on == [True, False] * 3:  # the adapter really changes what is said
        base = LoopGenerator(peft_model, qwen_tokenizer).generate(prompts, [False] * 6, GREEDY)
        assert [loop[i] == base[i] for i in range(6)] != [True] * 6
        assert all(loop[i] == base[i] for i in range(1, 6, 2))


def test_top_k_one_and_tiny_top_p_pick_the_argmax():
    logits = torch.randn(5, 1000)
    want = logits.argmax(-1)
    assert torch.equal(sample_next(logits, Sampling(top_k=1)), want)
    assert torch.equal(sample_next(logits, Sampling(top_p=1e-6)), want)
    assert torch.equal(sample_next(logits, Sampling(top_k=20, top_p=1e-6)), want)


def test_sampling_frequencies_follow_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20_000, 1)
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(sample_next(logits, Sampling(temperature=1.0), g), minlength=4).float()
    assert torch.allclose(counts / counts.sum(), torch.softmax(logits[0], -1), atol=0.01)
    # top-p 0.8 keeps the smallest set with mass >= 0.8: tokens 0 and 1 (0.64 + 0.24), renormalised
    counts = torch.bincount(sample_next(logits, Sampling(top_p=0.8), g), minlength=4).float()
    assert counts[2:].sum() == 0
    assert abs(counts[0] / counts.sum() - 0.644 / (0.644 + 0.237)) < 0.01
    # top-k 3 at temperature 0.5 never draws the 4th token
    counts = torch.bincount(sample_next(logits, Sampling(top_k=3, temperature=0.5), g), minlength=4)
    assert counts[3] == 0 and counts[2] > 0
