"""Contract tests: the TRL / PEFT / transformers internals that talkmethods relies on.

TalkTrainer overrides seven GRPOTrainer/Trainer methods (``training.trainer.TalkTrainer`` lists them) and
counts on how TRL splits, shuffles and scores the batch it returns; ``training.patches`` changes five
TRL/PEFT code paths, each docstring naming its test here. Each test names the pin that moved, so an
upgrade fails with a message saying what to re-check instead of silently training on the wrong rows.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import peft
import pytest
import torch
import transformers
import trl
from conftest import tiny_problems, train_config
from trl import GRPOConfig, GRPOTrainer

import talkmethods.training.build as build_mod
from talkmethods.engines.sampling import Sampling
from talkmethods.models import ModelSpec
from talkmethods.training.build import build_trainer
from talkmethods.training.patches import score_only_valid_positions_on_cpu

TRL_PIN, PEFT_PIN, TRANSFORMERS_PIN, LIGER_PIN = "1.16.0", "0.21.2", "5.23.0", "0.8.5"
BASE_KEYS = {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "num_items_in_batch"}
OUR_KEYS = BASE_KEYS | {"tool_mask"}  # TRL's own key for completion tokens outside the loss (packed seat rows)


def src(obj) -> str:
    return inspect.getsource(obj)


# ----------------------------------------------------------------------------------- versions


def test_trl_version_pinned():
    assert trl.__version__ == TRL_PIN, f"trl=={TRL_PIN} pinned, found {trl.__version__}: re-run this file's checks"


def test_peft_version_pinned():
    assert peft.__version__ == PEFT_PIN, f"peft=={PEFT_PIN} pinned, found {peft.__version__}"


def test_transformers_version_pinned():
    assert transformers.__version__ == TRANSFORMERS_PIN, (
        f"transformers=={TRANSFORMERS_PIN} pinned, found {transformers.__version__}"
    )


# ----------------------------------------------------------------------- GRPOTrainer internals


def test_generate_and_score_completions_signature():
    params = list(inspect.signature(GRPOTrainer._generate_and_score_completions).parameters)
    assert params == ["self", "inputs"], (
        f"trl=={TRL_PIN} pinned; GRPOTrainer._generate_and_score_completions signature changed: {params}"
    )


def test_prepare_inputs_generates_then_splits_by_steps_per_generation():
    s = src(GRPOTrainer._prepare_inputs)
    assert "self._generate_and_score_completions(generation_batch)" in s, (
        f"trl=={TRL_PIN} pinned; GRPOTrainer._prepare_inputs no longer calls _generate_and_score_completions"
    )
    assert "split_tensor_dict(generation_batch, self.args.steps_per_generation)" in s, (
        f"trl=={TRL_PIN} pinned; GRPOTrainer._prepare_inputs no longer splits with "
        "split_tensor_dict(generation_batch, self.args.steps_per_generation)"
    )
    assert "shuffle_sequence_dict(generation_batch)" in s, (
        f"trl=={TRL_PIN} pinned; GRPOTrainer._prepare_inputs no longer shuffles the generation batch"
    )


def test_prepare_inputs_buffers_micro_batches_indexed_by_step():
    """TalkTrainer._prepare_inputs re-splits ``_buffered_inputs`` right after TRL fills it."""
    s = src(GRPOTrainer._prepare_inputs)
    assert (
        "self._buffered_inputs = " in s and "self._buffered_inputs[self._step % self.args.steps_per_generation]" in s
    ), (
        f"trl=={TRL_PIN} pinned; GRPOTrainer._prepare_inputs no longer buffers micro-batches in _buffered_inputs "
        "indexed by _step % steps_per_generation"
    )
    assert "self._step % generate_every == 0 or self._buffered_inputs is None" in s, (
        f"trl=={TRL_PIN} pinned; GRPOTrainer._prepare_inputs changed when it generates"
    )
    t = src(GRPOTrainer.training_step)
    assert t.index("super().training_step") < t.index("self._step += 1"), (
        f"trl=={TRL_PIN} pinned; GRPOTrainer.training_step no longer advances _step after the step"
    )


def test_loss_scores_through_get_per_token_logps_and_entropies():
    """The rollout-vs-trainer log-prob check wraps compute_loss and _get_per_token_logps_and_entropies."""
    params = list(inspect.signature(GRPOTrainer.compute_loss).parameters)
    assert params == ["self", "model", "inputs", "return_outputs", "num_items_in_batch"], (
        f"trl=={TRL_PIN} pinned; GRPOTrainer.compute_loss signature changed: {params}"
    )
    params = list(inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters)[:5]
    assert params == ["self", "model", "input_ids", "attention_mask", "logits_to_keep"], (
        f"trl=={TRL_PIN} pinned; _get_per_token_logps_and_entropies signature changed: {params}"
    )
    s = src(GRPOTrainer._compute_loss)
    assert re.search(
        r"per_token_logps, entropies, aux_loss = self\._get_per_token_logps_and_entropies\(\s*model,"
        r"\s*input_ids,\s*attention_mask,\s*logits_to_keep,",
        s,
    ), (
        f"trl=={TRL_PIN} pinned; _compute_loss no longer scores the completion through "
        "_get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, ...)"
    )
    assert "logits_to_keep = completion_ids.size(1)" in s


def test_logps_come_from_the_fused_head_with_labels_as_a_keyword():
    """``_unscored_labels_hook`` rewrites the ``labels`` keyword of this one model call."""
    import trl.trainer.utils as trl_utils

    s = src(GRPOTrainer._get_per_token_logps_and_entropies)
    assert "outputs = model(**model_inputs, labels=labels, fused_lm_head=True)" in s, (
        f"trl=={TRL_PIN} pinned; _get_per_token_logps_and_entropies no longer calls model(..., labels=labels, fused_lm_head=True)"
    )
    assert "labels[:, :-logits_to_keep] = -100" in s
    assert "mask = labels != -100" in src(trl_utils.add_fused_lm_head), (
        f"trl=={TRL_PIN} pinned; the fused LM head no longer skips positions labelled -100"
    )


def test_loss_skips_tool_mask_tokens_and_attends_them():
    """Packed seat rows rely on it: ``completion_mask`` is attended, ``tool_mask`` zeroes tokens out of the loss."""
    s = src(GRPOTrainer._compute_loss)
    assert "attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)" in s, (
        f"trl=={TRL_PIN} pinned; _compute_loss no longer attends every completion_mask token"
    )
    assert 'mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]' in s, (
        f"trl=={TRL_PIN} pinned; _compute_loss no longer multiplies the loss mask by inputs['tool_mask']"
    )
    assert (
        re.search(r'normalizer = inputs\["num_items_in_batch"\]', s)
        and "(per_token_loss * mask).sum() / normalizer" in s
    ), f"trl=={TRL_PIN} pinned; dapo no longer sums the masked tokens over num_items_in_batch"


def test_a_zero_advantage_row_s_loss_terms_are_all_switched_by_beta_and_the_entropy_bonus():
    """``training.rows.live_rows`` leaves zero-advantage rows out of the loss: exact while the per-token loss
    is the advantage times a ratio, and the two terms that are not (KL, the entropy bonus) are off. The
    trainer reads both switches (``beta``, ``_entropy_bonus_enabled``); the same-update tests in
    tests/test_trainer.py check the rest through the real loss."""
    init, loss = src(GRPOTrainer.__init__), src(GRPOTrainer._compute_loss)
    assert "self._entropy_bonus_enabled = self.entropy_coef != 0.0 or self.use_adaptive_entropy" in init, (
        f"trl=={TRL_PIN} pinned; GRPOTrainer no longer sets _entropy_bonus_enabled as the trainer expects"
    )
    assert "if self.beta != 0.0:" in loss and "if self._entropy_bonus_enabled:" in loss, (
        f"trl=={TRL_PIN} pinned; _compute_loss's KL or entropy-bonus switch moved"
    )


def test_log_merges_the_metrics_dict():
    params = list(inspect.signature(GRPOTrainer.log).parameters)
    assert params == ["self", "logs", "start_time"], (
        f"trl=={TRL_PIN} pinned; GRPOTrainer.log signature changed: {params}"
    )
    s = src(GRPOTrainer.log)
    assert "self._metrics[mode].items()" in s and "logs.update(metrics)" in s, (
        f"trl=={TRL_PIN} pinned; GRPOTrainer.log no longer merges self._metrics into the logged dict"
    )


@pytest.mark.parametrize("key", sorted(BASE_KEYS))
def test_compute_loss_reads_the_base_keys(key):
    assert f'inputs["{key}"]' in src(GRPOTrainer._compute_loss), (
        f"trl=={TRL_PIN} pinned; GRPOTrainer._compute_loss no longer reads inputs[{key!r}]"
    )


def test_compute_loss_accepts_per_row_advantages_and_dapo_normaliser():
    s = src(GRPOTrainer._compute_loss)
    assert "if advantages.dim() == 1:" in s and "advantages.unsqueeze(1)" in s, (
        f"trl=={TRL_PIN} pinned; GRPOTrainer._compute_loss no longer takes (B,) advantages"
    )
    assert 'normalizer = inputs["num_items_in_batch"].clamp(min=1.0)' in s, (
        f"trl=={TRL_PIN} pinned; the dapo loss no longer normalises by num_items_in_batch"
    )
    assert GRPOTrainer.loss_is_scaled_for_ga is True, (
        f"trl=={TRL_PIN} pinned; GRPOTrainer.loss_is_scaled_for_ga changed (micro-batch losses would be rescaled)"
    )


def test_trl_base_output_keys_are_the_documented_six():
    s = src(GRPOTrainer._generate_and_score_completions)
    block = re.search(r"output = \{(.*?)\}", s, re.S)
    assert block, (
        f"trl=={TRL_PIN} pinned; GRPOTrainer._generate_and_score_completions no longer builds `output = {{...}}`"
    )
    keys = set(re.findall(r'"(\w+)":', block.group(1)))
    assert keys == BASE_KEYS, f"trl=={TRL_PIN} pinned; the base batch keys changed: {sorted(keys)}"


def test_split_tensor_dict_drops_rows_that_do_not_divide():
    """Why TalkTrainer pads to a multiple of steps_per_generation (DESIGN §2 pitfall)."""
    from trl.trainer.utils import split_tensor_dict

    d = {"x": torch.arange(10), "n": torch.tensor(7)}
    whole = split_tensor_dict(d, 1)
    assert len(whole) == 1 and whole[0]["x"].tolist() == list(range(10)) and int(whole[0]["n"]) == 7
    parts = split_tensor_dict(d, 3)
    assert sum(len(p["x"]) for p in parts) == 9, (
        f"trl=={TRL_PIN} pinned; split_tensor_dict no longer drops the remainder: revisit the row padding"
    )
    assert all(int(p["n"]) == 7 for p in parts), "scalars (num_items_in_batch) must be copied to every part"


def test_shuffle_sequence_dict_keeps_rows_aligned_and_scalars_whole():
    from trl.trainer.utils import shuffle_sequence_dict

    torch.manual_seed(0)
    d = {
        "prompt_ids": torch.arange(50)[:, None].repeat(1, 3),
        "advantages": torch.arange(50).float(),
        "num_items_in_batch": torch.tensor(123),
    }
    out = shuffle_sequence_dict(d)
    assert out["prompt_ids"][:, 0].tolist() != list(range(50)), "shuffle did not shuffle"
    assert out["prompt_ids"][:, 0].tolist() == out["advantages"].long().tolist(), (
        f"trl=={TRL_PIN} pinned; shuffle_sequence_dict no longer permutes all keys in unison"
    )
    assert int(out["num_items_in_batch"]) == 123


def test_fused_forward_looks_up_use_triton_at_call_time():
    """``patches.score_only_valid_positions_on_cpu`` replaces ``trl.trainer.utils._use_triton``."""
    import trl.trainer.utils as trl_utils

    assert hasattr(trl_utils, "_use_triton"), f"trl=={TRL_PIN} pinned; trl.trainer.utils._use_triton is gone"
    s = src(trl_utils.add_fused_lm_head)
    assert "def _fused_forward(" in s and "compact = _use_triton(" in s, (
        f"trl=={TRL_PIN} pinned; _fused_forward no longer calls `compact = _use_triton(`: "
        "talkmethods.training.patches.score_only_valid_positions_on_cpu patches nothing"
    )
    # ... and our patch, once applied (build_trainer does), scores compactly on a CPU; the original decision elsewhere.
    score_only_valid_positions_on_cpu()
    assert trl_utils._use_triton(torch.device("cpu")) is True
    assert getattr(trl_utils._use_triton, "_talkmethods", False)
    from trl.kernels.chunked_logprob import _use_triton as original

    assert original(torch.device("cpu")) is False  # the patch is what turns compact scoring on


def test_grpo_sampler_repeats_each_prompt_num_generations_times_in_a_row():
    """TalkTrainer takes ``inputs[::num_generations]`` as the step's problems."""
    s = src(GRPOTrainer._get_train_sampler)
    assert "mini_repeat_count=self.num_generations" in s, (
        f"trl=={TRL_PIN} pinned; GRPOTrainer's sampler no longer repeats prompts num_generations times in a row"
    )
    from trl.trainer.utils import RepeatSampler

    idx = list(RepeatSampler(list(range(8)), mini_repeat_count=4, batch_size=8, repeat_count=1, shuffle=True, seed=0))
    assert len(idx) == 32 and sorted(set(idx)) == list(range(8))
    assert all(len(set(idx[4 * k : 4 * k + 4])) == 1 for k in range(8))


