"""The fast engine (merged weights, static KV cache) against ``model.generate``, on the CPU.

On a GPU the same maths is compiled and captured in CUDA graphs; ``bench/speed.py`` repeats the
greedy-equality check there (fp32) and reports it. Here it runs eagerly, in float32.
"""

from __future__ import annotations

import pytest
import torch
from conftest import chat_prompts, tiny_problems

from talkmethods.engines.fast.generator import COLUMN_BUCKET, FastGenerator, batch_bucket
from talkmethods.engines.loop import LoopGenerator
from talkmethods.engines.plain import PlainGenerator
from talkmethods.engines.sampling import Sampling
from talkmethods.models import ModelSpec, load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = Sampling(max_new_tokens=10, top_k=1)


def _nonzero_b(model, seed: int):
    """``model`` (eval mode) with every LoRA B matrix random, so each adapter changes outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.eval()


def _lora(model, targets=("q_proj", "v_proj", "down_proj"), seed=0):
    """``model`` with a LoRA adapter whose B matrices are non-zero, so the adapter changes outputs."""
    from peft import LoraConfig, get_peft_model

    return _nonzero_b(get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=list(targets))), seed)


@pytest.fixture(scope="module")
def peft_model():
    return _lora(load_model(ModelSpec("offline-tiny-qwen2"), torch.float32))


def _logprobs_by_forward(model, prompt, completion, adapter_on):
    return _logprobs_at_temperature(model, prompt, completion, adapter_on, 1.0)


@pytest.mark.parametrize("adapter_on", [[False] * 6, [True] * 6, [True, False] * 3])
def test_fast_matches_generate_token_for_token_when_greedy(peft_model, qwen_tokenizer, adapter_on):
    prompts = chat_prompts(qwen_tokenizer)  # different lengths: left padding is exercised
    plain = PlainGenerator(peft_model, qwen_tokenizer).generate(prompts, adapter_on, GREEDY)
    fast = FastGenerator(peft_model, qwen_tokenizer)
    assert fast.generate(prompts, adapter_on, GREEDY) == plain
    if adapter_on == [True, False] * 3:  # the adapter really changes what is said, and only in its rows
        base = fast.generate(prompts, [False] * 6, GREEDY)
        assert [plain[i] == base[i] for i in range(0, 6, 2)] != [True] * 3
        assert all(plain[i] == base[i] for i in range(1, 6, 2))


@pytest.mark.parametrize("attention", ["matmul", "sdpa"])
def test_every_attention_form_gives_the_same_tokens(peft_model, qwen_tokenizer, attention):
    prompts = chat_prompts(qwen_tokenizer)
    want = PlainGenerator(peft_model, qwen_tokenizer).generate(prompts, [True] * 6, GREEDY)
    assert FastGenerator(peft_model, qwen_tokenizer, attention=attention).generate(prompts, [True] * 6, GREEDY) == want


def test_fast_runs_a_model_without_adapter(qwen_tokenizer):
    model = load_model(ModelSpec("offline-tiny-qwen2"), torch.float32).eval()
    prompts = chat_prompts(qwen_tokenizer, 3)
    fast = FastGenerator(model, qwen_tokenizer)
    assert fast.generate(prompts, [False] * 3, GREEDY) == PlainGenerator(model, qwen_tokenizer).generate(
        prompts, [False] * 3, GREEDY
    )
    with pytest.raises(ValueError, match="no adapter"):
        fast.generate(prompts, [True] * 3, GREEDY)


def test_logprobs_are_those_of_a_plain_forward(peft_model, qwen_tokenizer):
    prompts = chat_prompts(qwen_tokenizer)
    on = [True, False] * 3
    torch.manual_seed(0)
    fast = FastGenerator(peft_model, qwen_tokenizer)
    out = fast.generate(prompts, on, Sampling(max_new_tokens=12, temperature=0.9))
    assert len(fast.last_logprobs) == 6
    for p, c, lp, a in zip(prompts, out, fast.last_logprobs, on, strict=True):
        assert len(lp) == len(c) > 0
        # TRL's log-probs divide the logits by the temperature: so does the engine's
        ref = _logprobs_at_temperature(peft_model, p, c, a, 0.9)
        assert torch.allclose(torch.tensor(lp), ref, atol=1e-4), (lp, ref)


def _logprobs_at_temperature(model, prompt, completion, adapter_on, temperature):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        if adapter_on:
            logits = model(ids).logits
        else:
            with model.disable_adapter():
                logits = model(ids).logits
    lp = (logits[0, len(prompt) - 1 : -1].float() / temperature).log_softmax(-1)
    return lp.gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_sync_weights_folds_in_the_new_adapter_and_staleness_shows(qwen_tokenizer):
    """After an optimizer step the merged copy is stale until ``sync_weights``: the log-prob check sees it."""
    model = _lora(
        load_model(ModelSpec("offline-tiny-qwen2"), torch.float32),
        targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    )
    prompts = chat_prompts(qwen_tokenizer, 4)
    fast = FastGenerator(model, qwen_tokenizer)
    fast.generate(prompts, [True] * 4, GREEDY)
    with torch.no_grad():  # "an optimizer step": move every LoRA matrix
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.3 * torch.randn_like(p))

    def worst_diff():
        out = fast.generate(prompts, [True] * 4, GREEDY)
        return max(
            (torch.tensor(lp) - _logprobs_by_forward(model, p, c, True)).abs().max().item()
            for p, c, lp in zip(prompts, out, fast.last_logprobs, strict=True)
        )

    stale = worst_diff()
    fast.sync_weights()
    fresh = worst_diff()
    assert fresh < 1e-4 < 0.05 < stale
    assert fast.generate(prompts, [True] * 4, GREEDY) == PlainGenerator(model, qwen_tokenizer).generate(
        prompts, [True] * 4, GREEDY
    )


def _cohort(seeds=("seed17", "seed18", "seed19")):
    """A model with one LoRA adapter per seed (no ``default``), each with its own non-zero B."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj", "gate_proj"])
    model = get_peft_model(load_model(ModelSpec("offline-tiny-qwen2"), torch.float32), cfg, adapter_name=seeds[0])
    for name in seeds[1:]:
        model.add_adapter(name, cfg)
    return _nonzero_b(model, 3)


