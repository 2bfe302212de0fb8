"""Tests for talkmethods.training (TalkTrainer, build_trainer): rows through TRL's real loss, and a learning signal
on the tiny model. The row packing and micro-batching on their own (no TRL): tests/test_rows.py.

Row counts are measured where TRL's loss sees them (``_compute_loss``'s ``inputs``), not in our own
code. The learning tests train the offline tiny Qwen2 with each arm on a reward the random policy
sometimes earns, and check the reward climbs, while sign-flipped and zeroed advantages do not.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from conftest import tiny_problems, train_config

from talkmethods.credit import Credit
from talkmethods.dialogue import seat_messages
from talkmethods.engines.sampling import Sampling
from talkmethods.models import ModelSpec
from talkmethods.rollout import Turn
from talkmethods.training.build import build_trainer
from talkmethods.training.runs import StepLog

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPEC = ModelSpec("offline-tiny-qwen2")
F, T = False, True


def parity_judge(turn: Turn, problem: dict) -> bool:
    """A reward the random model earns about half the time, so groups are rarely uniform."""
    return turn.completion_ids[0] % 2 == 0


class Recorder:
    """Wraps a trainer's loss and credit rule; records what each sees."""

    def __init__(self, trainer):
        self.loss_inputs: list[dict] = []
        self.credits: list[tuple[list[float], list[bool], Credit]] = []
        self.last_rows_at_loss: list[int] = []
        self.losses: list[float] = []
        self.chats: list[list] = []  # each problem's chats, in the credit rule's order
        original_loss = trainer._compute_loss
        original_draw = trainer._draw_chats

        def draw_chats(problems):
            by_problem, stats = original_draw(problems)
            self.chats += by_problem
            return by_problem, stats

        rule = trainer.credit_rule

        def compute_loss(_self, model, inputs):
            self.loss_inputs.append({k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in inputs.items()})
            self.last_rows_at_loss.append(_self.last_rows)
            loss = original_loss(model, inputs)
            self.losses.append(float(loss.detach()))
            return loss

        def credit_rule(rewards, b_base):
            c = rule(rewards, b_base)
            self.credits.append((list(rewards), list(b_base), c))
            return c

        trainer._compute_loss = types.MethodType(compute_loss, trainer)
        trainer.credit_rule = credit_rule
        trainer._draw_chats = draw_chats


def tiny_config(**fields):
    """The tests' training config: one grpo step of 8 problems, 4 micro-batches, 4-token turns; ``fields`` override."""
    return train_config(
        **{
            "arm": "grpo",
            "seed": 17,
            "model": SPEC,
            "steps": 1,
            "problems_per_step": 8,
            "micro_batches": 4,
            "sampling": Sampling(max_new_tokens=4),
            "save_every": 1000,
            "ada_draw_ahead": False,
            **fields,
        }
    )


def step_log(path: Path) -> list[dict]:
    """The step log a trainer built with ``StepLog(path / "steps.jsonl")`` wrote, a dict a step."""
    return [json.loads(line) for line in (path / "steps.jsonl").read_text().splitlines()]


def train_one_step(
    arm, tmp_path: Path, judge=parity_judge, max_new_tokens=4, micro_batches=1, problems=8, ada_draw_ahead=False
):
    cfg = tiny_config(
        arm=arm,
        problems_per_step=problems,
        micro_batches=micro_batches,
        sampling=Sampling(max_new_tokens=max_new_tokens),
        ada_draw_ahead=ada_draw_ahead,
        pack_seats=False,
    )
    trainer = build_trainer(
        cfg, tiny_problems(problems), tmp_path, judge=judge, callbacks=[StepLog(tmp_path / "steps.jsonl")]
    )
    rec = Recorder(trainer)
    trainer.train()
    return trainer, rec, step_log(tmp_path)


def expected_advantages(credits):
    """Each kept chat's advantage, once per trained turn."""
    return sorted(a for _, _, c in credits for a, mask in zip(c.advantages, c.trained_turns) for _ in range(sum(mask)))