def test_repeat_sampler_shuffles_once_an_epoch_and_trainer_sets_the_epoch():
    """``patches.replayable`` replays the sampler's own generator to an epoch's start in ``set_epoch``."""
    from accelerate.data_loader import DataLoaderShard
    from transformers import Trainer
    from trl.trainer.utils import RepeatSampler

    init, it = src(RepeatSampler.__init__), src(RepeatSampler.__iter__)
    assert "self.generator = torch.Generator()" in init and "self.generator.manual_seed(seed)" in init, (
        f"trl=={TRL_PIN} pinned; RepeatSampler no longer shuffles with its own generator seeded once"
    )
    assert (
        "self.num_samples = len(data_source)" in init
        and "self.shuffle = shuffle" in init
        and "self.seed = seed" in init
    )
    assert it.count("torch.randperm(") == 1 and "torch.randperm(self.num_samples, generator=self.generator)" in it, (
        f"trl=={TRL_PIN} pinned; RepeatSampler.__iter__ no longer draws one randperm(num_samples) per epoch: "
        "talkmethods.training.patches.replayable replays the wrong draws"
    )
    assert "set_epoch" not in vars(RepeatSampler), (
        f"trl=={TRL_PIN} pinned; RepeatSampler has a set_epoch of its own now"
    )
    assert "train_dataloader.set_epoch(epoch)" in src(Trainer._run_epoch), (
        f"transformers=={TRANSFORMERS_PIN} pinned; Trainer no longer calls set_epoch on the dataloader every epoch"
    )
    assert "self.batch_sampler.sampler.set_epoch(epoch)" in src(DataLoaderShard.set_epoch), (
        "accelerate's DataLoaderShard.set_epoch no longer reaches the sampler"
    )


