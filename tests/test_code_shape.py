"""Shape rules on the product code that keep it walkable (style.md, 1; issue 39):

- a class takes no base class from another module of the project, except an abstract interface
  (an ABC with abstract methods, a Protocol), a generated stub, or one of the few extension
  points listed in EXTENSION_POINTS with the reason. Parts are objects their owner holds and
  calls by name (`scheduler.policy`, `service.links`, `core.replicas`), not mixins spread over
  files: the 500-line module cap that came before produced exactly those;
- no function over 60 lines;
- a module over 800 lines says why in its docstring (a line starting "Size:").
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("llmserve",)
LONG_MODULE_LINES = 800
MAX_FUNCTION_LINES = 60
# Bases another module may extend, and why each is one.
EXTENSION_POINTS = {
    "OpsModule": "every layer's torch Module: it carries the op backend that set_ops swaps",
    "LlamaForCausalLM": "the reference decoder: a family overrides its named parts, as "
    "transformers' modular families do",
    "Qwen3ForCausalLM": "Qwen3-MoE is Qwen3 with sparse blocks (the same pattern)",
    "SparseLayers": "the MoE decoder a sparse family extends (DeepSeek-V3 over GLM-4.5's router)",
    "RotaryEmbedding": "a family's rotary variant (SmolLM3's layers without rope)",
    "Linear": "a family's variant of the linear layer (DeepSeek's rotary rows permuted at load)",
    "PeerSecurity": "dataclass fields for the internal links, shared by three service configs",
    "NullIsDefault": "the pydantic base of the HTTP APIs' request bodies (an explicit null is the "
    "default, as OpenAI's schema allows)",
}


def product_modules() -> list[Path]:
    return sorted(p for d in PRODUCT for p in (ROOT / d).rglob("*.py") if "_pb2" not in p.name)


@pytest.mark.parametrize("path", product_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_and_function_sizes(path: Path) -> None:
    text = path.read_text()
    tree = ast.parse(text)
    num_lines = text.count("\n")
    doc = ast.get_docstring(tree) or ""
    assert num_lines <= LONG_MODULE_LINES or any(
        line.startswith("Size:") for line in doc.splitlines()
    ), (
        f"{path.relative_to(ROOT)} has {num_lines} lines: over {LONG_MODULE_LINES}, its "
        "docstring says why (a line starting 'Size:'), or it is split into objects by job"
    )
    long = [
        f"{node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{path.relative_to(ROOT)}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def _is_interface(node: ast.ClassDef) -> bool:
    """An ABC with at least one abstract method, or a Protocol."""
    bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
    if "Protocol" in bases:
        return True
    abstract = any(
        isinstance(d, ast.Attribute | ast.Name) and ast.unparse(d).endswith("abstractmethod")
        for f in node.body
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
        for d in f.decorator_list
    )
    return "ABC" in bases and abstract


def test_no_class_extends_another_modules_class() -> None:
    """Every base a class takes from another project module is an interface, a generated stub
    or a listed extension point."""
    classes: dict[str, list[tuple[Path, ast.ClassDef]]] = {}
    trees = {p: ast.parse(p.read_text()) for p in product_modules()}
    for path, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append((path, node))
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
                defined = classes.get(name or "", [])
                if not defined or any(p == path for p, _ in defined):
                    continue  # not the project's, or this module's own
                if name in EXTENSION_POINTS or all(_is_interface(c) for _, c in defined):
                    continue
                found.append(f"{path.relative_to(ROOT)}: {node.name}({name})")
    assert not found, (
        f"classes extending another module's class (hold the part as an object instead): {found}"
    )


def test_the_rule_sees_a_mixin() -> None:
    """The check above would catch the shape it forbids (a base from another module)."""
    mixin = ast.parse("class Parts:\n    def f(self): ...\n").body[0]
    interface = ast.parse(
        "class Parts(abc.ABC):\n    @abc.abstractmethod\n    def f(self): ...\n"
    ).body[0]
    assert isinstance(mixin, ast.ClassDef) and isinstance(interface, ast.ClassDef)
    assert not _is_interface(mixin) and _is_interface(interface)
