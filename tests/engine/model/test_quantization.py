"""--quantization and --kv-cache-dtype: the CPU int8 kernel against its torch twin, the int8
forms holding GGUF blocks exactly, and the quality of every mode on the built-in model against
the unquantized one (llmserve/bench/quality.py), with the thresholds of issue 14."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from llmserve.bench.engine_driver import generate
from llmserve.bench.quality import PASSAGES, agreement, prompt_logits
from llmserve.common.model_config import load_model_config
from llmserve.engine.config import EngineConfig
from llmserve.engine.model.quant import Fp8Linear, Int8Linear, grouped_int8
from llmserve.engine.model.weights import build_model, load_weights, resolve_quantization
from llmserve.engine.step.engine import Engine
from llmserve.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.stack  # starts service processes (tests/conftest.py)

HAS_AVX2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@pytest.mark.skipif(not HAS_AVX2, reason="the int8 kernel is AVX2 code")
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 17, 64, 130])
@pytest.mark.parametrize(("n", "k", "group"), [(13, 64, 32), (96, 96, 32), (7, 40, 40), (16, 9, 9)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_kernel_matches_its_torch_twin(
    m: int, n: int, k: int, group: int, with_bias: bool
) -> None:
    """kernels/cpu_int8.cpp on packed tiles: 1-4 rows per micro-kernel pass and remainders, N
    not a multiple of 16 (a padded tile), per-channel groups, odd K; must build here (g++,
    ninja)."""
    assert cpu_kernels.unavailable() is None
    gen = torch.Generator().manual_seed(m * 1000 + n)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    scales = torch.rand(n, k // group, generator=gen) + 0.01
    offsets = torch.randn(n, k // group, generator=gen)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    packed = cpu_kernels.pack_int8(q, scales, offsets, group)
    got = cpu_kernels.int8_linear(x, packed, bias)
    want = cpu_kernels.int8_linear_reference(x, q, scales, offsets, group, bias)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.skipif(not HAS_AVX2, reason="the int8 kernel is AVX2 code")
def test_a_stale_build_lock_does_not_stop_the_kernel_loading() -> None:
    """An engine killed mid-build leaves torch's `lock` file in the build directory; torch's
    builder waits on it forever, so every later engine start hung. The load must go through."""
    import subprocess
    import sys

    assert cpu_kernels.unavailable() is None  # built (and cached) in this process first
    (cpu_kernels.build_dir() / "lock").write_text("")
    code = "from llmserve.kernels import cpu; assert cpu.unavailable() is None, cpu.unavailable()"
    done = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert not (cpu_kernels.build_dir() / "lock").exists()


def test_int8_forms_hold_gguf_blocks_exactly() -> None:
    """A Q4_1 block (d * i + m, i in 0..15) survives the asymmetric form and a Q8_0 block
    (d * q, |q| <= 127) the symmetric one, to float32 rounding; Int8Linear picks the form that
    holds each weight."""
    gen = torch.Generator().manual_seed(0)
    d = torch.rand(8, 4, 1, generator=gen) * 0.02 + 0.001
    low = -torch.rand(8, 4, 1, generator=gen) * 0.1
    levels = torch.randint(0, 16, (8, 4, 32), generator=gen).float()
    levels[..., 0], levels[..., 1] = 0, 15  # every block spans its range, as Q4_1's does
    q4_1 = (d * levels + low).view(8, 128)
    q8 = torch.randint(-127, 128, (8, 4, 32), generator=gen).float()
    q8[..., 0] = 127
    q8_0 = (d * q8).view(8, 128)
    for weight, symmetric in ((q4_1, False), (q8_0, True)):
        q, scale, offset = grouped_int8(weight, 32, symmetric)
        back = q.view(8, 4, 32).float() * scale[..., None] + offset[..., None]
        torch.testing.assert_close(back.view(8, 128), weight, rtol=0, atol=1e-6)
        layer = Int8Linear(weight, None)
        assert layer.symmetric == symmetric


def test_auto_quantization_keeps_a_q8_0_gguf_quantized(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """--quantization auto on a CPU for a GGUF whose projections are Q8_0: its blocks as stored
    (gguf), or int8 where a tensor-parallel rank cannot take them (its int8 values come through
    unchanged); none for a float GGUF, an HF directory or a GPU."""
    import numpy as np

    from tests.engine.model.test_weights import write_gguf

    hf_dir = tiny_model(hidden_size=64, intermediate_size=128)
    names = tuple(
        f"blk.{i}.{t}.weight"
        for i in range(2)
        for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    )
    q8_path, f32_path = tmp_path / "q8.gguf", tmp_path / "f32.gguf"
    stored = write_gguf(hf_dir, q8_path, quantize=names)
    write_gguf(hf_dir, f32_path)
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve_quantization("auto", q8_path, cpu) == "gguf"
    assert resolve_quantization("auto", q8_path, cpu, whole=False) == "int8"
    assert resolve_quantization("auto", q8_path, gpu) == "none"
    assert resolve_quantization("auto", f32_path, cpu) == "none"
    assert resolve_quantization("auto", hf_dir, cpu) == "none"
    assert resolve_quantization("none", q8_path, cpu) == "none"
    config = load_model_config(q8_path)
    model = build_model(
        config, load_weights(q8_path, config), 64, torch.float32, torch.device("cpu"),
        quantization="int8",
    )  # fmt: skip
    down = model.layers[1].mlp.down_proj
    assert isinstance(down, Int8Linear)
    assert down.packed is not None and down.symmetric
    n, k = config.hidden_size, config.intermediate_size
    q = down.packed.q.transpose(1, 2).reshape(-1, k)[:n]  # back from [N / 16, K, 16] tiles
    blocks = stored["blk.1.ffn_down.weight"].reshape(-1, 34)  # Q8_0: fp16 d + 32 int8
    file_q = blocks[:, 2:].copy().view(np.int8).reshape(n, k)
    assert torch.equal(q, torch.from_numpy(file_q))


@pytest.fixture(scope="module")
def builtin(builtin_model_path: Path) -> tuple:
    """The built-in model's config, weights, reference model and reference logits of PASSAGES."""
    from llmserve.gateway.tokenizer import Tokenizer

    config = load_model_config(builtin_model_path)
    weights = load_weights(builtin_model_path, config)
    tokenizer = Tokenizer.from_model_path(builtin_model_path)
    prompts = [tokenizer.encode(text) for text in PASSAGES]
    reference = build_model(config, weights, 1024, torch.float32, torch.device("cpu"))
    logits = [prompt_logits(reference, config, p) for p in prompts]
    return config, weights, reference, prompts, logits