# -------------------------------------------------------------------------------------- PEFT


def test_peft_lora_supports_mixed_adapter_batches():
    import peft.tuners.lora.layer as lora_layer
    import peft.tuners.lora.model as lora_model

    assert '"__base__"' in src(lora_layer), f"peft=={PEFT_PIN} pinned; LoRA layers no longer know '__base__'"
    s = src(lora_model.LoraModel._enable_peft_forward_hooks)
    assert 'kwargs.pop("adapter_names", None)' in s, (
        f"peft=={PEFT_PIN} pinned; LoraModel no longer takes adapter_names (mixed batches)"
    )
    # PEFT refuses adapter_names in training mode: PlainGenerator must switch to eval to generate.
    assert "Cannot pass `adapter_names` when the model is in training mode." in s


def test_trainer_saves_and_resumes_a_peft_model_s_adapters_by_sub_folder():
    """A seed cohort's trainer (``training.cohort``) saves its own adapter only (``TalkTrainer._save`` hands
    Trainer's ``self.model.save_pretrained`` call ``selected_adapters``); PEFT writes a non-default adapter
    into a sub-folder named after it, and Trainer's resume loads each sub-folder into the adapter of that
    name, trainable when it is the active one (``set_adapter`` of the seed whose thread resumes)."""
    import transformers
    from peft import PeftModel

    assert "self.model.save_pretrained(output_dir, state_dict=state_dict" in src(transformers.Trainer._save), (
        f"transformers=={TRANSFORMERS_PIN} pinned; Trainer._save no longer saves through self.model.save_pretrained"
    )
    load = src(transformers.Trainer._load_from_checkpoint)
    assert "adapter_subdirs" in load and (
        "model.load_adapter(peft_id, subdir_name, is_trainable=(subdir_name == active_adapter))" in load
    ), f"transformers=={TRANSFORMERS_PIN} pinned; resuming no longer loads adapters from sub-folders by name"
    save = src(PeftModel.save_pretrained)
    assert "selected_adapters" in save and (
        'os.path.join(save_directory, adapter_name) if adapter_name != "default" else save_directory' in save
    ), f"peft=={PEFT_PIN} pinned; a named adapter is no longer saved in its own sub-folder"


