"""The decoding kernels of Qwen3.5's Gated DeltaNet against their references: the conv-state update and the
delta-rule step, each with its in-place state update, over several tokens in a row (the state carried)."""

import pytest
import torch
from helpers import TOLERANCE, assert_close, dtype_id

from unsloth_lite.kernels.deltanet_decode import (
    conv_state_update,
    conv_state_update_reference,
    delta_rule_step,
    delta_rule_step_reference,
)
from unsloth_lite.kernels.gated_delta_rule_reference import recurrent_gated_delta_rule_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("channels,width,bias", [(96, 4, True), (300, 4, False), (37, 3, True)])
def test_conv_state_update(channels, width, bias, dtype, device):
    batch, steps = 3, 5
    x = torch.randn(batch, steps, channels, device=device, dtype=dtype)  # the projection's layout: strided steps
    weight = torch.randn(channels, width, device=device, dtype=dtype)
    b = torch.randn(channels, device=device, dtype=dtype) if bias else None
    state = torch.randn(batch, channels, width, device=device, dtype=dtype)
    expected_state = state.clone()
    history = torch.cat([state.double(), x.double().transpose(1, 2)], dim=-1)  # every input seen, in order
    for t in range(steps):
        y = conv_state_update(x[:, t], state, weight, b)
        expected = conv_state_update_reference(x[:, t], expected_state, weight, b)
        window = history[:, :, t + 1 : t + 1 + width]
        exact = torch.nn.functional.silu((window * weight.double()).sum(-1) + (b.double() if bias else 0))
        assert_close(y, exact, TOLERANCE[dtype], f"y at step {t}")
        assert_close(expected, exact, TOLERANCE[dtype], f"reference y at step {t}")
        assert torch.equal(state, expected_state), f"state at step {t}"
        assert torch.equal(state.double(), window), f"state holds the last {width} inputs at step {t}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("k_heads,v_heads,key_dim,value_dim", [(2, 4, 16, 16), (1, 3, 24, 40), (2, 2, 32, 20)])
def test_delta_rule_step(k_heads, v_heads, key_dim, value_dim, dtype, device):
    """Token by token against the recurrence (the definition), the state carried in fp32 between steps."""
    batch, steps = 2, 4
    q = torch.randn(batch, steps, k_heads, key_dim, device=device, dtype=dtype)
    k = torch.randn(batch, steps, k_heads, key_dim, device=device, dtype=dtype)
    v = torch.randn(batch, steps, v_heads, value_dim, device=device, dtype=dtype)
    g = -torch.rand(batch, steps, v_heads, device=device)  # log decay ≤ 0, fp32 as the gates give it
    beta = torch.rand(batch, steps, v_heads, device=device, dtype=dtype)
    initial = torch.randn(batch, v_heads, key_dim, value_dim, device=device)
    state, reference_state = initial.clone(), initial.clone()
    outputs = []
    for t in range(steps):
        outputs.append(delta_rule_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state))
        ref = delta_rule_step_reference(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], reference_state)
        assert_close(outputs[-1], ref, TOLERANCE[dtype], f"o at step {t}")
    exact, final = recurrent_gated_delta_rule_reference(
        *(t.double() for t in (q, k, v, g, beta)), initial_state=initial.double(), output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert_close(torch.stack(outputs, dim=1), exact, TOLERANCE[dtype], "o")
    assert_close(state, final, 1e-5, "state")
    assert_close(reference_state, final, 1e-5, "reference state")
