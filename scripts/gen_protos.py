"""Generate the Python stubs for llmserve/protos/*.proto into llmserve/protos/.

    python scripts/gen_protos.py            # write llmserve/protos/*_pb2*.py(i)
    python scripts/gen_protos.py --out DIR  # under DIR/llmserve/protos (the staleness test)

The stubs must import under grpcio 1.84 (the GPU machine's version): stubs made by a newer
grpcio-tools refuse to load under an older grpcio, so this script insists on grpcio-tools 1.84.0.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from importlib import metadata
from pathlib import Path

REQUIRED_GRPCIO_TOOLS = "1.84.0"
ROOT = Path(__file__).resolve().parent.parent
PROTOS = Path("llmserve", "protos")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every llmserve/protos/*.proto; return the files written under
    out_dir/llmserve/protos."""
    version = metadata.version("grpcio-tools")
    if version != REQUIRED_GRPCIO_TOOLS:
        sys.exit(
            f"grpcio-tools=={version} installed; the stubs must be made by "
            f"grpcio-tools=={REQUIRED_GRPCIO_TOOLS} so they import under grpcio 1.84"
        )
    import grpc_tools
    from grpc_tools import protoc

    (out_dir / PROTOS).mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"
    sources = [str(p.relative_to(ROOT)) for p in sorted((ROOT / PROTOS).glob("*.proto"))]
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *sources,
    ]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")
    return sorted(p for p in (out_dir / PROTOS).iterdir() if "_pb2" in p.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT)
    args = parser.parse_args()
    if args.out.resolve() == ROOT:
        for old in (ROOT / PROTOS).glob("*_pb2*"):
            old.unlink()
    written = generate(args.out)
    shutil.rmtree(args.out / PROTOS / "__pycache__", ignore_errors=True)
    print("\n".join(str(p) for p in written))


if __name__ == "__main__":
    main()