def credited_tokens(rec) -> int:
    """Completion tokens of every kept chat's trained turns: the dapo normaliser, zero-advantage rows included."""
    total = 0
    for chats, (_, _, c) in zip(rec.chats, rec.credits, strict=True):
        for i, mask in zip(c.kept, c.trained_turns, strict=True):
            total += sum(len(t.completion_ids) for t, on in zip(chats[i].turns, mask, strict=True) if on)
    return total


def check_batch_reaches_the_loss(trainer, rec, rows, micro_batches=1):
    """``rows`` turns credited; those with a non-zero advantage reach TRL's loss (``live_rows``), the rest
    only its normaliser."""
    assert len(rec.loss_inputs) == micro_batches, "one optimizer step = micro_batches loss calls"
    credited = expected_advantages(rec.credits)
    assert len(credited) == rows
    live = [a for a in credited if a != 0]
    batches = rec.loss_inputs
    n = sum(b["completion_ids"].shape[0] for b in batches)
    assert n == max(micro_batches, -(-len(live) // micro_batches) * micro_batches), "live rows, padded to the split"
    assert trainer.last_rows == len(live) == rec.last_rows_at_loss[-1], "rows were dropped between rollout and loss"
    normaliser = credited_tokens(rec)
    assert normaliser > sum(int(b["completion_mask"].sum()) for b in batches) or len(live) == rows
    lengths = []
    for b in batches:
        m = b["completion_ids"].shape[0]
        assert m >= 1
        real = b["completion_mask"].sum(1) > 0
        if bool(real.any()):  # grouped by length and trimmed: no column is padding in every row of the micro-batch
            assert bool(b["prompt_mask"][:, 0].any()) and bool(b["completion_mask"][:, -1].any())
        lengths.append((b["prompt_mask"].sum(1) + b["completion_mask"].sum(1)).tolist())
        assert b["prompt_ids"].shape[0] == b["prompt_mask"].shape[0] == b["completion_mask"].shape[0] == m
        assert b["advantages"].shape == (m,)
        # dapo: the normaliser is the token count of the WHOLE generation batch (the rows left out too), in
        # every micro-batch.
        assert int(b["num_items_in_batch"]) == normaliser
        per_row = b["completion_mask"].sum(1)[real]
        assert bool((per_row <= trainer.sampling.max_new_tokens).all())
        assert bool((b["advantages"][~real] == 0).all()), "a padding row carries no advantage"
    assert all(max(a) <= min(b) for a, b in zip(lengths, lengths[1:])), "micro-batches are in length order"
    # The advantages the loss sees are exactly the credit rule's non-zero ones, one per trained turn (TRL
    # shuffles rows), plus padding rows' zeros.
    seen = sorted(a for b in batches for a, r in zip(b["advantages"].tolist(), (b["completion_mask"].sum(1) > 0)) if r)
    assert seen == pytest.approx(sorted(live), abs=1e-6)
    # On-policy (ratio 1, beta 0) the dapo loss is -sum_rows(A_i * tokens_i) / tokens of the generation batch.
    for b, loss in zip(batches, rec.losses):
        by_hand = -float((b["advantages"] * b["completion_mask"].sum(1)).sum()) / normaliser
        assert loss == pytest.approx(by_hand, abs=1e-5)


@pytest.mark.parametrize("arm", ["grpo", "raft", "ada"])
def test_one_step_reaches_the_loss_with_128_rows(arm, tmp_path):
    trainer, rec, logs = train_one_step(arm, tmp_path)
    # 8 problems x 4 chats kept x 4 trained turns.
    check_batch_reaches_the_loss(trainer, rec, rows=128)
    assert len(rec.credits) == 8
    for _rewards, b_base, c in rec.credits:
        assert not any(b_base), "only the mixed arms run a base B"
        assert len(c.kept) == 4
    assert logs[-1]["rows"] == 128.0
    zero = sum(a == 0 for a in expected_advantages(rec.credits))
    assert logs[-1]["skipped_rows"] == zero and logs[-1]["loss_rows"] == 128 - zero


def test_mixed_step_trains_only_adapter_turns(tmp_path):
    trainer, rec, logs = train_one_step("mixed", tmp_path)
    # 8 problems x (2 chats x 4 turns + 2 base-B chats x 2 A turns) = 8 x 12 = 96.
    # (The issue text said 120; with 2 of every 4 chats having a base B, 96 is what the design gives.)
    check_batch_reaches_the_loss(trainer, rec, rows=96)
    assert len(rec.credits) == 8
    for _rewards, b_base, c in rec.credits:
        assert b_base == [F, F, T, T]
        assert c.trained_turns == ((T, T, T, T), (T, T, T, T), (T, F, T, F), (T, F, T, F))
    assert logs[-1]["rows"] == 96.0


def test_ada_replays_uniform_problems_and_still_keeps_four_chats(tmp_path):
    always_right = {"p0", "p1"}

    def judge(turn, problem):  # p0, p1 are always solved (uniform), the rest depend on the tokens
        return problem["id"] in always_right or parity_judge(turn, problem)

    trainer, rec, logs = train_one_step("ada", tmp_path, judge=judge)
    check_batch_reaches_the_loss(trainer, rec, rows=128)
    drawn = [len(r) for r, _, _ in rec.credits]
    saturated = [(r, c) for r, _, c in rec.credits if len(r) == 16 and set(r) == {1.0}]
    assert len(saturated) >= 2, drawn  # p0 and p1: 4 + 3 replays x 4, still uniform
    for _, c in saturated:
        assert c.kept == (0, 1, 2, 3) and c.advantages == (0.0, 0.0, 0.0, 0.0)
    assert all(n in (4, 8, 12, 16) for n in drawn)
    assert logs[-1]["chats_drawn"] == float(sum(drawn))
    assert logs[-1]["chats_drawn"] >= 32 + 2 * 12 > 32
    assert logs[-1]["zero_adv_share"] >= 2 / 8
    assert logs[-1]["chats_generated"] == logs[-1]["chats_drawn"], "round by round plays only the chats it uses"


def test_ada_drawing_ahead_plays_every_round_and_uses_the_reached_ones(tmp_path):
    def judge(turn, problem):  # p0 is always solved (uniform): it reaches every round; p1 depends on the tokens
        return problem["id"] == "p0" or parity_judge(turn, problem)

    trainer, rec, logs = train_one_step("ada", tmp_path, judge=judge, problems=2, ada_draw_ahead=True)
    check_batch_reaches_the_loss(trainer, rec, rows=2 * 4 * 4)
    drawn = [len(r) for r, _, _ in rec.credits]
    assert any(len(r) == 16 and set(r) == {1.0} for r, _, _ in rec.credits), drawn  # p0 (the sampler shuffles)
    assert all(n in (4, 8, 12, 16) for n in drawn)
    assert logs[-1]["chats_generated"] == 2 * 16.0, "every round of every problem, played up front"
    assert logs[-1]["chats_drawn"] == float(sum(drawn)), "only the rounds the rule reached"


def test_micro_batches_split_the_rows_but_not_the_normaliser(tmp_path):
    trainer, rec, logs = train_one_step("grpo", tmp_path, micro_batches=2)
    check_batch_reaches_the_loss(trainer, rec, rows=128, micro_batches=2)
    assert trainer.args.steps_per_generation == trainer.args.gradient_accumulation_steps == 2
    assert logs[-1]["rows"] == 128.0 and trainer.state.global_step == 1


def _sgd_update(path, prepare=lambda trainer: None, judge=parity_judge, **fields):
    """One SGD step (update = lr × gradient; Adam's first step is sign-like) of grpo on 8 tiny problems.

    Returns the trainer and the change of every LoRA B matrix; ``prepare`` edits the built trainer first.
    The step's log line is in ``path / "steps.jsonl"``.
    """
    from transformers.training_args import OptimizerNames

    cfg = tiny_config(learning_rate=1.0, **fields)
    trainer = build_trainer(cfg, tiny_problems(8), path, judge=judge, callbacks=[StepLog(path / "steps.jsonl")])
    prepare(trainer)
    trainer.args.optim = OptimizerNames.SGD
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if "lora_B" in k}
    trainer.train()
    return trainer, {k: v.detach() - before[k] for k, v in trainer.model.named_parameters() if "lora_B" in k}


def _assert_same_update(a: dict, b: dict) -> None:
    assert max(u.abs().max().item() for u in a.values()) > 1e-4, "the step moved the adapter"
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-8), k