# mode: (quantization, kv dtype, top-1 at least, mean KL at most). Issue 14's thresholds are
# int8 >= 98%, fp8 weights >= 97%, fp8 KV >= 98%. Two miss on this 135M model and carry the
# bound they were measured against instead, as a guard (docs/quantization.md, "Quality"): fp8
# KV keeps 93% (94-95% with per-layer scales; its 3 mantissa bits are the limit, not the range)
# and fp8 weights 84% (test_fp8_weights_quality).
MODES = {
    "int8": ("int8", torch.float32, 0.98, 1e-3),
    # the Q4_1 / Q8_0 blocks as stored, activations rounded to int16 per block of 32 (int8, as
    # llama.cpp rounds them, kept 97%: kernels/cpu_gguf.py); measured 100%, 6e-8 nats with every
    # product through the dot products
    "gguf": ("gguf", torch.float32, 0.995, 1e-5),
    # --quantization auto's dense copy (engine/model/cpu_weights.py) on every product: the blocks
    # widened once, so the dequantized model's own logits but for the GEMM's summation order
    "gguf+dense": ("gguf+dense", torch.float32, 0.999, 1e-6),
    "kv-bf16": ("none", torch.bfloat16, 0.98, 1e-3),
    "kv-fp16": ("none", torch.float16, 0.98, 1e-3),
    "kv-fp8 (misses 98%)": ("none", torch.float8_e4m3fn, 0.90, 0.02),
    "int8+kv-fp8 (misses 98%)": ("int8", torch.float8_e4m3fn, 0.90, 0.02),
}


@pytest.fixture(scope="module")
def quantized_builtin(builtin: tuple) -> Callable[[str], torch.nn.Module]:
    """The built-in model built with a --quantization mode, once per mode (int8 serves two of
    MODES; a model holds no state between forwards, its KV pools are passed in)."""
    config, weights, reference = builtin[:3]
    models: dict[str, torch.nn.Module] = {"none": reference}

    def get(quantization: str) -> torch.nn.Module:
        if quantization not in models:
            dense = quantization == "gguf+dense"  # the dense copy from 1 row on
            models[quantization] = build_model(
                config, weights, 1024, torch.float32, torch.device("cpu"),
                quantization="gguf" if dense else quantization,
                dense_budget_mib=1024 if dense else 0, dense_rows=1,
            )  # fmt: skip
        return models[quantization]

    return get


