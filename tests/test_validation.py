"""Bad input gets a clear ValueError naming the argument."""

from __future__ import annotations

import pytest
import torch

from kernel_templates.hstu_attention import HSTUBwdConfig, HSTUFwdConfig, hstu_attention


def _inputs(L=6, H=2, D=32, Dv=32, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(L, H, D, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(L, H, Dv, generator=g, dtype=dtype)
    return q, k, v, torch.tensor([0, 2, L])


def _call(**over):
    q, k, v, off = _inputs()
    args = dict(q=q, k=k, v=v, seq_offsets=off, max_seq_len=8)
    args.update(over)
    return hstu_attention(**args)


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(q=torch.randn(6, 64)), "q must have rank 3"),
        (dict(k=torch.randn(6, 2, 64)), "k must have q's shape"),
        (dict(v=torch.randn(5, 2, 32)), "v must have shape"),
        (dict(q=torch.randn(6, 2, 32, dtype=torch.float64)), "q must be float16"),
        (dict(k=torch.randn(6, 2, 32, dtype=torch.float16)), "share a dtype"),
        (dict(q=torch.randn(6, 2, 48), k=torch.randn(6, 2, 48)), "Dqk"),
        (dict(v=torch.randn(6, 2, 40)), "Dv"),
        (dict(q=torch.randn(6, 32, 2).transpose(1, 2)), "contiguous in its last dim"),
        (dict(seq_offsets=torch.tensor([0, 4, 2, 6])), "non-decreasing"),
        (dict(seq_offsets=torch.tensor([0, 2, 5])), "end at L"),
        (dict(seq_offsets=torch.tensor([1, 2, 6])), "start at 0"),
        (dict(seq_offsets=torch.tensor([0.0, 6.0])), "int32 or int64"),
        (dict(max_seq_len=3), "max_seq_len=3 is below the longest"),
        (dict(num_targets=torch.tensor([1])), "num_targets must have shape"),
        (dict(num_targets=torch.tensor([3, 1])), "num_targets must be within"),
        (dict(contextual_seq_len=-1), "contextual_seq_len"),
        (dict(max_attn_len=-2), "max_attn_len"),
        (dict(scaling_seqlen=0), "scaling_seqlen"),
        (dict(fwd_config=HSTUBwdConfig()), "fwd_config must be an HSTUFwdConfig"),
        # falsy non-configs ran the heuristic default without a word (``config or default``)
        (dict(fwd_config={}), "fwd_config must be an HSTUFwdConfig, got dict"),
        (dict(bwd_config=0), "bwd_config must be an HSTUBwdConfig, got int"),
    ],
)
def test_bad_input_names_the_argument(over, match):
    with pytest.raises(ValueError, match=match):
        _call(**over)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for a second device")
def test_tensors_on_different_devices():
    q, k, v, off = _inputs()
    with pytest.raises(ValueError, match="one device"):
        hstu_attention(q.cuda(), k.cuda(), v.cuda(), off, 8)


def test_tensors_on_different_devices_meta():
    q, k, v, off = _inputs()
    with pytest.raises(ValueError, match="one device"):
        hstu_attention(q.to("meta"), k, v, off, 8)


@pytest.mark.parametrize(
    "ctor,match",
    [
        (lambda: HSTUFwdConfig(block_m=48), "block_m must be a power of two"),
        (lambda: HSTUFwdConfig(num_warps=3), "num_warps"),
        (lambda: HSTUFwdConfig(num_stages=0), "num_stages"),
        (lambda: HSTUBwdConfig(dq_mode="fast"), "dq_mode"),
        (lambda: HSTUFwdConfig(l2_group=3), "l2_group must be one of"),
        (lambda: HSTUBwdConfig(l2_group=-1), "l2_group must be one of"),
        (lambda: HSTUBwdConfig(dkv_split=1), "dkv_split must be a bool"),
        (lambda: HSTUBwdConfig(dq_block_n=48), "dq_block_n must be 0"),
        (lambda: HSTUFwdConfig.from_dict({"block_m": 64}), "missing fields"),
        (lambda: HSTUFwdConfig.from_dict({**HSTUFwdConfig().to_dict(), "x": 1}), "unknown fields"),
    ],
)
def test_bad_configs(ctor, match):
    with pytest.raises(ValueError, match=match):
        ctor()


def test_config_round_trip():
    c = HSTUBwdConfig(32, 64, 4, 3, "separate")
    assert HSTUBwdConfig.from_dict(c.to_dict()) == c and hash(c) == hash(HSTUBwdConfig.from_dict(c.to_dict()))
