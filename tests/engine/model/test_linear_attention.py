"""The gated delta rule's two reference forms agree, carry state across splits, and match
transformers' Qwen3-Next torch implementation (float32)."""

import pytest
import torch

from llmserve.engine.model import linear_attention as la


def _inputs(t: int, h: int = 2, dk: int = 8, dv: int = 6, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=gen), dim=-1)
    v = torch.randn(t, h, dv, generator=gen)
    g = -torch.rand(t, h, generator=gen)
    beta = torch.rand(t, h, generator=gen)
    s0 = torch.randn(h, dk, dv, generator=gen) * 0.1
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("t", [1, 5, 16, 37])
def test_chunked_matches_recurrent(t: int) -> None:
    q, k, v, g, beta, s0 = _inputs(t, seed=t)
    out_r, s_r = la.recurrent(q, k, v, g, beta, s0)
    out_c, s_c = la.chunked(q, k, v, g, beta, s0, chunk=8)
    torch.testing.assert_close(out_c, out_r, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(s_c, s_r, atol=1e-5, rtol=1e-4)


def test_state_carries_across_a_split() -> None:
    q, k, v, g, beta, s0 = _inputs(21, seed=3)
    whole, s_whole = la.chunked(q, k, v, g, beta, s0, chunk=8)
    a, s_a = la.chunked(q[:13], k[:13], v[:13], g[:13], beta[:13], s0, chunk=8)
    b, s_b = la.recurrent(q[13:], k[13:], v[13:], g[13:], beta[13:], s_a)
    torch.testing.assert_close(torch.cat([a, b]), whole, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(s_b, s_whole, atol=1e-5, rtol=1e-4)


def test_batched_decode_step_matches_recurrent_per_row() -> None:
    """decode_step over three sequences (their own states) = `recurrent` of one token each."""
    rows = [_inputs(1, seed=s) for s in (4, 5, 6)]
    out, states = la.decode_step(*(torch.cat([r[i] for r in rows]) for i in range(5)),
                                 torch.stack([r[5] for r in rows]))  # fmt: skip
    for b, r in enumerate(rows):
        want, want_s = la.recurrent(*r)
        torch.testing.assert_close(out[b], want[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(states[b], want_s, atol=1e-6, rtol=1e-5)


def test_matches_transformers() -> None:
    mod = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta, s0 = _inputs(19, seed=7)
    out, s = la.chunked(q, k, v, g, beta, s0, chunk=8)
    ref, ref_s = mod.torch_recurrent_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        initial_state=s0[None],
        output_final_state=True,
    )
    torch.testing.assert_close(out, ref[0].float(), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(s, ref_s[0].float(), atol=1e-5, rtol=1e-4)
