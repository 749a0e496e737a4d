"""CPU checks of kernels/: every .cu compiles with nvcc for sm_90 and sm_80 (all the template
instances the wrappers launch, warnings as errors, no register spills), the sources also compile
through NVRTC exactly as CuPy is asked to where a libnvrtc can be found, and kernels/cuda.py
imports and rejects bad arguments without CuPy or a GPU.

nvcc or libnvrtc missing: those tests skip, naming what is missing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import llmserve.kernels.cuda as kc

ARCHS = ("sm_90", "sm_80")
CU_FILES = sorted(p.name for p in kc.KERNEL_DIR.glob("*.cu"))
WORKERS = max(2, min(4, os.cpu_count() or 2))
NVCC_CACHE = Path.home() / ".cache" / "llmserve" / "nvcc-checks"


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    home = Path(os.environ.get("CUDA_HOME", os.environ.get("CUDA_PATH", "/usr/local/cuda")))
    candidate = home / "bin" / "nvcc"
    return str(candidate) if candidate.exists() else None


def _translation_unit(filename: str) -> str:
    """The source as NVRTC receives it, plus the address of every template instance the wrappers
    launch from it, so that nvcc instantiates (and ptxas assembles) exactly those."""
    exprs = [e for s in kc.all_module_specs() if s.filename == filename for e in s.name_expressions]
    source = kc.load_source(filename)
    if exprs:
        refs = ",\n  ".join(f"(void*)&{e}" for e in exprs)
        source += f"\nvoid* llmserve_instances[] = {{\n  {refs}\n}};\n"
    return source


def _compile(nvcc: str, filename: str, arch: str, workdir: Path) -> tuple[int, str]:
    """nvcc's exit status and output for one translation unit, remembered under
    ~/.cache/llmserve/nvcc-checks keyed by the unit's text, the flags and nvcc's version (the
    same input gives the same answer; an edited kernel is compiled again)."""
    tu = workdir / f"{Path(filename).stem}_{arch}.cu"
    text = _translation_unit(filename)
    flags = [f"-arch={arch}", "-std=c++17", "--cubin", "-Werror", "all-warnings", "-Xptxas", "-v"]
    key = hashlib.sha256("\0".join([text, *flags, _nvcc_version(nvcc)]).encode()).hexdigest()
    cached = NVCC_CACHE / f"{key}.json"
    if cached.exists():
        rc, log = json.loads(cached.read_text())
        return rc, log
    tu.write_text(text)
    cmd = [nvcc, *flags, "-o", str(tu.with_suffix(".cubin")), str(tu)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir, timeout=300)
    result = (proc.returncode, proc.stdout + proc.stderr)
    NVCC_CACHE.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(result))
    partial.replace(cached)  # whole or absent, with two workers at it
    return result


@functools.cache
def _nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def nvcc_results() -> dict[tuple[str, str], tuple[int, str]]:
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not on PATH (nor in $CUDA_HOME/bin): CUDA compile checks skipped")
    jobs = [(f, a) for f in CU_FILES for a in ARCHS]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(WORKERS) as pool:
        futures = {job: pool.submit(_compile, nvcc, *job, Path(tmp)) for job in jobs}
        return {job: future.result() for job, future in futures.items()}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("filename", CU_FILES)
def test_nvcc_compiles(nvcc_results: dict, filename: str, arch: str) -> None:
    rc, log = nvcc_results[(filename, arch)]
    assert rc == 0, f"nvcc -arch={arch} failed on {filename}:\n{log}"
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert all(s == ("0", "0") for s in spills), f"register spills in {filename} ({arch}):\n{log}"


def test_every_kernel_file_is_launched() -> None:
    used = {s.filename for s in kc.all_module_specs()}
    assert set(CU_FILES) - used == {"common.cu"}, "a .cu file that no wrapper compiles"


# ---------------------------------------------------------------------------------------------
# NVRTC, as CuPy drives it (optional: needs a libnvrtc, e.g. from the nvidia-cuda-nvrtc wheel)


def _find_nvrtc() -> str | None:
    explicit = os.environ.get("LLMSERVE_NVRTC")
    if explicit:
        return explicit
    candidates: list[Path] = []
    for entry in sys.path:
        base = Path(entry) / "nvidia"
        if base.is_dir():
            candidates += sorted(base.glob("*/lib/libnvrtc.so*"))
    home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    candidates += sorted((home / "lib64").glob("libnvrtc.so*"))
    for path in candidates:
        if "builtins" not in path.name and "alt" not in path.name:
            return str(path)
    return ctypes.util.find_library("nvrtc")


def _nvrtc_compile(lib: ctypes.CDLL, spec: kc.ModuleSpec, arch: str) -> str:
    """Compile one module like cupy.RawModule does; returns '' or an error report."""
    prog = ctypes.c_void_p()
    source = kc.load_source(spec.filename).encode()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source, spec.filename.encode(), 0, None, None):
        return "nvrtcCreateProgram failed"
    try:
        for expr in spec.name_expressions:
            lib.nvrtcAddNameExpression(prog, expr.encode())
        options = [*kc.NVRTC_OPTIONS, f"-arch={arch}", "-ftz=true"]  # CuPy appends -ftz=true
        argv = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        rc = lib.nvrtcCompileProgram(prog, len(options), argv)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace").strip()
        if rc != 0:
            return f"NVRTC error {rc}:\n{text}"
        if "warning" in text:
            return f"NVRTC warnings:\n{text}"
        for expr in spec.name_expressions:
            lowered = ctypes.c_char_p()
            if lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(lowered)):
                return f"no lowered name for {expr}"
        cubin = ctypes.c_size_t()
        if lib.nvrtcGetCUBINSize(prog, ctypes.byref(cubin)) or cubin.value == 0:
            return "no cubin produced"
        return ""
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def test_nvrtc_compiles_every_module() -> None:
    path = _find_nvrtc()
    if path is None:
        pytest.skip("no libnvrtc found (set LLMSERVE_NVRTC or install nvidia-cuda-nvrtc)")
    lib = ctypes.CDLL(path)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    jobs = [(spec, arch) for spec in kc.all_module_specs() for arch in ("sm_90", "sm_80")]
    with ThreadPoolExecutor(WORKERS) as pool:
        reports = list(pool.map(lambda job: _nvrtc_compile(lib, *job), jobs))
    failures = [f"{spec} {arch}: {r}" for (spec, arch), r in zip(jobs, reports, strict=True) if r]
    assert not failures, "\n\n".join(failures)


# ---------------------------------------------------------------------------------------------
# The Python side, without CuPy or a GPU


def test_import_without_cupy() -> None:
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "import llmserve.kernels.cuda as k\n"
        "assert not k.is_available()\n"
        "assert len(k.all_module_specs()) == 37\n"
    )
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


def test_sources_need_no_headers() -> None:
    for spec in kc.all_module_specs():
        text = kc.load_source(spec.filename)
        assert "#include" not in text, f"{spec.filename} includes a header NVRTC may not find"


def test_wrappers_reject_bad_arguments() -> None:
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 2, 128, dtype=torch.bfloat16)
    tables = torch.zeros(2, 4, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="q is on cpu"):
        kc.paged_decode_attention(q, cache, cache, tables, lens, 0.1)
    with pytest.raises(ValueError, match=r"x.dtype=torch.float32 is not supported"):
        kc.silu_and_mul(torch.zeros(2, 32))
    with pytest.raises(ValueError, match="must have 3 dimensions"):
        kc.store_kv(torch.zeros(4, 128, dtype=torch.float16), q, cache, cache, lens)


def test_decode_num_splits() -> None:
    slots = 132 * 3
    assert kc.decode_num_splits(8, 32768, slots) > 16  # batch 1, 8 kv heads, 32k: split widely
    assert kc.decode_num_splits(2048, 1024, slots) <= 2  # batch 256 at 1k fills the GPU
    assert kc.decode_num_splits(8, 20, slots) == 1  # too short to split
    assert kc.decode_smem_bytes(128) == 69632
    assert kc.prefill_smem_bytes(128, 64) == 87040
    assert kc.prefill_smem_bytes(128, 128) == 69632
    # FP8 pools: the copied bytes plus one converted tile (kernels/*.cu headers)
    assert kc.decode_smem_bytes(128, fp8=True) == 67584
    assert kc.prefill_smem_bytes(128, 64, fp8=True) == 84992
    assert kc.prefill_smem_bytes(128, 128, fp8=True) == 68608
