import cProfile, pstats, sys, tempfile, time
from pathlib import Path
sys.argv = ["x"]
import bench_corrections as bc
from app.config import shipped_adapter
from app.service import finetune as finetune_service
from app.training.finetune import run_finetune
from app.ui import constants as C
from model_backend import load_policy
policy = load_policy("embedded", adapter=shipped_adapter())
items = bc.rehearse_training_calls(policy, 6, 0)
del policy
d = C.FT_DEFAULTS
with tempfile.TemporaryDirectory() as tmp:
    store, tools, chosen = bc.corrected_store(Path(tmp) / "b.db", items, 20, 3)
    req = finetune_service.build_request(episodes=None, annotated=False, steps=d["steps"], lr=d["lr"], rank=d["rank"],
                                         parent=shipped_adapter(), out=Path(tmp) / "child", heldout_rows=0, agreement=False,
                                         max_steps=C.FT_MAX_STEPS, unseen_rows=d["unseen_rows"],
                                         replay_ratio=d["replay_ratio"], eval_every=d["eval_every"])
    pr = cProfile.Profile(); t = time.perf_counter()
    pr.enable(); r = run_finetune(store, req); pr.disable()
    print("wall", time.perf_counter() - t, "corrections", len(chosen), r.metrics["train"])
    pstats.Stats(pr).sort_stats("cumulative").print_stats(45)
