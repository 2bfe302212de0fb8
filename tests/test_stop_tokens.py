"""Real stop tokens, said by the model itself, in every rollout engine.

Other tests make turns end by declaring extra stop ids or by pushing ``<|im_end|>`` up with a
forward hook, which the fast engine never sees (it reads the weights). Here the tiny model is
taught, by a few dozen Adam steps on a LoRA adapter, to end each of its turns on its own under
greedy sampling, at a length planned per chat and turn: with ``<|im_end|>`` (151645), with
``<|endoftext|>`` (151643) or not at all (the cap), after 0 to 7 words, so the rows of one batch
stop at different steps; base-seat turns (the random model) run to the cap. Every engine (``plain``,
``loop``, ``fast`` in its CPU form and, under Triton's interpreter, with its attention and sampling
kernels) must then play exactly the planned chats, emit nothing after a stop, rebuild each seat's
next prompt from the real tokens, report the log-probs of a fresh forward, and give the trainer
rows that score the stop token and nothing after it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from talkmethods.dialogue import seat_messages
from talkmethods.engines import ENGINES
from talkmethods.engines.sampling import Sampling
from talkmethods.models import ModelSpec, load_model
from talkmethods.rollout import Chat, Turn, play_chats
from talkmethods.training.build import LORA_TARGETS
from talkmethods.training.rows import pad_rows, to_rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IM_END, ENDOFTEXT = 151645, 151643
STOPS = (IM_END, ENDOFTEXT)
CAP = 8
GREEDY = Sampling(max_new_tokens=CAP, top_k=1)
LOGIT_SCALE = 20.0  # on the final norm: a random width-64 model's logits span about ±1, too flat to train a sure pick
NAMES = ["Zorblax", "Quimby", "Mervolt", "Tasselink", "Brindle", "Okapo", "Wendrake", "Plumtide"]
PROBLEMS = [
    {
        "id": f"s{i}",
        "facts_a": [f"{NAMES[2 * i]} has {11 + i} shells."],
        "facts_b": [f"{NAMES[2 * i + 1]} has {20 + i} shells."],
        "shared_question": f"How many shells do {NAMES[2 * i]} and {NAMES[2 * i + 1]} have?",
        "gold": str(31 + 2 * i),
        "prompt_style": "short",
    }
    for i in range(4)
]
FLAT = [p for p in PROBLEMS for _ in range(2)]  # chats 2p and 2p+1 play problem p: A1's prompt is the same
SEATS = [(True, True), (True, False)] * 4  # B is a base seat in every other chat
# Per turn and chat: (words said, then the stop; None: no stop, the turn runs to the cap); None for a base seat.
PLAN = [
    [(2, IM_END), (2, IM_END), (CAP, None), (CAP, None), (5, ENDOFTEXT), (5, ENDOFTEXT), (0, IM_END), (0, IM_END)],
    [(1, ENDOFTEXT), None, (4, IM_END), None, (7, ENDOFTEXT), None, (CAP, None), None],
    [
        (3, ENDOFTEXT),
        (0, ENDOFTEXT),
        (6, ENDOFTEXT),
        (7, IM_END),
        (1, IM_END),
        (5, ENDOFTEXT),
        (2, IM_END),
        (CAP, None),
    ],
    [(4, ENDOFTEXT), None, (2, IM_END), None, (0, ENDOFTEXT), None, (7, IM_END), None],
]


def single_token_words(tok) -> list[int]:
    """Ids of short lower-case words that are one token each (`` file``, `` would``, ...)."""
    return [i for i in range(1000, 6000) if re.fullmatch(r" [a-z]{4,8}", tok.decode([i]))]


def planned_completion(words: list[int], turn: int, chat: int) -> list[int]:
    n, stop = PLAN[turn][chat]
    assert n + (stop is not None) <= CAP and (stop is not None or n == CAP)
    block = chat - chat % 2 if turn == 0 else chat  # the two chats of a problem share A1's prompt, so its words
    return words[64 * turn + 8 * block : 64 * turn + 8 * block + n] + ([stop] if stop is not None else [])


def build_model(lora: dict[str, torch.Tensor] | None = None):
    """The tiny Qwen2 made able to end a turn, with a fresh (or the given) LoRA adapter.

    Its ``<|endoftext|>`` row of the tied embedding is the zero padding row (``padding_idx``), whose
    logit is 0 whatever the context: the model could never say it. A real checkpoint's row is not.
    """
    from peft import LoraConfig, get_peft_model

    base = load_model(ModelSpec("offline-tiny-qwen2"), torch.float32)
    with torch.no_grad():
        base.model.norm.weight.mul_(LOGIT_SCALE)
        base.model.embed_tokens.weight[ENDOFTEXT] = (
            torch.randn(base.config.hidden_size, generator=torch.Generator().manual_seed(1)) * 0.02
        )
    torch.manual_seed(0)  # LoRA A's init
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=list(LORA_TARGETS)))
    if lora is not None:
        assert not model.load_state_dict(lora, strict=False).unexpected_keys
    return model.eval()


class Planned:
    """An engine that says the plan in adapter rows; base rows are the base model's greedy tokens."""

    reuses_turns = False
    last_logprobs = None

    def __init__(self, model, tok, words):
        self.base = ENGINES["plain"](model, tok)
        self.eos_ids, self.words, self.turn = self.base.eos_ids, words, 0

    def generate(self, prompts, adapter_on, sampling):
        said = self.base.generate(prompts, [False] * len(prompts), sampling)
        out = [
            planned_completion(self.words, self.turn, i) if on else b
            for i, (on, b) in enumerate(zip(adapter_on, said))
        ]
        self.turn += 1
        return out