def test_peft_set_adapter_leaves_only_that_adapter_trainable():
    """A cohort's optimizer is built from the parameters that require grad when its seed holds the turn."""
    from peft import LoraConfig, get_peft_model

    from talkmethods.models import ModelSpec, load_model

    cfg = LoraConfig(r=4, target_modules=["q_proj"])
    model = get_peft_model(load_model(ModelSpec("offline-tiny-qwen2"), torch.float32), cfg, adapter_name="seed17")
    model.add_adapter("seed18", cfg)
    for active, other in (("seed18", "seed17"), ("seed17", "seed18")):
        model.set_adapter(active)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable and all(f".{active}." in n for n in trainable), trainable
        assert any(f".{other}." in n for n, _ in model.named_parameters())


def test_peft_lora_linear_forward_is_the_sum_fuse_lora_adds_fuses():
    """``patches.fuse_lora_adds`` replaces PEFT's vanilla LoRA branch per layer and reads the layer's internals."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.layer import Linear as LoraLinear

    s = src(LoraLinear.forward)
    assert "if active_adapter not in self.lora_variant:  # vanilla LoRA" in s and (
        "result = result + lora_B(lora_A(dropout(x))) * scaling" in s
    ), (
        f"peft=={PEFT_PIN} pinned; LoRA Linear.forward no longer computes base(x) + B(A(dropout(x))) * scaling: "
        "talkmethods.training.patches._lora_forward would fuse another sum"
    )
    assert "x = self._cast_input_dtype(x, lora_A.weight.dtype)" in s, (
        f"peft=={PEFT_PIN} pinned; LoRA Linear.forward no longer casts the input to the adapter's dtype"
    )
    layer = next(
        m
        for m in get_peft_model(
            torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False)), LoraConfig(r=2, lora_alpha=4, target_modules=["0"])
        ).modules()
        if type(m) is LoraLinear
    )
    missing = [
        n
        for n in (
            "lora_A",
            "lora_B",
            "scaling",
            "lora_dropout",
            "lora_variant",
            "active_adapters",
            "merged",
            "disable_adapters",
            "base_layer",
        )
        if not hasattr(layer, n)
    ]
    assert not missing, f"peft=={PEFT_PIN} pinned; LoRA Linear layers no longer have {missing}"


# ----------------------------------------------------------------- our config and our batch


@pytest.fixture(scope="module")
def built(tmp_path_factory, one_torch_thread):
    """A TalkTrainer from build_trainer, with the GRPOConfig kwargs it passed."""
    passed = {}
    real = build_mod.GRPOConfig

    def recording(**kwargs):
        passed.update(kwargs)
        return real(**kwargs)

    build_mod.GRPOConfig = recording
    try:
        cfg = train_config(
            arm="mixed",
            seed=17,
            model=ModelSpec("offline-tiny-qwen2"),
            steps=1,
            problems_per_step=8,
            learning_rate=3e-4,
            sampling=Sampling(max_new_tokens=4),
            save_every=1000,
            micro_batches=1,
            pack_seats=False,
            ada_draw_ahead=False,
        )
        trainer = build_trainer(
            cfg,
            tiny_problems(8),
            tmp_path_factory.mktemp("contract"),
            judge=lambda turn, problem: turn.completion_ids[0] % 2 == 0,
        )
    finally:
        build_mod.GRPOConfig = real
    return trainer, passed


def test_grpo_config_accepts_every_field_build_trainer_passes(built):
    trainer, passed = built
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    unknown = sorted(set(passed) - fields)
    assert not unknown, f"trl=={TRL_PIN} pinned; GRPOConfig no longer has fields {unknown}"
    args = trainer.args
    for name, value in passed.items():
        if name in ("output_dir", "report_to"):
            continue
        assert getattr(args, name) == value, f"GRPOConfig rewrote {name}: {value!r} -> {getattr(args, name)!r}"
    # What the design pins (DESIGN §2): on-policy, no KL, dapo, no std scaling, recipe batch.
    assert (args.beta, args.num_iterations, args.loss_type, args.scale_rewards) == (0.0, 1, "dapo", "none")
    assert args.steps_per_generation == args.gradient_accumulation_steps == 1
    assert args.generation_batch_size == 32 and args.num_generations == 4
    assert args.learning_rate == 3e-4 and not args.activation_checkpointing


def test_our_batch_has_exactly_the_base_keys(built):
    trainer, _ = built
    batch = next(iter(trainer.get_train_dataloader()))  # what TRL hands _prepare_inputs
    assert len(batch) == 32
    assert all(len({row["id"] for row in batch[4 * k : 4 * k + 4]}) == 1 for k in range(8))
    trainer.model.train()  # as inside trainer.train()
    out = trainer._generate_and_score_completions(batch)
    assert set(out) == OUR_KEYS
    n = out["completion_ids"].shape[0]
    assert n == 96 == trainer.last_rows  # mixed: 8 x (2 x 4 + 2 x 2)
    assert out["advantages"].shape == (n,) and out["advantages"].dtype == torch.float32
    assert out["num_items_in_batch"].ndim == 0
    assert out["prompt_ids"].dtype == out["completion_ids"].dtype == torch.long
    assert trainer._metrics["train"]["talk/rows"][-1] == 96.0


def test_lora_input_uncast_changes_no_number_under_bf16_autocast():
    """PEFT's fp32 adapter casts each LoRA input up; under bf16 autocast skipping that is exact (and cheaper)."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    from talkmethods.models import ModelSpec, load_model
    from talkmethods.training.patches import lora_inputs_uncast

    torch.manual_seed(0)
    model = get_peft_model(
        load_model(ModelSpec("offline-tiny-qwen2"), torch.bfloat16),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj", "gate_proj"]),
    )
    lora = [m for m in model.modules() if isinstance(m, BaseTunerLayer) and hasattr(m, "lora_A")]
    assert lora and all(m.lora_A["default"].weight.dtype == torch.float32 for m in lora)  # PEFT's upcast adapter
    with torch.no_grad():
        for m in lora:
            m.lora_B["default"].weight.normal_()
    ids = torch.randint(0, 1000, (2, 24))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(ids).logits
        with lora_inputs_uncast(model, True):
            assert not any(m.cast_input_dtype_enabled for m in lora)
            got = model(ids).logits
            # the flag PEFT's cast reads (peft.helpers.disable_input_dtype_casting sets the same one)
            x = torch.ones(2, dtype=torch.bfloat16)
            assert lora[0]._cast_input_dtype(x, torch.float32).dtype == torch.bfloat16
    assert all(m.cast_input_dtype_enabled for m in lora)  # restored
    assert lora[0]._cast_input_dtype(x, torch.float32).dtype == torch.float32
    assert torch.equal(got, want)
    with lora_inputs_uncast(model, False):  # no autocast (fp32 on a CPU): PEFT casts as it always does
        assert all(m.cast_input_dtype_enabled for m in lora)


