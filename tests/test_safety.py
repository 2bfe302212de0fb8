"""Safety: model output is never evaluated, remote code is never trusted, checkpoints load without pickle code.

Static scans (AST, so comments and docstrings that *mention* ``eval`` do not count) cover the package
and the Snakemake scripts; the loaders are then called with the hub entry points replaced by recorders,
and the checkpoint paths (HF Trainer's resume in transformers 5.23, PEFT's adapter load) are run with
``torch.load`` replaced by a recorder, so a version bump that drops ``weights_only=True`` fails here.
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import dotted_name

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted(
    [*(REPO / "talkmethods").rglob("*.py"), *(REPO / "workflow_scripts").glob("*.py"), *(REPO / "bench").glob("*.py")]
)
SPEC_NAME = "offline-tiny-qwen2"


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _calls(path: Path):
    """(call node, dotted callee name) for every call in ``path``."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Call):
            yield node, dotted_name(node.func)


def test_the_scan_sees_the_package():
    assert len(SOURCES) > 20 and any(p.name == "grading.py" for p in SOURCES)


def _evaluates(node: ast.Call, name: str) -> bool:
    """A call that evaluates a string or runs code: bare eval/exec/compile/__import__, any sympify or
    parse_expr, os.system/os.popen, or an ``x.eval(...)`` with arguments (``module.eval()`` with none only
    switches a torch module to inference mode; ``re.compile``/``torch.compile`` evaluate no text)."""
    tail = name.rsplit(".", 1)[-1]
    if name in ("eval", "exec", "compile", "__import__", "os.system", "os.popen"):
        return True
    if tail in ("sympify", "parse_expr", "exec"):
        return True
    return tail == "eval" and bool(node.args or node.keywords)


def test_nothing_evaluates_strings():
    """No eval/exec/compile/sympify/parse_expr, no pickle or unsafe YAML, no shell anywhere in the code."""
    found = []
    for path in SOURCES:
        for node, name in _calls(path):
            tail = name.rsplit(".", 1)[-1]
            if _evaluates(node, name):
                found.append(f"{_rel(path)}:{node.lineno} {name}()")
            if name.startswith(("pickle.", "cPickle.", "dill.", "marshal.")) and tail.startswith("load"):
                found.append(f"{_rel(path)}:{node.lineno} {name}()")
            if name in ("yaml.load", "yaml.load_all", "yaml.unsafe_load", "yaml.full_load"):
                found.append(f"{_rel(path)}:{node.lineno} {name}() (use yaml.safe_load)")
            if any(
                k.arg == "shell" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                for k in node.keywords
            ):
                found.append(f"{_rel(path)}:{node.lineno} {name}(shell=...)")
    assert not found, found


def test_imports_no_symbolic_evaluator():
    found = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            mods = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            found += [
                f"{_rel(path)}: {m}"
                for m in mods
                if m.split(".")[0]
                in {"sympy", "math_verify", "latex2sympy2", "latex2sympy2_extended", "pickle", "dill"}
            ]
    assert not found, found


def test_trust_remote_code_is_never_true():
    """Every trust_remote_code= in the code is the constant False; no config or script text turns it on."""
    keywords = []
    for path in SOURCES:
        for node, name in _calls(path):
            for k in node.keywords:
                if k.arg == "trust_remote_code":
                    keywords.append((f"{_rel(path)}:{node.lineno} {name}", k.value))
                if k.arg is None:  # **kwargs could smuggle it in: only allowed where no hub loader is called
                    assert not name.endswith("from_pretrained"), f"{_rel(path)}:{node.lineno} {name}(**...)"
    assert keywords, "load_model/load_tokenizer should pass trust_remote_code=False explicitly"
    bad = [w for w, v in keywords if not (isinstance(v, ast.Constant) and v.value is False)]
    assert not bad, bad
    texts = [
        *SOURCES,
        REPO / "config.yaml",
        REPO / "offline.yaml",
        *(REPO / "rules").glob("*.smk"),
        REPO / "Snakefile",
    ]
    pattern = re.compile(r"trust_remote_code\s*[:=]\s*(True|true|1|yes)", re.I)
    assert not [str(p) for p in texts if pattern.search(p.read_text())]
    assert "trust_remote_code" not in (REPO / "talkmethods/schemas/config.schema.yaml").read_text()


