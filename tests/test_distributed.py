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