def test_length_grouping_does_not_change_the_update(tmp_path):
    """The loss is a token sum over the generation batch: grouping rows by length changes no weight."""

    def grouping(on):
        return lambda trainer: setattr(trainer, "group_rows", on)

    _, grouped = _sgd_update(tmp_path / "grouped", grouping(True), pack_seats=False)
    _, plain = _sgd_update(tmp_path / "plain", grouping(False), pack_seats=False)
    _assert_same_update(grouped, plain)


def test_right_aligned_rows_do_not_change_the_update(tmp_path):
    """Each row's pads after its tokens and no attention mask (``patches.right_aligned_rows``): the same
    SGD update as TRL's left-padded rows under a mask, and the backbone really ran without one."""
    masks = {}

    def aligned(on):
        def prepare(trainer):
            trainer.right_align_rows = on
            backbone = trainer.model.get_base_model().model
            seen = masks.setdefault(on, [])

            def probe(module, args, kwargs):
                if torch.is_grad_enabled():  # the loss's forwards, not the rollout's
                    seen.append(kwargs.get("attention_mask"))

            backbone.register_forward_pre_hook(probe, with_kwargs=True)

        return prepare

    _, rolled = _sgd_update(tmp_path / "rolled", aligned(True))
    _, masked = _sgd_update(tmp_path / "masked", aligned(False))
    assert masks[True] and all(m is None for m in masks[True]), "a loss forward still passed a mask"
    assert masks[False] and all(m is not None for m in masks[False])
    _assert_same_update(rolled, masked)


