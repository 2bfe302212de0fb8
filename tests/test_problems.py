"""Tests for talkmethods.problems: jsonl checks, the three sources, the atomic writer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from talkmethods import problems
from talkmethods.problems import DataError, load_gsm8k, load_jsonl_problems, write_jsonl

GSM8K_DIR = Path(__file__).resolve().parents[2] / "shared/data/gsm8k"

GOOD = {"question": "Ava has 3 pens. Ben has 2 pens. How many pens?", "answer": "3+2=5\n#### 5"}


def _row(question: str = GOOD["question"], answer: str = GOOD["answer"]) -> str:
    return json.dumps({"question": question, "answer": answer})


def _write(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_load_good_file_canonicalises_gold(tmp_path):
    path = _write(
        tmp_path / "train.jsonl",
        _row(),
        "",
        _row("Q two. Fact. How much?", "so\n#### $1,000"),
        _row("Q three. Fact. How much?", "so\n####  -7 "),
    )
    loaded = load_jsonl_problems(path)
    assert loaded[0] == {"source": "train", "index": 0, **GOOD, "gold": "5"}
    # The blank line is skipped; index stays the 0-based physical line.
    assert [(p["index"], p["gold"]) for p in loaded] == [(0, "5"), (2, "1000"), (3, "-7")]
    assert load_jsonl_problems(path, source="gsm8k-train")[1]["source"] == "gsm8k-train"


@pytest.mark.parametrize(
    ("lines", "line", "fragment"),
    [
        ([_row(), json.dumps({"answer": "#### 3"})], 2, "missing field 'question'"),
        ([json.dumps({"question": "Q?"})], 1, "missing field 'answer'"),
        ([_row(), _row("Other?", "no marker here")], 2, "no '#### <number>'"),
        ([_row("Other?", "so\n#### twelve")], 1, "not a number: 'twelve'"),
        ([_row("Other?", "so\n#### 3/4")], 1, "not a number"),
        ([_row(), _row("Other?"), '{"question": "Q?", "answer": '], 3, "broken JSON"),
        ([_row(), '["a", "list"]'], 2, "expected a JSON object"),
        ([_row(), _row(question=""), _row()], 2, "non-empty string"),
        ([_row(), _row("Other?"), _row()], 3, "same question text as line 1"),
        ([_row(), _row("  " + GOOD["question"].replace(" ", "  "))], 2, "duplicate problem"),
        ([], 1, "file is empty"),
        (["", "   "], 1, "file is empty"),
    ],
    ids=[
        "missing-question",
        "missing-answer",
        "no-marker",
        "non-numeric-gold",
        "fraction-gold",
        "broken-json",
        "not-object",
        "empty-question",
        "duplicate",
        "duplicate-whitespace",
        "empty-file",
        "blank-file",
    ],
)
def test_bad_file_names_file_and_line(tmp_path, lines, line, fragment):
    path = _write(tmp_path / "bad.jsonl", *lines)
    with pytest.raises(DataError) as err:
        load_jsonl_problems(path)
    message = str(err.value)
    assert str(path) in message
    assert f"line {line}" in message
    assert fragment in message


def test_data_error_is_a_value_error():
    assert issubclass(DataError, ValueError)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="file not found") as err:
        load_jsonl_problems(tmp_path / "nope.jsonl")
    assert str(tmp_path / "nope.jsonl") in str(err.value)


def test_local_missing_dir_names_it(tmp_path):
    missing = tmp_path / "no_such_dir"
    with pytest.raises(DataError, match="data.local_dir not found") as err:
        load_gsm8k("local", str(missing))
    assert str(missing) in str(err.value)


def test_local_missing_test_file_names_it(tmp_path):
    _write(tmp_path / "train.jsonl", _row())
    with pytest.raises(DataError, match="file not found") as err:
        load_gsm8k("local", tmp_path)
    assert str(tmp_path / "test.jsonl") in str(err.value)


def test_local_without_dir_says_which_key(tmp_path):
    with pytest.raises(DataError, match="data.local_dir is not set"):
        load_gsm8k("local", None)


def test_local_bad_line_names_file_and_line(tmp_path):
    _write(tmp_path / "train.jsonl", _row())
    _write(tmp_path / "test.jsonl", _row("Other?"), _row("Third?", "#### x"))
    with pytest.raises(DataError) as err:
        load_gsm8k("local", tmp_path)
    assert f"{tmp_path / 'test.jsonl'}, line 2" in str(err.value)


def test_local_small_folder(tmp_path):
    _write(tmp_path / "train.jsonl", _row(), _row("Other?", "#### 1,234"))
    _write(tmp_path / "test.jsonl", _row("Third?", "#### 7"))
    train, test = load_gsm8k("local", tmp_path)
    assert [p["gold"] for p in train] == ["5", "1234"]
    assert [p["source"] for p in train + test] == ["gsm8k-train"] * 2 + ["gsm8k-test"]


def test_unknown_source():
    with pytest.raises(DataError, match="data.source must be one of hub, local, generated"):
        load_gsm8k("huggingface", None)


def test_real_gsm8k_loads():
    if not GSM8K_DIR.is_dir():
        pytest.fail(f"real GSM8K not found at {GSM8K_DIR}: expected ../shared/data/gsm8k")
    train, test = load_gsm8k("local", GSM8K_DIR)
    assert (len(train), len(test)) == (7473, 1319)
    assert train[0]["gold"] == "72" and train[0]["index"] == 0
    assert all(p["gold"].lstrip("-").isdigit() for p in train + test)


# ---- hub source, with datasets.load_dataset monkeypatched ------------------------------------


def test_hub_uses_openai_gsm8k_main(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return {
            "train": [GOOD, {"question": "Other?", "answer": "#### 1,000"}],
            "test": [{"question": "Third?", "answer": "x\n#### $4"}],
        }

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    train, test = load_gsm8k("hub", None)
    assert calls == [(("openai/gsm8k", "main"), {})]
    assert train[1] == {
        "source": "gsm8k-train",
        "index": 1,
        "question": "Other?",
        "answer": "#### 1,000",
        "gold": "1000",
    }
    assert test[0]["gold"] == "4" and test[0]["source"] == "gsm8k-test"


def test_hub_unreachable_suggests_local(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError) as err:
        load_gsm8k("hub", None)
    message = str(err.value)
    assert "openai/gsm8k" in message
    assert "data.source: local" in message and "local_dir" in message
    assert isinstance(err.value.__cause__, ConnectionError)


def test_hub_bad_row_names_split_and_row(monkeypatch):
    datasets = pytest.importorskip("datasets")
    rows = {"train": [GOOD, {"question": "Q?", "answer": "no gold"}], "test": [GOOD]}
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: rows)
    with pytest.raises(DataError, match=r"openai/gsm8k train, row 2: .*'####"):
        load_gsm8k("hub", None)


# ---- generated source --------------------------------------------------------------------------


def test_generated_pools_are_disjoint_and_deterministic():
    train, test = load_gsm8k("generated", None, seed=3, n_generated_train=40, n_generated_test=12)
    assert (len(train), len(test)) == (40, 12)
    assert not {p["question"] for p in train} & {p["question"] for p in test}
    assert [p["index"] for p in test] == list(range(12))
    assert {p["source"] for p in train} == {"synthetic-train"}
    again = load_gsm8k("generated", None, seed=3, n_generated_train=40, n_generated_test=12)
    assert again == (train, test)
    assert load_gsm8k("generated", None, seed=4, n_generated_train=40, n_generated_test=12) != again


# ---- write_jsonl -------------------------------------------------------------------------------


def test_write_jsonl_is_deterministic(tmp_path):
    path = tmp_path / "out" / "problems.jsonl"
    write_jsonl(path, [{"b": 1, "a": "café"}, {"z": [1, 2], "id": "x"}])
    assert path.read_bytes() == ('{"a": "café", "b": 1}\n{"id": "x", "z": [1, 2]}\n').encode()
    assert os.listdir(path.parent) == ["problems.jsonl"]  # no temp file left


def test_write_jsonl_round_trips_problems(tmp_path):
    path = tmp_path / "train.jsonl"
    write_jsonl(path, [GOOD, {"question": "Other?", "answer": "#### 9"}])
    assert [p["gold"] for p in load_jsonl_problems(path)] == ["5", "9"]


def test_write_jsonl_failure_keeps_old_file(tmp_path, monkeypatch):
    path = tmp_path / "problems.jsonl"
    write_jsonl(path, [{"old": True}])
    before = path.read_bytes()

    def records():
        yield {"new": True}
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        write_jsonl(path, records())
    assert path.read_bytes() == before

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(problems.os, "replace", broken_replace)
    with pytest.raises(OSError):
        write_jsonl(path, [{"new": True}])
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["problems.jsonl"]