def test_several_adapters_and_the_base_decode_in_one_call_as_each_alone(qwen_tokenizer):
    """A seed cohort's call: each row on its own seed's adapter (or none), the tokens of ``generate``."""
    model = _cohort()
    prompts = chat_prompts(qwen_tokenizer, 8)
    rows = ["seed17", "seed18", False, "seed19", "seed18", "seed17", "seed19", False]
    want = PlainGenerator(model, qwen_tokenizer).generate(prompts, rows, GREEDY)
    fast = FastGenerator(model, qwen_tokenizer, stack_adapters=False)  # a batch per adapter's merged copy
    assert sorted(fast.weights, key=str) == [None, "seed17", "seed18", "seed19"]
    assert fast.generate(prompts, rows, GREEDY) == want
    assert LoopGenerator(model, qwen_tokenizer).generate(prompts, rows, GREEDY) == want  # PEFT's per-row routing
    for name in ("seed17", "seed18", "seed19"):  # each adapter's rows as in a call of that adapter alone
        alone = fast.generate(prompts, [name] * 8, GREEDY)
        assert [a for a, r in zip(alone, rows, strict=True) if r == name] == [
            w for w, r in zip(want, rows, strict=True) if r == name
        ]
    # the adapters really differ: the same prompts say different things under different seeds
    assert fast.generate(prompts, ["seed17"] * 8, GREEDY) != fast.generate(prompts, ["seed19"] * 8, GREEDY)
    assert not fast._stacked
    with pytest.raises(ValueError, match="'default' requested but the model has adapters"):
        fast.generate(prompts, [True] * 8, GREEDY)
    with pytest.raises(ValueError, match="'seed20' requested"):
        PlainGenerator(model, qwen_tokenizer).generate(prompts, ["seed20"] * 8, GREEDY)


def test_stacked_adapters_decode_as_one_batch_with_the_tokens_of_generate(qwen_tokenizer):
    """``stack_adapters``: the adapters' rows in one batch over the base weights (each group's LoRA as a
    batched product, groups of unequal size filled up), the base rows beside; every row as ``generate``."""
    model = _cohort()
    prompts = chat_prompts(qwen_tokenizer, 9)
    rows = ["seed17", "seed18", False, "seed19", "seed18", "seed17", "seed19", False, "seed17"]
    want = PlainGenerator(model, qwen_tokenizer).generate(prompts, rows, GREEDY)
    fast = FastGenerator(model, qwen_tokenizer, stack_adapters=True)
    assert fast.generate(prompts, rows, GREEDY) == want
    assert list(fast._stacked) == [("seed17", "seed18", "seed19")]
    # 3 groups filled to 3 rows (seed17's), decoded as one batch beside the base rows' batch
    assert fast._slots[(9, (None, ("seed17", "seed18", "seed19")))].k.size(1) == 9
    # a seed's new weights reach the stack after sync_weights(that seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B.seed18" in name:
                p.add_(0.5 * torch.randn_like(p))
    fast.sync_weights("seed18")
    assert fast.generate(prompts, rows, GREEDY) == PlainGenerator(model, qwen_tokenizer).generate(
        prompts, rows, GREEDY
    )


