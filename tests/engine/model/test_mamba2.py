"""Mamba-2's mixer references (engine/model/mamba2.py): the token-by-token and chunked forms
against each other, a prefill split in two with the state carried against the whole, and
against transformers' GraniteMoeHybrid functions and mixer layer (float32, tiny shapes)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from llmserve.common.mamba2_config import Mamba2Config, mamba2_from_granite
from llmserve.engine.model import mamba2

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HEADS, HEAD_DIM, GROUPS, STATE, KERNEL = 4, 3, 2, 5, 4


def inputs(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    return {
        "x": rand(n, HEADS, HEAD_DIM),
        "dt": mamba2.discretize(rand(n, HEADS), rand(HEADS)),
        "a": -torch.exp(rand(HEADS)),
        "b": rand(n, GROUPS, STATE),
        "c": rand(n, GROUPS, STATE),
        "d": rand(HEADS),
        "state": rand(HEADS, HEAD_DIM, STATE),
    }


def close(ours: torch.Tensor, ref: torch.Tensor, tol: float = 1e-5) -> None:
    err = float((ours - ref).abs().max() / ref.abs().max())
    assert err < tol, err


@pytest.mark.parametrize("n, chunk", [(11, 4), (8, 4), (3, 256), (1, 2)])
def test_chunked_matches_recurrent(n: int, chunk: int) -> None:
    """Whole chunks, a ragged last chunk, one chunk larger than the prompt, one token."""
    args = inputs(n, seed=n)
    y, s = mamba2.recurrent(**args)
    yc, sc = mamba2.chunked(**args, chunk=chunk)
    close(yc, y)
    close(sc, s)
    assert not torch.allclose(s, args["state"])  # the state moved


def test_split_prefill_carries_the_state() -> None:
    """Tokens [0, 7) then [7, 13) from the first part's conv and SSM state equal [0, 13)."""
    args = inputs(13, seed=1)
    conv_in = torch.randn(13, 10)
    weight, bias = torch.randn(10, KERNEL), torch.randn(10)
    conv0 = torch.zeros(10, KERNEL - 1)
    whole_conv, whole_conv_state = mamba2.causal_conv1d(conv_in, conv0, weight, bias)
    first, mid = mamba2.causal_conv1d(conv_in[:7], conv0, weight, bias)
    second, end = mamba2.causal_conv1d(conv_in[7:], mid, weight, bias)
    close(torch.cat((first, second)), whole_conv)
    assert torch.equal(end, whole_conv_state) and torch.equal(end, conv_in[-3:].t())
    y, s = mamba2.chunked(**args, chunk=4)
    part = {k: v[:7] if k not in ("a", "d", "state") else v for k, v in args.items()}
    rest = {k: v[7:] if k not in ("a", "d", "state") else v for k, v in args.items()}
    y1, s1 = mamba2.chunked(**part, chunk=4)
    y2, s2 = mamba2.chunked(**{**rest, "state": s1}, chunk=4)
    close(torch.cat((y1, y2)), y)
    close(s2, s)


def test_against_transformers_scan_and_state_update() -> None:
    """transformers' mamba2_chunk_scan (with an initial state, its final state returned) and
    mamba2_selective_state_update (one decode token) against `chunked` and `recurrent`."""
    hf = pytest.importorskip("transformers.models.granitemoehybrid.modeling_granitemoehybrid")
    g = torch.Generator().manual_seed(5)
    n = 9
    x, dt_raw = torch.randn(n, HEADS, HEAD_DIM, generator=g), torch.randn(n, HEADS, generator=g)
    dt_bias, a_log = torch.randn(HEADS, generator=g), torch.randn(HEADS, generator=g)
    b, c = torch.randn(2, n, GROUPS, STATE, generator=g)
    d, s0 = torch.randn(HEADS, generator=g), torch.randn(HEADS, HEAD_DIM, STATE, generator=g)
    a = -torch.exp(a_log)
    ref_y, ref_s = hf.mamba2_chunk_scan(
        x[None], dt_raw[None], a, b[None], c[None], chunk_size=4, D=d, dt_bias=dt_bias,
        initial_states=s0[None], dt_softplus=True, return_final_states=True,
    )  # fmt: skip
    y, s = mamba2.chunked(x, mamba2.discretize(dt_raw, dt_bias), a, b, c, d, s0, chunk=4)
    close(y, ref_y[0])
    close(s, ref_s[0])
    state = s0[None].clone()
    ref_one = hf.mamba2_selective_state_update(
        state, x[:1], dt_raw[:1, :, None].expand(-1, -1, HEAD_DIM),
        a[:, None, None].expand(-1, HEAD_DIM, STATE), b[:1], c[:1],
        d[:, None].expand(-1, HEAD_DIM), dt_bias=dt_bias[:, None].expand(-1, HEAD_DIM),
        dt_softplus=True,
    )  # fmt: skip
    y1, s1 = mamba2.recurrent(x[:1], mamba2.discretize(dt_raw[:1], dt_bias), a, b[:1], c[:1], d, s0)
    close(y1[0], ref_one[0])
    close(s1, state[0])