def train_to_plan(model, chats, max_steps: int = 200, margin: float = 2.0) -> int:
    """Adam on the adapter until every planned token (stops included) is the greedy pick by ``margin`` logits.

    Returns the steps taken (a few dozen). The margin keeps the greedy picks of every engine the same
    whatever their float rounding.
    """
    data = [(t.prompt_ids, t.completion_ids) for c in chats for t in c.turns if t.adapter_on]
    width = max(len(p) + len(c) for p, c in data)
    ids = torch.full((len(data), width), ENDOFTEXT)
    mask = torch.zeros_like(ids)
    where, target = [], []
    for i, (p, c) in enumerate(data):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        mask[i, : len(p) + len(c)] = 1
        where += [(i, len(p) - 1 + j) for j in range(len(c))]
        target += c
    rows, cols = torch.tensor(where).T
    target = torch.tensor(target)
    inner = model.get_base_model()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for step in range(max_steps):
        # the LM head on the completion positions only: the 151,936-wide head is most of the cost
        hidden = inner.model(input_ids=ids, attention_mask=mask).last_hidden_state[rows, cols]
        logits = hidden @ inner.lm_head.weight.T
        with torch.no_grad():
            top = logits.topk(2, dim=-1)
            sure = (top.indices[:, 0] == target) & (top.values[:, 0] - top.values[:, 1] > margin)
            if bool(sure.all()):
                model.eval()
                return step
        opt.zero_grad()
        F.cross_entropy(logits, target).backward()
        opt.step()
    raise AssertionError(f"the adapter did not learn the plan in {max_steps} steps")


@pytest.fixture(scope="module")
def trained(one_torch_thread, qwen_tokenizer):
    """The model taught the plan, the planned chats, and its adapter weights."""
    words = single_token_words(qwen_tokenizer)
    assert len(words) >= 4 * 64
    model = build_model()
    plan, _ = play_chats(Planned(model, qwen_tokenizer, words), qwen_tokenizer, FLAT, SEATS, GREEDY)
    train_to_plan(model, plan)
    lora = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
    return model, plan, lora


