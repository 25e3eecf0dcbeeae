"""Our decoding loop against llama.cpp (llama-cpp-python) on the same GGUF file, side by side in one run.

Same prompt (the ~1,000-token Act-style prompt of bench_decode.py, as token ids), same number of new
tokens, greedy, 2 threads each; rounds interleave ours and the peer's so that load from other jobs hits
both alike, and each figure is the best round. Prompt tokens/s: the whole prompt from an empty cache
(ours: the prefill phase, without the prefix cache). Decode tokens/s: the steps after the first new token.

llama.cpp runs in its own virtual environment (`make bench-peer` builds it: requirements-bench.txt,
never part of `make setup`/`make test`); this script starts it as a subprocess (`--peer-worker`), which
imports only llama_cpp and numpy. Writes bench/results/peer.json (peer_threadsN.json for --threads N != 2).
Run: `.venv/bin/python bench/bench_peer.py --peer-python .venv-bench/bin/python`.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def peer_worker(spec_path: str) -> None:
    """In the peer's environment: one round of llama.cpp on the prompt; prints a JSON line."""
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    spec = json.loads(Path(spec_path).read_text())
    ids, new_tokens = spec["ids"], spec["new_tokens"]
    llm = Llama(model_path=spec["gguf"], n_ctx=len(ids) + new_tokens + 16, n_threads=spec["threads"],
                n_threads_batch=spec["threads"], n_batch=512, verbose=False)
    vocab = llm.n_vocab()

    def greedy() -> int:  # the last position's logits (llama-cpp-python keeps no copy without logits_all)
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(vocab,))))

    llm.reset()
    start = time.perf_counter()
    llm.eval(ids)
    prompt_s = time.perf_counter() - start
    out = [greedy()]
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        llm.eval([out[-1]])
        out.append(greedy())
    decode_s = time.perf_counter() - start
    print(json.dumps({"version": llama_cpp.__version__, "prompt_s": prompt_s, "decode_s": decode_s, "tokens": out,
                      "system_info": llama_cpp.llama_print_system_info().decode().strip()}))


def gguf_summary(path: Path) -> dict[str, Any]:
    """Tensor types and bytes of the GGUF file; llama.cpp reads all of them per token (the tied
    embedding table is also the output matrix)."""
    from gguf import GGUFReader

    by_type: dict[str, int] = {}
    for tensor in GGUFReader(str(path)).tensors:
        by_type[tensor.tensor_type.name] = by_type.get(tensor.tensor_type.name, 0) + int(tensor.n_bytes)
    return {"bytes_by_type": by_type, "bytes": sum(by_type.values())}


def ours_round(policy: Any, ids: list[int], new_tokens: int) -> dict[str, Any]:
    from model_backend.base import Timings
    from model_backend.decoding import Row, generate

    timings = Timings()
    out = generate(policy.model, policy.tokenizer, [Row(ids)], new_tokens, eos_ids=set(), pad_id=policy.pad_id,
                   timings=timings)[0]
    return {"prompt_s": timings.seconds["generate.prefill"], "decode_s": timings.seconds["generate.decode"],
            "tokens": out.token_ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--peer-python", default=str(ROOT / ".venv-bench" / "bin" / "python"),
                        help="python of the environment with llama-cpp-python (make bench-peer builds it)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peer-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer_worker:
        peer_worker(args.peer_worker)
        return

    import torch

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_decode import realistic_prompt_messages, weight_bytes
    from common import write_results
    from model_backend import Prompt, load_policy, native
    from model_backend.loading import embedded_gguf_path

    torch.set_num_threads(args.threads)
    variants = {w: load_policy("embedded", weights=w) for w in ("fp32", "fp16")}
    for policy in variants.values():
        policy.prefix_cache = None  # every round encodes the whole prompt
    fp32 = variants["fp32"]
    ids = fp32.encode(Prompt(realistic_prompt_messages(1000, fp32.count_tokens)))
    gguf = embedded_gguf_path()
    print(f"prompt: {len(ids)} tokens, {args.new_tokens} new tokens, greedy, {args.threads} threads")

    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in [*variants, "llama.cpp"]}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as spec:
        json.dump({"ids": ids, "new_tokens": args.new_tokens, "threads": args.threads, "gguf": str(gguf)}, spec)
    for _ in range(args.rounds):
        for name, policy in variants.items():
            runs[name].append(ours_round(policy, ids, args.new_tokens))
        proc = subprocess.run([args.peer_python, __file__, "--peer-worker", spec.name], capture_output=True,
                              text=True, check=True)
        runs["llama.cpp"].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    Path(spec.name).unlink()

    summary = gguf_summary(gguf)
    results: dict[str, Any] = {"prompt_tokens": len(ids), "new_tokens": args.new_tokens, "threads": args.threads,
                               "rounds": args.rounds, "gguf": {"file": gguf.name, **summary}, "engines": {},
                               "native_decode": native.status()}
    peer_tokens = runs["llama.cpp"][0]["tokens"]
    for name, rs in runs.items():
        prompt_s = min(r["prompt_s"] for r in rs)
        decode_s = min(r["decode_s"] for r in rs)
        tokens = rs[0]["tokens"]
        same = next((i for i, (a, b) in enumerate(zip(tokens, peer_tokens)) if a != b), len(tokens))
        nbytes = summary["bytes"] if name == "llama.cpp" else weight_bytes(variants[name].model)
        results["engines"][name] = {
            "prompt_tok_s": len(ids) / prompt_s, "decode_tok_s": (args.new_tokens - 1) / decode_s,
            "weight_bytes_per_token": nbytes, "tokens_equal_to_llama_cpp_before_first_difference": same,
            **({"version": rs[0]["version"], "system_info": rs[0]["system_info"]} if name == "llama.cpp" else {}),
        }
    peer = results["engines"]["llama.cpp"]
    for name in variants:
        e = results["engines"][name]
        e["peer_over_ours_decode"] = peer["decode_tok_s"] / e["decode_tok_s"]
        e["peer_over_ours_prompt"] = peer["prompt_tok_s"] / e["prompt_tok_s"]
    results["goal_peer_over_ours_decode"] = 1.5
    for name, e in results["engines"].items():
        ratio = "" if name == "llama.cpp" else (f"; llama.cpp is {e['peer_over_ours_decode']:.2f}x ours at decode, "
                                                f"{e['peer_over_ours_prompt']:.2f}x at the prompt")
        print(f"{name:9s}: prompt {e['prompt_tok_s']:7.1f} tok/s, decode {e['decode_tok_s']:6.1f} tok/s, "
              f"{e['weight_bytes_per_token'] / 1e6:.0f} MB of weights per token{ratio}")
    write_results("peer" if args.threads == 2 else f"peer_threads{args.threads}", results)


if __name__ == "__main__":
    main()
