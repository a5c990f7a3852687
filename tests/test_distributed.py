"""Several processes on the CPU (gloo, 2 processes, fp32, tiny models): a data-parallel step of the Trainer
equals one process's step on the concatenated batch, FSDP2 over the NF4 base equals the unsharded model, and
the CLI under torchrun resumes after a kill with the losses of an uninterrupted run. The processes run the
plain-PyTorch references (no interpreter): the kernels are checked elsewhere, the distribution here."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import assert_close
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "UNSLOTH_LITE_POISON_OUTPUTS")}
ENV.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="gloo on the CPU; GPU runs use the recipes")


@pytest.fixture(scope="module")
def worker_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed")
    result = subprocess.run([*TORCHRUN, "tests/distributed_worker.py", str(out)], cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return out


def compare_gradients(results):
    names = [key.removeprefix("grad/") for key in results if key.startswith("grad/")]
    assert len(names) == 2 * 7 * 2  # A and B of every projection of both layers
    for name in names:
        assert results[f"grad/{name}"].abs().sum() > 0, name
        assert_close(results[f"grad/{name}"], results[f"reference_grad/{name}"], 1e-5, name)


def test_data_parallel_step_equals_one_process_on_the_concatenated_batch(worker_results):
    results = load_file(worker_results / "ddp.safetensors")
    assert_close(results["loss"], results["reference_loss"], 1e-6, "loss")
    compare_gradients(results)


def test_fsdp2_over_the_nf4_base_equals_the_unsharded_model(worker_results):
    results = load_file(worker_results / "fsdp.safetensors")
    local_rows, all_rows = results["packed_rows"].tolist()
    assert local_rows == all_rows // 2  # the packed NF4 storage is sharded, half on each process
    assert_close(results["losses"], results["reference_losses"], 1e-6, "per-process losses")
    compare_gradients(results)


def train_command(output_dir, *overrides):
    settings = ["training.max_steps=4", "training.save_steps=2", "training.save_total_limit=5",
                "training.logging_steps=1", "training.per_device_train_batch_size=4", "data.eval_fraction=0"]
    return [*TORCHRUN, "scripts/train.py", "--recipe", "tiny_qwen", f"training.output_dir={output_dir}",
            *settings, *overrides]


def logged_losses(output_dir):
    history = json.loads((Path(output_dir) / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


def children(pid):
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def running(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_launch(process):
    """SIGKILL to the launcher and its workers at once, as a lost machine would lose them. torchrun starts
    each worker in a session of its own: killing the launcher's group alone leaves the workers training."""
    os.killpg(process.pid, signal.SIGSTOP)  # the launcher frozen: no worker started or stopped meanwhile
    workers = children(process.pid)
    assert len(workers) == 2, workers
    for worker in workers:
        os.killpg(os.getpgid(worker), signal.SIGKILL)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    deadline = time.time() + 60
    while any(running(worker) for worker in workers) and time.time() < deadline:
        time.sleep(0.01)
    assert not any(running(worker) for worker in workers), workers


def test_resume_after_kill_on_two_processes_continues_like_an_uninterrupted_run(tmp_path):
    whole = tmp_path / "whole"
    result = subprocess.run(train_command(whole), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    summary = json.loads((whole / "train_summary.json").read_text())
    assert summary["processes"] == 2 and summary["train_tokens"] > 0, summary

    cut = tmp_path / "cut"
    # Its own session, so that the test's own process survives the kill of the launcher's group.
    process = subprocess.Popen(train_command(cut), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while not (cut / "checkpoint-2" / "trainer_state.json").exists() and time.time() < deadline:
        time.sleep(0.005)
    kill_launch(process)
    assert (cut / "checkpoint-2" / "rng_state_0.pth").exists() and (cut / "checkpoint-2" / "rng_state_1.pth").exists()
    for checkpoint in cut.glob("checkpoint-*"):  # only complete checkpoints carry the checkpoint name
        assert (checkpoint / "trainer_state.json").exists(), checkpoint
    if (cut / "checkpoint-4").exists():  # the kill came late: resume from checkpoint-2 anyway
        import shutil

        shutil.rmtree(cut / "checkpoint-4")

    resumed = subprocess.run(train_command(cut, "training.resume_from_checkpoint=true"), cwd=ROOT, env=ENV,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    expected, got = logged_losses(whole), logged_losses(cut)
    assert sorted(expected) == sorted(got) == list(range(1, 5))
    for step in range(1, 5):
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step
