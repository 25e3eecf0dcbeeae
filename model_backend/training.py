"""Joint Act + Rehearse LoRA training on one set of weights.

Reads top to bottom: config, rows (prompt + target, loss only on the target), model
(a LoRA wrapper on a freshly loaded base; the base weights stay frozen and are never
written), loop (weighted token cross-entropy, gradient accumulation, progress callback),
atomic save (temporary directory, then one rename).
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

from .base import Prompt

if TYPE_CHECKING:
    from .loading import LoadedModel

log = logging.getLogger(__name__)

Role = Literal["act", "rehearse"]
ROLES: tuple[str, ...] = ("act", "rehearse")
LINEAR_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""Written into shipped adapter configs instead of a machine-local cache path (loading matches by name)."""


class TrainingError(ValueError):
    """Bad training input (no rows, bad config): the message says what to change."""


@dataclass
class TrainConfig:
    """One training run. Defaults are the shipped agent's settings (NOTES.md probe)."""

    steps: int = 80
    """Optimizer steps (each one `grad_accum` rows)."""
    lr: float = 3e-4
    # 3e-4 with r=16 learned the call format in 80 steps in the probe; higher diverged less gently.
    rank: int = 16
    alpha: int = 32
    # alpha = 2 * rank: the usual LoRA scaling, keeps the update size stable when rank changes.
    dropout: float = 0.0
    # No dropout: runs are a few hundred steps, far from overfitting a 135M model's adapter.
    target_modules: tuple[str, ...] = LINEAR_TARGETS
    """All linear layers: attention-only LoRA learned the format but not the arguments."""
    grad_accum: int = 1
    warmup_steps: int = 5
    # A short warmup: Adam's first steps are noisy and the adapter starts at zero.
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    max_seq_len: int = 1100
    """Rows longer than this (prompt + target tokens) are dropped, never truncated: a cut prompt
    would teach the model on a context it never sees at inference. ~1,100 keeps the median
    expert Act row (about 1,000 tokens) and bounds a step near 6-7 s on 2 cores."""
    pack_len: int | None = 2400
    """Act rows of one episode share a sequence up to this many tokens (None: one row per
    sequence). Their prompts extend each other, so a pack of ~6 targets costs about 2 rows."""
    max_seconds: float | None = None
    """Wall-time budget: training stops when it is spent, and the learning-rate schedule
    follows whichever of steps or time is further along, so a slow (shared) machine gets
    fewer steps but a complete schedule."""
    act_weight: float = 1.0
    rehearse_weight: float = 1.0
    """Per-role multipliers on the row loss (joint training: both roles share the weights)."""
    seed: int = 0
    device: str = "auto"
    shuffle: bool = True

    def validate(self) -> None:
        if not 1 <= self.steps <= 10_000:
            raise TrainingError(f"steps must be between 1 and 10000, got {self.steps}")
        if not (self.lr > 0 and math.isfinite(self.lr)) or self.lr > 1.0:
            raise TrainingError(f"learning rate must be > 0 and at most 1, got {self.lr}")
        if not 1 <= self.rank <= 256:
            raise TrainingError(f"LoRA rank must be between 1 and 256, got {self.rank}")
        if self.grad_accum < 1:
            raise TrainingError(f"grad_accum must be >= 1, got {self.grad_accum}")
        if self.act_weight < 0 or self.rehearse_weight < 0 or self.act_weight + self.rehearse_weight == 0:
            raise TrainingError("role weights must be >= 0 and not both 0")
        if not self.target_modules:
            raise TrainingError("target_modules must name at least one module")


@dataclass
class TrainRow:
    """One supervised example: a prompt exactly as the engine renders it, and the target text."""

    role: Role
    prompt: Prompt
    target: str
    """What the model should write after the prompt (and its prefill)."""
    source: str = "expert"
    """Where the row came from: `expert`, `self`, `correction`."""
    ref: str = ""
    """A pointer back to the trace (task/episode, step, branch) for the model card and registry."""


