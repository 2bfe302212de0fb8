"""Tests for talkmethods.training.rows: chats to loss rows, rows to TRL's batch tensors, micro-batches by length.

Pure tensor code, checked by hand on small batches; nothing here imports TRL (the first test checks the
module does not either). The rows reaching TRL's real loss: tests/test_trainer.py.
"""

from __future__ import annotations

import math
import subprocess
import sys
import types

import pytest
import torch

from talkmethods.rollout import Turn
from talkmethods.training.rows import CUDNN_NAN_WIDTH, WIDTH_STEP, group_by_length, pad_rows, to_rows

T, F = True, False


def test_rows_import_without_trl():
    """The warm start and the tests build rows without TRL: importing the module must not load it."""
    code = (
        "import sys, talkmethods.training.rows; assert 'trl' not in sys.modules, 'talkmethods.training.rows loads TRL'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_group_by_length_by_hand():
    # 6 rows: prompt lengths 1..6 (left-padded to 6), completion lengths 6..1 (right-padded to 6) + one long
    p_len = [1, 2, 5, 6, 2, 1]
    c_len = [1, 1, 1, 6, 2, 1]
    n = len(p_len)
    prompt_mask = torch.tensor([[0] * (6 - k) + [1] * k for k in p_len])
    completion_mask = torch.tensor([[1] * k + [0] * (6 - k) for k in c_len])
    batch = {
        "prompt_ids": prompt_mask * 7,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_mask * 9,
        "completion_mask": completion_mask,
        "advantages": torch.arange(n, dtype=torch.float32),
        "rollout_logps": -completion_mask.float(),
        "num_items_in_batch": completion_mask.sum(),
    }
    parts = group_by_length(batch, 3)
    assert len(parts) == 3
    seen = sorted(a for part in parts for a in part["advantages"].tolist())
    assert seen == list(range(n)), "every row exactly once"
    for part in parts:
        assert part["num_items_in_batch"] == completion_mask.sum()
        assert part["prompt_ids"].shape == part["prompt_mask"].shape
        assert part["completion_ids"].shape == part["completion_mask"].shape == part["rollout_logps"].shape
        assert bool(part["prompt_mask"][:, 0].any()) and bool(part["completion_mask"][:, -1].any())
        for i, a in enumerate(part["advantages"].long().tolist()):  # each row kept its own tokens
            assert int(part["prompt_mask"][i].sum()) == p_len[a] and int(part["completion_mask"][i].sum()) == c_len[a]
    # the longest row (12 tokens) sits alone; padded tokens drop from 6 x 12 = 72
    assert parts[-1]["advantages"].tolist() == [3.0]
    assert sum(p["prompt_ids"].numel() + p["completion_ids"].numel() for p in parts) < 72
    with pytest.raises(ValueError, match="cannot fill"):
        group_by_length(batch, 7)
    with pytest.raises(ValueError, match="does not know"):
        group_by_length({**batch, "old_per_token_logps": completion_mask.float()}, 2)


def test_to_rows_and_pad_rows_by_hand():
    def turn(seat, p, c):
        return Turn(seat=seat, adapter_on=True, prompt_ids=p, completion_ids=c, text="")

    full = types.SimpleNamespace(
        turns=[
            turn("A", [1, 2], [3]),
            turn("B", [4], [5, 6]),
            turn("A", [7, 8, 9], [10]),
            turn("B", [11], [12, 13, 14]),
        ]
    )
    base_b = types.SimpleNamespace(
        turns=[turn("A", [20], [21]), turn("B", [22], [23]), turn("A", [24], [25, 26]), turn("B", [27], [28])]
    )
    rows = to_rows([full, base_b], [0.5, -0.25], [(T, T, T, T), (T, F, T, F)])
    assert [(r.prompt_ids, r.advantage) for r in rows] == [
        ([1, 2], 0.5),
        ([4], 0.5),
        ([7, 8, 9], 0.5),
        ([11], 0.5),
        ([20], -0.25),
        ([24], -0.25),
    ]
    packed = to_rows([full, base_b], [0.5, -0.25], [(T, T, T, T), (T, F, T, F)], pack=True)
    assert sorted(map(repr, packed)) == sorted(map(repr, rows)), "no prefixes here: the same rows"
    b = pad_rows(rows, pad_id=0, device="cpu")
    assert b["prompt_ids"].tolist() == [[0, 1, 2], [0, 0, 4], [7, 8, 9], [0, 0, 11], [0, 0, 20], [0, 0, 24]]
    assert b["prompt_mask"].tolist() == [[0, 1, 1], [0, 0, 1], [1, 1, 1], [0, 0, 1], [0, 0, 1], [0, 0, 1]]
    assert b["completion_ids"].tolist() == [[3, 0, 0], [5, 6, 0], [10, 0, 0], [12, 13, 14], [21, 0, 0], [25, 26, 0]]
    assert b["completion_mask"].tolist() == [[1, 0, 0], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert b["advantages"].tolist() == [0.5, 0.5, 0.5, 0.5, -0.25, -0.25]
    assert b["advantages"].dtype == torch.float32
    assert torch.equal(b["tool_mask"], b["completion_mask"]), "one turn a row: every completion token is scored"


def test_a_seats_two_turns_pack_into_one_row_when_the_first_is_the_seconds_prefix():
    def turn(seat, p, c, lp=None):
        return Turn(seat=seat, adapter_on=True, prompt_ids=p, completion_ids=c, text="", logprobs=lp)

    chat = types.SimpleNamespace(
        turns=[
            turn("A", [1, 2], [3, 4], [-0.1, -0.2]),
            turn("B", [5], [6], [-0.3]),
            turn(
                "A", [1, 2, 3, 4, 99, 6, 98], [7], [-0.4]
            ),  # A1's prompt and completion, B's reply, A2's generation prompt
            turn("B", [5, 7, 0, 3], [8, 9], [-0.5, -0.6]),  # not B1 + its completion (re-tokenised): two rows
        ]
    )
    rows = to_rows([chat], [0.5], [(T, T, T, T)], pack=True)
    packed, b1, b2 = rows
    assert (packed.prompt_ids, packed.completion_ids, packed.scored, packed.turns) == (
        [1, 2],
        [3, 4, 99, 6, 98, 7],
        [1, 1, 0, 0, 0, 1],
        2,
    )
    assert packed.logprobs[:2] == [-0.1, -0.2] and packed.logprobs[-1] == -0.4
    assert all(math.isnan(x) for x in packed.logprobs[2:5])
    assert (b1.completion_ids, b2.completion_ids, b1.turns + b2.turns) == ([6], [8, 9], 2)
    b = pad_rows(rows, pad_id=0, device="cpu")
    assert b["completion_mask"][0].tolist() == [1] * 6 and b["tool_mask"][0].tolist() == [1, 1, 0, 0, 0, 1]
    assert torch.isnan(b["rollout_logps"][0, 2:5]).all() and b["rollout_logps"][0, 5] == pytest.approx(-0.4)
    # a base B (untrained) is never packed with anything: only A's turns are rows
    assert len(to_rows([chat], [0.5], [(T, F, T, F)], pack=True)) == 1


def test_empty_filler_rows_are_dropped_before_grouping():
    """Rows padded in so TRL can split the batch evenly carry no loss token; grouping leaves them out."""
    p_len, c_len = [5, 6, 7, 8, 9, 0, 0, 0], [3, 3, 4, 4, 5, 0, 0, 0]
    prompt_mask = torch.tensor([[0] * (9 - k) + [1] * k for k in p_len])
    completion_mask = torch.tensor([[1] * k + [0] * (5 - k) for k in c_len])
    batch = {
        "prompt_ids": prompt_mask * 7,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_mask * 9,
        "completion_mask": completion_mask,
        "advantages": torch.arange(8, dtype=torch.float32),
    }
    parts = group_by_length(batch, 4)
    assert sorted(a for part in parts for a in part["advantages"].tolist()) == [0, 1, 2, 3, 4]
    assert sum(int(part["completion_mask"].sum()) for part in parts) == sum(c_len)


def test_no_micro_batch_has_the_width_cudnn_gets_wrong():
    """pytorch#196678: cuDNN SDPA backward gives NaN at sequence length 64 mod 128 with a mask; never build one."""
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        n = 16
        p_len = torch.randint(1, 200, (n,), generator=g)
        c_len = torch.randint(1, 100, (n,), generator=g)
        if trial == 0:  # one row is the widest prompt and completion
            p_len[:] = 1
            c_len[:] = 1
            p_len[0], c_len[0] = 200, 120  # 320 = 64 mod 128
        width_p, width_c = int(p_len.max()), int(c_len.max())
        prompt_mask = torch.stack([torch.arange(width_p) >= width_p - k for k in p_len]).long()
        completion_mask = torch.stack([torch.arange(width_c) < k for k in c_len]).long()
        batch = {
            "prompt_ids": prompt_mask * 7,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_mask * 9,
            "completion_mask": completion_mask,
            "advantages": torch.arange(n, dtype=torch.float32),
        }
        parts = group_by_length(batch, 4, WIDTH_STEP)  # as on a GPU
        for part in parts + group_by_length(batch, 4):
            width = part["prompt_ids"].size(1) + part["completion_ids"].size(1)
            assert width % CUDNN_NAN_WIDTH[0] != CUDNN_NAN_WIDTH[1], width
            need = int(part["prompt_mask"].sum(1).max() + part["completion_mask"].sum(1).max())
            assert 0 <= width - need < 2 * WIDTH_STEP, "no more padding than the rounding needs"
            assert part["prompt_ids"].shape == part["prompt_mask"].shape
            for i, a in enumerate(part["advantages"].long().tolist()):  # each row still its own tokens
                assert (
                    int(part["prompt_mask"][i].sum()) == p_len[a] and int(part["completion_mask"][i].sum()) == c_len[a]
                )
        assert all((p["prompt_ids"].size(1) + p["completion_ids"].size(1)) % WIDTH_STEP == 0 for p in parts)
        if trial == 0:
            assert max(p["prompt_ids"].size(1) for p in parts) == 200 + 32, "320 wide (64 mod 128) became 352"
            assert max(p["prompt_ids"].size(1) for p in group_by_length(batch, 4)) == 201, "or 321 without rounding"
