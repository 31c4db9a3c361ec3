"""launch/README.md quotes the tools: its `tppo plan` block is the command's output, its table
of arithmetic and compiled plans is the arithmetic plan beside results/compiled_*.json, and the
range ``tppo plan`` prints (``plan.SHIPPED_RATIO``) is that table's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tppo_jax.config import load_config
from tppo_jax.plan import SHIPPED_RATIO, format_plan, plan_memory, shipped_comparison, shipped_table

PAGE = Path(__file__).resolve().parents[1] / "launch" / "README.md"
REGEN = "regenerate it from the tools (launch/README.md says how)"


def test_the_table_rows_cite_compiled_files_that_hold_the_figures():
    """Cheap: every compiled figure in the table is its JSON's (arithmetic: the slow test)."""
    import json

    text = PAGE.read_text()
    row = r"^\| `(\w+)`[^|]*\| (\S+) \| [\d.]+ GiB \| `([^`]+)` ([\d.]+) of ([\d.]+) GiB"
    rows = re.findall(row, text, flags=re.M)
    assert len(rows) >= 4
    results = PAGE.parents[1] / "results"
    for config, topo, worst, gib, hbm in rows:
        found = []
        for f in results.glob(f"compiled_{config}*_{topo}.json"):
            d = json.loads(f.read_text())
            w = max(d["programs"], key=lambda r: r.get("resident", 0))
            found.append((w["name"], f"{w['resident'] / 1024**3:.2f}",
                          f"{d['hbm_per_chip'] / 1024**3:.2f}"))
        assert (worst, gib, hbm) in found, f"{config} {topo}: {REGEN}"


@pytest.mark.slow  # ~25 s on 2 shared cores: the arithmetic plans of a 32B and 4 others
def test_the_page_quotes_the_tools_output():
    text = PAGE.read_text()
    rows = shipped_comparison()
    assert shipped_table(rows) in text, f"the table differs from the tools': {REGEN}"
    ratios = [round(r["ratio"], 2) for r in rows]
    assert (min(ratios), max(ratios)) == SHIPPED_RATIO, "plan.SHIPPED_RATIO: " + REGEN
    paper = format_plan(plan_memory(load_config("configs/paper_qwen25_32b.yaml"), "v5p-512"),
                        config_name="paper_qwen25_32b")
    assert f"```\n{paper}\n```" in text, f"the tppo plan block differs: {REGEN}"