def test_packed_rows_do_not_change_the_update(tmp_path):
    """A micro-batch's rows as one row of real tokens (``patches.packed_rows``): the same SGD update as
    TRL's left-padded rows under a mask, and the backbone really got one packed row with no mask."""
    seen = {}

    def packing(on):
        def prepare(trainer):
            trainer.right_align_rows = False
            trainer.pack_rows = on
            backbone = trainer.model.get_base_model().model
            shapes = seen.setdefault(on, [])

            def probe(module, args, kwargs):
                if torch.is_grad_enabled():  # the loss's forwards, not the rollout's
                    shapes.append((kwargs["input_ids"].size(0), kwargs.get("attention_mask")))

            backbone.register_forward_pre_hook(probe, with_kwargs=True)

        return prepare

    _, packed = _sgd_update(tmp_path / "packed", packing(True))
    _, masked = _sgd_update(tmp_path / "masked", packing(False))
    assert seen[True] and all(n == 1 and all(v is None for v in m.values()) for n, m in seen[True])
    assert seen[False] and all(n > 1 and m is not None for n, m in seen[False])
    _assert_same_update(packed, masked)


def test_lora_own_backward_does_not_change_the_update(tmp_path):
    """Each LoRA layer as one autograd node (``patches.lora_own_backward``): the same SGD update as
    autograd's graph of the same sum, and the loss's backward really went through the node."""
    from talkmethods.training.patches import lora_own_backward

    ran = {}

    def own(on):
        def prepare(trainer):
            assert lora_own_backward(trainer.model, on) == trainer.lora_layers_fused > 0
            seen = ran.setdefault(on, [])

            def probe(module, args, kwargs):
                if torch.is_grad_enabled():  # the loss's forwards, not the rollout's
                    out = module.forward(*args, **kwargs)
                    seen.append(type(out.grad_fn).__name__ if out.grad_fn is not None else None)

            # o_proj: a layer of no group (patches.lora_groups makes q/k/v one node)
            layer = next(m for n, m in trainer.model.named_modules() if n.endswith("self_attn.o_proj"))
            layer.register_forward_pre_hook(probe, with_kwargs=True)

        return prepare

    _, mine = _sgd_update(tmp_path / "own", own(True))
    _, autograd = _sgd_update(tmp_path / "autograd", own(False))
    assert ran[True] and set(ran[True]) == {"_LoraProductBackward"}, ran[True]
    assert ran[False] and "_LoraProductBackward" not in ran[False]
    _assert_same_update(mine, autograd)