LEFT_PADDED_ROWS = [(5, 9), (11, 4), (2, 12), (0, 0)]  # (prompt, completion) a row; the last an empty filler row
PROMPT_COLUMNS, COMPLETION_COLUMNS = 11, 12


def _fused_head_model_and_left_padded_rows():
    """The offline tiny model (fp32) with TRL's fused head, and a batch of ``LEFT_PADDED_ROWS`` laid out as
    TRL lays it out: prompts left-padded to PROMPT_COLUMNS, completions right-padded to COMPLETION_COLUMNS, labels on the
    completions (as TRL's _get_per_token_logps_and_entropies)."""
    from trl.trainer.utils import add_fused_lm_head

    from talkmethods.models import ModelSpec, load_model

    torch.manual_seed(0)
    model = load_model(ModelSpec("offline-tiny-qwen2"), torch.float32)
    add_fused_lm_head(model, temperature=0.7)
    p_len, c_len = PROMPT_COLUMNS, COMPLETION_COLUMNS
    ids = torch.zeros(len(LEFT_PADDED_ROWS), p_len + c_len, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(LEFT_PADDED_ROWS):
        ids[i, p_len - p : p_len + c] = torch.randint(1, 1000, (p + c,))
        mask[i, p_len - p : p_len + c] = 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-c_len] = -100
    return model, ids, mask, labels


def test_right_aligned_rows_give_the_fused_head_s_numbers():
    """``right_aligned_rows`` rolls each row's pads to its end and drops the mask: TRL's fused head gives
    the same per-token log-probs and gradients as in TRL's own left-padded layout (fp32), the backbone sees
    no mask, and a batch that is not one block of ones a row runs unchanged."""
    from talkmethods.training.patches import right_aligned_rows

    model, ids, mask, labels = _fused_head_model_and_left_padded_rows()
    lengths, p_len, c_len = LEFT_PADDED_ROWS, PROMPT_COLUMNS, COMPLETION_COLUMNS

    seen = []
    probe = model.model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw.get("attention_mask")), with_kwargs=True
    )

    def run(hooks: bool, attention_mask=mask):
        model.zero_grad(set_to_none=True)
        handles = []
        if hooks:
            pre, post = right_aligned_rows()
            handles = [model.register_forward_pre_hook(pre, with_kwargs=True), model.register_forward_hook(post)]
        try:
            out = model(input_ids=ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
        finally:
            for h in handles:
                h.remove()
        weights = (torch.arange(out.log_probs.numel()).view_as(out.log_probs) % 7).float()
        (out.log_probs * weights).sum().backward()
        grads = torch.cat([q.grad.flatten() for q in model.parameters() if q.grad is not None])
        return out.log_probs.detach(), grads

    want, want_grads = run(False)
    assert seen[-1] is not None
    got, got_grads = run(True)
    assert seen[-1] is None, "the backbone still got an attention mask"
    assert got.shape == want.shape == (4, p_len + c_len - 1)
    assert (want[:, -c_len:] != 0).sum() == sum(c for _, c in lengths)  # the completions are scored
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_grads, want_grads, rtol=1e-4, atol=1e-6)
    holey = mask.clone()
    holey[0, p_len] = 0  # not one block: left alone, the mask reaches the backbone
    run(True, holey)
    assert seen[-1] is not None
    probe.remove()


def _tiny_model_and_lora_that_acts():
    """The offline tiny model (fp32) and a copy of it under the recipe's LoRA targets (r 8, alpha 16) whose
    B matrices are random, so the adapter changes the logits (a fresh one's B is zero)."""
    import copy

    from peft import LoraConfig, get_peft_model

    from talkmethods.models import ModelSpec, load_model
    from talkmethods.training.build import LORA_TARGETS

    torch.manual_seed(0)
    base = load_model(ModelSpec("offline-tiny-qwen2"), torch.float32)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=8, lora_alpha=16, target_modules=list(LORA_TARGETS)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return base, model


