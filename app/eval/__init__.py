"""Batch evaluation: `evaluation` runs task ids x rows (rehearsal modes and the real best-of-K
baseline) into the table; `report` writes results.json, results.md and the plotly figures."""
