"""The offline default's DAG through SLURM, end to end, on a single-node cluster on this machine.

scripts/slurm_localhost.sh installs (apt-get) and starts SLURM + munge; scripts/run_slurm_demo.sh
runs the workflow with profiles/slurm to a complete card in a fresh directory and checks that every
job went through SLURM and completed there. Needs root and apt-get (CI runs as root); anywhere
else this test fails and says why.

Every rule of the DAG goes through SLURM, on two arms (raft, mixed: a base partner's seat), one seed
and a 60-step warm start, a 16-job DAG; the whole 65-job card is what the local end-to-end test runs (test_pipeline), and
here it took ~17 of the suite's minutes on 2 cores. TALKMETHODS_SLURM_FULL=1 runs the whole card through
SLURM; SLURM_DEMO_TARGETS="results/raft/seed17/eval.json" a smaller DAG; TALKMETHODS_SKIP_SLURM=1
skips the test (a reported skip, for machines that cannot run it). Timings print with -s.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import NO_SLURM

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def _run(cmd: list[str], env: dict, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


@pytest.mark.slurm
@pytest.mark.slow
def test_offline_dag_through_slurm(tmp_path):
    if os.environ.get("TALKMETHODS_SKIP_SLURM") == "1":
        pytest.skip("TALKMETHODS_SKIP_SLURM=1: SLURM end-to-end test not run")
    if os.geteuid() != 0:
        pytest.fail(
            "the SLURM test starts a local cluster and needs root (CI runs as root); "
            "set TALKMETHODS_SKIP_SLURM=1 to skip it here"
        )
    if not shutil.which("apt-get") and not shutil.which("slurmctld"):
        pytest.fail(
            "the SLURM test needs apt-get to install slurm-wlm and munge (Debian/Ubuntu), "
            "or SLURM already installed; neither is here"
        )

    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != NO_SLURM)  # the real scontrol

    up, t_up = _run(["bash", str(SCRIPTS / "slurm_localhost.sh")], env, timeout=900)
    assert up.returncode == 0, f"local SLURM cluster did not start:\n{up.stdout}\n{up.stderr}"
    print(f"\ncluster start: {t_up:.0f} s\n{up.stderr.strip()}")

    workdir = tmp_path / "demo"
    env["SLURM_DEMO_DIR"] = str(workdir)
    full = os.environ.get("TALKMETHODS_SLURM_FULL") == "1"
    if not full:
        overlay = tmp_path / "two-arms-one-seed.yaml"
        # a short warm start: the base's accuracy is the end-to-end test's business, SLURM's wiring is this one's
        overlay.write_text("arms: [raft, mixed]\nseeds: [17]\nmodel:\n  warmstart:\n    steps: 60\n")
        env["SLURM_DEMO_CONFIG"] = str(overlay)
    demo, t_demo = _run(["bash", str(SCRIPTS / "run_slurm_demo.sh")], env, timeout=3 * 3600)
    out = workdir / "snakemake.out"
    tail = out.read_text()[-4000:] if out.exists() else ""
    assert demo.returncode == 0, f"SLURM demo failed:\n{demo.stderr}\n--- snakemake.out tail ---\n{tail}"
    print(f"DAG through SLURM: {t_demo:.0f} s\n{demo.stderr.strip()}")

    m = re.search(r"SLURM_DEMO_SECONDS=(\d+) SLURM_DEMO_JOBS=(\d+)", demo.stdout)
    assert m, demo.stdout
    n_jobs = int(m.group(2))
    assert n_jobs >= 1

    log = out.read_text()
    assert "Provided remote nodes" in log  # the SLURM executor, not local cores
    ids = re.findall(r"has been submitted with SLURM jobid (\d+)", log)
    local = re.findall(r"^localrule (\w+):", log, re.M)  # `localrules:` run beside snakemake, by design
    assert set(local) <= {"train_curve", "aggregate", "card"}, set(local)
    assert len(set(ids)) == n_jobs - len(local)
    stats = dict(re.findall(r"^(\w+)\s+(\d+)$", log.split("Job stats:", 1)[1].split("\n\n", 1)[0], re.M))
    assert int(stats["total"]) == n_jobs

    targets = os.environ.get("SLURM_DEMO_TARGETS", "results/card.md results/card.png").split()
    for t in targets:
        assert (workdir / t).stat().st_size > 0, t
    if "results/card.md" in targets:
        card = (workdir / "results/card.md").read_text()
        assert "offline" in card.lower()  # the offline default's card
        assert (workdir / "results/card.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        # the whole DAG: every (arm, seed) trained and evaluated, the base model evaluated
        for rule in (
            "split",
            "selftest",
            "warmstart",
            "train",
            "eval_run",
            "eval_base",
            "train_curve",
            "aggregate",
            "card",
        ):
            assert int(stats.get(rule, 0)) >= 1, f"no {rule} job in the SLURM run"
        assert int(stats["train"]) == (12 if full else 2)
        assert int(stats["eval_run"]) == 3 * int(stats["train"])
