"""The engines package: the decode-loop engine against the reference ``model.generate`` path, the
shared sampling rule, and the registry (the fast engine is imported only when asked for)."""

from __future__ import annotations

import pytest
import torch
from conftest import chat_prompts

from talkmethods.engines.loop import LoopGenerator
from talkmethods.engines.plain import PlainGenerator
from talkmethods.engines.sampling import Sampling, sample_with_logprob
from talkmethods.models import ModelSpec, load_model

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

    model = get_peft_model(
        load_model(ModelSpec("offline-tiny-qwen2"), torch.float32),
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.eval()


@pytest.mark.parametrize("adapter_on", [[False] * 6, [True] * 6, [True, False] * 3])
def test_loop_matches_generate_token_for_token_when_greedy(peft_model, qwen_tokenizer, adapter_on):
    prompts = chat_prompts(qwen_tokenizer)  # different lengths: left padding is exercised
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


@pytest.mark.parametrize("width", [151_936, 151_937, 100])
def test_inverse_cdf_in_two_levels_is_the_flat_rule(width):
    """Block sums then one block's cumulative sum pick the same index as one flat cumulative sum."""
    from talkmethods.engines.sampling import _inverse_cdf

    g = torch.Generator().manual_seed(width)
    for _ in range(3):
        probs = torch.softmax(torch.randn(16, width, generator=g, dtype=torch.float64) * 3, -1)
        probs[:, ::7] = 0  # zero-mass tokens are never picked
        u = torch.rand(16, generator=g, dtype=torch.float64)
        cdf = probs.cumsum(-1)
        want = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:]).clamp(max=width - 1)
        got = _inverse_cdf(probs, u)
        assert torch.equal(got, want)
        assert bool((probs.gather(-1, got) > 0).all())


def test_full_vocabulary_sampling_follows_the_softmax():
    """The two-level path (a 151,936-token row) draws with the softmax's frequencies."""
    logits = torch.full((4000, 151_936), -30.0)
    logits[:, [5, 70_000, 151_935]] = torch.tensor([1.0, 0.0, 2.0])
    g = torch.Generator().manual_seed(1)
    tok, logp = sample_with_logprob(logits, 1.0, 0, 1.0, torch.rand(4000, generator=g))
    counts = torch.stack([(tok == t).sum() for t in (5, 70_000, 151_935)]).float()
    assert counts.sum() > 3990
    assert torch.allclose(counts / counts.sum(), torch.softmax(torch.tensor([1.0, 0.0, 2.0]), -1), atol=0.03)
    assert torch.allclose(logp, torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0], atol=1e-5)


@pytest.mark.parametrize("width", [151_936, 151_937, 3000])
def test_top_k_through_blocks_is_torch_topk(width):
    from talkmethods.engines.sampling import top_k_of

    g = torch.Generator().manual_seed(width)
    x = torch.randn(24, width, generator=g)
    x[0, :40] = 9.0 + torch.arange(40) * 0.01  # the top 20 crowd into one block
    x[1, -3:] = 50.0 - torch.arange(3.0)  # in the last, partial block
    for k in (1, 20):
        want_v, want_i = torch.topk(x, k, dim=-1)
        got_v, got_i = top_k_of(x, k)
        assert torch.equal(got_v, want_v) and torch.equal(got_i, want_i)


def test_plain_samples_as_configured_not_as_the_checkpoint_says(peft_model, qwen_tokenizer):
    """A hub checkpoint's generation_config (Qwen2.5-Instruct: repetition_penalty 1.05, top_k 20) must not
    leak into sampling: with the configured knobs and the same seed, plain generate gives the tokens it
    gives for a checkpoint with no such defaults."""
    prompts = chat_prompts(qwen_tokenizer)
    sampling = Sampling(max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=0)
    gen = PlainGenerator(peft_model, qwen_tokenizer)
    torch.manual_seed(3)
    clean = gen.generate(prompts, [True] * 6, sampling)
    saved = peft_model.generation_config
    try:
        peft_model.generation_config = type(saved)(
            **{**saved.to_dict(), "repetition_penalty": 1.5, "top_k": 2, "min_p": 0.5, "no_repeat_ngram_size": 1}
        )
        torch.manual_seed(3)
        assert gen.generate(prompts, [True] * 6, sampling) == clean
        # the control that this test can fail: left to the checkpoint's defaults, generate samples otherwise
        ids, mask = gen.left_pad(prompts)
        torch.manual_seed(3)
        leaked = peft_model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            max_new_tokens=12,
            temperature=1.0,
            top_p=1.0,
            eos_token_id=gen.eos_ids,
            pad_token_id=gen.pad_id,
        )
        assert gen._trim(leaked[:, ids.size(1) :]) != clean
    finally:
        peft_model.generation_config = saved


@pytest.mark.parametrize("engine", ["loop", "fast"])
def test_engines_without_a_repetition_penalty_refuse_one(peft_model, qwen_tokenizer, engine):
    from talkmethods.engines import ENGINES

    gen = ENGINES[engine](peft_model, qwen_tokenizer)
    with pytest.raises(ValueError, match=f"the {engine} engine applies no repetition penalty"):
        gen.generate(
            chat_prompts(qwen_tokenizer, 2), [True, True], Sampling(max_new_tokens=2, repetition_penalty=1.05)
        )


def test_the_registry_imports_the_fast_engine_only_when_asked_for():
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, talkmethods.engines, talkmethods.rollout; "
        "print(sorted(m for m in sys.modules if m.startswith('talkmethods.engines.fast')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("engine", ["plain", "loop", "fast", "fast-eager"])
def test_every_engine_has_what_the_rollout_reads(peft_model, qwen_tokenizer, engine):
    """The ``Generator`` protocol's attributes, with the values ``play_chats`` used to assume when absent."""
    from talkmethods.engines import ENGINES, Generator

    gen = ENGINES[engine](peft_model, qwen_tokenizer)
    for name in Generator.__annotations__:
        assert hasattr(gen, name), name
    assert gen.reuses_turns is engine.startswith("fast") and gen.last_logprobs is None
    assert set(gen.eos_ids) == {qwen_tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    assert callable(gen.sync_weights) and callable(gen.generate)