def test_lora_groups_do_not_change_the_update(tmp_path):
    """q/k/v and gate/up as one autograd node each (``patches.lora_groups``, on top of LoRA's own backward):
    the same SGD update as one node a layer, and the loss's backward really went through the group node."""
    from talkmethods.training.patches import lora_groups

    ran = {}

    def grouped(on):
        def prepare(trainer):
            assert lora_groups(trainer.model, on) == 2 * trainer.lora_layers_fused // 7 > 0
            seen = ran.setdefault(on, [])

            def probe(module, args, output):
                if torch.is_grad_enabled():  # the loss's forwards, not the rollout's
                    seen.append(type(output.grad_fn).__name__ if output.grad_fn is not None else None)

            q_proj = next(m for n, m in trainer.model.named_modules() if n.endswith("self_attn.q_proj"))
            q_proj.register_forward_hook(probe)

        return prepare

    _, mine = _sgd_update(tmp_path / "groups", grouped(True))
    _, apart = _sgd_update(tmp_path / "apart", grouped(False))
    assert ran[True] and set(ran[True]) == {"_LoraGroupBackward"}, ran[True]
    assert ran[False] and set(ran[False]) == {"_LoraProductBackward"}, ran[False]
    _assert_same_update(mine, apart)


def test_leaving_zero_advantage_rows_out_does_not_change_the_update(tmp_path):
    """A zero-advantage row adds zero to the dapo loss; with the normaliser unchanged, the step is the same."""

    def skipping(on):
        return lambda trainer: setattr(trainer, "skip_zero_advantage", on)

    def judge(turn, problem):  # p0 always solved: a uniform group, four rows of zero advantage at least
        return problem["id"] == "p0" or parity_judge(turn, problem)

    def update(path, on):
        _, change = _sgd_update(path, skipping(on), judge=judge, pack_seats=True)
        return step_log(path)[-1], change

    log_on, on = update(tmp_path / "on", True)
    log_off, off = update(tmp_path / "off", False)
    assert log_on["skipped_rows"] >= 2 and log_off["skipped_rows"] == 0  # p0's two packed seats a chat, at least
    assert log_on["loss_rows"] + log_on["skipped_rows"] == log_off["loss_rows"]
    assert log_on["rows"] == log_off["rows"] == 128
    _assert_same_update(on, off)


def test_a_step_of_zero_advantages_still_steps_the_optimizer(tmp_path):
    """With every row left out, the loss still runs (empty rows), so each LoRA weight gets a zero gradient
    rather than none, and Adam moves it on its momentum exactly as when every row runs."""
    from transformers import TrainerCallback

    def run(path, skip):
        state = {"step": 0, "weights": []}

        def judge(turn, problem):  # the second step's groups are all solved: every advantage zero
            return True if state["step"] else parity_judge(turn, problem)

        class Snap(TrainerCallback):
            def on_step_end(self, _args, _state, control, model=None, **k):
                state["step"] += 1
                state["weights"].append({n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n})

        cfg = tiny_config(steps=2, learning_rate=1e-2, pack_seats=True)
        trainer = build_trainer(
            cfg, tiny_problems(8), path, judge=judge, callbacks=[Snap(), StepLog(path / "steps.jsonl")]
        )
        trainer.skip_zero_advantage = skip
        trainer.train()
        first, second = state["weights"]
        return step_log(path), {n: second[n] - first[n] for n in first}

    logs_on, moved_on = run(tmp_path / "on", True)
    logs_off, moved_off = run(tmp_path / "off", False)
    assert logs_on[1]["loss_rows"] == 0 and logs_on[1]["skipped_rows"] == logs_off[1]["loss_rows"] > 0
    assert logs_on[1]["loss"] == 0.0 and logs_on[1]["grad_norm"] == 0.0
    assert max(d.abs().max().item() for d in moved_on.values()) > 1e-4, "Adam's momentum moved the adapter"
    for n in moved_on:
        assert torch.allclose(moved_on[n], moved_off[n], rtol=1e-4, atol=1e-7), n