@pytest.mark.parametrize("mode", list(MODES))
def test_quality_on_the_builtin_model(
    builtin: tuple, quantized_builtin: Callable[[str], torch.nn.Module], mode: str
) -> None:
    config, _, _, prompts, ref_logits = builtin
    quantization, kv_dtype, min_top1, max_kl = MODES[mode]
    model = quantized_builtin(quantization)
    got = [prompt_logits(model, config, p, kv_dtype) for p in prompts]
    result = agreement(ref_logits, got)
    assert result.positions > 300
    assert result.top1 >= min_top1, result
    assert result.mean_kl <= max_kl, result


def test_fp8_weights_quality(builtin: tuple) -> None:
    """FP8 e4m3 weights and activations (per-channel / per-token scales): measured on this
    135M model at 84% top-1, below issue 14's 97%. e4m3 keeps 3 mantissa bits, so every weight
    moves by up to 6%; fp8 weights alone keep 90%, fp8 activations alone 96%
    (docs/quantization.md). The bound here guards against regressions, not the target."""
    config, weights, _, prompts, ref_logits = builtin
    model = build_model(
        config, weights, 1024, torch.float32, torch.device("cpu"), quantization="fp8"
    )
    assert isinstance(model.layers[0].mlp.down_proj, Fp8Linear)
    result = agreement(ref_logits, [prompt_logits(model, config, p) for p in prompts])
    assert result.top1 >= 0.80, result
    assert result.mean_kl <= 0.1, result


@pytest.mark.parametrize(("rows", "k", "n"), [(1, 64, 96), (5, 128, 40), (33, 96, 128)])
def test_fp8_cpu_path_is_scaled_mm(rows: int, k: int, n: int) -> None:
    """On a CPU, Fp8Linear's float32 GEMM over the widened e4m3 weight gives what
    torch._scaled_mm gives for the same e4m3 values and scales: equal, or a bfloat16 unit in the
    last place apart where the summation order rounds differently."""
    from llmserve.engine.model.quant import FP8_MAX, per_channel_fp8

    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(n, k, generator=gen) * 0.05, torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    layer = Fp8Linear(weight, bias)
    q, scale = per_channel_fp8(weight)
    x_scale = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    xq = (x / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    want = torch._scaled_mm(
        xq, q.t(), scale_a=x_scale, scale_b=scale[None, :], out_dtype=torch.bfloat16
    ).float()
    got = layer(x)
    ulp = want.abs().clamp(min=2**-20) * 2**-7  # bfloat16's spacing near each value
    assert ((got - (want + bias)).abs() <= ulp).all()
    assert (got == want + bias).float().mean() >= 0.97


MODE_PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 2683, 1453, 28, 260, 3468]]
MODE_ENGINE = dict(device="cpu", num_kv_blocks=64, max_model_len=256, seed=0)


@pytest.fixture(scope="module")
def unquantized_tokens(builtin_model_path: Path) -> list[list[int]]:
    """The unquantized engine's 8 greedy tokens for MODE_PROMPTS, made once for every mode."""
    return generate(Engine(EngineConfig(**MODE_ENGINE, quantization="none")), MODE_PROMPTS, 8)


# unquantized_tokens is asked for inside the test: the group (the module's, as tests/conftest.py
# names groups) keeps these on the worker that made it
@pytest.mark.xdist_group("tests/engine/model/test_quantization.py")
@pytest.mark.parametrize(
    ("quantization", "kv_cache_dtype"), [("int8", "bf16"), ("int8", "fp8"), ("fp8", "auto")]
)
def test_engine_runs_each_mode(
    request: pytest.FixtureRequest, quantization: str, kv_cache_dtype: str
) -> None:
    """The engine builds and generates in each mode, its pool of the asked dtype; each
    request's first greedy token under int8 is the unquantized engine's (fp8 weights keep 84%
    of top-1 tokens, so they may part ways at once)."""
    prompts, common = MODE_PROMPTS, MODE_ENGINE
    engine = Engine(
        EngineConfig(**common, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    )
    want = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "auto": torch.float32}
    assert engine.kv_cache.dtype == want[kv_cache_dtype]
    got = generate(engine, prompts, 8)
    assert [len(g) for g in got] == [8, 8]
    if quantization == "int8":
        base = request.getfixturevalue("unquantized_tokens")
        assert [g[0] for g in got] == [b[0] for b in base], (got, base)


