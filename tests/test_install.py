"""llmserve as a user installs it. The wheel adds exactly one import name, `llmserve`, and carries
every file the engine reads at run time (.proto, .cu, .cpp, .h). Installed into a fresh venv
beside Hugging Face's `kernels` package (which transformers >= 5.25 imports from modeling_utils:
a top-level `kernels` of ours shadowed it and broke both Quickstart commands), transformers
imports and `llmserve serve`, started from another directory, answers a request.

The scratch venv gets the wheel alone; its dependencies come from this checkout's locked .venv
through a .pth line (a path entry: the editable install's finder there is never run), so
nothing is downloaded and the test stays well under a minute.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

from tests.stack import ROOT, free_port

RUNTIME_FILES = (".proto", ".cu", ".cpp", ".h")
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "eos_token_id": 300,
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a copy of what the Dockerfile copies too, so no build/ lands in the checkout.
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source)
    shutil.copytree(
        ROOT / "llmserve", source / "llmserve", ignore=shutil.ignore_patterns("__pycache__")
    )
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(source)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (built,) = out.glob("llmserve-*.whl")
    return built


def test_the_wheel_adds_one_import_name_and_its_runtime_files(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        declared = set(archive.read(top_level).decode().split())
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"llmserve"}, tops
    assert declared == {"llmserve"}, declared
    wanted = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "llmserve").rglob("*")
        if p.suffix in RUNTIME_FILES and "__pycache__" not in p.parts
    }
    assert {n for n in wanted if n.endswith(".cpp")}, "the checkout has no .cpp: moved?"
    missing = sorted(wanted - set(names))
    assert not missing, f"the wheel lacks {missing}"


@pytest.fixture(scope="module")
def user_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel; every other package (HF's `kernels` among them) from the
    checkout's .venv through a path entry."""
    venv = tmp_path_factory.mktemp("user") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    Path(purelib, "locked-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "-q", str(wheel)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return venv


def test_transformers_and_llmserve_import_side_by_side(user_venv: Path, tmp_path: Path) -> None:
    code = (
        "import json, kernels, transformers.modeling_utils, llmserve.kernels.reference\n"
        "from kernels import CUDAProperties\n"
        "import llmserve.engine.engine, llmserve.gateway.service, llmserve.scheduler.service.service\n"
        "print(json.dumps({'hf_kernels': kernels.__file__, 'ours': llmserve.__file__}))"
    )
    done = subprocess.run(
        [str(user_venv / "bin" / "python"), "-c", code],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    files = json.loads(done.stdout.splitlines()[-1])
    assert Path(files["ours"]).is_relative_to(user_venv), files  # the wheel, not the checkout
    assert not Path(files["hf_kernels"]).is_relative_to(ROOT / "llmserve"), files


def test_serve_from_another_directory_answers(user_venv: Path, tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))
    ports = [free_port() for _ in range(4)]
    command = [
        str(user_venv / "bin" / "llmserve"), "serve", "--model", "tiny", "--load-format",
        "dummy", "--num-kv-blocks", "16", "--device", "cpu", "--host", "127.0.0.1",
        "--port", str(ports[0]), "--scheduler-port", str(ports[1]),
        "--engine-port", str(ports[2]), "--http-port", str(ports[3]), "--metrics-port", "0",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        reply = _chat_when_up(ports[3], proc, deadline=time.monotonic() + 90)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    output = (tmp_path / "serve.log").read_text()
    assert reply is not None, output[-3000:]
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 3
    assert str(ROOT / "llmserve") not in output, "a service ran the checkout's code"


def _chat_when_up(port: int, proc: subprocess.Popen[bytes], deadline: float) -> dict | None:
    """The first answer of /v1/completions (3 tokens), polling until the stack is up."""
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    while time.monotonic() < deadline and proc.poll() is None:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=body.encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read())
        except OSError:
            time.sleep(0.5)
    return None


@pytest.mark.parametrize("lock", ["dev-py311.txt", "dev-py312.txt"])
def test_the_lock_pins_every_dependency_within_its_range(lock: str) -> None:
    """requirements/ (scripts/lock.sh) pins each package pyproject.toml names, at a version its
    range allows; torch is installed apart (scripts/setup.sh)."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [
        Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]
    ]
    pins = {}
    for line in (ROOT / "requirements" / lock).read_text().splitlines():
        if line and not line.startswith((" ", "#")):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version.strip()
    python = {"dev-py311.txt": "3.11", "dev-py312.txt": "3.12"}[lock]
    bad = []
    for req in wanted:
        name = canonicalize_name(req.name)
        if name == "torch" or (req.marker and not req.marker.evaluate({"python_version": python})):
            continue
        if name not in pins or not req.specifier.contains(pins[name], prereleases=True):
            bad.append(f"{req} (locked: {pins.get(name)})")
    assert not bad, f"{lock} is stale, run scripts/lock.sh: {bad}"