# The interpreter runs a kernel program at a time: greedy, two chats whose rows stop at different steps; sampled
# (plain sampling) and eval (eval's sampling: temperature 0.7, top-k 20, top-p 0.8), one each.
TRITON_CHATS = {"greedy": [0, 2], "sampled": [0], "eval": [0]}
EVAL_SAMPLING = Sampling(max_new_tokens=CAP, temperature=0.7, top_k=20, top_p=0.8)
TRITON_RUN = """
import json, sys, torch
from talkmethods.engines import ENGINES
from talkmethods.engines.sampling import Sampling
from talkmethods.models import ModelSpec, load_tokenizer
from talkmethods.rollout import play_chats
from tests.test_stop_tokens import CAP, EVAL_SAMPLING, FLAT, GREEDY, SEATS, TRITON_CHATS, build_model
torch.set_num_threads(1)
tok = load_tokenizer(ModelSpec("offline-tiny-qwen2"))
model = build_model(torch.load(sys.argv[1]))
out = {}
for name, sampling in [("greedy", GREEDY), ("sampled", Sampling(max_new_tokens=CAP)), ("eval", EVAL_SAMPLING)]:
    fast = ENGINES["fast"](model, tok)
    assert fast._auto_form(1) == "triton"
    torch.manual_seed(0)
    which = TRITON_CHATS[name]
    chats, _ = play_chats(fast, tok, [FLAT[i] for i in which], [SEATS[i] for i in which], sampling)
    out[name] = {"turns": [[t.__dict__ for t in c.turns] for c in chats], "reused": fast.timing["reused_tokens"]}
print("JSON" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def played(trained, qwen_tokenizer, tmp_path_factory):
    """Per run: the chats played, the indices of their chats in the plan, and the fast engine's reused K/V tokens.

    ``plain``, ``loop`` and ``fast`` (its CPU form) play every chat here; ``fast-triton`` plays two under
    Triton's interpreter (its attention kernel; a fresh process, as the interpreter is switched on before
    ``triton`` is imported), greedy, ``fast-triton-sampled`` one at
    temperature 1, through the plain-sampling kernels, and ``fast-triton-eval`` one on eval's sampling,
    through the top-k/top-p kernels.
    """
    model, _, lora = trained
    runs = {}
    for name in ("plain", "loop", "fast"):
        gen = ENGINES[name](model, qwen_tokenizer)
        chats, _ = play_chats(gen, qwen_tokenizer, FLAT, SEATS, GREEDY)
        runs[name] = (chats, list(range(len(FLAT))), getattr(gen, "timing", {}).get("reused_tokens"))
    if _has_triton():
        path = tmp_path_factory.mktemp("stop_tokens") / "lora.pt"
        torch.save(lora, path)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root)
        out = subprocess.run(
            [sys.executable, "-c", TRITON_RUN, str(path)],
            env=env,
            cwd=root,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout.split("JSON", 1)[1])
        for name, key in (("greedy", "fast-triton"), ("sampled", "fast-triton-sampled"), ("eval", "fast-triton-eval")):
            chats = [
                Chat(problem=FLAT[i], a_adapter=SEATS[i][0], b_adapter=SEATS[i][1], turns=[Turn(**t) for t in turns])
                for i, turns in zip(TRITON_CHATS[name], got[name]["turns"], strict=True)
            ]
            runs[key] = (chats, TRITON_CHATS[name], got[name]["reused"])
    return runs


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


GREEDY_RUNS = ["plain", "loop", "fast", "fast-triton"]
SAMPLED_RUNS = ["fast-triton-sampled", "fast-triton-eval"]  # drawn, not greedy: no plan to compare with
ALL_RUNS = GREEDY_RUNS + SAMPLED_RUNS
TEMPERATURE = {"fast-triton-eval": EVAL_SAMPLING.temperature}  # a rollout's log-probs are under softmax(logits / T)


def run_of(played, run):
    if run not in played:
        pytest.skip("triton is not installed: no interpreted kernels")
    return played[run]


def chats_of(played, run):
    return run_of(played, run)[0]


def ends(turn: Turn) -> int | None:
    """The stop a turn ended with, or None (it ran to the cap)."""
    return turn.completion_ids[-1] if turn.completion_ids and turn.completion_ids[-1] in STOPS else None


@pytest.mark.parametrize("run", ALL_RUNS)
def test_a_turn_ends_at_its_first_stop_and_nothing_follows(played, qwen_tokenizer, run):
    """A completion holds at most one stop, as its last token; without one it is ``max_new_tokens`` long."""
    chats = chats_of(played, run)
    for chat in chats:
        for turn in chat.turns:
            ids = turn.completion_ids
            assert 1 <= len(ids) <= CAP
            assert [j for j, t in enumerate(ids) if t in STOPS] in ([], [len(ids) - 1]), ids
            assert ends(turn) is not None or len(ids) == CAP
            assert turn.text == qwen_tokenizer.decode(ids, skip_special_tokens=True)
    kinds = Counter(ends(t) for c in chats for t in c.turns)
    if run in SAMPLED_RUNS:  # drawn: the adapter's picks are likely (seeded), not sure
        assert kinds[IM_END] and kinds[ENDOFTEXT], kinds  # both drawn from the vocabulary's last, ragged chunk
        return
    assert kinds[IM_END] >= 2 and kinds[ENDOFTEXT] >= 2 and kinds[None] >= 1, kinds
    for k in range(4):  # in every turn's batch, rows stop at different steps, and before the cap
        lengths = [len(c.turns[k].completion_ids) for c in chats]
        assert len(set(lengths)) >= 2 and min(lengths) < CAP, (k, lengths)


@pytest.mark.parametrize("run", GREEDY_RUNS)
def test_every_engine_plays_the_planned_chats_token_for_token(trained, played, run):
    """Greedy, adapter turns say the plan and base turns the base model's picks: every engine plays the same chats."""
    got, which, _ = run_of(played, run)
    plan = [trained[1][i] for i in which]
    assert [[(t.seat, t.adapter_on, t.prompt_ids, t.completion_ids) for t in c.turns] for c in got] == [
        [(t.seat, t.adapter_on, t.prompt_ids, t.completion_ids) for t in c.turns] for c in plan
    ]


