"""Run every benchmark, then write the benchmark tables from bench/results/*.json: the full one in
docs/PERFORMANCE.md and a short one (a few headline rows of the same table) in README.md.

`make bench` runs this. Each script prints its figures and writes its own JSON file;
`--table-only` rebuilds both tables from the existing files without running.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SCRIPTS = ["bench_decode.py", "bench_weights.py", "bench_step.py", "bench_ui.py", "bench_finetune.py", "bench_remote.py",
           "bench_adapter.py", "bench_prefix_cache.py", "bench_load.py", "bench_gil.py", "bench_rehearse_format.py",
           "bench_corrections.py"]
START, END = "<!-- bench:start -->", "<!-- bench:end -->"
# The README's short table: the rows of the full table whose figure starts with one of these.
SHORT_ROWS = ("step p50, shipped adapter", "Step's wait once the step was computed ahead",
              "decode tokens/s, batch 1, fp16 weights (the CPU default", "decode tokens/s, batch 4, all rows, fp16 weights (the default)",
              "prefix cache speed-up", "UI overhead per step", "corrections fine-tune")


def load(name: str) -> dict:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def fmt(value, suffix: str = "") -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}{suffix}" if isinstance(value, float) else f"{value}{suffix}"


def table() -> str:
    """Markdown rows: figure | measured | goal. Missing results show as n/a."""
    rows = ["| figure | measured | goal |", "|---|---|---|"]
    step = load("step_latency")
    for k, r in step.get("results", {}).items():
        if "p50_s" not in r:
            continue  # the older format (base model, one task)
        ratio = f", {fmt(r['ratio_to_k1'], 'x')} of K=1" if "ratio_to_k1" in r else ""
        if "paired_median_ratio" in r:
            ratio += f" (per task and step, median {fmt(r['paired_median_ratio'], 'x')})"
        top = max(r["mean_phase_s"].items(), key=lambda kv: kv[1])
        rows.append(f"| step p50, shipped adapter, parallel K={k}, {len(step['tasks'])} held-out tasks "
                    f"(largest phase: {top[0]}, {fmt(top[1], ' s')}) | {fmt(r['p50_s'], ' s')}{ratio} | "
                    f"{'<= 4 s; <= 1.3x K=1' if k == '4' else ''} |")
    baseline = load("step_latency_torch_step").get("results", {})
    if baseline:
        rows.append("| same, the torch decode step (native off, `bench_step.py --torch-step`): step p50 K=1 / K=4 | "
                    + " / ".join(fmt(baseline[k]["p50_s"], " s") for k in ("1", "4") if k in baseline) + " | |")
    ahead = load("step_latency_ahead").get("results", {})
    if "1" in ahead and "4" in ahead:
        rows.append("| Step's wait once the step was computed ahead (the Run tab, while the person reads; "
                    "`bench_step.py --ahead`), p50 K=1 / K=4 | "
                    + " / ".join(fmt(ahead[k]["p50_s"], " s") for k in ("1", "4")) + " | |")
        rows.append("| computing a step ahead takes, p50 K=1 / K=4: a task's first step / a later one | "
                    + " / ".join(f"{fmt(ahead[k]['ahead_first_p50_s'], ' s')}, {fmt(ahead[k]['ahead_later_p50_s'], ' s')}"
                                 for k in ("1", "4")) + " | |")
    continued = load("rehearse_format")
    if "ratio_continued" in continued:
        rows.append("| K=4 / K=1 step p50 with a Rehearse prompt continuing the Act prompt (speed side only, untrained; "
                    f"`bench_rehearse_format.py`; {fmt(continued['ratio_today'], 'x')} today in the same run) | "
                    f"{fmt(continued['ratio_continued'], 'x')}" + (
                        f" (per task and step, median {fmt(continued['paired_today'], 'x')} -> "
                        f"{fmt(continued['paired_continued'], 'x')})" if "paired_continued" in continued else "")
                    + " | <= 1.3x |")
    dec = load("decode")
    d, b, sp, st = (dec.get(k, {}) for k in ("decode", "bound", "shared_prefix", "startup"))
    for value, label, goal in (
        (d.get("ours_batch1_tok_s"), "decode tokens/s, batch 1, fp32 weights (our loop)", ""),
        (d.get("ours_batch4_tok_s"), "decode tokens/s, batch 4, all rows, fp32 weights (our loop)", ""),
        (d.get("ours_batch4_fp16_tok_s"), "decode tokens/s, batch 4, all rows, fp16 weights (the default)", ""),
        (d.get("hf_generate_batch1_tok_s"), "decode tokens/s, batch 1, plain `generate`", ""),
        (b.get("bound_tok_s"), f"bound: {fmt(b.get('read_gb_s'))} GB/s read / {fmt(b.get('weight_bytes'))} weight bytes, tokens/s", ""),
        (b.get("ratio_batch1"), "fp32: batch-1 decode / bound", ">= 0.70"),
        (d.get("ours_batch1_generic_tok_s"), "decode tokens/s, batch 1, our loop through `model(...)` (before the lean step)", ""),
        (d.get("ours_batch1_fp16_tok_s"), "decode tokens/s, batch 1, fp16 weights (the CPU default, native decode step)", ""),
        (d.get("ours_batch1_fp16_torch_step_tok_s"), "decode tokens/s, batch 1, fp16 weights, the torch step (native off)", ""),
        (d.get("ours_batch4_fp16_torch_step_tok_s"), "decode tokens/s, batch 4, all rows, fp16 weights, the torch step (native off)", ""),
        (b.get("fp16", {}).get("ratio_batch1"), f"fp16: batch-1 decode / its bound ({fmt(b.get('fp16', {}).get('weight_bytes'))} weight bytes)", ">= 0.70"),
        (b.get("fp16", {}).get("ratio_batch1_best_read"), f"fp16: the same at torch's all-thread read ({fmt(b.get('torch_read_gb_s'))} GB/s), the stricter bound", ">= 0.70"),
        (sp.get("speedup"), f"shared-prefix batched K=4 vs 4x plain `generate` (same outputs: {all(sp.get('same_outputs', [False]))})", ">= 2.5x"),
        (st.get("cold_s"), "cold start: GGUF conversion + load, s", ""),
        (st.get("warm_s"), "warm start: from the safetensors cache, s", ""),
    ):
        if value is not None:
            rows.append(f"| {label} | {fmt(value)} | {goal} |")
    quality = load("weights")
    if quality.get("formats"):
        f, n = quality["formats"], quality["rows"]
        names = [w for w in ("fp32", "fp16") if w in f]
        rows.append(f"| teacher-forced held-out rows ({len(quality['tasks'])} tasks, {n['act']} Act, {n['rehearse']} "
                    f"Rehearse), {' / '.join(names)}: Act exact; Rehearse exact; text equal to fp32's | "
                    f"{' / '.join(str(f[w]['act_exact']) for w in names)}; "
                    f"{' / '.join(str(f[w]['rehearse_exact']) for w in names)}; "
                    f"{' / '.join(str(f[w]['same_text_as_fp32']) for w in names)} | |")
    native_text = load("native_text")
    if "fp16_native_same_text_as_torch_step" in native_text:
        n = native_text["rows"]
        rows.append(f"| same rows, fp16: native decode step's text equal to the torch step's "
                    f"| {native_text['fp16_native_same_text_as_torch_step']} / {n['act'] + n['rehearse']} | same text |")
    for peer in (load("peer"), load("peer_threads1")):
        if not peer.get("engines"):
            continue
        e = peer["engines"]
        cpp = e["llama.cpp"]
        load_avg = fmt(peer.get("machine", {}).get("load_average", [None])[0])
        rows.append(f"| llama.cpp ({cpp['version']}, {peer['gguf']['file']}, {fmt(cpp['weight_bytes_per_token'])} bytes "
                    f"a token), {peer['threads']} thread(s), load average {load_avg}: decode / prompt tokens/s | "
                    f"{fmt(cpp['decode_tok_s'])} / {fmt(cpp['prompt_tok_s'])} | |")
        for name in ("fp32", "fp16"):
            if name in e:
                rows.append(f"| ours, {name} weights, same run: decode / prompt tokens/s (llama.cpp's decode / ours) | "
                            f"{fmt(e[name]['decode_tok_s'])} / {fmt(e[name]['prompt_tok_s'])} "
                            f"({fmt(e[name]['peer_over_ours_decode'], 'x')}) | <= 1.5x |")
    ui = load("ui")
    if "worst_callback_p50_ms" in ui:
        rows.append(f"| UI overhead per step, model excluded: callback p50 (worst task) | "
                    f"{fmt(ui['worst_callback_p50_ms'], ' ms')} | <= 150 ms |")
        rows.append(f"| same, end to end through Gradio's queue and gradio_client | "
                    f"{fmt(ui['worst_end_to_end_p50_ms'], ' ms')} | |")
    ft = load("finetune")
    if "wall_s" in ft:
        rows.append(f"| fine-tune, 20 corrected steps x 3 epochs | {fmt(ft['wall_s'], ' s')} "
                    f"({fmt(ft.get('train', {}).get('tokens_per_s'), ' tokens/s')}) | <= 180 s |")
    cr = load("corrections")
    if cr.get("delta_exact"):
        d, u = cr["delta_exact"], cr["unseen"]
        rows.append(f"| simulated annotator (`bench_corrections.py`), {cr['corrections']} corrections of "
                    f"{', '.join(cr['corrected_tools'])}: unseen-call exact change, corrected tools (n={u['corrected tools']['n']}) "
                    f"/ other tools (n={u['other tools']['n']}); fine-tune wall (load average {fmt(cr['load_average_end'][0])}) | "
                    f"{fmt(d['corrected tools'], '')} / {fmt(d['other tools'], '')}; {fmt(cr['finetune_wall_s'], ' s')} | "
                    f">= +0.15 / >= -0.02; <= 180 s |")
    remote = load("remote").get("results", {})
    for key, label in (("local_k1", "step, local backend, K=1"), ("local_k4", "step, local backend, K=4"),
                       ("transformers_serve_k1", "step via `transformers serve`, K=1"),
                       ("transformers_serve_k4", "step via `transformers serve`, K=4")):
        if key in remote:
            r = remote[key]
            where = (f" (server {fmt(r['mean_server_s'], ' s')}, network {fmt(r['mean_network_s'], ' s')}, "
                     f"client {fmt(r['mean_client_s'], ' s')})") if "mean_server_s" in r else ""
            rows.append(f"| {label} | {fmt(r['mean_s'], ' s')}{where} | |")
    ad = load("adapter").get("results", {})
    for k in ("1", "4"):
        if f"adapter_k{k}_tok_s" in ad:
            rows.append(f"| act with the shipped adapter, K={k}: tokens/s as loaded / merged (base) | "
                        f"{fmt(ad[f'adapter_k{k}_tok_s'])} / {fmt(ad[f'merged_k{k}_tok_s'])} "
                        f"({fmt(ad[f'base_k{k}_tok_s'])}) | |")
    load_run = load("reliability").get("load")
    if load_run:
        rows.append(f"| read-only endpoints, {load_run['clients']} clients for {fmt(load_run['seconds'], ' s')}: "
                    f"error rate / p50 / p95 | {fmt(load_run['error_rate'])} / {fmt(load_run['latency_s_p50'], ' s')} / "
                    f"{fmt(load_run['latency_s_p95'], ' s')} ({fmt(load_run['requests_per_s'])} requests/s) | |")
    gil = load("gil")
    if gil:
        by = {r["switch_interval_s"]: r for r in gil["with_busy_thread"]}
        default, ours = by.get(gil["python_default_interval_s"]), by.get(gil["server_interval_s"])
        if default and ours:
            rows.append(f"| batch-1 decode beside a busy Python thread: median tokens/s at Python's 5 ms switch interval "
                        f"/ at the server's {fmt(gil['server_interval_s'] * 1e3, ' ms')} (alone) | "
                        f"{fmt(statistics.median(default['decode_tok_s']))} / {fmt(statistics.median(ours['decode_tok_s']))} "
                        f"({fmt(gil['decode_alone_tok_s'])}) | |")
    pc = load("prefix_cache")
    for i, r in pc.get("by_step", {}).items():
        rows.append(f"| step {i}, shipped adapter, parallel K={pc['k']}: cached / uncached prefix | "
                    f"{fmt(r['cached_s'], ' s')} / {fmt(r['uncached_s'], ' s')} ({fmt(r['speedup'], 'x')}) | "
                    f"{'>= 2x from step 3' if i == '3' else ''} |")
    if pc.get("speedup_step3_on") is not None:
        rows.append(f"| prefix cache speed-up, steps 3 and later (same decisions: {pc['same_decisions']}) | "
                    f"{fmt(pc['speedup_step3_on'], 'x')} | >= 2x |")
    cor = load("corrections")
    if cor.get("finished"):
        u = cor["unseen"]

        def moved(group: str) -> str:
            g = u.get(group, {})
            return (f"{fmt(g['before']['rehearse_exact'])} -> {fmt(g['after']['rehearse_exact'])} (n={g['n']})"
                    if g.get("n") else "n/a")

        rows.append(f"| corrections fine-tune, simulated annotator (`bench_corrections.py`, N={cor['corrections']} of "
                    f"{', '.join(cor['corrected_tools'])}): Rehearse exact on unseen calls, corrected tools / other tools; "
                    f"the fine-tune's wall time | {moved('corrected tools')} / {moved('other tools')}; "
                    f"{fmt(cor['finetune_wall_s'], ' s')} | +0.15 / >= -0.02; <= 180 s |")
    return "\n".join(rows)


def short_table() -> str:
    """The README's rows: the header and the full table's rows named in SHORT_ROWS, in its order."""
    head, sep, *rows = table().split("\n")
    return "\n".join([head, sep] + [r for r in rows if r.removeprefix("| ").startswith(SHORT_ROWS)])


def write_table(path: Path, text: str) -> None:
    """Replace what lies between the markers in `path` with `text` (printed instead where there are none)."""
    content = path.read_text()
    if START not in content:
        print(f"{path.name} has no benchmark markers; table:\n{text}")
        return
    head, rest = content.split(START, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{START}\n{text}\n{END}{tail}")
    print(f"{path.relative_to(ROOT)} benchmark table updated")


def update_readme() -> None:
    write_table(ROOT / "docs" / "PERFORMANCE.md", table())
    write_table(ROOT / "README.md", short_table())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--table-only", action="store_true", help="only rebuild the tables (README, docs/PERFORMANCE.md)")
    args = parser.parse_args()
    if not args.table_only:
        for script in SCRIPTS:
            path = ROOT / "bench" / script
            if path.exists():
                print(f"== {script}", flush=True)
                subprocess.run([sys.executable, str(path)], cwd=ROOT / "bench", check=True)
    update_readme()


if __name__ == "__main__":
    main()