@dataclass
class EncodedRow:
    """One token sequence with one or more target spans (a pack holds several Act rows)."""

    input_ids: list[int]
    spans: list[tuple[int, int]]
    """[start, end) token ranges that are targets; the loss covers only these."""
    role: Role
    refs: list[str] = field(default_factory=list)

    @property
    def n_prompt(self) -> int:
        return self.spans[0][0]

    @property
    def n_target(self) -> int:
        return sum(end - start for start, end in self.spans)

    @property
    def n_rows(self) -> int:
        return len(self.spans)


@dataclass
class TrainResult:
    steps: int
    losses: list[float]
    """Mean weighted loss of each optimizer step."""
    tokens: int
    """Tokens processed (prompt + target) over the whole run."""
    target_tokens: int
    seconds: float
    rows_used: int
    rows_dropped: int
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def s_per_step(self) -> float:
        return self.seconds / self.steps if self.steps else 0.0

    def summary(self) -> dict[str, Any]:
        k = max(1, min(10, len(self.losses) // 4))
        return {"steps": self.steps, "seconds": round(self.seconds, 1), "s_per_step": round(self.s_per_step, 2),
                "tokens": self.tokens, "tokens_per_s": round(self.tokens_per_s, 1),
                "target_tokens": self.target_tokens, "rows_used": self.rows_used,
                "rows_dropped": self.rows_dropped,
                "loss_first": round(sum(self.losses[:k]) / k, 4) if self.losses else None,
                "loss_last": round(sum(self.losses[-k:]) / k, 4) if self.losses else None}


@dataclass
class Progress:
    step: int
    steps: int
    loss: float
    elapsed_s: float
    tokens: int


ProgressCallback = Callable[[Progress], None]


# ---------------------------------------------------------------- rows -> tokens


def render(tokenizer: Any, prompt: Prompt) -> str:
    """The prompt as the policy renders it (`Prompt.render`, the one render)."""
    return prompt.render(tokenizer)


def end_of_turn_id(tokenizer: Any) -> int | None:
    """`<|im_end|>` (ChatML), else the tokenizer's EOS: the model learns to end its reply."""
    tok = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(tok, int) and tok != tokenizer.unk_token_id:
        return tok
    return tokenizer.eos_token_id


def end_of_turn_text(tokenizer: Any) -> str:
    """`end_of_turn_id` as text ("" without one): what a row's target ends with, in training and when scored."""
    eot = end_of_turn_id(tokenizer)
    return tokenizer.convert_ids_to_tokens(eot) if eot is not None else ""


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_rows(tokenizer: Any, rows: Sequence[TrainRow], max_seq_len: int | None = None,
                pack_len: int | None = None) -> tuple[list[EncodedRow], list[TrainRow]]:
    """Tokenize rows; returns (encoded sequences, rows dropped for length).

    Prompt and target are tokenized apart, as at inference (the prompt is encoded, the
    target is generated after it). With `pack_len`, consecutive Act rows whose prompts
    extend each other (the steps of one episode: each prompt is the previous prompt, its
    target, and the tool's result) share one sequence of at most `pack_len` tokens, with a
    target span per row. A row joins a pack only when the pack's tokens up to its target
    equal the tokens of its own prompt, so every target is trained on exactly the
    context inference gives it; the long shared prefix is then computed once.
    """
    eot = end_of_turn_id(tokenizer)
    eot_text = end_of_turn_text(tokenizer)
    kept: list[EncodedRow] = []
    dropped: list[TrainRow] = []
    open_pack: EncodedRow | None = None
    open_text = ""  # rendered text of the open pack (prompt + targets so far)
    for row in rows:
        prompt_text = render(tokenizer, row.prompt)
        prompt_ids = _ids(tokenizer, prompt_text)
        target_ids = _ids(tokenizer, row.target) + ([eot] if eot is not None else [])
        if len(target_ids) <= (1 if eot is not None else 0) or (
                max_seq_len is not None and len(prompt_ids) + len(target_ids) > max_seq_len):
            dropped.append(row)
            continue
        if (pack_len is not None and row.role == "act" and open_pack is not None
                and prompt_text.startswith(open_text)):
            delta = _ids(tokenizer, prompt_text[len(open_text):])
            start = len(open_pack.input_ids) + len(delta)
            if (start + len(target_ids) <= pack_len
                    and open_pack.input_ids + delta == prompt_ids):
                open_pack.input_ids += delta + target_ids
                open_pack.spans.append((start, start + len(target_ids)))
                open_pack.refs.append(row.ref)
                open_text = prompt_text + row.target + eot_text
                continue
        encoded = EncodedRow(prompt_ids + target_ids, [(len(prompt_ids), len(prompt_ids) + len(target_ids))],
                             row.role, [row.ref])
        kept.append(encoded)
        if pack_len is not None and row.role == "act":  # Rehearse rows in between leave the pack open
            open_pack, open_text = encoded, prompt_text + row.target + eot_text
    return kept, dropped


# ---------------------------------------------------------------- model


def trainable_model(loaded: LoadedModel, config: TrainConfig) -> Any:
    """A LoRA-wrapped model to train: continues `loaded`'s adapter when it has one, else a new one.

    `loaded` must be a fresh `load_model(...)` result, never a cached policy's model:
    peft injects its layers into the module tree in place.
    """
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model

    torch.manual_seed(config.seed)
    model = loaded.model
    if isinstance(model, PeftModel):
        # Continue the parent adapter (loaded for inference: unfreeze only its LoRA weights).
        for name, param in model.named_parameters():
            param.requires_grad = "lora_" in name
    else:
        lora = LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                          target_modules=list(config.target_modules), task_type="CAUSAL_LM", bias="none")
        model = get_peft_model(model, lora)
    if not any(p.requires_grad for p in model.parameters()):
        raise TrainingError("the model has no trainable LoRA parameters")
    return model


def nll_of_rows(model: Any, encoded: Sequence[EncodedRow]) -> list[float]:
    """Mean NLL per target token of each row under `model` (forward only)."""
    import torch

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = []
    with torch.inference_mode():
        for row in encoded:
            out.append(float(_row_loss(model, row, device)))
    model.train(was_training)
    return out


def _row_loss(model: Any, row: EncodedRow, device: Any) -> Any:
    """Mean over the row's targets of each target's mean token NLL (a pack counts each row once)."""
    import torch

    ids = torch.tensor([row.input_ids], device=device)
    # Positions whose next token is a target: the LM head (a 49k-vocab matmul) runs only there.
    positions = torch.tensor([p - 1 for start, end in row.spans for p in range(start, end)], device=device)
    targets = ids[0, positions + 1]
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    body, head = getattr(causal, "model", None), getattr(causal, "lm_head", None)
    if body is not None and head is not None:
        hidden = body(input_ids=ids).last_hidden_state[0, positions]
        logits = head(hidden).float()
    else:  # an architecture without the usual body/head split: full logits
        logits = model(input_ids=ids).logits[0, positions].float()
    token_nll = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    per_row, offset = [], 0
    for start, end in row.spans:
        per_row.append(token_nll[offset: offset + end - start].mean())
        offset += end - start
    return torch.stack(per_row).mean()


# ---------------------------------------------------------------- loop


def train(model: Any, encoded: Sequence[EncodedRow], config: TrainConfig,
          progress: ProgressCallback | None = None, dropped: int = 0, checkpoint_every: int = 0,
          checkpoint: Callable[[int], bool] | None = None) -> TrainResult:
    """Train `model` (LoRA parameters only) on `encoded` rows for `config.steps` optimizer steps.

    `checkpoint(step)` runs after every `checkpoint_every`-th step and after the last one (the model in eval
    mode, back to training after); when it returns True training stops there (early stopping)."""
    import torch

    config.validate()
    if not encoded:
        raise TrainingError("no training rows (all were dropped or none were selected)")
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    total = config.steps

    def lr_factor(step: int, elapsed: float) -> float:
        # Linear warmup, then cosine to 10%: late steps refine instead of undoing early ones.
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        frac = (step - config.warmup_steps) / max(1, total - config.warmup_steps)
        if config.max_seconds:
            frac = max(frac, elapsed / config.max_seconds)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))

    weights = {"act": config.act_weight, "rehearse": config.rehearse_weight}
    order: list[int] = []

    def next_row() -> EncodedRow:
        if not order:  # a new epoch: every row once, in a fresh seeded order
            order.extend(range(len(encoded)))
            if config.shuffle:
                rng.shuffle(order)
        return encoded[order.pop()]

    model.train()
    losses: list[float] = []
    tokens = target_tokens = 0
    started = time.perf_counter()
    for step in range(total):
        elapsed = time.perf_counter() - started
        if config.max_seconds and step and elapsed >= config.max_seconds:
            log.info("time budget of %.0f s spent after %d of %d steps", config.max_seconds, step, total)
            break
        for group in optimizer.param_groups:
            group["lr"] = config.lr * lr_factor(step, elapsed)
        optimizer.zero_grad(set_to_none=True)
        step_loss, weight_sum = 0.0, 0.0
        batch = [next_row() for _ in range(config.grad_accum)]
        norm = sum(weights[r.role] for r in batch) or 1.0
        for row in batch:
            w = weights[row.role]
            if w == 0:
                continue
            loss = _row_loss(model, row, device)
            (loss * (w / norm)).backward()
            step_loss += float(loss.detach()) * w
            weight_sum += w
            tokens += len(row.input_ids)
            target_tokens += row.n_target
        torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
        optimizer.step()
        value = step_loss / weight_sum if weight_sum else float("nan")
        if not math.isfinite(value):
            raise TrainingError(f"loss became {value} at step {step + 1}; lower the learning rate")
        losses.append(value)
        if progress is not None:
            progress(Progress(step + 1, total, value, time.perf_counter() - started, tokens))
        if checkpoint is not None and checkpoint_every > 0 and ((step + 1) % checkpoint_every == 0
                                                                 or step + 1 == total):
            model.eval()
            stop = checkpoint(step + 1)
            model.train()
            if stop:
                break
    model.eval()
    cfg = asdict(config)
    cfg["target_modules"] = list(config.target_modules)
    return TrainResult(len(losses), losses, tokens, target_tokens, time.perf_counter() - started,
                       rows_used=sum(r.n_rows for r in encoded), rows_dropped=dropped, config=cfg)