@pytest.mark.parametrize(("quantization", "kv_cache_dtype"), [("int8", "bf16"), ("fp8", "fp8")])
def test_modes_through_the_whole_stack(
    builtin_model_path: Path, tmp_path: Path, quantization: str, kv_cache_dtype: str
) -> None:
    """Each mode serves the built-in model through gateway, scheduler and engine, as
    `llmserve serve --quantization Q --kv-cache-dtype K` starts it; every block comes back."""
    from llmserve.client import make_request
    from tests.stack import start_stack

    flags = ["--quantization", quantization, "--kv-cache-dtype", kv_cache_dtype]
    stack = start_stack(
        None, engine_args=[*flags, "--kv-cache-gb", "0.25"], log_dir=tmp_path, timeout=300
    )
    try:
        request = make_request(
            messages=[("user", "What is the capital of France?")],
            max_tokens=12,
            temperature=0.0,
            ignore_eos=True,
        )
        with stack.client() as client:
            result = client.generate(request)
        assert len(result.token_ids) == 12 and result.finish_reason == "length"
        assert result.text.strip()
        stack.assert_idle()
    finally:
        stack.close()


# ---- --quantization int8 on a GPU: kernels/int8_gemm.cu, never a silent fallback -------------


def test_int8_on_a_gpu_needs_our_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    import llmserve.kernels.cuda as kc
    from llmserve.engine.model.quant import quantization_limits

    gpu = torch.device("cuda")
    monkeypatch.setattr(kc, "is_available", lambda: False)
    why = quantization_limits("int8", gpu)
    assert why is not None and "kernels/int8_gemm.cu" in why and "is_available() is False" in why
    assert quantization_limits("int8", torch.device("cpu")) is None
    monkeypatch.setattr(kc, "is_available", lambda: True)
    assert quantization_limits("int8", gpu) is None


def test_gpu_int8_self_check_on_the_emulator(monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up check of the GPU int8 path, its kernel run on CPU tensors by the emulator:
    it passes as built, and names what went wrong for a kernel that disagrees or fails."""

    import llmserve.engine.model.quant as quant
    from llmserve.kernels import int8 as gpu_int8
    from tests.kernel_emu import emu

    cpu = torch.device("cpu")
    with emu.installed_or_skip():
        assert quant._gpu_int8_problem(cpu, torch.bfloat16) is None
        assert quant._gpu_int8_problem(cpu, torch.float16) is None
    why = quant._gpu_int8_problem(cpu, torch.float32)
    assert why == "kernels/int8_gemm.cu takes float16 or bfloat16 activations, not torch.float32"

    def wrong(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return torch.ones(x.shape[0], w.shape[0], dtype=x.dtype)

    monkeypatch.setattr(gpu_int8, "int8_linear", wrong)
    why = quant._gpu_int8_problem(cpu, torch.bfloat16)
    assert why is not None and why.startswith("self-check: int8_linear on 1 rows differs")

    def crash(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no kernel image is available for execution")

    monkeypatch.setattr(gpu_int8, "int8_linear", crash)
    why = quant._gpu_int8_problem(cpu, torch.bfloat16)
    assert why == "self-check: RuntimeError: no kernel image is available for execution"


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 200])
def test_int8_linear_on_the_gpu(rows: int) -> None:
    """Int8Linear on CUDA runs kernels/int8_gemm.cu: within bf16 rounding of the dequantized
    weight's product in float32 (an 8B-shaped down projection, with a bias)."""
    import llmserve.kernels.cuda as kc

    if not kc.is_available():
        pytest.skip("kernels.cuda.is_available() is False (needs CuPy and an sm_80+ GPU)")
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(4096, 14336, generator=gen) * 0.02).to("cuda", torch.bfloat16)
    bias = torch.randn(4096, generator=gen).to("cuda", torch.bfloat16)
    layer = Int8Linear(weight, bias)
    x = torch.randn(rows, 14336, generator=gen).to("cuda", torch.bfloat16)
    q, scales = grouped_int8(weight, weight.shape[1], True)
    dequantized = q.float() * scales.view(-1, 1)
    want = x.float() @ dequantized.t() + bias.float()
    got = layer(x).float()
    error = ((got - want).norm(dim=1) / want.norm(dim=1)).max().item()
    assert error <= 1e-2, error
