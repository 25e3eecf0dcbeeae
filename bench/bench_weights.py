"""What fp16 linear weights change on held-out work: teacher-forced Act and Rehearse of the shipped
adapter, each weights format against fp32.

Every Act and Rehearse row of the expert replays of the first held-out BFCL tasks (never trained on):
the expert's history, greedy decoding with the product's defaults (constrained), one prompt at a time.
Per format: Act exact (the expert's call, or an answer where the expert answered), Rehearse exact (the
real response, canonical JSON), and how many texts equal fp32's. Not a speed benchmark: the seconds are
for scale only.

Writes bench/results/weights.json. Run: `.venv/bin/python bench/bench_weights.py [--tasks 12]
[--formats fp32,fp16]`. The native decode step against the torch one, on the same rows:
`--formats fp16,fp16-torch --name native_text` (bench/results/native_text.json).
"""
from __future__ import annotations

import argparse
import time

from common import write_results
from tqdm import tqdm

from app import envs
from app.config import SHIPPED_ADAPTER
from app.formats import canonical_call, canonical_json, parse_action, parse_result
from app.records import RunSettings
from app.training.rows import PromptContext, expert_rows
from model_backend import GenerationConfig, load_policy, native

ACT = GenerationConfig(max_new_tokens=96, temperature=0.0, stop=("</tool_call>",))
REHEARSE = GenerationConfig(max_new_tokens=160, temperature=0.0, stop=("</execution_result>",))


def act_ok(text: str, target: str) -> bool:
    got, want = parse_action(text), parse_action(target)
    if got.kind != want.kind:
        return False
    return canonical_call(got.call) == canonical_call(want.call) if got.kind == "call" else True  # type: ignore[arg-type]


def rehearse_ok(text: str, target: str) -> bool:
    predicted, error = parse_result(text)
    return error is None and canonical_json(predicted) == canonical_json(parse_result(target)[0])


def run(weights: str, rows: list) -> dict:
    """`weights` is a format, or `fp16-torch`: fp16 through the lean torch step (the native step off)."""
    native.use(weights != "fp16-torch")
    policy = load_policy("embedded", adapter=SHIPPED_ADAPTER, weights=weights.removesuffix("-torch"))
    start = time.perf_counter()
    texts, ok = [], {"act": 0, "rehearse": 0}
    for row in tqdm(rows, desc=weights):
        if row.role == "act":
            text = policy.act(row.prompt, 1, ACT)[0].text
            ok["act"] += act_ok(text, row.prompt.prefill + row.target)
        else:
            text = policy.rehearse([row.prompt], REHEARSE)[0].text
            ok["rehearse"] += rehearse_ok(text, row.target)
        texts.append(text)
    return {"texts": texts, "act_exact": ok["act"], "rehearse_exact": ok["rehearse"],
            "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=12, help="first N held-out tasks")
    parser.add_argument("--formats", default="fp32,fp16",
                        help="fp32, fp16, and fp16-torch (fp16 with the native decode step off)")
    parser.add_argument("--name", default="weights", help="results file: bench/results/NAME.json")
    args = parser.parse_args()
    formats = args.formats.split(",")
    reference = load_policy("embedded", adapter=SHIPPED_ADAPTER, weights="fp32")
    tasks = envs.list_tasks("multi_turn_base", "heldout")[: args.tasks]
    rows, _ = expert_rows(tasks, PromptContext(reference.count_tokens, reference.context_window, RunSettings()))
    n = {"act": sum(r.role == "act" for r in rows), "rehearse": sum(r.role == "rehearse" for r in rows)}
    runs = {w: run(w, rows) for w in dict.fromkeys(["fp32", *formats])}
    out: dict = {"tasks": tasks, "rows": n, "adapter": SHIPPED_ADAPTER.name, "formats": {}}
    for w, r in runs.items():
        same = [a == b for a, b in zip(r["texts"], runs["fp32"]["texts"])]
        out["formats"][w] = {"act_exact": r["act_exact"], "rehearse_exact": r["rehearse_exact"],
                             "same_text_as_fp32": sum(same), "seconds": r["seconds"]}
        print(f"{w}: Act exact {r['act_exact']}/{n['act']}, Rehearse exact {r['rehearse_exact']}/{n['rehearse']}, "
              f"text equal to fp32's {sum(same)}/{len(rows)} ({r['seconds']} s)")
    if "fp16" in runs and "fp16-torch" in runs:
        same = sum(a == b for a, b in zip(runs["fp16"]["texts"], runs["fp16-torch"]["texts"]))
        out["fp16_native_same_text_as_torch_step"] = same
        print(f"fp16, native step against the torch step: {same}/{len(rows)} texts equal")
    out["native_decode"] = native.status() if "fp16" in formats else "not used"
    write_results(args.name, out)


if __name__ == "__main__":
    main()
