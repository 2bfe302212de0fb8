"""Loading GSM8K-style problems: the hub dataset, a local jsonl folder, or the offline generator.

Every source goes through one row check (`question`, `answer` with a `#### N` gold), so a
bad file fails before any job runs with a `DataError` that names the file and the line.
Loaded records are plain dicts::

    {"source": "gsm8k-train", "index": 42, "question": ..., "answer": ..., "gold": "72"}

`index` is the 0-based line (or hub row) so that ids built from it (``gsm8k-train-00042``)
point back into the original file. `write_jsonl` is the one deterministic, atomic writer.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from talkmethods.errors import UserError

log = logging.getLogger(__name__)

HUB_DATASET = "openai/gsm8k"
HUB_CONFIG = "main"
SOURCES = ("hub", "local", "generated")

# GSM8K golds are integers; a decimal or a sign is accepted so that other GSM8K-style files load.
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_HINT = (
    "set data.source: local with data.local_dir pointing to a folder holding train.jsonl "
    "and test.jsonl (fields question, answer), or data.source: generated for the offline default"
)


class DataError(UserError, ValueError):
    """Bad or missing input data; the message names the file (and the 1-based line) to fix."""


def canonical_gold(answer: str, where: str) -> str:
    """Extract the gold number after the last ``####`` of a GSM8K solution.

    Args:
        answer: The solution text, ending in ``#### N``.
        where: Location for error messages, e.g. ``"train.jsonl, line 3"``.

    Returns:
        The number as a string with commas and ``$`` removed, e.g. ``"1000"`` for ``$1,000``.

    Raises:
        DataError: No ``####`` marker, or the text after it is not a number.
    """
    if "####" not in answer:
        raise DataError(f"{where}: field 'answer' has no '#### <number>' gold marker")
    raw = answer.rpartition("####")[2].strip()
    gold = raw.replace(",", "").replace("$", "").strip()
    if not _NUMBER.fullmatch(gold):
        raise DataError(f"{where}: gold after '####' is not a number: {raw!r}")
    return gold


def parse_problem(row: object, where: str, source: str, index: int) -> dict:
    """Check one GSM8K-style row and turn it into a problem record.

    Args:
        row: The decoded row; must be a mapping with string fields ``question`` and ``answer``.
        where: Location for error messages (file and 1-based line, or hub split and row).
        source: Pool name used in ids, e.g. ``"gsm8k-train"``.
        index: 0-based position of the row in its file or split.

    Returns:
        ``{"source", "index", "question", "answer", "gold"}``.

    Raises:
        DataError: The row is not an object, a field is missing or empty, or the gold is bad.
    """
    if not isinstance(row, Mapping):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for field in ("question", "answer"):
        if field not in row:
            raise DataError(f"{where}: missing field {field!r}")
        if not isinstance(row[field], str) or not row[field].strip():
            raise DataError(f"{where}: field {field!r} must be a non-empty string")
    return {
        "source": source,
        "index": index,
        "question": row["question"],
        "answer": row["answer"],
        "gold": canonical_gold(row["answer"], where),
    }


def _check_duplicates(problems: list[dict], name: str, unit: str) -> None:
    """Raise if two problems share a question text (whitespace-normalised)."""
    first_seen: dict[str, int] = {}
    for problem in problems:
        key = " ".join(problem["question"].split())
        if key in first_seen:
            raise DataError(
                f"{name}, {unit} {problem['index'] + 1}: duplicate problem: same question text "
                f"as {unit} {first_seen[key] + 1}"
            )
        first_seen[key] = problem["index"]


def load_jsonl_problems(path: str | os.PathLike, source: str | None = None) -> list[dict]:
    """Load and check a GSM8K-style jsonl file (one ``{"question", "answer"}`` object a line).

    Blank lines are skipped; ``index`` stays the 0-based physical line, so ids point at the file.

    Args:
        path: The jsonl file.
        source: Pool name used in ids; defaults to the file stem (``train``).

    Returns:
        Problem records in file order (see `parse_problem`).

    Raises:
        DataError: Missing or empty file, broken JSON line, missing field, answer without
            ``####``, non-numeric gold, or two lines with the same question text.
    """
    path = Path(path)
    source = source if source is not None else path.stem
    if not path.is_file():
        raise DataError(f"{path}: file not found (expected GSM8K-style jsonl)")
    problems = []
    with path.open(encoding="utf-8") as handle:
        for index, line in enumerate(handle):
            if not line.strip():
                continue
            where = f"{path}, line {index + 1}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: broken JSON ({exc.msg}, column {exc.colno})") from exc
            problems.append(parse_problem(row, where, source, index))
    if not problems:
        raise DataError(f"{path}, line 1: file is empty (expected one JSON problem a line)")
    _check_duplicates(problems, str(path), "line")
    log.info("loaded %d problems from %s", len(problems), path)
    return problems


def _load_hub() -> tuple[list[dict], list[dict]]:
    """Load ``openai/gsm8k`` (config ``main``) through `datasets`, imported only here."""
    try:
        import datasets  # heavy import; only the hub source needs it

        dataset = datasets.load_dataset(HUB_DATASET, HUB_CONFIG)
    except Exception as exc:  # offline, DNS, auth, missing package: all mean "use local"
        raise DataError(
            f"could not load {HUB_DATASET} ({HUB_CONFIG}) from the hub ({type(exc).__name__}: {exc}); {_HINT}"
        ) from exc
    pools = []
    for split in ("train", "test"):
        if split not in dataset:
            raise DataError(f"{HUB_DATASET} ({HUB_CONFIG}): split {split!r} missing")
        name = f"{HUB_DATASET} {split}"
        pool = [
            parse_problem(row, f"{name}, row {index + 1}", f"gsm8k-{split}", index)
            for index, row in enumerate(dataset[split])
        ]
        if not pool:
            raise DataError(f"{name}, row 1: split is empty")
        _check_duplicates(pool, name, "row")
        pools.append(pool)
    return pools[0], pools[1]


def _load_local(local_dir: str | os.PathLike | None) -> tuple[list[dict], list[dict]]:
    """Load ``train.jsonl`` and ``test.jsonl`` from a local folder."""
    if not local_dir:
        raise DataError("data.source is 'local' but data.local_dir is not set; " + _HINT)
    folder = Path(local_dir)
    if not folder.is_dir():
        raise DataError(f"{folder}: data.local_dir not found (expected train.jsonl and test.jsonl)")
    pools = []
    for split in ("train", "test"):
        path = folder / f"{split}.jsonl"
        if not path.is_file():
            raise DataError(f"{path}: file not found in data.local_dir {folder}")
        pools.append(load_jsonl_problems(path, source=f"gsm8k-{split}"))
    return pools[0], pools[1]


def _load_generated(seed: int, n_train: int, n_test: int, world: str) -> tuple[list[dict], list[dict]]:
    """Generate one batch of unique problems and cut it into train and test (disjoint)."""
    from talkmethods.synthetic import generate_problems

    rows = generate_problems(n_train + n_test, seed, world)
    pools = []
    for split, chunk in (("train", rows[:n_train]), ("test", rows[n_train:])):
        pools.append(
            [
                parse_problem(row, f"generated {split}, row {i + 1}", f"synthetic-{split}", i)
                for i, row in enumerate(chunk)
            ]
        )
    return pools[0], pools[1]


def load_gsm8k(
    source: str,
    local_dir: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    n_generated_train: int = 2048,
    n_generated_test: int = 512,
    world: str = "templates",
) -> tuple[list[dict], list[dict]]:
    """Load the train and test pools from the configured source.

    Args:
        source: ``"hub"`` (``openai/gsm8k``, config ``main``), ``"local"`` (``local_dir``
            holding ``train.jsonl`` and ``test.jsonl``) or ``"generated"`` (offline synthetic
            problems; no network).
        local_dir: Folder for the ``"local"`` source; ignored otherwise.
        seed: Generator seed for the ``"generated"`` source.
        n_generated_train: Train pool size for the ``"generated"`` source.
        n_generated_test: Test pool size for the ``"generated"`` source.
        world: Which generated world (``talkmethods.synthetic.WORLDS``) for the ``"generated"`` source.

    Returns:
        ``(train_pool, test_pool)``: lists of problem records (see `parse_problem`).

    Raises:
        DataError: Unknown source, unreachable hub, missing folder or file, or bad rows.
    """
    if source == "hub":
        train, test = _load_hub()
    elif source == "local":
        train, test = _load_local(local_dir)
    elif source == "generated":
        train, test = _load_generated(seed, n_generated_train, n_generated_test, world)
    else:
        raise DataError(f"data.source must be one of {', '.join(SOURCES)}; got {source!r}")
    log.info("data source %s: %d train, %d test problems", source, len(train), len(test))
    return train, test


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: str | os.PathLike, records: Iterable[Mapping]) -> None:
    """Write records as jsonl, deterministically and atomically.

    Keys are sorted, non-ASCII is kept, lines end in ``\\n``; the text goes to a temporary
    file in the same folder, which then replaces ``path`` (a killed job leaves no half file).

    Args:
        path: Output file; its folder is created if missing.
        records: JSON-serialisable mappings, written in the given order.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w", encoding="utf-8", newline="\n") as handle:
            for record in records:
                handle.write(json.dumps(record, sort_keys=True, ensure_ascii=False) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