def _logits_grads_nodes(model, dtype, ids):
    """``model``'s logits on ``ids`` (fp32, or bf16 autocast with the adapter kept fp32), its gradients of a
    logsumexp loss, and the type names of its graph's nodes (which LoRA path ran)."""
    model.zero_grad()
    model.to(dtype)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()  # the adapter stays fp32, as PEFT keeps it under bf16 autocast
    nodes = []
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        logits = model(ids).logits
    seen, todo = set(), [logits.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.append(type(node).__name__)
        todo += [n for n, _ in node.next_functions]
    logits.float().logsumexp(-1).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().float(), grads, nodes


def _flat(grads: dict) -> torch.Tensor:
    return torch.cat([grads[n].flatten() for n in sorted(grads)])


def test_fused_lora_forward_is_peft_s_sum_exactly_in_fp32_and_to_an_ulp_in_bf16():
    """``fuse_lora_adds`` reads PEFT's LoRA internals (lora_A/B, scaling, lora_variant, lora_dropout,
    active_adapters, merged, disable_adapters): same logits and gradients as PEFT's own forward."""
    import copy

    from talkmethods.training.build import LORA_TARGETS
    from talkmethods.training.patches import fuse_lora_adds

    base, want_model = _tiny_model_and_lora_that_acts()
    got_model = copy.deepcopy(want_model)
    assert fuse_lora_adds(got_model) == len(LORA_TARGETS) * base.config.num_hidden_layers
    assert fuse_lora_adds(got_model) == 0  # once only
    ids = torch.randint(0, 1000, (2, 19))

    def run(model, autocast: bool):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(ids).logits
        logits.float().logsumexp(-1).sum().backward()
        return logits.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want, want_grads = run(want_model, False)
    from unittest import mock

    addmm, calls = torch.addmm, []
    with mock.patch("torch.addmm", lambda *a, **k: calls.append(1) or addmm(*a, **k)):
        got, got_grads = run(got_model, False)
    assert len(calls) == len(LORA_TARGETS) * base.config.num_hidden_layers  # the fused path ran, not PEFT's
    assert torch.equal(got, want)  # the scaling (2) is a power of two: moving it is exact
    assert want_grads.keys() == got_grads.keys() and len(want_grads) == 2 * len(LORA_TARGETS) * 2
    for name in want_grads:
        assert torch.allclose(got_grads[name], want_grads[name], rtol=1e-5, atol=1e-7), name
    want, _ = run(want_model, True)
    got, _ = run(got_model, True)
    assert (got - want).abs().max().item() <= 2 * 2.0**-7 * want.abs().max().item()  # a bf16 ulp or two
    with torch.no_grad(), got_model.disable_adapter():  # PEFT's own path: the adapter is off
        assert torch.equal(got_model(ids).logits, base(ids).logits)


def test_lora_own_backward_is_autograd_s_maths():
    """``patches.lora_own_backward``: the fused LoRA layers as one autograd node each give autograd's
    logits and gradients (fp32: to rounding; under bf16 autocast with the adapter in fp32: within what
    bf16 rounding moves), the adapter's gradients in its own dtype, and off again gives autograd's graph."""
    import copy

    from talkmethods.training.build import LORA_TARGETS
    from talkmethods.training.patches import _LoraProduct, fuse_lora_adds, lora_own_backward

    base, want_model = _tiny_model_and_lora_that_acts()
    fuse_lora_adds(want_model)
    got_model = copy.deepcopy(want_model)
    n_layers = len(LORA_TARGETS) * base.config.num_hidden_layers
    assert lora_own_backward(got_model) == n_layers
    ids = torch.randint(0, 1000, (2, 19))
    run = functools.partial(_logits_grads_nodes, ids=ids)
    want, want_grads, want_nodes = run(want_model, torch.float32)
    got, got_grads, got_nodes = run(got_model, torch.float32)
    assert got_nodes.count("_LoraProductBackward") == n_layers and "_LoraProductBackward" not in want_nodes
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert want_grads.keys() == got_grads.keys() and len(want_grads) == 2 * n_layers
    for name in want_grads:
        assert got_grads[name].dtype == torch.float32
        assert torch.allclose(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6), name

    # bf16 autocast, base in bf16, adapter in fp32 (the GPU recipe): both against the fp32 gradients above
    _, want_bf, _ = run(want_model, torch.bfloat16)
    _, got_bf, _ = run(got_model, torch.bfloat16)
    ref = _flat(want_grads)
    err_want = float((_flat(want_bf) - ref).norm() / ref.norm())
    err_got = float((_flat(got_bf) - ref).norm() / ref.norm())
    assert all(g.dtype == torch.float32 for g in got_bf.values())
    print(f"bf16 gradients from fp32: autograd {err_want:.3e}, own backward {err_got:.3e}")
    assert 0 < err_got <= 1.5 * err_want, (err_got, err_want)  # as exact as autograd's bf16 graph, to rounding

    assert lora_own_backward(got_model, on=False) == n_layers
    got_model.float()
    *_, nodes = run(got_model, torch.float32)
    assert "_LoraProductBackward" not in nodes and issubclass(_LoraProduct, torch.autograd.Function)


def test_lora_groups_are_one_node_each_with_autograd_s_maths():
    """``patches.lora_groups``: q/k/v and gate/up as one ``_LoraGroup`` node each (o/down stay one
    ``_LoraProduct`` each), with autograd's logits and gradients (fp32: to rounding; bf16 autocast: within
    what bf16 rounding moves). Pins Qwen2's call order the groups lean on: the group's first layer first,
    the others on the same input. Another order still gives the same numbers; off again, no group node."""
    import copy

    from talkmethods.training.patches import fuse_lora_adds, lora_groups, lora_own_backward

    base, want_model = _tiny_model_and_lora_that_acts()
    fuse_lora_adds(want_model)
    got_model = copy.deepcopy(want_model)
    layers = base.config.num_hidden_layers
    lora_own_backward(got_model)
    assert lora_groups(got_model) == 2 * layers
    run = functools.partial(_logits_grads_nodes, ids=torch.randint(0, 1000, (2, 19)))

    want, want_grads, want_nodes = run(want_model, torch.float32)
    got, got_grads, got_nodes = run(got_model, torch.float32)
    assert got_nodes.count("_LoraGroupBackward") == 2 * layers  # Qwen2 still calls q, k, v (gate, up) in order
    assert got_nodes.count("_LoraProductBackward") == 2 * layers  # o_proj and down_proj on their own
    # Liger's MLP (train.liger_kernels on a GPU) calls gate_proj before up_proj on the same x too
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    assert "(self.gate_proj(x), self.up_proj(x))" in inspect.getsource(LigerSwiGLUMLP.forward)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert want_grads.keys() == got_grads.keys()
    for name in want_grads:
        assert got_grads[name].dtype == torch.float32
        assert torch.allclose(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6), name
    no_stash = [n for n, m in got_model.named_modules() if "_group_output" in m.__dict__]
    assert not no_stash, no_stash  # every layer took its output back: nothing held past the forward

    _, want_bf, _ = run(want_model, torch.bfloat16)
    _, got_bf, _ = run(got_model, torch.bfloat16)
    ref = _flat(want_grads)
    err_want = float((_flat(want_bf) - ref).norm() / ref.norm())
    err_got = float((_flat(got_bf) - ref).norm() / ref.norm())
    print(f"bf16 gradients from fp32: autograd {err_want:.3e}, LoRA groups {err_got:.3e}")
    assert all(g.dtype == torch.float32 for g in got_bf.values())
    assert 0 < err_got <= 1.5 * err_want, (err_got, err_want)

    # another order (v, then q, k): v computes its own sum, q's group leaves v an output it never takes
    got_model.float(), want_model.float()
    got_attn, want_attn = (m.base_model.model.model.layers[0].self_attn for m in (got_model, want_model))
    x = torch.randn(2, 5, base.config.hidden_size)
    v = got_attn.v_proj(x)
    q, k = got_attn.q_proj(x), got_attn.k_proj(x)
    for got_y, want_y in zip((q, k, v), (want_attn.q_proj(x), want_attn.k_proj(x), want_attn.v_proj(x)), strict=True):
        assert torch.allclose(got_y, want_y, rtol=1e-5, atol=1e-6)
    assert "_group_output" in got_attn.v_proj.__dict__  # the output v did not take back ...
    x_next = x + 1
    assert torch.allclose(got_attn.v_proj(x_next), want_attn.v_proj(x_next), rtol=1e-5, atol=1e-6)
    assert "_group_output" not in got_attn.v_proj.__dict__  # ... is dropped, never returned for another input

    assert lora_groups(got_model, on=False) == 2 * layers
    *_, nodes = run(got_model, torch.float32)
    assert "_LoraGroupBackward" not in nodes and nodes.count("_LoraProductBackward") == 7 * layers


IMPORT_THEN_BUILD = """
import sys
sys.path.insert(0, sys.argv[1])  # tests/, for conftest
import peft.helpers, peft.tuners.lora.layer as lora_layer, transformers.trainer as hf_trainer
import trl.trainer.grpo_trainer as grpo, trl.trainer.utils as trl_utils
from trl.kernels.chunked_logprob import _use_triton as original

def snapshot():
    owners = (trl_utils, grpo, hf_trainer, peft.helpers, lora_layer, grpo.GRPOTrainer, hf_trainer.Trainer,
              lora_layer.Linear, trl_utils.RepeatSampler)
    return {(repr(o), k): id(v) for o in owners for k, v in vars(o).items() if not k.startswith("__")}

before = snapshot()
import talkmethods.evaluate, talkmethods.split, talkmethods.warmstart
import talkmethods.training.build, talkmethods.training.patches, talkmethods.training.rows, talkmethods.training.runs
import talkmethods.training.trainer
changed = sorted(k for k, v in snapshot().items() if before.get(k) != v)
assert not changed, f"importing talkmethods.training patched {changed}"
assert trl_utils._use_triton is original

from conftest import tiny_problems, train_config
from talkmethods.engines.sampling import Sampling
from talkmethods.models import ModelSpec
from talkmethods.training.build import build_trainer

cfg = train_config(arm="grpo", seed=17, model=ModelSpec("offline-tiny-qwen2"), steps=1, problems_per_step=2,
                  sampling=Sampling(max_new_tokens=2), save_every=1000, micro_batches=1, pack_seats=False, ada_draw_ahead=False)
trainer = build_trainer(cfg, tiny_problems(2), sys.argv[2])
assert trl_utils._use_triton is not original and trl_utils._use_triton._talkmethods, "build_trainer did not patch TRL"
import transformers.models.qwen2.modeling_qwen2 as mq
assert cfg.liger_kernels and not trainer.liger and mq.apply_rotary_pos_emb.__module__ == mq.__name__, "Liger on a CPU"
fused = [m for m in trainer.model.modules() if type(m) is lora_layer.Linear and "forward" in vars(m)]
assert len(fused) == trainer.lora_layers_fused > 0, (len(fused), trainer.lora_layers_fused)
assert "forward" in vars(lora_layer.Linear) and not hasattr(lora_layer.Linear.forward, "__self__"), "PEFT's class is untouched"
print("ok", len(fused))
"""


def test_importing_talkmethods_training_patches_nothing(tmp_path):
    """No patch at import: TRL, PEFT and transformers are as shipped until build_trainer applies them (a fresh process)."""
    _runs_in_a_fresh_process(IMPORT_THEN_BUILD, tmp_path)


def _runs_in_a_fresh_process(script: str, tmp_path) -> None:
    """Run ``script`` (argv: tests/, a scratch dir) in a fresh interpreter; it must print "ok"."""
    out = subprocess.run(
        [sys.executable, "-c", script, str(Path(__file__).parent), str(tmp_path)],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        check=False,
    )
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-3000:]