def test_every_from_pretrained_call_names_trust_remote_code_false():
    """AutoModel/AutoTokenizer.from_pretrained must say trust_remote_code=False (PeftModel's has no such knob)."""
    missing = []
    for path in SOURCES:
        for node, name in _calls(path):
            if name.startswith("Auto") and name.endswith(".from_pretrained"):
                if not any(k.arg == "trust_remote_code" for k in node.keywords):
                    missing.append(f"{_rel(path)}:{node.lineno} {name}")
    assert not missing, missing


def test_loaders_pass_trust_remote_code_false(monkeypatch, tmp_path):
    """Call load_model/load_tokenizer for a hub id and a local dir with the transformers entry points recorded."""
    import transformers

    from talkmethods.models import ModelSpec, load_model, load_tokenizer

    seen = []

    class Tok:
        pad_token = None

    def record(kind):
        def from_pretrained(name, *args, **kwargs):
            seen.append((kind, name, kwargs))
            return Tok() if kind == "tokenizer" else torch.nn.Linear(1, 1)

        return from_pretrained

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", record("tokenizer"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", record("model"))
    for name in ("Qwen/Qwen2.5-1.5B-Instruct", str(tmp_path)):
        load_tokenizer(ModelSpec(name))
        load_model(ModelSpec(name), torch.float32, "cpu")
    assert [(k, n) for k, n, _ in seen] == [
        ("tokenizer", "Qwen/Qwen2.5-1.5B-Instruct"),
        ("model", "Qwen/Qwen2.5-1.5B-Instruct"),
        ("tokenizer", str(tmp_path)),
        ("model", str(tmp_path)),
    ]
    assert all(kw.get("trust_remote_code") is False for _, _, kw in seen), seen