def test_trainer_refuses_generation_not_matching_accumulation(tmp_path, monkeypatch):
    """Off-policy splits are refused: one rollout must make exactly one optimizer step."""
    import talkmethods.training.build as build_mod

    real = build_mod.GRPOConfig
    monkeypatch.setattr(build_mod, "GRPOConfig", lambda **kw: real(**{**kw, "steps_per_generation": 2}))
    cfg = train_config(
        arm="grpo",
        seed=17,
        model=SPEC,
        steps=1,
        problems_per_step=8,
        sampling=Sampling(max_new_tokens=4),
        save_every=1000,
        micro_batches=1,
        pack_seats=False,
        ada_draw_ahead=False,
    )
    with pytest.raises(ValueError, match="steps_per_generation"):
        build_trainer(cfg, tiny_problems(8), tmp_path, judge=parity_judge)


def test_micro_batches_must_divide_the_rows(tmp_path):
    cfg = train_config(
        arm="grpo",
        seed=17,
        model=SPEC,
        steps=1,
        problems_per_step=8,
        micro_batches=3,
        pack_seats=False,
        ada_draw_ahead=False,
    )
    with pytest.raises(ValueError, match="micro_batches"):
        build_trainer(cfg, tiny_problems(8), tmp_path)


def test_unknown_arm_is_refused(tmp_path):
    cfg = train_config(
        arm="ppo", seed=17, model=SPEC, steps=1, micro_batches=1, pack_seats=False, ada_draw_ahead=False
    )
    with pytest.raises(ValueError, match="arm='ppo'"):
        build_trainer(cfg, tiny_problems(8), tmp_path)


def test_packing_seats_does_not_change_the_update(tmp_path):
    """Same rollout, packed or not: the token-sum loss and so the SGD update are the same; half the rows."""
    packed_trainer, packed = _sgd_update(tmp_path / "packed", pack_seats=True)
    plain_trainer, plain = _sgd_update(tmp_path / "plain", pack_seats=False)
    assert [packed_trainer.last_rows, plain_trainer.last_rows] == [64, 128], (
        "every seat's two turns packed into one row"
    )
    _assert_same_update(packed, plain)


# ------------------------------------------------------------------------------ learning signal
#
# The reward: a seat's final message is "right" when its FIRST token is in a set S. A random
# 151,936-token policy almost never hits a small set, and scaling embedding rows alone was tried and
# fails here: the random model's last hidden state is nearly the same for every prompt (cos > 0.99),
# so scaled rows give nothing below x30 and at x50 one or two tokens take all the mass (groups are
# uniform, no signal). So the fixture sets the (tied, frozen) embedding rows of 16 ordinary word
# tokens to  L * u/|u|^2  (u = the mean final hidden state at the generation position: these 16 hold
# essentially all first-token mass)  + s_i * w  (w a unit direction orthogonal to u; s_i = +1 for the
# 5 tokens in S, -1 for the other 11)  + 3 * (the row's own random values)  (so the 16 differ).
# The base hit rate is ~0.34 per seat; LoRA can raise it only by turning the hidden state towards w,
# i.e. by learning to prefer S. The learning rate is the recipe's 1e-4.

WORDS = [
    " red",
    " blue",
    " green",
    " cat",
    " dog",
    " sun",
    " moon",
    " tree",
    " fish",
    " bird",
    " rock",
    " milk",
    " rain",
    " snow",
    " wind",
    " fire",
]
N_IN_S = 5
LEARN_STEPS = 12
MARGIN = 0.15


