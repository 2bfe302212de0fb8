"""Claim a free GPU on a multi-GPU host: an exclusive lock file per GPU, released when the job ends.

Snakemake's ``resources: gpu=1`` only counts jobs and never sets CUDA_VISIBLE_DEVICES (DESIGN §5),
so each GPU job takes the first GPU whose lock it can get. ``fcntl.flock`` locks vanish with the
process, so a killed job frees its GPU. ``TALKMETHODS_JOBS_PER_GPU=k`` gives each GPU k slots (k jobs
share it): small models leave a GPU mostly idle between kernel launches, so several of their runs
overlap well (the warm-started world on one H200). A 1.5B model's runs gain only with CUDA MPS running
(three runs under MPS: 1.27x the steps/s of one on an H200; without MPS the GPU time-slices processes
and k = 2 gained nothing: bench/share.py, shared-gpu.yaml); otherwise keep 1. Under SLURM
(CUDA_VISIBLE_DEVICES already set) or on a machine without GPUs this does nothing.
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


def gpu_count() -> int:
    """GPUs on this host (``TALKMETHODS_FAKE_GPUS`` fakes a count for tests)."""
    fake = os.environ.get("TALKMETHODS_FAKE_GPUS")
    if fake is not None:
        return int(fake)
    # nvidia-smi, not torch: torch caches its device count, which would outlive the
    # CUDA_VISIBLE_DEVICES set below.
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def jobs_per_gpu() -> int:
    """Jobs that may share one GPU (``TALKMETHODS_JOBS_PER_GPU``, default 1)."""
    raw = os.environ.get("TALKMETHODS_JOBS_PER_GPU", "1")
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"TALKMETHODS_JOBS_PER_GPU={raw!r}: expected a whole number >= 1")
    return int(raw)


def lock_dir() -> Path:
    return Path(os.environ.get("TALKMETHODS_GPU_LOCK_DIR", "/tmp/talkmethods-gpu-locks"))


@contextmanager
def claim_gpu(poll_s: float = 2.0, timeout_s: float | None = None):
    """Hold an exclusive lock on one free GPU and expose only it through CUDA_VISIBLE_DEVICES.

    Yields the claimed GPU index, or None when there is nothing to claim.
    """
    n = gpu_count()
    if n == 0 or "CUDA_VISIBLE_DEVICES" in os.environ:
        yield None
        return
    lock_dir().mkdir(parents=True, exist_ok=True)
    try:  # shared by every user of the host (sticky, like /tmp)
        os.chmod(lock_dir(), 0o1777)
    except PermissionError:
        pass  # another user made it, already shared
    start = time.monotonic()
    slots = [(gpu, k) for k in range(jobs_per_gpu()) for gpu in range(n)]  # spread over GPUs before sharing one
    while True:
        for gpu, k in slots:
            name = f"gpu{gpu}.lock" if k == 0 else f"gpu{gpu}.slot{k}.lock"
            fd = os.open(lock_dir() / name, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                os.fchmod(fd, 0o666)  # the umask must not lock other users out
            except PermissionError:
                pass  # another user's file, already 0o666
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)  # before CUDA initialises in this process
            log.info("claimed GPU %d (slot %d)", gpu, k)
            try:
                yield gpu
            finally:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
            return
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise TimeoutError(f"no free GPU among {n} after {timeout_s:.0f} s (locks in {lock_dir()})")
        time.sleep(poll_s)
