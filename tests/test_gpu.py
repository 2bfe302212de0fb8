"""talkmethods.gpu.claim_gpu on a CPU machine, with the GPU count faked (TALKMETHODS_FAKE_GPUS).

Claimants are real processes (a small Python snippet each), as Snakemake's parallel GPU jobs are:
the lock is an fcntl.flock per GPU, which only means something between open file descriptions.
Each worker claims, writes a record (its GPU, pid, CUDA_VISIBLE_DEVICES, times), and holds the GPU
until the test tells it to let go (a release file) or for at most a few seconds, then exits.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from talkmethods import gpu as tm_gpu

ROOT = Path(__file__).resolve().parents[1]
N = 3  # faked GPUs

WORKER = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from talkmethods.gpu import claim_gpu

record, release, max_hold = sys.argv[2], sys.argv[3], float(sys.argv[4])

def write(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)  # the test sees a whole record or none

before = os.environ.get("CUDA_VISIBLE_DEVICES")
with claim_gpu(poll_s=0.05) as gpu:
    data = {"gpu": gpu, "pid": os.getpid(), "before": before,
            "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"), "t_claim": time.time()}
    write(record, data)
    end = time.monotonic() + max_hold
    while time.monotonic() < end and not os.path.exists(release):
        time.sleep(0.02)
    data["t_release"] = time.time()
data["cvd_after"] = os.environ.get("CUDA_VISIBLE_DEVICES")
write(record + ".done", data)
"""