def granite_config(**overrides: object) -> object:
    transformers = pytest.importorskip("transformers")
    fields = dict(
        vocab_size=64, hidden_size=12, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, mamba_n_heads=HEADS, mamba_n_groups=GROUPS, mamba_d_state=STATE,
        mamba_d_conv=KERNEL, mamba_expand=1, mamba_chunk_size=4, layer_types=["mamba"],
    )  # fmt: skip
    return transformers.GraniteMoeHybridConfig(**{**fields, **overrides})


@torch.no_grad()
def test_mixer_matches_transformers_layer() -> None:
    """Our Mamba2Mixer with the weights of transformers' GraniteMoeHybridMambaLayer: the same
    output for a 10-token prompt; the prompt in chunks of 6, 1, 3 from carried states too."""
    hf = pytest.importorskip("transformers.models.granitemoehybrid.modeling_granitemoehybrid")
    cfg = granite_config()
    torch.manual_seed(0)
    layer = hf.GraniteMoeHybridMambaLayer(cfg, 0).eval()
    for p in layer.parameters():
        p.normal_(0, 0.5)
    shape = mamba2_from_granite(cfg.to_dict())
    assert shape == Mamba2Config(HEADS, HEAD_DIM, GROUPS, STATE, KERNEL, chunk_size=4)
    mixer = mamba2.Mamba2Mixer(cfg.hidden_size, shape, cfg.rms_norm_eps, state_idx=0)
    missing = mixer.load_state_dict(layer.state_dict(), strict=False)
    assert not missing.missing_keys, missing
    hidden = torch.randn(10, cfg.hidden_size)
    ref = layer(hidden[None])[0]
    conv, ssm = mixer.new_state(hidden)
    parts = []
    s = shape
    for rows in (slice(0, 6), slice(6, 7), slice(7, 10)):
        gate, xbc, dt = mixer.in_proj(hidden[rows]).split(
            [s.intermediate_size, s.conv_dim, s.num_heads], dim=-1
        )
        y, conv, ssm = mixer.run_chunk(xbc, dt, conv, ssm)
        y = mixer.norm(y, gate)
        parts.append(mixer.out_proj(y))
    close(torch.cat(parts), ref)
    assert conv.shape == s.conv_shape and ssm.shape == s.ssm_shape


def test_config_names_bad_fields() -> None:
    with pytest.raises(ValueError, match="mamba_n_groups=3 must divide mamba_n_heads=4"):
        Mamba2Config(4, 2, 3, 8, 4)
    with pytest.raises(ValueError, match="mamba_n_heads=5 x mamba_d_head=2"):
        mamba2_from_granite({"hidden_size": 8, "mamba_n_heads": 5, "mamba_d_head": 2})


class ThreadRank:
    """Rank `rank` of two ranks run as threads: all_reduce sums the two ranks' tensors (the
    engine's TPGroup over gloo, without processes)."""

    def __init__(self, rank: int, shared: dict[int, torch.Tensor], barrier: threading.Barrier):
        self.rank, self.size, self.shared, self.barrier = rank, 2, shared, barrier

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.shared[self.rank] = x.clone()
        self.barrier.wait()
        total = self.shared[0] + self.shared[1]
        self.barrier.wait()
        return x.copy_(total)


@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_one_group_norm_split_over_two_ranks(norm_before_gate: bool) -> None:
    """The gated norm of a one-group layer split by heads over T = 2 (each rank half the
    channels, its squares summed across the ranks): the whole norm's halves, gate before the
    norm (Granite 4.0-H, Nemotron-H) or after it (Falcon-H1's mamba_norm_before_gate); a norm
    over each rank's half alone differs."""
    g = torch.Generator().manual_seed(3)
    y, gate, w = torch.randn(5, 12, generator=g), torch.randn(5, 12, generator=g), torch.rand(12)
    whole = mamba2.gated_rms_norm(y, gate, w, 1, 1e-6, norm_before_gate=norm_before_gate)
    shared: dict[int, torch.Tensor] = {}
    barrier, out = threading.Barrier(2, timeout=30), {}

    def run(rank: int) -> None:
        tp: Any = ThreadRank(rank, shared, barrier)
        cols = slice(6 * rank, 6 * rank + 6)
        part = (y[:, cols], gate[:, cols], w[cols], 1, 1e-6)
        out[rank] = mamba2.gated_rms_norm(*part, tp, norm_before_gate)
        out[rank + 2] = mamba2.gated_rms_norm(*part, None, norm_before_gate)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    torch.testing.assert_close(torch.cat((out[0], out[1]), dim=-1), whole)
    assert not torch.allclose(torch.cat((out[2], out[3]), dim=-1), whole, atol=1e-3)