def test_a_stacked_cohort_plays_whole_chats_as_generate_does(qwen_tokenizer):
    """Four turns, each seat's lane continued over the stacked batch (prefix reuse), against ``generate``."""
    from talkmethods.rollout import play_chats

    model = _cohort()
    chats = [p for p in tiny_problems(4) for _ in range(3)]
    seats = [(n, n) for n in ("seed17", "seed18", "seed19")] * 4
    sampling = Sampling(max_new_tokens=8, top_k=1)
    fast = FastGenerator(model, qwen_tokenizer, stack_adapters=True)
    got, _ = play_chats(fast, qwen_tokenizer, chats, seats, sampling)
    want, _ = play_chats(PlainGenerator(model, qwen_tokenizer), qwen_tokenizer, chats, seats, sampling)
    assert [[t.completion_ids for t in c.turns] for c in got] == [[t.completion_ids for t in c.turns] for c in want]
    assert list(fast._stacked) == [("seed17", "seed18", "seed19")]
    assert fast.timing["reused_tokens"] > 0  # the seats' second turns continued their cached first


def test_sync_weights_of_one_adapter_leaves_the_others(qwen_tokenizer):
    """A cohort's seed folds in its own new weights after its step; the other seeds' copies do not move."""
    model = _cohort(("seed17", "seed18"))
    fast = FastGenerator(model, qwen_tokenizer)
    before = {name: [t.clone() for t in w.tensors] for name, w in fast.weights.items()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # both adapters move
                p.add_(0.3 * torch.randn_like(p))
    fast.sync_weights("seed18")
    moved = {
        name: any(not torch.equal(a, b) for a, b in zip(before[name], w.tensors, strict=True))
        for name, w in fast.weights.items()
    }
    assert moved == {None: False, "seed17": False, "seed18": True}
    fast.sync_weights()
    prompts = chat_prompts(qwen_tokenizer, 4)
    rows = ["seed17", "seed18", "seed17", "seed18"]
    assert fast.generate(prompts, rows, GREEDY) == PlainGenerator(model, qwen_tokenizer).generate(
        prompts, rows, GREEDY
    )


def test_cache_grows_for_longer_prompts_and_turns(peft_model, qwen_tokenizer):
    fast = FastGenerator(peft_model, qwen_tokenizer)
    short = chat_prompts(qwen_tokenizer, 2)
    fast.generate(short, [True] * 2, GREEDY)
    columns = fast._slots[(2, (None, "default"))].columns
    long = [(p[:-5] * 100)[: columns - k] + p[-5:] for k, p in enumerate(short)]  # wider than the cache
    assert max(len(p) for p in long) + GREEDY.max_new_tokens > columns
    want = PlainGenerator(peft_model, qwen_tokenizer).generate(long, [True] * 2, GREEDY)
    assert fast.generate(long, [True] * 2, GREEDY) == want
    assert fast._slots[(2, (None, "default"))].columns >= max(len(p) for p in long) + GREEDY.max_new_tokens
    assert fast._slots[(2, (None, "default"))].columns % COLUMN_BUCKET == 0


def test_rows_stop_at_their_own_end_of_turn(peft_model, qwen_tokenizer):
    """A row ends at its first end-of-turn token (kept); the loop stops once every row has ended."""
    fast = FastGenerator(peft_model, qwen_tokenizer)
    prompts = chat_prompts(qwen_tokenizer, 4)
    full = fast.generate(prompts, [True] * 4, Sampling(max_new_tokens=20, top_k=1))
    assert all(len(row) == 20 for row in full)  # the tiny random model never ends a turn by itself
    # declare the 3rd token of row 0 an end-of-turn token: row 0 stops there, the others where it appears
    stop = full[0][2]
    fast.eos_ids = fast.eos_ids + [stop]
    fast.eos = torch.tensor(fast.eos_ids)
    cut = fast.generate(prompts, [True] * 4, Sampling(max_new_tokens=20, top_k=1))
    for want, got in zip(full, cut, strict=True):
        end = want.index(stop) + 1 if stop in want else len(want)
        assert got == want[:end]
    assert len(cut[0]) == full[0].index(stop) + 1 <= 3
    steps_before = fast.timing["decode_steps"]
    fast.eos_ids = fast.eos_ids + [t for row in full for t in row[:1]]  # every row ends at its first token
    fast.eos = torch.tensor(fast.eos_ids)
    assert fast.generate(prompts, [True] * 4, Sampling(max_new_tokens=200, top_k=1)) == [row[:1] for row in full]
    assert fast.timing["decode_steps"] - steps_before <= 16  # stopped at the first check, not after 200 steps


def test_batch_bucket():
    assert [batch_bucket(n) for n in (1, 8, 9, 32, 33, 512, 513, 600)] == [8, 8, 16, 32, 64, 512, 640, 640]


def test_non_qwen2_models_are_refused_with_a_hint(qwen_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=1000,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    with pytest.raises(ValueError, match="engine to loop"):
        FastGenerator(model, qwen_tokenizer)


def test_a_policy_with_nan_weights_stops_the_rollout(qwen_tokenizer):
    """A NaN gradient that reached the adapter must end the run, not feed it noise (see training.rows.CUDNN_NAN_WIDTH)."""
    model = load_model(ModelSpec("offline-tiny-qwen2"), torch.float32).eval()
    gen = FastGenerator(model, qwen_tokenizer)
    with torch.no_grad():
        gen.weights[None].tensors[1].fill_(float("nan"))  # layer 0's fused q/k/v
    with pytest.raises(FloatingPointError, match="non-finite"):
        gen.generate(chat_prompts(qwen_tokenizer, 2), [False, False], Sampling(max_new_tokens=4))


def test_the_triton_attention_form_is_refused_off_the_gpu_with_a_reason(peft_model, qwen_tokenizer, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fast = FastGenerator(peft_model, qwen_tokenizer, attention="triton")
    assert fast._auto_form(6) in ("sdpa", "matmul")  # auto never picks the kernel on a CPU
    with pytest.raises(ValueError, match="CUDA device"):
        fast.generate(chat_prompts(qwen_tokenizer), [True] * 6, GREEDY)


def test_compiled_engine_matches_generate_on_the_cpu(peft_model, qwen_tokenizer):
    """The GPU path's maths under ``torch.compile`` (fullgraph: no graph breaks; prefill with dynamic
    shapes), here with inductor's CPU backend: the same greedy tokens, across new batch and prompt shapes."""
    prompts = chat_prompts(qwen_tokenizer)
    on = [True, False] * 3
    fast = FastGenerator(peft_model, qwen_tokenizer, graphs=False, compile=True, attention="sdpa")
    assert fast.generate(prompts, on, GREEDY) == PlainGenerator(peft_model, qwen_tokenizer).generate(
        prompts, on, GREEDY
    )
    longer = [p + p for p in chat_prompts(qwen_tokenizer, 3)]
    want = PlainGenerator(peft_model, qwen_tokenizer).generate(longer, [True] * 3, GREEDY)
    assert fast.generate(longer, [True] * 3, GREEDY) == want


def test_the_fast_eager_engine_is_the_fast_engine_without_torch_compile(peft_model, qwen_tokenizer, monkeypatch):
    """``eval.engine: fast-eager`` builds the fast engine with compile off (graphs left to the device),
    ``fast`` leaves compile to the device (on with a GPU): the one difference between them."""
    import talkmethods.engines.fast.generator as gen_module
    from talkmethods.engines import ENGINES

    built = []

    class Spy(FastGenerator):
        def __init__(self, *args, **kwargs):
            built.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gen_module, "FastGenerator", Spy)
    eager, fast = ENGINES["fast-eager"](peft_model, qwen_tokenizer), ENGINES["fast"](peft_model, qwen_tokenizer)
    assert built == [{"compile": False}, {}]
    assert eager._wrap is None and eager.graphs == fast.graphs
    prompts = chat_prompts(qwen_tokenizer, 3)
    assert eager.generate(prompts, [True] * 3, GREEDY) == fast.generate(prompts, [True] * 3, GREEDY)


def _chats_to_play():
    from tests.conftest import tiny_problems

    flat = [p for p in tiny_problems(3) for _ in range(2)]
    seats = [(True, True), (True, False)] * 3  # B's rows on two weight sets: two lanes
    return flat, seats


def _plain_chats(peft_model, tok):
    """The chats ``_play_both`` plays, from ``generate`` alone (greedy, no extra stop)."""
    from talkmethods.rollout import play_chats

    return play_chats(PlainGenerator(peft_model, tok), tok, *_chats_to_play(), GREEDY)[0]


def _play_both(peft_model, tok, stop=None, attention="auto"):
    from talkmethods.rollout import play_chats

    flat, seats = _chats_to_play()
    fast, plain = FastGenerator(peft_model, tok, attention=attention), PlainGenerator(peft_model, tok)
    if stop is not None:  # rows then end their turns at different lengths
        for gen in (fast, plain):
            gen.eos_ids = gen.eos_ids + [stop]
        fast.eos = torch.tensor(fast.eos_ids)
    got, _ = play_chats(fast, tok, flat, seats, GREEDY)
    want, _ = play_chats(plain, tok, flat, seats, GREEDY)
    return fast, got, want


@pytest.mark.parametrize("early_stops", [False, True])
def test_a_seats_second_turn_continues_its_cached_first_turn(peft_model, qwen_tokenizer, early_stops):
    """Each seat's second prompt is prefilled from where its first turn's K/V end (the partner's reply
    and the template), and the chats are token for token those ``generate`` plays re-reading the
    whole dialogue: positions, the skipped stale columns and the cached prefix are right."""
    stop = None
    if early_stops:
        stop = _plain_chats(peft_model, qwen_tokenizer)[0].turns[0].completion_ids[3]
    fast, got, want = _play_both(peft_model, qwen_tokenizer, stop)
    assert [[(t.prompt_ids, t.completion_ids) for t in c.turns] for c in got] == [
        [(t.prompt_ids, t.completion_ids) for t in c.turns] for c in want
    ]
    if early_stops:
        lengths = {len(t.completion_ids) for c in got for t in c.turns}
        assert len(lengths) > 1 and min(lengths) < 10, lengths  # holes of several sizes were skipped
    later = sum(len(t.prompt_ids) for c in got for t in c.turns[2:])
    cached = sum(len(c.turns[k - 2].prompt_ids) + len(c.turns[k - 2].completion_ids) - 1 for c in got for k in (2, 3))
    assert fast.timing["reused_tokens"] == cached > 0.6 * later
    assert fast.timing["prompt_tokens"] == sum(len(t.prompt_ids) for c in got for t in c.turns)


def test_a_lane_starts_afresh_after_new_weights_or_other_prompts(peft_model, qwen_tokenizer):
    fast = FastGenerator(peft_model, qwen_tokenizer)
    prompts = chat_prompts(qwen_tokenizer, 3)
    first = fast.generate(prompts, [True] * 3, GREEDY, lane="A")
    longer = [p + c + [7, 8] for p, c in zip(prompts, first, strict=True)]
    fast.sync_weights()  # the cached K/V belong to the old weights
    assert fast.generate(longer, [True] * 3, GREEDY, lane="A") == PlainGenerator(peft_model, qwen_tokenizer).generate(
        longer, [True] * 3, GREEDY
    )
    assert fast.timing["reused_tokens"] == 0
    fast.generate(prompts, [True] * 3, GREEDY, lane="A")
    other = [[9] + p for p in longer]  # no row continues its cached tokens
    fast.generate(other, [True] * 3, GREEDY, lane="A")
    assert fast.timing["reused_tokens"] == 0
    fast.generate(prompts, [True] * 3, GREEDY, lane="A")
    mixed = [longer[0], other[1], longer[2]]  # rows 0 and 2 continue, row 1 is prefilled whole
    want = PlainGenerator(peft_model, qwen_tokenizer).generate(mixed, [True] * 3, GREEDY)
    assert fast.generate(mixed, [True] * 3, GREEDY, lane="A") == want
    assert fast.timing["reused_tokens"] == sum(
        len(p) + len(c) - 1 for i, (p, c) in enumerate(zip(prompts, first)) if i != 1
    )


def test_both_weight_sets_decode_together_on_their_own_buffers(peft_model, qwen_tokenizer):
    """Adapter and base rows of one call: two batches stepped in turn (on a GPU, on two streams), each with
    its own cache, split counters and (on a GPU) graph pool, giving what each set gives alone."""
    fast = FastGenerator(peft_model, qwen_tokenizer)
    prompts = chat_prompts(qwen_tokenizer, 4)
    together = fast.generate(prompts, [True, False] * 2, GREEDY)
    alone = [fast.generate([p], [on], GREEDY)[0] for p, on in zip(prompts, [True, False] * 2, strict=True)]
    assert together == alone
    on, off = fast._slots[(2, (None, "default"))], fast._slots[(2, (None, None))]
    assert on.k.data_ptr() != off.k.data_ptr() and on.counters.data_ptr() != off.counters.data_ptr()
    assert fast.timing["decode_steps"] == 2 * (GREEDY.max_new_tokens - 1) + 4 * (GREEDY.max_new_tokens - 1)