def test_transformers_resume_path_loads_with_weights_only():
    """Pin transformers 5.23's Trainer: every torch.load in its resume code passes weights_only=True."""
    import inspect
    import textwrap

    import transformers
    from transformers import Trainer

    assert transformers.__version__ == "5.23.0"
    names = [
        "_load_rng_state",
        "_load_optimizer_and_scheduler",
        "_load_scaler",
        "_load_from_checkpoint",
        "_load_best_model",
    ]
    checked = 0
    for name in names:
        fn = getattr(Trainer, name, None)
        if fn is None:
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and dotted_name(node.func) == "torch.load":
                kw = {k.arg: k.value for k in node.keywords}
                assert isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True, (
                    f"Trainer.{name}: torch.load without weights_only=True (line {node.lineno})"
                )
                checked += 1
    assert checked >= 4, checked  # rng state, optimizer, scheduler, scaler at least


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A real one-step checkpoint of the tiny model (TalkTrainer, parity reward) and its trainer."""
    from conftest import tiny_problems, train_config

    from talkmethods.engines.sampling import Sampling
    from talkmethods.models import ModelSpec
    from talkmethods.training.build import build_trainer

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    work = tmp_path_factory.mktemp("ckpt")
    cfg = train_config(
        arm="grpo",
        seed=3,
        model=ModelSpec(SPEC_NAME),
        steps=1,
        problems_per_step=2,
        save_every=1,
        sampling=Sampling(max_new_tokens=2),
        micro_batches=1,
        pack_seats=False,
        ada_draw_ahead=False,
    )
    trainer = build_trainer(
        cfg,
        tiny_problems(4),
        work,
        judge=lambda turn, problem: bool(turn.completion_ids) and turn.completion_ids[0] % 2 == 0,
    )
    trainer.train()
    yield trainer, work / "checkpoint-1"
    torch.set_num_threads(before)


class TorchLoadRecorder:
    def __init__(self, monkeypatch):
        self.calls = []
        original = torch.load

        def load(*args, **kwargs):
            self.calls.append(kwargs.get("weights_only"))
            return original(*args, **kwargs)

        monkeypatch.setattr(torch, "load", load)


def test_resume_loads_checkpoint_state_with_weights_only(tiny_checkpoint, monkeypatch):
    """Run the resume loaders of a real checkpoint: every torch.load is weights_only=True, the adapter is safetensors."""
    trainer, ckpt = tiny_checkpoint
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "adapter_model.bin").exists()
    assert {p.name for p in ckpt.glob("*.pt*")} == {"optimizer.pt", "scheduler.pt", "rng_state.pth"}
    rec = TorchLoadRecorder(monkeypatch)
    trainer._load_rng_state(str(ckpt))
    trainer._load_optimizer_and_scheduler(str(ckpt))
    trainer._load_from_checkpoint(str(ckpt))
    assert len(rec.calls) >= 3 and all(w is True for w in rec.calls), rec.calls


def test_a_pickled_payload_in_a_checkpoint_is_refused(tiny_checkpoint, tmp_path, monkeypatch):
    """A tampered rng_state.pth that would run code on unpickling fails under weights_only instead of running."""
    trainer, ckpt = tiny_checkpoint
    bad = tmp_path / "checkpoint-1"
    shutil.copytree(ckpt, bad)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"python": Payload()}, bad / "rng_state.pth")
    with pytest.raises(Exception, match="(?i)weights_only|unsupported global|not allowed"):
        trainer._load_rng_state(str(bad))
    assert not marker.exists()


def test_eval_adapter_load_is_safetensors_only(tiny_checkpoint, monkeypatch, tmp_path):
    """evaluate.run_eval loads adapters with PeftModel.from_pretrained: safetensors, no torch.load."""
    from peft import PeftModel

    from talkmethods.models import ModelSpec, load_model

    trainer, _ = tiny_checkpoint
    adapter = tmp_path / "adapter"
    trainer.model.save_pretrained(str(adapter))
    assert (adapter / "adapter_model.safetensors").is_file()
    rec = TorchLoadRecorder(monkeypatch)
    opened = []
    import peft.utils.save_and_load as peft_io

    real_load_file = peft_io.safe_load_file

    def spy(path, *args, **kwargs):
        opened.append(str(path))
        return real_load_file(path, *args, **kwargs)

    monkeypatch.setattr(peft_io, "safe_load_file", spy)
    PeftModel.from_pretrained(load_model(ModelSpec(SPEC_NAME), torch.float32, "cpu"), str(adapter), is_trainable=False)
    assert rec.calls == [] and opened == [str(adapter / "adapter_model.safetensors")]
    # PEFT's fallback for a .bin adapter also refuses pickled code: weights_only defaults to True there.
    assert "weights_only=True" in Path(peft_io.__file__).read_text().split("def torch_load", 1)[1][:200]


def test_training_args_pickle_is_never_loaded_on_resume():
    """training_args.bin (a full pickle HF writes into each checkpoint) is not read by the resume path."""
    import inspect

    from transformers import Trainer

    from talkmethods import training

    src = "".join(
        inspect.getsource(getattr(Trainer, n))
        for n in (
            "_load_rng_state",
            "_load_optimizer_and_scheduler",
            "_load_from_checkpoint",
            "train",
            "_inner_training_loop",
            "_init_training_state",
        )
    )
    assert "TRAINING_ARGS_NAME" not in src and "training_args.bin" not in src
    ours = list(Path(training.__file__).parent.glob("*.py"))
    assert len(ours) >= 5 and not any("training_args.bin" in p.read_text() for p in ours)
