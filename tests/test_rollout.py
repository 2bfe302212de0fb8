"""Tests for talkmethods.rollout: batched A1 B1 A2 B2 chats on the offline tiny Qwen2.

What is pinned: turn order; each seat's prompt is exactly its own view (own facts, shared question,
partner's messages as ``user``) and never the partner's private facts; completions are kept as exact
token ids that decode to the turn text and stop at the first EOS; one generate call per turn for all
chats; adapter routing per seat in mixed batches (a base seat is the base model, token for token);
grading of the final messages only.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_problems

from talkmethods.dialogue import OPENING_LINE, system_prompt
from talkmethods.engines.plain import BASE_ADAPTER, PlainGenerator
from talkmethods.engines.sampling import Sampling
from talkmethods.models import ModelSpec, load_model
from talkmethods.rollout import Turn, judge_by_gold, play_chats
from talkmethods.training.build import LORA_TARGETS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPEC = ModelSpec("offline-tiny-qwen2")
IM_END, ENDOFTEXT = 151645, 151643
MAX_NEW = 6
# Chat k's seats cycle through every (A adapter, B adapter) combination, so every turn's batch mixes
# adapter-on and adapter-off rows.
SEAT_CYCLE = [(True, True), (True, False), (False, True), (False, False)]


def seats_for(n):
    return [SEAT_CYCLE[k % 4] for k in range(n)]


def chat_inputs(n_problems=8, per_problem=4):
    probs = tiny_problems(n_problems)
    flat = [p for p in probs for _ in range(per_problem)]
    return flat, seats_for(len(flat))


@pytest.fixture(scope="module")
def base_model():
    model = load_model(SPEC, torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="module")
def peft_model(one_torch_thread):
    """The tiny model with a LoRA adapter whose B matrices are random, so the adapter really acts."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1234)  # LoRA A's init draws from the global RNG
    model = get_peft_model(
        load_model(SPEC, torch.float32),
        LoraConfig(r=8, lora_alpha=16, target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM"),
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model.eval()
    return model


class CountingGenerator:
    """Wraps a generator; records every ``generate`` call (prompts, adapter flags)."""

    eos_ids: list[int] = []  # the inner engine's stop tokens are not passed on
    reuses_turns = False
    last_logprobs = None

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[list[list[int]], list[bool]]] = []

    def generate(self, prompts, adapter_on, sampling):
        self.calls.append(([list(p) for p in prompts], list(adapter_on)))
        return self.inner.generate(prompts, adapter_on, sampling)


@pytest.fixture(scope="module")
def sampled(peft_model, qwen_tokenizer):
    """32 chats (8 problems x 4), sampled at temperature 1, seats cycling through all combinations."""
    flat, seats = chat_inputs()
    gen = CountingGenerator(PlainGenerator(peft_model, qwen_tokenizer))
    model_calls = []
    original = peft_model.generate

    def spy(*args, **kwargs):
        model_calls.append(kwargs.get("adapter_names"))
        return original(*args, **kwargs)

    peft_model.generate = spy
    try:
        torch.manual_seed(5)
        chats, stats = play_chats(gen, qwen_tokenizer, flat, seats, Sampling(max_new_tokens=MAX_NEW))
    finally:
        del peft_model.generate  # back to the class method
    return chats, stats, gen, model_calls, seats


def expected_prompt_ids(tokenizer, problem, turn_index, history_texts):
    """The prompt a seat must see, built here from the design (not from dialogue.seat_messages)."""
    seat = "AB"[turn_index % 2]
    own = problem["facts_a"] if seat == "A" else problem["facts_b"]
    messages = [{"role": "system", "content": system_prompt(seat, own, problem["shared_question"])}]
    if seat == "A":
        messages.append({"role": "user", "content": OPENING_LINE})
    for i, text in enumerate(history_texts):
        spoken_by_self = (i % 2) == (turn_index % 2)
        messages.append({"role": "assistant" if spoken_by_self else "user", "content": text})
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


# ------------------------------------------------------------------------ structure of the chats


def test_turn_order_and_seats(sampled):
    chats, _, _, _, seats = sampled
    assert len(chats) == 32
    for chat, (a_on, b_on) in zip(chats, seats):
        assert [t.seat for t in chat.turns] == ["A", "B", "A", "B"]
        assert [t.adapter_on for t in chat.turns] == [a_on, b_on, a_on, b_on]
        assert (chat.a_adapter, chat.b_adapter) == (a_on, b_on)


def test_all_chats_of_a_turn_go_through_one_generate_call(sampled):
    chats, _, gen, model_calls, seats = sampled
    assert len(gen.calls) == 4, "one generator call per turn (A1, B1, A2, B2), all 32 chats batched"
    for k, (prompts, adapter_on) in enumerate(gen.calls):
        assert len(prompts) == 32
        assert adapter_on == [s[k % 2] for s in seats]
        assert prompts == [c.turns[k].prompt_ids for c in chats]
    # ...and underneath, one model.generate per turn, routing every row to its own adapter.
    assert len(model_calls) == 4
    for k, names in enumerate(model_calls):
        assert names == ["default" if s[k % 2] else BASE_ADAPTER for s in seats]


def test_each_prompt_is_exactly_the_seats_own_view(sampled, qwen_tokenizer):
    """First prompts are the template's; a second prompt keeps the seat's own first message token for token."""
    chats, _, _, _, _ = sampled
    newline = qwen_tokenizer.encode("\n")
    for chat in chats:
        history = [t.text for t in chat.turns]
        for k, turn in enumerate(chat.turns):
            rendered = expected_prompt_ids(qwen_tokenizer, chat.problem, k, history[:k])
            if k < 2:
                assert turn.prompt_ids == rendered
                continue
            own = chat.turns[k - 2]
            sampled_ids = (
                own.completion_ids[:-1] if own.completion_ids[-1:] in ([IM_END], [ENDOFTEXT]) else own.completion_ids
            )
            head = own.prompt_ids + sampled_ids + [IM_END] + newline
            assert turn.prompt_ids[: len(head)] == head
            # the partner's reply and the generation prompt, exactly as the template renders them
            partner = qwen_tokenizer.encode(f"<|im_start|>user\n{history[k - 1]}<|im_end|>\n<|im_start|>assistant\n")
            assert turn.prompt_ids[len(head) :] == partner == rendered[len(rendered) - len(partner) :]


def test_with_canonical_tokens_every_prompt_is_the_templates_rendering(qwen_tokenizer):
    """When the sampled tokens are the tokenizer's own split of the text, token-for-token prompts change nothing."""
    problem = tiny_problems(1)[0]
    script = [
        lambda i: f"Zorblax has 17 pebbles, says row {i}.",
        lambda i: "Quimby has 29.\n\nOk  then",
        lambda i: "So \\boxed{46}.",
        lambda i: "b2: 3.5 $ ✓",
    ]
    chats, _ = play_chats(
        ScriptedGenerator(qwen_tokenizer, script),
        qwen_tokenizer,
        [problem] * 3,
        [(True, True)] * 3,
        Sampling(max_new_tokens=32),
    )
    for chat in chats:
        history = [t.text for t in chat.turns]
        for k, turn in enumerate(chat.turns):
            assert turn.prompt_ids == expected_prompt_ids(qwen_tokenizer, chat.problem, k, history[:k])


def test_a_seat_continues_its_own_non_canonical_tokens(qwen_tokenizer):
    """A message sampled as an odd split of its text reaches the seat's next prompt as sampled, not re-tokenised."""
    problem = tiny_problems(1)[0]
    odd = [qwen_tokenizer.convert_tokens_to_ids(c) for c in "hello"]  # h e l l o, one token each
    assert qwen_tokenizer.encode("hello") != odd

    class Odd(ScriptedGenerator):
        def generate(self, prompts, adapter_on, sampling):
            out = super().generate(prompts, adapter_on, sampling)
            return [odd + [IM_END] for _ in out] if self.turn == 1 else out

    chats, _ = play_chats(
        Odd(qwen_tokenizer, [lambda i: "x"] * 4),
        qwen_tokenizer,
        [problem],
        [(True, True)],
        Sampling(max_new_tokens=32),
    )
    a1, a2 = chats[0].turns[0], chats[0].turns[2]
    assert a1.text == "hello"
    assert a2.prompt_ids[: len(a1.prompt_ids) + len(odd) + 1] == a1.prompt_ids + odd + [IM_END]


def test_a_seat_never_sees_the_partners_private_facts(sampled, qwen_tokenizer):
    chats, _, _, _, _ = sampled
    for chat in chats:
        p = chat.problem
        for turn in chat.turns:
            shown = qwen_tokenizer.decode(turn.prompt_ids)
            own, partner = (p["facts_a"], p["facts_b"]) if turn.seat == "A" else (p["facts_b"], p["facts_a"])
            assert p["shared_question"] in shown
            for fact in own:
                assert fact in shown
            for fact in partner:
                assert fact not in shown
            # Nor any piece of them (the names are in the shared question, the phrases are not).
            for phrase in ["Quimby has", "rivers"] if turn.seat == "A" else ["Zorblax has", "jars"]:
                assert phrase not in shown


def test_partner_messages_reach_the_prompt_as_user_turns(sampled, qwen_tokenizer):
    chats, _, _, _, _ = sampled
    chat = chats[0]
    a2 = qwen_tokenizer.decode(chat.turns[2].prompt_ids)
    b1_text = chat.turns[1].text
    a1_text = chat.turns[0].text
    assert f"<|im_start|>user\n{b1_text}<|im_end|>" in a2
    assert f"<|im_start|>assistant\n{a1_text}<|im_end|>" in a2
    b2 = qwen_tokenizer.decode(chat.turns[3].prompt_ids)
    assert f"<|im_start|>user\n{chat.turns[2].text}<|im_end|>" in b2
    assert b2.endswith("<|im_start|>assistant\n")


def test_completion_ids_decode_to_the_turn_text(sampled, qwen_tokenizer):
    chats, _, _, _, _ = sampled
    for chat in chats:
        for turn in chat.turns:
            assert qwen_tokenizer.decode(turn.completion_ids, skip_special_tokens=True) == turn.text


def test_stats_count_turns_and_tokens(sampled):
    chats, stats, _, _, _ = sampled
    assert stats["turns"] == 128
    assert stats["completion_tokens"] == sum(len(t.completion_ids) for c in chats for t in c.turns)
    assert stats["longest_prompt"] == max(len(t.prompt_ids) for c in chats for t in c.turns)


def check_eos_trimming(chats, max_new):
    ended = full = 0
    for chat in chats:
        for turn in chat.turns:
            ids = turn.completion_ids
            assert 1 <= len(ids) <= max_new
            assert not any(t in (IM_END, ENDOFTEXT) for t in ids[:-1]), "tokens after the first EOS"
            if ids[-1] in (IM_END, ENDOFTEXT):
                ended += 1
            else:
                assert len(ids) == max_new, "a completion without EOS must be max_new_tokens long"
                full += 1
    return ended, full


def test_completions_end_at_eos_or_max_new_tokens(sampled):
    chats, _, _, _, _ = sampled
    check_eos_trimming(chats, MAX_NEW)


def test_completions_stop_at_the_first_eos_when_the_model_emits_it(base_model, qwen_tokenizer):
    """A model that says <|im_end|> ~30% of the time: some turns end early, some run to the cap."""
    hook = base_model.get_output_embeddings().register_forward_hook(
        lambda module, inputs, logits: logits.index_add(
            -1, torch.tensor([IM_END]), torch.full((*logits.shape[:-1], 1), 11.0)
        )
    )
    try:
        flat, _ = chat_inputs(4, 4)
        torch.manual_seed(3)
        chats, _ = play_chats(
            PlainGenerator(base_model, qwen_tokenizer),
            qwen_tokenizer,
            flat,
            [(False, False)] * len(flat),
            Sampling(max_new_tokens=MAX_NEW),
        )
    finally:
        hook.remove()
    ended, full = check_eos_trimming(chats, MAX_NEW)
    assert ended > 0 and full > 0, (ended, full)  # both branches were exercised
    for chat in chats:
        for turn in chat.turns:
            assert qwen_tokenizer.decode(turn.completion_ids, skip_special_tokens=True) == turn.text


def test_trim_cuts_after_the_first_eos(base_model, qwen_tokenizer):
    gen = PlainGenerator(base_model, qwen_tokenizer)
    rows = torch.tensor([[5, IM_END, 7, 8], [1, 2, 3, 4], [ENDOFTEXT, 9, IM_END, 9]])
    assert gen._trim(rows) == [[5, IM_END], [1, 2, 3, 4], [ENDOFTEXT]]


def test_adapter_requested_on_a_model_without_one_is_an_error(base_model, qwen_tokenizer):
    gen = PlainGenerator(base_model, qwen_tokenizer)
    with pytest.raises(ValueError, match="no adapter"):
        gen.generate([[1, 2, 3]], [True], Sampling(max_new_tokens=2))


# ---------------------------------------------------------------- adapter on / off, per seat


def left_pad(prompts, pad_id):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


def test_base_rows_of_a_mixed_batch_are_the_base_model_logits(sampled, peft_model, base_model, qwen_tokenizer):
    chats, _, _, _, _ = sampled
    prompts = [c.turns[3].prompt_ids for c in chats[:8]]  # B2 prompts of 8 chats
    names = ["default", BASE_ADAPTER] * 4
    ids, mask = left_pad(prompts, qwen_tokenizer.pad_token_id)
    with torch.no_grad():
        mixed = peft_model(input_ids=ids, attention_mask=mask, adapter_names=names, logits_to_keep=1).logits
        adapter = peft_model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits
        base = base_model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits
    for i, name in enumerate(names):
        if name == BASE_ADAPTER:
            torch.testing.assert_close(mixed[i], base[i], rtol=1e-4, atol=1e-4)
        else:
            torch.testing.assert_close(mixed[i], adapter[i], rtol=1e-4, atol=1e-4)
            # The adapter really changes the output (else the base check above proves nothing).
            assert (adapter[i] - base[i]).abs().max() > 0.1


def greedy_chats(model, tokenizer, flat, seats):
    torch.manual_seed(0)
    chats, _ = play_chats(
        PlainGenerator(model, tokenizer), tokenizer, flat, seats, Sampling(max_new_tokens=4, top_k=1)
    )
    return chats


def assert_each_turn_is_its_seats_model(chats, peft_model, base_model):
    """Teacher-forced: each completion token is the argmax of the model that seat should run."""
    matched_wrong = 0
    with torch.no_grad():
        for chat in chats:
            for turn in chat.turns:
                ids = torch.tensor([turn.prompt_ids + turn.completion_ids])
                keep = len(turn.completion_ids) + 1
                on = peft_model(input_ids=ids, logits_to_keep=keep).logits[0, :-1].argmax(-1).tolist()
                off = base_model(input_ids=ids, logits_to_keep=keep).logits[0, :-1].argmax(-1).tolist()
                right, wrong = (on, off) if turn.adapter_on else (off, on)
                assert turn.completion_ids == right, f"seat {turn.seat} adapter_on={turn.adapter_on}"
                matched_wrong += turn.completion_ids == wrong
    # The two models disagree on (nearly) every turn, so the check above discriminates.
    n = sum(len(c.turns) for c in chats)
    assert matched_wrong <= n // 10, (matched_wrong, n)


def test_greedy_mixed_batch_each_seat_runs_its_own_model(peft_model, base_model, qwen_tokenizer):
    flat, seats = chat_inputs(4, 4)  # every turn's batch mixes adapter-on and adapter-off rows
    chats = greedy_chats(peft_model, qwen_tokenizer, flat, seats)
    assert_each_turn_is_its_seats_model(chats, peft_model, base_model)


def test_greedy_base_b_partner_whole_batch(peft_model, base_model, qwen_tokenizer):
    """Trained A x base B: A turns run the adapter for every row, B turns disable it for every row."""
    flat, _ = chat_inputs(2, 4)
    chats = greedy_chats(peft_model, qwen_tokenizer, flat, [(True, False)] * len(flat))
    assert [t.adapter_on for t in chats[0].turns] == [True, False, True, False]
    assert_each_turn_is_its_seats_model(chats, peft_model, base_model)
    # disable_adapter() was a context: the adapter is back on afterwards.
    ids = torch.tensor([chats[0].turns[0].prompt_ids])
    with torch.no_grad():
        after = peft_model(input_ids=ids, logits_to_keep=1).logits
        base = base_model(input_ids=ids, logits_to_keep=1).logits
    assert (after - base).abs().max() > 0.1


# ------------------------------------------------------------------------------------ grading


def test_judge_by_gold_reads_the_box():
    turn = Turn(seat="A", adapter_on=True, prompt_ids=[], completion_ids=[], text="\\boxed{46}")
    assert judge_by_gold(turn, {"gold": "46"}) is True
    assert judge_by_gold(turn, {"gold": "47"}) is False
    no_box = Turn(seat="B", adapter_on=True, prompt_ids=[], completion_ids=[], text="46")
    assert judge_by_gold(no_box, {"gold": "46"}) is False


class ScriptedGenerator:
    """Returns fixed messages: call k (turn k) gives row i the text script[k](i), then <|im_end|>."""

    eos_ids: list[int] = []
    reuses_turns = False
    last_logprobs = None

    def __init__(self, tokenizer, script):
        self.tokenizer = tokenizer
        self.script = script
        self.turn = 0

    def generate(self, prompts, adapter_on, sampling):
        texts = [self.script[self.turn](i) for i in range(len(prompts))]
        self.turn += 1
        return [self.tokenizer.encode(t) + [IM_END] for t in texts]


def test_only_the_final_messages_are_graded_and_the_team_reward(qwen_tokenizer):
    problem = tiny_problems(1)[0]  # gold 46
    script = [
        lambda i: "I think it is \\boxed{46}" if i == 3 else f"Zorblax has 17 pebbles, says row {i}.",  # A1
        lambda i: "\\boxed{46}" if i == 3 else "Quimby has 29.",  # B1
        lambda i: "So \\boxed{46}." if i in (0, 1) else "\\boxed{45}",  # A2
        lambda i: "\\boxed{46}" if i in (0, 2) else "no idea",  # B2
    ]
    chats, _ = play_chats(
        ScriptedGenerator(qwen_tokenizer, script),
        qwen_tokenizer,
        [problem] * 4,
        [(True, True)] * 4,
        Sampling(max_new_tokens=32),
    )
    assert [(c.a_right, c.b_right) for c in chats] == [(True, True), (True, False), (False, True), (False, False)]
    assert [c.reward for c in chats] == [1.0, 0.5, 0.5, 0.0]  # row 3's early boxes do not count
    # The partner's words reach the prompt; A's private facts only through what A said.
    assert "Zorblax has 17 pebbles, says row 0." in qwen_tokenizer.decode(chats[0].turns[1].prompt_ids)
    assert chats[0].turns[2].text == "So \\boxed{46}."


def test_custom_judge_sees_the_final_turns(qwen_tokenizer):
    problem = tiny_problems(1)[0]
    seen = []

    def judge(turn, prob):
        seen.append((turn.seat, turn.text, prob["id"]))
        return turn.seat == "A"

    script = [lambda i: "a1", lambda i: "b1", lambda i: "a2", lambda i: "b2"]
    chats, _ = play_chats(
        ScriptedGenerator(qwen_tokenizer, script),
        qwen_tokenizer,
        [problem],
        [(True, True)],
        Sampling(max_new_tokens=8),
        judge,
    )
    assert seen == [("A", "a2", "p0"), ("B", "b2", "p0")]
    assert chats[0].reward == 0.5


def test_one_batched_tokenizer_call_gives_each_seats_own_prompt(sampled, qwen_tokenizer):
    """``seat_prompts`` (one batched encode for a whole turn) builds what ``seat_prompt`` builds seat by seat."""
    from talkmethods.dialogue import seat_messages
    from talkmethods.rollout import seat_prompt, seat_prompts

    chats, _, _, _, _ = sampled
    stops = {IM_END, ENDOFTEXT}
    for k in range(4):
        seats = [
            (seat_messages(c.problem, k, [t.text for t in c.turns[:k]]), c.turns[k - 2] if k >= 2 else None)
            for c in chats
        ]
        batched = seat_prompts(qwen_tokenizer, seats, stops)
        assert batched == [seat_prompt(qwen_tokenizer, m, own, stops) for m, own in seats]
        assert batched == [c.turns[k].prompt_ids for c in chats]