def shape_first_token_distribution(trainer, problems) -> set[int]:
    tok, model = trainer.processing_class, trainer.model
    vocab = [tok.encode(w) for w in WORDS]
    assert all(len(v) == 1 for v in vocab), "each word must be one token"
    vocab = [v[0] for v in vocab]
    captured = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, o: captured.append(i[0][:, -1]))
    try:
        with torch.no_grad():
            for p in problems[:2]:
                for turn in range(4):
                    ids = tok.apply_chat_template(
                        seat_messages(p, turn, ["Hello there."] * turn),
                        add_generation_prompt=True,
                        tokenize=True,
                        return_dict=False,
                    )
                    assert not set(ids) & set(vocab)
                    model(input_ids=torch.tensor([ids]))
    finally:
        hook.remove()
    u = torch.cat(captured).mean(0)
    w = torch.randn(u.shape[0], generator=torch.Generator().manual_seed(0))
    w = w - (w @ u) / (u @ u) * u
    w = w / w.norm()
    sign = torch.tensor([1.0 if i < N_IN_S else -1.0 for i in range(len(vocab))])
    emb = model.get_input_embeddings().weight
    assert emb.data_ptr() == model.get_output_embeddings().weight.data_ptr(), "tiny model ties its embeddings"
    with torch.no_grad():
        emb[vocab] = 3.0 * emb[vocab] + 30.0 * u / (u @ u) + sign[:, None] * w[None, :]
    return set(vocab[:N_IN_S])


def lora_and_base_params(model):
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    return lora, base


def run_learning(arm, tmp_path, advantage_scale=1.0):
    problems = tiny_problems(8)
    cfg = train_config(
        arm=arm,
        seed=17,
        model=SPEC,
        steps=LEARN_STEPS,
        problems_per_step=4,
        learning_rate=1e-4,
        sampling=Sampling(max_new_tokens=2),
        save_every=1000,
        micro_batches=1,
        pack_seats=False,
        ada_draw_ahead=False,
    )
    target: set[int] = set()
    trainer = build_trainer(
        cfg,
        problems,
        tmp_path,
        judge=lambda turn, _: turn.completion_ids[0] in target,
        callbacks=[StepLog(tmp_path / "steps.jsonl")],
    )
    target |= shape_first_token_distribution(trainer, problems)
    if advantage_scale != 1.0:  # controls: flip or zero every advantage the arm's rule gives
        rule = trainer.credit_rule

        def scaled(rewards, b_base):
            c = rule(rewards, b_base)
            return Credit(c.kept, tuple(advantage_scale * a for a in c.advantages), c.trained_turns)

        trainer.credit_rule = scaled
    lora0, base0 = lora_and_base_params(trainer.model)
    trainer.train()
    lora1, base1 = lora_and_base_params(trainer.model)
    rewards = [x["reward"] for x in step_log(tmp_path)]
    assert len(rewards) == LEARN_STEPS
    gain = sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5
    print(
        f"\n[learning] arm={arm} advantage_scale={advantage_scale:+g} gain={gain:+.3f} "
        f"rewards={' '.join(f'{r:.2f}' for r in rewards)}"
    )
    return rewards, gain, (lora0, lora1), (base0, base1)


def assert_base_untouched(base):
    before, after = base
    assert before.keys() == after.keys() and len(before) > 0
    for name in before:
        assert torch.equal(before[name], after[name]), f"base weight {name} changed"


@pytest.mark.parametrize("arm", ["grpo", "ada", "raft", "mixed"])
def test_each_arm_learns_to_prefer_the_rewarded_tokens(arm, tmp_path, record_property):
    rewards, gain, (lora0, lora1), base = run_learning(arm, tmp_path)
    record_property("gain", gain)
    assert 0.15 <= rewards[0] <= 0.6, f"the untrained policy should earn some reward ({rewards[0]})"
    assert gain > MARGIN, f"{arm}: reward rose by {gain:.3f} over {LEARN_STEPS} steps: {rewards}"
    assert any(not torch.equal(lora0[n], lora1[n]) for n in lora0 if "lora_B" in n), "LoRA did not change"
    assert_base_untouched(base)


