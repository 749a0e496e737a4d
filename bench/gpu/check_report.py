"""The last lines of bench/gpu_engine_check.sh: every stage's status and figures in one compact
table (short enough for the device tool's 12,000-char tail), and the same in full as
$OUT/gpu_check.json, with a failing stage's last error lines.

    python3 -m bench.gpu.check_report --out OUT --raw RAW [--budget-s 500] [--elapsed-s N]

Reads RAW/stages.tsv (stage, command number, exit status or "skipped", seconds, command), each
stage's log RAW/<stage>.log, RAW/preflight.json and the JSON the stages wrote under OUT. Exit 1
when a stage that ran failed, else 0. Needs no torch.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

COPY_GBPS = 4280.0  # docs/gpu.md#the-gpu-machine: device-to-device copy, bytes read + written
ERROR_LINES = 12
_ERROR = re.compile(r"error|fail|traceback|assert|exception|timed out|killed", re.IGNORECASE)
# gpu_engine_check.sh's families stages and the shapes (configs/) each runs
FAMILY_SHAPES = {
    "families": ("qwen3-8b", "qwen3-30b-a3b"),
    "families2": ("deepseek-v2-lite", "gpt-oss-20b", "qwen3-next-80b-a3b-12l"),
    "families3": ("granite-4.0-h-small-10l",),
}


def load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_stages(raw: Path) -> dict[str, list[dict[str, Any]]]:
    stages: dict[str, list[dict[str, Any]]] = {}
    path = raw / "stages.tsv"
    for line in path.read_text().splitlines() if path.exists() else []:
        name, _, rc, seconds, cmd = line.split("\t", 4)
        stages.setdefault(name, []).append({"rc": rc, "seconds": int(seconds), "command": cmd})
    return stages


def status(commands: list[dict[str, Any]]) -> str:
    codes = [c["rc"] for c in commands]
    if all(c == "skipped" for c in codes):
        return "skipped (budget)"
    bad = [c for c in codes if c not in ("0", "skipped")]
    if not bad:
        return "ok" + (" (part skipped)" if "skipped" in codes else "")
    if any(c in ("124", "137") for c in bad):
        return "TIMEOUT"
    return f"FAIL (exit {bad[0]})"


def error_lines(log: Path) -> list[str]:
    """The log's last lines that look like an error (else its last lines)."""
    try:
        lines = [x.rstrip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return []
    errors = [x for x in lines if _ERROR.search(x)]
    return (errors or lines)[-ERROR_LINES:]


def pytest_line(log: Path) -> str | None:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    found = [x.strip("= ") for x in lines if re.search(r"\d+ (passed|failed|error|skipped)", x)]
    if found:
        return found[-1]
    # cut off before pytest's summary: count the verbose per-test lines
    counts = {w: sum(1 for x in lines if "::" in x and f" {w}" in x) for w in ("PASSED", "FAILED")}
    if not any(counts.values()):
        return None
    return f"{counts['PASSED']} passed, {counts['FAILED']} failed before it was stopped"


def bandwidth_rows(doc: Any, section: str = "") -> list[tuple[str, float, float]]:
    """(section, GB/s, % of copy) of every entry of kernels_bench.py's JSON that reports its
    bandwidth (`gbps`, `pct_of_copy`, or `tbps`)."""
    rows: list[tuple[str, float, float]] = []
    if isinstance(doc, dict):
        gbps = doc.get("gbps")
        if gbps is None and isinstance(doc.get("tbps"), int | float):
            gbps = doc["tbps"] * 1000
        if isinstance(gbps, int | float):
            pct = doc.get("pct_of_copy")
            rows.append((section, float(gbps), float(pct) if pct else 100 * gbps / COPY_GBPS))
        for key, value in doc.items():
            if key != "summary":
                rows += bandwidth_rows(value, section or key)
    elif isinstance(doc, list):
        for value in doc:
            rows += bandwidth_rows(value, section)
    return rows


def engine_figures(doc: Any) -> dict[str, Any]:
    """Output tok/s, decode MBU (floor / step time) and graph vs eager of a gpu_engine.py JSON."""
    figures: dict[str, Any] = {}
    if not isinstance(doc, dict):
        return figures
    off = doc.get("offline") or {}
    if "output_tok_s" in off:
        figures["output_tok_s"] = round(off["output_tok_s"])
    elif off.get("error"):
        figures["offline_error"] = off["error"]
    dec = doc.get("decode") or {}
    for key, value in dec.items():
        if key.startswith("batch_") and isinstance(value, dict) and value.get("step_ms_median"):
            row = {
                "step_ms": round(value["step_ms_median"], 3),
                "mbu_pct": round(100 * value["floor_ms"] / value["step_ms_median"], 1),
            }
            if "graph_speedup" in value:
                row["graph_vs_eager"] = round(value["graph_speedup"], 2)
            figures[key] = row
    if dec.get("error"):
        figures["decode_error"] = dec["error"]
    if dec.get("ops"):
        figures["ops"] = dec["ops"]
    return figures


def quant_figures(doc: Any) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for label, mode in ((doc or {}).get("modes") or {}).items():
        row = {
            k: round(v["tok_s_vs_bf16"], 2)
            for k, v in mode["decode"].items()
            if "tok_s_vs_bf16" in v
        }
        figures[label] = row or {"error": mode.get("decode_error") or "no bf16 baseline"}
    return figures


def kept_figures(doc: Any) -> dict[str, Any]:
    """bench/gpu/kept_decode.py's formats (W4A16, FP8-block checkpoint kernels): per batch,
    decode tok/s over the same process's bf16 engine, or the format's error."""
    figures: dict[str, Any] = {}
    base = (doc or {}).get("bf16") or {}
    for fmt in ("w4a16", "fp8-block"):
        part = (doc or {}).get(fmt)
        if not part:
            continue
        if "error" in part or "error" in base:
            figures[fmt] = {"error": part.get("error") or base.get("error")}
            continue
        figures[fmt] = {
            key: round(base[key]["step_ms_median"] / row["step_ms_median"], 2)
            for key, row in part.items()
            if key.startswith("batch_") and key in base
        }
    return figures


def lora_figures(doc: Any) -> dict[str, Any]:
    """Per batch of bench/gpu/lora.py's JSON: the adapters' decode tok/s over the base's (with
    graphs, and eager), prefill likewise, or the batch's error."""
    figures: dict[str, Any] = {}
    for key, row in (doc or {}).items():
        if key.startswith("batch_") and isinstance(row, dict):
            keep = ("lora_vs_base", "lora_vs_base_eager", "lora_prefill_vs_base", "error")
            figures[key] = {k: row[k] for k in keep if k in row}
    return figures


def stage_figures(name: str, out: Path, raw: Path) -> dict[str, Any]:
    log = raw / f"{name}.log"
    if name == "preflight":
        return load(raw / "preflight.json") or {}
    if name in ("kernels", "tests", "parallel"):
        line = pytest_line(log)
        return {"pytest": line} if line else {}
    if name == "kbench":
        rows = bandwidth_rows(load(out / "kernels_h200.json"))
        best: dict[str, tuple[float, float]] = {}
        for section, gbps, pct in rows:
            if section not in best or pct > best[section][1]:
                best[section] = (round(gbps), round(pct, 1))
        return {s: {"gbps": g, "pct_of_copy": p} for s, (g, p) in best.items()}
    if name == "8b":
        return engine_figures(load(out / "gpu_engine_llama-3-8b.json"))
    if name == "smollm2":
        return engine_figures(load(out / "gpu_engine_smollm2-135m.json"))
    if name == "quant":
        figures = kept_figures(load(raw / "quant" / "kept_decode_llama-3-8b.json"))
        return {**figures, **quant_figures(load(out / "gpu_engine_llama-3-8b_quant.json"))}
    if name == "structured":
        return structured_figures(load(raw / "structured.json"))
    if name in FAMILY_SHAPES:
        return {
            shape: engine_figures(load(raw / "families" / f"gpu_engine_{shape}.json"))
            for shape in FAMILY_SHAPES[name]
        }
    if name == "lora":
        return lora_figures(load(out / "gpu_lora_llama-3-8b.json"))
    return {}


def structured_figures(doc: Any) -> dict[str, Any]:
    """bench/studies/structured_cpu.py's run: output tok/s with none and all requests constrained,
    the mask time per row and step, the compile times."""
    if not doc:
        return {}
    summary = doc.get("summary", {})
    compiled = doc.get("compile", {})
    return {
        "tok_s_none": summary.get("0.0", {}).get("output_tok_s_median"),
        "tok_s_all": summary.get("1.0", {}).get("output_tok_s_median"),
        "all_vs_none": summary.get("1.0", {}).get("vs_none"),
        "mask_ms_per_row_step": doc.get("mask_ms_per_row_step_median"),
        "compile_cold_ms": compiled.get("cold_ms_median"),
        "compile_cached_ms": compiled.get("cached_ms_median"),
    }


def cells(name: str, figures: dict[str, Any]) -> str:
    """The table's figures of one stage, in a line."""
    if name in ("kernels", "tests", "parallel"):
        return figures.get("pytest", "")
    if name == "preflight":
        return f"{figures.get('total_s', '?')} s, ops {figures.get('ops', '?')}" if figures else ""
    if name == "kbench":
        return ", ".join(f"{s} {v['gbps']} GB/s = {v['pct_of_copy']}%" for s, v in figures.items())
    if name == "structured":
        if not figures:
            return ""
        return (
            f"all constrained {figures['all_vs_none']}x none ({figures['tok_s_all']} vs "
            f"{figures['tok_s_none']} tok/s), mask {figures['mask_ms_per_row_step']} ms/row/step, "
            f"compile {figures['compile_cold_ms']} ms cold, {figures['compile_cached_ms']} cached"
        )
    if name == "lora":
        return ", ".join(
            f"b{key.removeprefix('batch_')} error: {str(row['error'])[:50]}"
            if "error" in row
            else f"b{key.removeprefix('batch_')} {row.get('lora_vs_base')}x base"
            f" ({row.get('lora_vs_base_eager')}x eager), prefill {row.get('lora_prefill_vs_base')}x"
            for key, row in figures.items()
        ) + (" (8 adapters' tok/s vs base)" if figures else "")
    if name == "quant":
        return " | ".join(
            f"{label} error: {str(row['error'])[:50]}"
            if "error" in row
            else f"{label} "
            + ", ".join(f"b{k.removeprefix('batch_')} {v}x" for k, v in row.items())
            for label, row in figures.items()
        ) + (" (tok/s vs bf16)" if figures else "")
    if name in FAMILY_SHAPES:
        return " | ".join(
            f"{shape}: {cells('8b', row) or 'no figures'}" for shape, row in figures.items()
        )
    parts = []
    if "output_tok_s" in figures:
        parts.append(f"{figures['output_tok_s']:,} out tok/s")
    for key, row in figures.items():
        if key.startswith("batch_"):
            cell = f"b{key.removeprefix('batch_')} {row['step_ms']} ms MBU {row['mbu_pct']}%"
            if "graph_vs_eager" in row:
                cell += f" graph {row['graph_vs_eager']}x eager"
            parts.append(cell)
    parts += [f"{k}: {str(v)[:60]}" for k, v in figures.items() if k.endswith("_error")]
    return ", ".join(parts)


def report(out: Path, raw: Path, budget_s: int, elapsed_s: int | None) -> tuple[dict, str, int]:
    stages = read_stages(raw)
    order = [
        "preflight", "kernels", "kbench", "8b", "tests", "smollm2", "quant", "structured", "lora",
        "parallel", "families", "families2", "families3",
    ]  # fmt: skip
    doc: dict[str, Any] = {
        "benchmark": "gpu_check",
        "budget_s": budget_s,
        "elapsed_s": elapsed_s,
        "copy_gbps": COPY_GBPS,
        "stages": {},
    }
    rows, failed = [], False
    for name in order:
        commands = stages.get(name)
        if commands is None:
            doc["stages"][name] = {"status": "not run"}
            rows.append(f"{name:<9} {'not run':<17}")
            continue
        state = status(commands)
        figures = stage_figures(name, out, raw)
        entry: dict[str, Any] = {
            "status": state,
            "seconds": sum(c["seconds"] for c in commands),
            "commands": commands,
            "figures": figures,
        }
        line = f"{name:<9} {state:<17} {entry['seconds']:>4} s  {cells(name, figures)}"
        if state.startswith(("FAIL", "TIMEOUT")):
            failed = True
            entry["error"] = error_lines(raw / f"{name}.log")
            last = entry["error"][-1] if entry["error"] else "no output"
            line += f"\n{'':<9} ! {last[:110]} [gpu_check.json stages.{name}.error]"
        doc["stages"][name] = entry
        rows.append(line)
    head = f"== GPU check: {elapsed_s} s of BUDGET_S={budget_s}; % = of the 4.28 TB/s copy"
    return doc, "\n".join([head, *rows]), 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--raw", type=Path, required=True)
    p.add_argument("--budget-s", type=int, default=500)
    p.add_argument("--elapsed-s", type=int, default=None)
    args = p.parse_args()
    doc, table, code = report(args.out, args.raw, args.budget_s, args.elapsed_s)
    (args.out / "gpu_check.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(table)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
