"""Move product modules and rewrite every reference to them: imports (`llmserve.a.b`), string
paths in code and docs (`a/b.py`, `llmserve/a/b.py`). Used for the folder layout of issue 39, and
re-run on a branch made before a move to bring it onto the new layout.

    python scripts/move_modules.py engine/contract/echo.py=engine/contract/echo.py [...]
    python scripts/move_modules.py --plan scripts/layout_moves.txt    # one OLD=NEW per line

Paths are relative to llmserve/ (or to --base, e.g. `--base tests` for the test modules, whose
imports read `tests.x.y`). A NEW folder gets an `__init__.py` if it has none. `git mv` is
used when OLD is tracked, so history follows the file. Rewrites run over *.py, *.md, *.toml,
*.sh, *.yaml, *.yml, *.txt and Dockerfile under the repository (not .venv, .git).
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "llmserve"  # --base changes it
SUFFIXES = {".py", ".md", ".toml", ".sh", ".yaml", ".yml", ".txt", ".cfg", ".ini", ".json"}
SKIP_DIRS = {".venv", ".git", "node_modules", "__pycache__", ".mypy_cache", ".ruff_cache"}


def module_name(rel: str) -> str:
    return f"{PKG.name}." + rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def files_to_rewrite(skip: tuple[Path, ...] = ()) -> list[Path]:
    """The files whose references are rewritten: not skip (the plan itself), nor layout_*.txt
    (the plans of earlier moves, whose left sides must keep the old names)."""
    out = []
    for path in ROOT.rglob("*"):
        if any(part in SKIP_DIRS for part in path.relative_to(ROOT).parts):
            continue
        wanted = path.suffix in SUFFIXES or path.name == "Dockerfile"
        plan = path.name.startswith("layout_") or path.resolve() in skip
        generated = "_pb2" in path.name or "results" in path.parts
        if path.is_file() and wanted and not plan and not generated:
            out.append(path)
    return out


def move(pairs: list[tuple[str, str]], skip: tuple[Path, ...] = ()) -> None:
    tracked = set(subprocess.run(
        ["git", "ls-files", PKG.name], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split())  # fmt: skip
    for old, new in pairs:
        src, dst = PKG / old, PKG / new
        dst.parent.mkdir(parents=True, exist_ok=True)
        if f"{PKG.name}/{old}" in tracked:
            subprocess.run(["git", "mv", str(src), str(dst)], cwd=ROOT, check=True)
        else:
            src.rename(dst)
    for folder in sorted({(PKG / new).parent for _, new in pairs}):
        init = folder / "__init__.py"
        if not init.exists():  # a new package, after the moves (one may bring its own)
            init.write_text(f'"""{folder.relative_to(PKG)}/: see docs/architecture.md#layout."""\n')
            subprocess.run(["git", "add", str(init)], cwd=ROOT, check=True)
    rewrite(pairs, skip)


def rewrite(pairs: list[tuple[str, str]], skip: tuple[Path, ...] = ()) -> None:
    """Every reference to an old module, as an import or a path, made to name the new one: one
    pass over each file (a reference rewritten is never matched again), longest names first."""
    table: dict[str, str] = {}
    for old, new in pairs:
        old_mod, new_mod = module_name(old), module_name(new)
        table[old_mod] = new_mod
        old_pkg, _, old_leaf = old_mod.rpartition(".")
        new_pkg, _, new_leaf = new_mod.rpartition(".")
        table[f"from {old_pkg} import {old_leaf}"] = f"from {new_pkg} import {new_leaf}"
        table[f"{PKG.name}/{old}"] = f"{PKG.name}/{new}"
        if PKG.name == "llmserve":  # a bare engine/x.py names a product module; a bare
            table[old] = new  # test_x.py in prose is left as written

    keys = sorted(table, key=len, reverse=True)

    # A bare path (engine/x.py) must not be the tail of a longer one; llmserve/... may follow
    # a "/" (a docs link: ../llmserve/engine/x.py).
    def guarded(key: str) -> str:
        top = key.startswith((PKG.name, "from "))
        before = r"(?<![\w.])" if top else r"(?<![\w/.])"
        return rf"{before}{re.escape(key)}(?![\w/])"

    pattern = re.compile("|".join(map(guarded, keys)))
    for path in files_to_rewrite(skip):
        text = path.read_text(errors="surrogateescape")
        new_text = pattern.sub(lambda m: table[m.group(0)], text)
        if new_text != text:
            path.write_text(new_text, errors="surrogateescape")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("moves", nargs="*", help="OLD=NEW, paths relative to --base")
    parser.add_argument("--base", default="llmserve", help="the package the paths are under")
    parser.add_argument("--plan", type=Path, help="a file of OLD=NEW lines (# comments)")
    parser.add_argument(
        "--rewrite-only", action="store_true", help="rewrite references; move no file"
    )
    args = parser.parse_args()
    global PKG
    PKG = ROOT / args.base
    lines = list(args.moves)
    if args.plan:
        lines += [ln.split("#")[0].strip() for ln in args.plan.read_text().splitlines()]
    pairs = [tuple(ln.split("=", 1)) for ln in lines if ln]
    skip = (args.plan.resolve(),) if args.plan else ()  # the plan keeps its old names
    if args.rewrite_only:
        rewrite(pairs, skip)  # type: ignore[arg-type]
    else:
        move(pairs, skip)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