@pytest.mark.parametrize("scale", [-1.0, 0.0], ids=["flipped", "zeroed"])
def test_controls_do_not_pass_the_margin(scale, tmp_path, record_property):
    rewards, gain, (lora0, lora1), base = run_learning("grpo", tmp_path, advantage_scale=scale)
    record_property("gain", gain)
    assert gain < MARGIN, f"advantages x{scale:g} should not learn, yet the reward rose by {gain:.3f}"
    assert_base_untouched(base)
    if scale == 0.0:  # no advantage, no gradient, no update (AdamW's weight decay is 0)
        assert all(torch.equal(lora0[n], lora1[n]) for n in lora0)
    else:  # flipped: the policy learns to AVOID the rewarded tokens
        assert gain < 0.0


def _fast_run(tmp_path, stale: bool, pack: bool = False):
    from talkmethods.engines import ENGINES
    from talkmethods.engines.fast.generator import FastGenerator

    cfg = tiny_config(
        steps=2,
        problems_per_step=2,
        micro_batches=2,
        sampling=Sampling(max_new_tokens=6),
        learning_rate=5e-2,
        pack_seats=pack,
    )

    def factory(model, tok):
        gen = FastGenerator(model, tok)
        if stale:  # an engine that never refreshes its merged weights
            gen.sync_weights = lambda: None
        return gen

    trainer = build_trainer(
        cfg,
        tiny_problems(8),
        tmp_path,
        judge=parity_judge,
        callbacks=[StepLog(tmp_path / "steps.jsonl")],
        generator_factory=factory if stale else ENGINES["fast"],
    )
    trainer.train()
    return step_log(tmp_path)


def test_rollout_and_trainer_logprobs_agree_and_the_check_catches_stale_weights(tmp_path):
    logs = _fast_run(tmp_path / "fresh", stale=False)
    assert [row["step"] for row in logs] == [1, 2]
    for row in logs:  # float32 on a CPU: the two paths agree to rounding
        assert 0 <= row["logp_diff_max"] < 1e-4 and row["logp_diff_mean"] <= row["logp_diff_max"]
        assert 0 <= row["logp_kl"] < 1e-8  # KL(rollout || trainer), k3 estimate: zero up to rounding
    packed = _fast_run(tmp_path / "packed", stale=False, pack=True)  # the partner's reply inside a row is not compared
    assert all(0 <= row["logp_diff_max"] < 1e-4 for row in packed) and packed[0]["loss_rows"] < packed[0]["rows"]
    stale = _fast_run(tmp_path / "stale", stale=True)
    assert stale[0]["logp_diff_max"] < 1e-4, "before the first update the copies are equal"
    assert stale[1]["logp_diff_max"] > 1e-2, "after it, sampling from stale weights shows in the check"
    assert stale[1]["logp_kl"] > 1e3 * max(row["logp_kl"] for row in logs), "and in the KL estimate"
    from talkmethods.training.trainer import KL_TOLERANCE

    assert max(row["logp_kl"] for row in logs + packed) < KL_TOLERANCE < stale[1]["logp_kl"], stale[1]["logp_kl"]


def test_the_partner_reply_in_a_packed_row_is_not_scored():
    """The labels TRL's fused head scores lose the reply's positions (tool_mask 0); nothing else changes."""
    from talkmethods.training.patches import unscored_labels_hook

    labels = torch.tensor([[-100, 5, 6, 7, 8, 9, 10], [-100, -100, 5, 6, 7, -100, -100]])
    scored = torch.tensor([[1, 0, 0, 1, 1], [1, 1, 0, 0, 0]])  # the last 5 columns are the completion
    args, kwargs = unscored_labels_hook(scored)(None, (), {"labels": labels, "fused_lm_head": True})
    assert kwargs["labels"].tolist() == [[-100, 5, 6, -100, -100, 9, 10], [-100, -100, 5, 6, -100, -100, -100]]
    assert labels[0, 3] == 7, "the caller's labels are not changed in place"
    assert unscored_labels_hook(scored)(None, (), {"labels": labels}) is None, "only the fused-head loss call"
    assert unscored_labels_hook(None)(None, (), {"labels": labels, "fused_lm_head": True}) is None