@pytest.mark.parametrize("run", ALL_RUNS)
def test_a_seats_next_prompt_is_rebuilt_from_its_real_tokens(played, qwen_tokenizer, run):
    """A seat's second prompt holds its first message token for token, the sampled stop given way to the
    template's ``<|im_end|>`` (an ``<|endoftext|>`` too: ChatML closes a message with ``<|im_end|>``)."""
    chats = chats_of(played, run)
    tok = qwen_tokenizer
    after = Counter()
    for chat in chats:
        texts = [t.text for t in chat.turns]
        for k, turn in enumerate(chat.turns):
            assert ENDOFTEXT not in turn.prompt_ids
            if k < 2:
                want = tok.apply_chat_template(
                    seat_messages(chat.problem, k, texts[:k]),
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
                assert turn.prompt_ids == list(want)
                continue
            own, partner = chat.turns[k - 2], chat.turns[k - 1]
            said = own.completion_ids[:-1] if ends(own) is not None else own.completion_ids
            reply = tok.encode("\n") + tok.encode(
                f"<|im_start|>user\n{partner.text}<|im_end|>\n<|im_start|>assistant\n"
            )
            assert turn.prompt_ids == own.prompt_ids + said + [IM_END] + reply, (run, k)
            after[ends(own)] += 1
    if run not in SAMPLED_RUNS:
        assert after[IM_END] and after[ENDOFTEXT] and after[None], after  # each kind of end was continued


@pytest.mark.parametrize("run", ["loop", "fast", "fast-triton", *SAMPLED_RUNS])
def test_rollout_log_probs_are_a_fresh_forwards(trained, played, run):
    """The engines that score their tokens give each one, the stop included, its log-prob under a plain forward."""
    model = trained[0]
    chats = chats_of(played, run)
    for chat in chats:
        for turn in chat.turns:
            ids = torch.tensor([turn.prompt_ids + turn.completion_ids])
            with torch.no_grad():
                if turn.adapter_on:
                    logits = model(ids).logits
                else:
                    with model.disable_adapter():
                        logits = model(ids).logits
            ref = (logits[0, len(turn.prompt_ids) - 1 : -1] / TEMPERATURE.get(run, 1.0)).log_softmax(-1)
            ref = ref.gather(-1, torch.tensor(turn.completion_ids)[:, None])[:, 0]
            assert len(turn.logprobs) == len(turn.completion_ids)
            assert torch.allclose(torch.tensor(turn.logprobs), ref, atol=1e-4), (run, turn.logprobs, ref)


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("run", GREEDY_RUNS)
def test_training_rows_score_the_stop_and_nothing_after_it(played, qwen_tokenizer, run, pack):
    """The loss scores each trained turn's tokens, its stop included; not the partner's reply inside a packed row,
    and not the padding after a row, although the padding id is ``<|endoftext|>``, a stop id."""
    chats = chats_of(played, run)
    pad_id = qwen_tokenizer.pad_token_id
    assert pad_id == ENDOFTEXT
    rows, row_turns = [], []
    for chat in chats:
        trained = (True, chat.b_adapter, True, chat.b_adapter)
        rows_here = to_rows([chat], [1.0], [trained], pack=pack)
        # to_rows gives a chat's rows in turn order, or seat by seat when it packs
        pending = [t for t, on in zip(chat.turns, trained, strict=True) if on]
        pending = sorted(pending, key=lambda t: t.seat) if pack else pending
        for row in rows_here:
            row_turns.append(pending[: row.turns])
            pending = pending[row.turns :]
        assert not pending
        rows += rows_here
    batch = pad_rows(rows, pad_id, "cpu")
    scored_stops, packed = Counter(), set()
    for i, (row, turns) in enumerate(zip(rows, row_turns, strict=True)):
        n = len(row.completion_ids)
        ids, attended, scored = (batch[k][i].tolist() for k in ("completion_ids", "completion_mask", "tool_mask"))
        assert attended[:n] == [1] * n and attended[n:] == [0] * (len(ids) - n)
        assert scored[n:] == [0] * (len(ids) - n)
        assert [t for t, s in zip(ids, scored, strict=True) if s] == [t for turn in turns for t in turn.completion_ids]
        scored_stops.update(t for t, s in zip(ids, scored, strict=True) if s and t in STOPS)
        if len(turns) == 2:  # packed: the row is what the model read when it said the second turn
            packed.add(id(turns[0]))
            assert row.prompt_ids + row.completion_ids == turns[1].prompt_ids + turns[1].completion_ids
        if "rollout_logps" in batch:
            want = torch.tensor([lp for turn in turns for lp in turn.logprobs])
            assert torch.equal(batch["rollout_logps"][i][torch.tensor(scored, dtype=torch.bool)], want)
    trained_turns = [t for c in chats for t, on in zip(c.turns, (True, c.b_adapter) * 2, strict=True) if on]
    ended = Counter(ends(t) for t in trained_turns)
    assert scored_stops == Counter({s: ended[s] for s in STOPS}) and ended[IM_END] and ended[ENDOFTEXT]
    assert max(len(r.completion_ids) for r in rows) > min(len(r.completion_ids) for r in rows)  # rows were padded
    assert ("rollout_logps" in batch) == (run != "plain")
    # a seat's first turn packs with its second unless it ended on <|endoftext|>: its next prompt has <|im_end|> there
    if pack:
        firsts = Counter()
        for chat in chats:
            for first in chat.turns[: 1 + chat.b_adapter]:
                firsts[ends(first)] += 1
                assert (id(first) in packed) == (ends(first) != ENDOFTEXT), chat.turns.index(first)
        assert len(firsts) == 3, firsts  # each kind of end was packed or kept apart


@pytest.mark.parametrize("run", ["fast", "fast-triton", *SAMPLED_RUNS])
def test_the_fast_engine_continues_each_seats_cached_turn(played, run):
    """Each seat's second prompt continues the K/V its first turn left (its prompt and all its tokens but the
    last, never fed): rows that stopped early, on either stop, or ran to the cap."""
    chats, _, reused = run_of(played, run)
    cached = sum(
        len(c.turns[k - 2].prompt_ids) + len(c.turns[k - 2].completion_ids) - 1 for c in chats for k in (2, 3)
    )
    assert reused == cached > 0