LIGER_ON_THE_TINY_MODEL = """
import sys
sys.path.insert(0, sys.argv[1])
import inspect
import peft.tuners.lora.layer as lora_layer
import transformers.models.qwen2.modeling_qwen2 as mq
from liger_kernel.transformers.rms_norm import LigerRMSNorm
from liger_kernel.transformers.rope import liger_rotary_pos_emb
from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
from conftest import tiny_problems, train_config
from talkmethods.engines.sampling import Sampling
from talkmethods.models import ModelSpec
from talkmethods.training.build import build_trainer
from talkmethods.training.patches import liger_kernels

cfg = train_config(arm="grpo", seed=17, model=ModelSpec("offline-tiny-qwen2"), steps=1, problems_per_step=2,
                  sampling=Sampling(max_new_tokens=2), save_every=1000, micro_batches=1, pack_seats=False, ada_draw_ahead=False)
trainer = build_trainer(cfg, tiny_problems(2), sys.argv[2])
model = trainer.model
forward = model.get_base_model().forward
liger_kernels(model)  # what build_trainer does on a CUDA GPU (the kernels themselves need one to run)
base = model.get_base_model().model
norms = [base.norm] + [n for l in base.layers for n in (l.input_layernorm, l.post_attention_layernorm)]
assert all(n.forward.__func__ is LigerRMSNorm.forward for n in norms), "Liger no longer patches the norms' forward"
assert all(l.mlp.forward.__func__ is LigerSwiGLUMLP.forward for l in base.layers), "Liger no longer patches the MLPs"
assert all(isinstance(l.mlp.gate_proj, lora_layer.Linear) for l in base.layers), "the MLP lost its LoRA layers"
mlp_src = inspect.getsource(LigerSwiGLUMLP.forward)
assert all(f"self.{p}_proj(" in mlp_src for p in ("gate", "up", "down")), "Liger's MLP skips the (LoRA) projections"
assert mq.apply_rotary_pos_emb is liger_rotary_pos_emb, "Liger no longer replaces modeling_qwen2's RoPE"
assert "apply_rotary_pos_emb(" in inspect.getsource(mq.Qwen2Attention.forward), "Qwen2Attention looks RoPE up elsewhere"
assert model.get_base_model().forward == forward, "Liger replaced the model's forward (its fused linear loss)"
print("ok")
"""


