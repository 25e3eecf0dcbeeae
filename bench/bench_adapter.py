"""What the shipped LoRA adapter costs at inference: base vs adapter (as loaded, unmerged) vs merged.

One real held-out Act prompt (the engine's own rendering), K=1 greedy and K=4 (greedy plus
3 sampled), up to a fixed number of new tokens (no stop strings); figures are tokens/s of
the whole call (prefill included), since the variants stop at different lengths. Merged
is `load_model(..., merge_adapter=True)`, as inference policies load it: the same function
in one set of weights, which shows what the adapter's extra matmuls cost.

Writes bench/results/adapter.json. Run: `.venv/bin/python bench/bench_adapter.py [--quick]`.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app import envs  # noqa: E402
from app.config import SHIPPED_ADAPTER  # noqa: E402
from app.training.rows import PromptContext, expert_rows  # noqa: E402
from model_backend import GenerationConfig, TransformersPolicy, load_model  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "adapter.json"


def timed_act(policy: TransformersPolicy, prompt: Any, k: int, new_tokens: int,
              repeats: int) -> tuple[float, int, list[str]]:
    """Best wall time of `act` over `repeats`, the tokens it generated (all rows), and the texts."""
    config = GenerationConfig(max_new_tokens=new_tokens, temperature=0.8, seed=0)
    best, tokens, texts = float("inf"), 0, []
    for _ in range(repeats):
        start = time.perf_counter()
        out = policy.act(prompt, k, config)
        best = min(best, time.perf_counter() - start)
        tokens, texts = sum(len(o.token_logprobs) for o in out), [o.text for o in out]
    return best, tokens, texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one repeat, 16 tokens")
    args = parser.parse_args()
    repeats, new_tokens = (1, 16) if args.quick else (3, 48)

    base = load_model("embedded")
    tok = base.tokenizer
    ctx = PromptContext(lambda text: len(tok.encode(text, add_special_tokens=False)), 8192)
    rows, _ = expert_rows(envs.list_tasks("multi_turn_base", "heldout")[:1], ctx)
    prompt = next(r.prompt for r in rows if r.role == "act")
    prompt_tokens = ctx.count_tokens("\n".join(m["content"] for m in prompt.messages))

    adapter = load_model("embedded", adapter=SHIPPED_ADAPTER)
    merged = load_model("embedded", adapter=SHIPPED_ADAPTER, merge_adapter=True)  # what load_policy uses
    results: dict[str, Any] = {}
    outputs: dict[str, dict[int, list[str]]] = {}
    for name, loaded in (("base", base), ("adapter", adapter), ("merged", merged)):
        policy = TransformersPolicy(loaded)
        outputs[name] = {}
        for k in (1, 4):
            seconds, tokens, texts = timed_act(policy, prompt, k, new_tokens, repeats)
            outputs[name][k] = texts
            results[f"{name}_k{k}_s"] = round(seconds, 3)
            results[f"{name}_k{k}_tokens"] = tokens
            results[f"{name}_k{k}_tok_s"] = round(tokens / seconds, 2)
            print(f"{name:8s} K={k}: {seconds:.2f} s, {tokens} tokens ({tokens / seconds:.1f} tokens/s, prefill "
                  "included)", flush=True)
    for k in (1, 4):  # ratios of tokens/s, so that different output lengths compare
        for name in ("adapter", "merged"):
            results[f"{name}_speed_vs_base_k{k}"] = round(results[f"{name}_k{k}_tok_s"] / results[f"base_k{k}_tok_s"], 3)
    results["merged_same_greedy_text"] = outputs["merged"][1][0] == outputs["adapter"][1][0]
    report = {"what": __doc__.splitlines()[0], "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
              "repeats": repeats, "results": results,
              "machine": {"python": platform.python_version(), "torch": torch.__version__,
                          "threads": torch.get_num_threads()}}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