class Worker:
    def __init__(self, tmp: Path, name: str, env: dict, max_hold: float = 15.0):
        self.record = tmp / f"{name}.json"
        self.release_file = tmp / f"{name}.release"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(ROOT), str(self.record), str(self.release_file), str(max_hold)],
            env=env,
        )

    def claimed(self) -> dict | None:
        return json.loads(self.record.read_text()) if self.record.exists() else None

    def wait_claim(self, timeout: float = 10.0) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            rec = self.claimed()
            if rec is not None:
                return rec
            assert self.proc.poll() is None, f"worker exited ({self.proc.returncode}) without claiming"
            time.sleep(0.02)
        raise AssertionError(f"no claim within {timeout} s")

    def release(self) -> dict:
        self.release_file.touch()
        assert self.proc.wait(timeout=10) == 0
        return json.loads(Path(str(self.record) + ".done").read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture()
def gpu_env(tmp_path, monkeypatch):
    """Environment for claimants: N fake GPUs, a private lock dir, no CUDA_VISIBLE_DEVICES."""
    locks = tmp_path / "locks"
    monkeypatch.setenv("TALKMETHODS_FAKE_GPUS", str(N))
    monkeypatch.setenv("TALKMETHODS_GPU_LOCK_DIR", str(locks))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return dict(os.environ)


@pytest.fixture()
def workers(tmp_path, gpu_env):
    started: list[Worker] = []

    def start(name: str, **kw) -> Worker:
        w = Worker(tmp_path, name, gpu_env, **kw)
        started.append(w)
        return w

    yield start
    for w in started:
        w.kill()


def test_parallel_claimants_never_share_a_gpu(workers):
    ws = [workers(f"w{i}", max_hold=5.0) for i in range(N)]
    recs = [w.wait_claim() for w in ws]
    assert sorted(r["gpu"] for r in recs) == list(range(N))
    for r in recs:
        assert r["before"] is None
        assert r["cvd"] == str(r["gpu"])  # the claimed GPU, and only it, is visible
    done = [w.release() for w in ws]
    # all N held their GPU at the same time, and each dropped CUDA_VISIBLE_DEVICES on release
    assert max(d["t_claim"] for d in done) < min(d["t_release"] for d in done)
    assert all(d["cvd_after"] is None for d in done)


def test_many_short_jobs_never_overlap_on_a_gpu(workers):
    """Twice as many claimants as GPUs, each holding its GPU for ~1 s: no two hold one at once."""
    ws = [workers(f"s{i}", max_hold=1.0) for i in range(2 * N)]
    for w in ws:
        assert w.proc.wait(timeout=20) == 0
    done = [json.loads(Path(str(w.record) + ".done").read_text()) for w in ws]
    assert len({d["pid"] for d in done}) == 2 * N
    for g in range(N):
        spans = sorted((d["t_claim"], d["t_release"]) for d in done if d["gpu"] == g)
        assert spans, f"GPU {g} never used"
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert start >= end, f"GPU {g} held twice at once: {spans}"


def test_one_more_claimant_waits_until_a_gpu_is_freed(workers):
    ws = [workers(f"w{i}") for i in range(N)]
    recs = [w.wait_claim() for w in ws]
    extra = workers("extra")
    time.sleep(1.0)
    assert extra.claimed() is None and extra.proc.poll() is None, "took a GPU that was held"

    freed = recs[1]["gpu"]
    t_release = ws[1].release()["t_release"]
    rec = extra.wait_claim(timeout=5)
    assert rec["gpu"] == freed
    assert rec["t_claim"] >= t_release
    for w in ws[::2]:
        assert w.proc.poll() is None  # the others still hold theirs


def test_sigkilled_holder_frees_its_gpu(workers, tmp_path):
    ws = [workers(f"w{i}") for i in range(N)]
    recs = [w.wait_claim() for w in ws]
    extra = workers("extra")
    time.sleep(0.5)
    assert extra.claimed() is None

    victim = recs[2]
    lock_text = (tmp_path / "locks" / f"gpu{victim['gpu']}.lock").read_text()
    assert lock_text.strip() == str(victim["pid"])  # the lock file names its holder
    os.kill(victim["pid"], signal.SIGKILL)
    t_kill = time.time()
    rec = extra.wait_claim(timeout=5)
    assert rec["gpu"] == victim["gpu"]
    assert rec["t_claim"] - t_kill < 5


def test_busy_gpus_are_skipped_in_process(gpu_env, tmp_path):
    locks = tmp_path / "locks"
    locks.mkdir()
    held = os.open(locks / "gpu0.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        with tm_gpu.claim_gpu(poll_s=0.01) as g:
            assert g == 1
            assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
        assert "CUDA_VISIBLE_DEVICES" not in os.environ
        # released: it can be claimed again, also after an exception in the body
        with pytest.raises(RuntimeError):
            with tm_gpu.claim_gpu(poll_s=0.01) as g:
                assert g == 1
                raise RuntimeError("job failed")
        assert "CUDA_VISIBLE_DEVICES" not in os.environ
        with tm_gpu.claim_gpu(poll_s=0.01) as g:
            assert g == 1
    finally:
        os.close(held)


def test_timeout_when_every_gpu_is_held(gpu_env, tmp_path):
    locks = tmp_path / "locks"
    locks.mkdir()
    fds = [os.open(locks / f"gpu{i}.lock", os.O_RDWR | os.O_CREAT) for i in range(N)]
    try:
        for fd in fds:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=f"no free GPU among {N}"):
            with tm_gpu.claim_gpu(poll_s=0.05, timeout_s=0.3):
                pass
        assert time.monotonic() - t0 < 5
        assert "CUDA_VISIBLE_DEVICES" not in os.environ
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("preset", ["0", "3,1", ""])
def test_noop_when_cuda_visible_devices_is_already_set(gpu_env, tmp_path, monkeypatch, preset):
    """Under SLURM the scheduler has set CUDA_VISIBLE_DEVICES: claim nothing, change nothing."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", preset)
    with tm_gpu.claim_gpu(poll_s=0.01, timeout_s=0.1) as g:
        assert g is None
        assert os.environ["CUDA_VISIBLE_DEVICES"] == preset
    assert os.environ["CUDA_VISIBLE_DEVICES"] == preset
    assert not (tmp_path / "locks").exists()


def test_noop_without_gpus(gpu_env, tmp_path, monkeypatch):
    monkeypatch.setenv("TALKMETHODS_FAKE_GPUS", "0")
    with tm_gpu.claim_gpu(poll_s=0.01, timeout_s=0.1) as g:
        assert g is None
        assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert not (tmp_path / "locks").exists()


def test_noop_under_slurm_in_a_worker(workers, gpu_env, tmp_path):
    """The same through a separate process, as a SLURM job step sees it."""
    gpu_env["CUDA_VISIBLE_DEVICES"] = "1"
    w = Worker(tmp_path, "slurm", gpu_env, max_hold=0.0)
    assert w.proc.wait(timeout=10) == 0
    done = json.loads(Path(str(w.record) + ".done").read_text())
    assert done["gpu"] is None and done["cvd"] == "1" and done["cvd_after"] == "1"
    assert not (tmp_path / "locks").exists()


def test_jobs_per_gpu_lets_k_jobs_share_each_gpu_and_no_more(workers, gpu_env, monkeypatch):
    """TALKMETHODS_JOBS_PER_GPU=2: 2·N claimants run at once, two per GPU; one more waits for a slot."""
    gpu_env["TALKMETHODS_JOBS_PER_GPU"] = "2"
    ws = [workers(f"k{i}", max_hold=8.0) for i in range(2 * N)]
    recs = [w.wait_claim() for w in ws]
    assert sorted(r["gpu"] for r in recs) == sorted(list(range(N)) * 2)
    extra = workers("extra", max_hold=1.0)
    time.sleep(0.5)
    assert extra.claimed() is None  # every slot is held
    ws[0].release()
    assert extra.wait_claim()["gpu"] == recs[0]["gpu"]


def test_jobs_per_gpu_refuses_a_bad_value(monkeypatch):
    from talkmethods.gpu import jobs_per_gpu

    monkeypatch.setenv("TALKMETHODS_JOBS_PER_GPU", "0")
    with pytest.raises(ValueError, match="TALKMETHODS_JOBS_PER_GPU"):
        jobs_per_gpu()


# ---- the CUDA allocator's default (talkmethods/__init__.py) -------------------------------------

# Runs a script as __main__ and prints PYTORCH_CUDA_ALLOC_CONF as it stood when torch was first imported:
# torch may read the variable when it loads, so the default must be set before then.
# The spy both snippets start with: records the variable at torch's first import.
SPY = r"""
import os, runpy, sys
seen = {}
class Spy:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and "torch" not in seen:
            seen["torch"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        return None
sys.meta_path.insert(0, Spy())
"""
AT_TORCH_IMPORT = (
    SPY
    + r"""
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit:
    pass
print("AT_TORCH_IMPORT", seen.get("torch", "never"))
print("AT_EXIT", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
"""
)


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def _conf_at(script: Path, *args: str, when: str = "AT_TORCH_IMPORT", **extra) -> str:
    res = subprocess.run(
        [sys.executable, "-c", AT_TORCH_IMPORT, str(script), *args],
        capture_output=True,
        text=True,
        env=_clean_env(**extra),
        cwd=ROOT,
        timeout=300,
    )
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(when)]
    assert lines, res.stderr[-2000:]
    return lines[-1].split(" ", 1)[1]


@pytest.mark.parametrize(
    "script, args",
    [
        ("bench/speed.py", ["--help"]),
        ("bench/ab.py", ["--help"]),
        ("talkmethods/__main__.py", ["split", "--config", "no-such.yaml"]),  # the CLI: torch loads for its errors
    ],
)
def test_expandable_segments_are_set_before_torch_loads(script, args):
    """Every entry point imports the package (which sets the allocator default) before torch."""
    assert _conf_at(ROOT / script, *args) == "expandable_segments:True"


# A workflow script run as Snakemake's ``script:`` runs it: a ``snakemake`` object in its globals (a fake
# with no params, so the script stops at its stage's call, after its imports).
WORKFLOW_SCRIPT = (
    SPY
    + r"""
import types
script, log = sys.argv[1], sys.argv[2]
empty = types.SimpleNamespace()
fake = types.SimpleNamespace(scriptdir=os.path.dirname(script), log=[log], threads=1, params=empty, input=empty,
                             output=empty, wildcards=empty)
try:
    runpy.run_path(script, init_globals={"snakemake": fake}, run_name="__main__")
except BaseException as err:
    print("STOPPED", type(err).__name__)
print("AT_TORCH_IMPORT", seen.get("torch", "never"))
"""
)


@pytest.mark.parametrize("script", ["train.py", "train_cohort.py", "evaluate.py", "warmstart.py"])
def test_each_gpu_workflow_script_sets_the_allocator_default_before_torch_loads(tmp_path, script):
    res = subprocess.run(
        [sys.executable, "-c", WORKFLOW_SCRIPT, str(ROOT / "workflow_scripts" / script), str(tmp_path / "rule.log")],
        capture_output=True,
        text=True,
        env=_clean_env(TALKMETHODS_FAKE_GPUS="0"),
        cwd=tmp_path,
        timeout=300,
    )
    assert "STOPPED AttributeError" in res.stdout, res.stdout + res.stderr[-2000:]  # at the stage's call, as meant
    assert "AT_TORCH_IMPORT expandable_segments:True" in res.stdout, res.stdout


def test_the_sharing_bench_hands_the_allocator_default_to_its_workers():
    """bench/share.py imports torch only in its workers, which inherit its environment."""
    assert _conf_at(ROOT / "bench/share.py", "--help", when="AT_TORCH_IMPORT") == "never"
    assert _conf_at(ROOT / "bench/share.py", "--help", when="AT_EXIT") == "expandable_segments:True"


def test_a_users_own_allocator_setting_is_kept(tmp_path):
    path = tmp_path / "stage.py"
    path.write_text("import talkmethods.training.cohort\n")
    assert _conf_at(path, PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:64") == "max_split_size_mb:64"
    # torch's newer name counts as the user's choice too: ours is not added beside it
    assert _conf_at(path, PYTORCH_ALLOC_CONF="expandable_segments:False") == "None"