def test_liger_patches_the_qwen2_pieces_the_recipe_names(tmp_path):
    """train.liger_kernels: the pinned Liger swaps exactly the norms, the MLPs and RoPE, and keeps LoRA and the head.

    In a fresh process: Liger's RoPE and classes are patched process-wide. The kernels need a CUDA GPU;
    their numbers are checked there, against eager and fp32 (bench/speed.py --grad-check --train-liger).
    """
    from importlib.metadata import version

    import liger_kernel.transformers

    assert version("liger-kernel") == LIGER_PIN, f"liger-kernel=={LIGER_PIN} pinned, found {version('liger-kernel')}"
    sig = inspect.signature(liger_kernel.transformers.apply_liger_kernel_to_qwen2).parameters
    assert {"rope", "rms_norm", "swiglu", "cross_entropy", "fused_linear_cross_entropy", "model"} <= set(sig)
    _runs_in_a_fresh_process(LIGER_ON_THE_TINY_MODEL, tmp_path)


def test_packed_rows_give_the_fused_head_s_numbers():
    """``packed_rows`` runs a micro-batch's rows as one row of real tokens (varlen attention, each row's
    positions from 0, pre-shifted labels): TRL's fused head gives the same per-token log-probs and
    gradients as in TRL's own left-padded layout (fp32), in TRL's layout; the backbone sees one row and
    no mask; the model's attention implementation is back after the call; a batch that is not one block
    of ones a row runs unchanged."""
    from talkmethods.training.patches import PACKED_ATTENTION, packed_rows

    model, ids, mask, labels = _fused_head_model_and_left_padded_rows()
    lengths, p_len, c_len = LEFT_PADDED_ROWS, PROMPT_COLUMNS, COMPLETION_COLUMNS
    before = model.config._attn_implementation

    seen = []
    probe = model.model.register_forward_pre_hook(
        lambda m, a, kw: seen.append((kw.get("input_ids"), kw.get("attention_mask"), m.config._attn_implementation)),
        with_kwargs=True,
    )

    def run(packed: bool, attention_mask=mask):
        model.zero_grad(set_to_none=True)
        if packed:
            with packed_rows(model):
                out = model(input_ids=ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
        else:
            out = model(input_ids=ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
        weights = (torch.arange(out.log_probs.numel()).view_as(out.log_probs) % 7).float()
        (out.log_probs * weights).sum().backward()
        grads = torch.cat([q.grad.flatten() for q in model.parameters() if q.grad is not None])
        return out.log_probs.detach(), grads

    want, want_grads = run(False)
    got, got_grads = run(True)
    seen_ids, seen_mask, seen_impl = seen[-1]
    assert seen_ids.shape == (1, sum(p + c for p, c in lengths)), "the backbone did not get one row of real tokens"
    assert seen_impl == PACKED_ATTENTION and all(m is None for m in seen_mask.values())
    assert model.config._attn_implementation == before
    assert got.shape == want.shape == (4, p_len + c_len - 1)
    assert (want[:, -c_len:] != 0).sum() == sum(c for _, c in lengths)  # the completions are scored
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # fp32 sums in another order (one row, not four): one element in ~10M moves by 1.4e-6 (of 2.7e-3)
    assert float((got_grads - want_grads).norm() / want_grads.norm()) < 1e-5
    holey = mask.clone()
    holey[0, p_len] = 0  # not one block: left alone, the batch reaches the backbone as it was
    run(True, holey)
    assert seen[-1][0].shape == ids.shape and seen[-1][2] == before

    def fail(*_):
        raise RuntimeError("a forward that dies midway")

    dies = model.model.layers[0].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="midway"), packed_rows(model):  # a dead forward leaves the model as it was
        model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    dies.remove()
    assert model.config._attn_implementation == before
    probe.remove()