# ---------------------------------------------------------------- save


def save_adapter(model: Any, out: str | os.PathLike[str], extra_files: dict[str, str] | None = None,
                 base_model: str = BASE_MODEL_ID, replace: bool = False,
                 _after_write: Callable[[Path], None] | None = None) -> Path:
    """Write the LoRA weights to `out` atomically: a sibling temp dir, then one rename.

    An existing `out` is an error unless `replace` (the shipped adapter is rebuilt in
    place): then the old directory is moved aside, the new one renamed in, and the old one
    removed; a failure puts the old one back. Either way a failure leaves no partial
    adapter and no temp dir. `_after_write` is a test hook run after the files are written
    and before the rename.
    """
    out = Path(out).expanduser()
    if out.exists() and not replace:
        raise TrainingError(f"{out} already exists; choose a new adapter directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    old: Path | None = None
    try:
        # No embedding layers are trained; False also skips peft's Hub lookup of the base config.
        model.save_pretrained(str(tmp), save_embedding_layers=False)
        config_path = tmp / "adapter_config.json"
        config = json.loads(config_path.read_text())
        # A machine-local cache path means nothing elsewhere; loading matches the base by name.
        config["base_model_name_or_path"] = base_model
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        if _after_write is not None:
            _after_write(tmp)
        tmp.chmod(0o755)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.rename(out, old)
        try:
            os.rename(tmp, out)
        except OSError:
            if old is not None:
                os.rename(old, out)
                old = None
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and old.exists():
            shutil.rmtree(old, ignore_errors=True)
    return out


def is_adapter_dir(path: str | os.PathLike[str]) -> bool:
    p = Path(path)
    return (p / "adapter_config.json").is_file() and any(
        (p / n).is_file() for n in ("adapter_model.safetensors", "adapter_model.bin"))


__all__ = [
    "BASE_MODEL_ID", "EncodedRow", "LINEAR_TARGETS", "Progress", "ProgressCallback", "ROLES", "Role",
    "TrainConfig", "TrainResult", "TrainRow", "TrainingError", "encode_rows", "end_of_turn_id", "end_of_turn_text",
    "is_adapter_dir", "nll_of_rows", "render", "save_adapter", "train", "trainable_model",
]
