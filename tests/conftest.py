"""Test setup shared by every kernel test.

The environment variables below are read when `unsloth_lite` (and its `@triton.jit` kernels) is imported, so
they are set here, before anything imports it:

* `UNSLOTH_LITE_POISON_OUTPUTS=1` fills every output buffer with NaN before a kernel writes it, so an element a
  kernel forgets to write fails `assert_close`'s finiteness check.
* `TRITON_INTERPRET=1` when there is no CUDA device: the kernels then run on CPU tensors in Triton's interpreter.
* Under pytest-xdist, `OMP_NUM_THREADS` (and OpenBLAS's and MKL's) and torch's thread count are each worker's
  share of the CPU cores, unless set already.

Seeds: every test gets a fresh random seed (printed, shown by pytest when the test fails). Set
`UNSLOTH_LITE_TEST_SEED=<seed>` to replay one.
"""

import os


def _threads_per_worker() -> int | None:
    """Under pytest-xdist, the CPU cores shared out among the workers (at least one each); None outside it."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return None
    return max(1, (os.cpu_count() or 1) // int(workers))


os.environ.setdefault("UNSLOTH_LITE_POISON_OUTPUTS", "1")
WORKER_THREADS = _threads_per_worker()
# The xdist workers already keep every core busy: more intra-op threads than a worker's share of the cores only
# contend for them (OpenMP's and OpenBLAS's threads spin while they wait), which made an interpreted kernel test
# up to twice as slow. Set before torch and numpy are imported, and inherited by the tests' subprocesses.
if WORKER_THREADS is not None:
    for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_variable, str(WORKER_THREADS))

import torch  # noqa: E402  (importing torch does not import triton, so the variable below is still in time)

if WORKER_THREADS is not None:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# No example database on disk, no per-example deadline (the interpreter is slow and its first call compiles).
# The autouse `seed` fixture below is function-scoped; @given tests seed torch themselves from a drawn value.
settings.register_profile(
    "unsloth_lite",
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.load_profile("unsloth_lite")

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_report_header(config):
    return (
        f"unsloth_lite kernels: device={'cuda' if CUDA else 'cpu'}, "
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}, "
        f"UNSLOTH_LITE_POISON_OUTPUTS={os.environ.get('UNSLOTH_LITE_POISON_OUTPUTS')}"
    )


def pytest_collection_modifyitems(config, items):
    if CUDA and not INTERPRET:
        return
    reason = "needs a CUDA device" if not CUDA else "needs compiled Triton (TRITON_INTERPRET=1 is set)"
    skip_gpu = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if CUDA else "cpu"


@pytest.fixture(autouse=True)
def seed(request) -> int:
    """Seeds torch (CPU and CUDA) from a fresh random seed per test, and prints it for replay."""
    replay = os.environ.get("UNSLOTH_LITE_TEST_SEED")
    value = int(replay) if replay else random.SystemRandom().randrange(2**31)
    torch.manual_seed(value)
    print(f"seed {value} for {request.node.nodeid} (replay: UNSLOTH_LITE_TEST_SEED={value})")
    request.node.user_properties.append(("seed", value))
    return value


# The patched decoding loop's cache is rounded up to `decode_loop.CACHE_ROUNDING` positions (256). Interpreted,
# each step's attention launch runs one program per 32 of them, empty ones included: the tests' sequences (under
# 64 tokens) paid for 8 splits of which one held keys. 64 positions keep the multi-split path (2 splits).
INTERPRETED_CACHE_ROUNDING = 64


@pytest.fixture(autouse=True)
def interpreted_cache_rounding(monkeypatch):
    """Under the interpreter, the decoding loop's cache rounded up to `INTERPRETED_CACHE_ROUNDING` positions."""
    if INTERPRET:
        from unsloth_lite.models import decode_loop

        monkeypatch.setattr(decode_loop, "CACHE_ROUNDING", INTERPRETED_CACHE_ROUNDING)


@pytest.fixture
def torch_delta_rule(monkeypatch):
    """Qwen3.5's Gated DeltaNet through Hugging Face's PyTorch reference (`helpers.bind_torch_delta_rule`),
    for the float64 parity tests."""
    from helpers import bind_torch_delta_rule

    bind_torch_delta_rule(monkeypatch.setattr)
