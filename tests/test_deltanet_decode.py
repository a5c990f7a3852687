"""The decoding kernels of Qwen3.5's Gated DeltaNet against their references: the conv-state update, the
delta-rule step and the step with its gates and gated norm, each with its in-place state update, over several
tokens in a row (the state carried)."""

import pytest
import torch
from helpers import TOLERANCE, assert_close, dtype_id

from unsloth_lite.kernels.deltanet_decode import (
    conv_state_update,
    conv_state_update_reference,
    delta_rule_step,
    delta_rule_step_reference,
)
from unsloth_lite.kernels.deltanet_decode_gated import delta_rule_gated_step
from unsloth_lite.kernels.deltanet_gates import deltanet_gates, deltanet_gates_reference
from unsloth_lite.kernels.gated_delta_rule_reference import recurrent_gated_delta_rule_reference
from unsloth_lite.kernels.gated_rms_norm import gated_rms_norm, gated_rms_norm_reference


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


def gated_step_case(batch, k_heads, v_heads, key_dim, value_dim, dtype, device):
    q = torch.randn(batch, 2, k_heads, key_dim, device=device, dtype=dtype)[:, 0]  # strided along B, as sliced
    k = torch.randn(batch, k_heads, key_dim, device=device, dtype=dtype)
    v = torch.randn(batch, v_heads, value_dim, device=device, dtype=dtype)
    a, b = (torch.randn(batch, 2, v_heads, device=device, dtype=dtype)[:, 1] for _ in range(2))
    a_log = torch.randn(v_heads, device=device)
    dt_bias = torch.randn(v_heads, device=device)
    z = torch.randn(batch, v_heads, value_dim, device=device, dtype=dtype)
    weight = 1 + 0.1 * torch.randn(value_dim, device=device, dtype=dtype)
    state = torch.randn(batch, v_heads, key_dim, value_dim, device=device)
    return q, k, v, a, b, a_log, dt_bias, state, z, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("k_heads,v_heads,key_dim,value_dim", [(2, 4, 16, 16), (1, 3, 24, 40)])
def test_delta_rule_gated_step(k_heads, v_heads, key_dim, value_dim, dtype, device):
    """Against the three launches it replaces (gates, step, gated norm) and against their references, two tokens
    in a row, the state carried."""
    q, k, v, a, b, a_log, dt_bias, state, z, weight = gated_step_case(2, k_heads, v_heads, key_dim, value_dim,
                                                                        dtype, device)
    separate, reference_state = state.clone(), state.clone()
    for step in range(2):
        y = delta_rule_gated_step(q, k, v, a, b, a_log, dt_bias, state, z, weight, eps=1e-6)
        g, beta = deltanet_gates(a, b, a_log, dt_bias)
        three = gated_rms_norm(delta_rule_step(q, k, v, g, beta, separate), weight, z, eps=1e-6)
        g, beta = deltanet_gates_reference(a, b, a_log, dt_bias)
        ref = gated_rms_norm_reference(delta_rule_step_reference(q, k, v, g, beta, reference_state), weight, z)
        assert y.shape == v.shape and y.dtype == dtype
        assert_close(y, three, TOLERANCE[dtype], f"y against the three launches at step {step}")
        assert_close(y, ref, TOLERANCE[dtype], f"y at step {step}")
        assert torch.equal(state, separate), f"state at step {step}"
        # β in b's dtype: a rounding apart from the reference's where the two sigmoids round differently
        assert_close(state, reference_state, TOLERANCE[dtype], f"state against the reference at step {step}")
        q, k, v, z = (torch.randn_like(t) for t in (q, k, v, z))


def test_delta_rule_gated_step_refuses_misfit_shapes(device):
    q, k, v, a, b, a_log, dt_bias, state, z, weight = gated_step_case(1, 2, 4, 16, 16, torch.float32, device)
    with pytest.raises(ValueError, match="do not fit v"):
        delta_rule_gated_step(q, k, v, a[:, :2], b[:, :2], a_log, dt_bias, state, z, weight)
    with pytest.raises(ValueError, match="norm_weight"):
        delta_rule_gated_step(q, k, v, a, b, a_log, dt_bias, state, z, weight[:8])
    with pytest.raises(ValueError, match="state"):
        delta_rule_gated_step(q, k, v, a, b, a_log, dt_bias, state[:, :, :8], z, weight)
