"""Interoperability: the drafters this project trains are what z-lab's reference and the serving engines load.

The reference (`dflash==0.1.0`, installed by tests/reference.py, never copied) loads a checkpoint the real
trainer wrote, through its own `DFlashDraftModel.from_pretrained`, and decodes with its own
`dflash_generate` next to our `dfpipe eval` loop, on the real SmolLM2 target, fp32 on CPU.

Contract tests follow for SGLang and vLLM, which need a GPU and cannot run here: each states which
config keys and tensor names that engine reads, as read from its source at the commit named, and checks
our config.json and safetensors against them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from services.trainer.eval import greedy, speculative
from services.trainer.features import Target
from services.trainer.model import DFlashDrafter, feature_layer_ids
from shared.messages import EvalReport
from shared.records import ChatMessage, CompletionRecord
from shared.store import Store
from shared.topology import Keys
from tests.conftest import make_config, new_run
from tests.reference import reference_model_module
from tests.test_trainer import _env, _spawn

# the module fixture generates the target's answers and trains (minutes on two shared cores)
pytestmark = pytest.mark.timeout(1800)

BLOCK = 8
MAX_NEW = 32
TRAIN = {"num_layers": 1, "block_size": BLOCK, "anchors_per_sequence": 48, "max_steps": 30, "checkpoint_every": 30,
         "token_budget": 4000, "holdout_mod": 3, "lr": 3e-3, "max_length": 256, "wait_for_data_s": 30,
         "init": "target", "eval_prompts": 16, "eval_max_new_tokens": MAX_NEW}


def _target_records(run: str, n: int, lm, tok) -> list[CompletionRecord]:
    """The target's own greedy answers (what regeneration gives a drafter to learn), token-exact."""
    lines = (Path(__file__).parents[1] / "services/pipeline/data/prompts.jsonl").read_text().splitlines()[:n]
    target = Target(lm, [1])
    out = []
    for i, row in enumerate(map(json.loads, lines)):
        messages = [ChatMessage(role=m["role"], content=m["content"]) for m in row.get("messages", [])] or \
            [ChatMessage(role="user", content=row["prompt"])]
        ids = tok.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                      add_generation_prompt=True)
        ids = list(ids if isinstance(ids, list) else ids["input_ids"])
        answer = greedy(target, ids, 32, {tok.eos_token_id})
        out.append(CompletionRecord(run=run, prompt_id=f"p{i:04d}", messages=messages, output_ids=answer,
                                    completion=tok.decode(answer, skip_special_tokens=True),
                                    completion_tokens=len(answer), finish_reason="stop"))
    return out


@pytest.fixture(scope="module")
def trained(stack, stack_env, target_dir: Path, tmp_path_factory):
    """A drafter trained by `dfpipe train` on the target's own answers, its checkpoint as written to S3,
    and the held-out prompts `dfpipe eval` uses."""
    import asyncio
    import hashlib

    from services.export.drafter import export_drafter
    from services.tokenizer.fingerprint import load_target_tokenizer, template_fingerprint
    from services.tokenizer.samples import SampleBuilder
    from services.trainer.data import held_out_prompts
    from shared.bus import Bus
    from shared.messages import TokenizedShard
    from shared.model import load_causal_lm
    from shared.records import samples_to_parquet
    from shared.topology import Subjects

    run, tmp = new_run(), tmp_path_factory.mktemp("interop")
    cfg = make_config(stack, run, trainer={"block_size": BLOCK})
    lm = load_causal_lm(str(target_dir))
    tok = load_target_tokenizer(cfg)
    built = SampleBuilder(tok, cfg).build(_target_records(run, 18, lm, tok))
    key = f"runs/{run}/tokenized/{template_fingerprint(tok, cfg)}/w0-00000000.parquet"
    data = samples_to_parquet(built.samples)
    store = Store.open(cfg)
    store.put_bytes(key, data)

    async def announce() -> None:
        async with await Bus.connect(cfg.bus, "pytest", deadline_s=10) as bus:
            await bus.ensure_streams()
            await bus.publish(Subjects.tokenized(run), TokenizedShard(
                run=run, key=key, source_key="-", fingerprint=template_fingerprint(tok, cfg),
                num_samples=len(built.samples), num_tokens=sum(s.num_tokens for s in built.samples),
                num_supervised=sum(s.num_supervised for s in built.samples),
                sha256=hashlib.sha256(data).hexdigest()), msg_id=key)

    asyncio.run(announce())
    env = _env(stack_env, **TRAIN)
    proc = _spawn(env, run, tmp / "train.log", "train")
    assert proc.wait(timeout=900) == 0, (tmp / "train.log").read_text()[-3000:]
    out = tmp / "drafter"
    eval_cfg = make_config(stack, run, trainer={k: TRAIN[k] for k in ("block_size", "holdout_mod", "eval_prompts")})

    async def export_and_pick() -> list[list[int]]:
        """The drafter as `dfpipe export` writes it (every test below reads that folder), and the held-out
        prompts as `dfpipe eval` picks them."""
        async with await Bus.connect(cfg.bus, "pytest", deadline_s=10) as bus:
            await export_drafter(eval_cfg, store, bus, str(out))
            return await held_out_prompts(eval_cfg, store, bus)

    prompts = asyncio.run(export_and_pick())
    assert len(prompts) >= 3
    return {"run": run, "env": env, "dir": out, "lm": lm, "prompts": prompts, "store": store,
            "eos": [lm.generation_config.eos_token_id]}


def test_reference_loads_our_checkpoint_and_computes_what_we_compute(trained) -> None:
    """No missing, unexpected or mismatched tensors, and the reference's drafter gives our drafter's
    hidden states on the same inputs (context of 20 positions, one block)."""
    ref = reference_model_module()
    model, info = ref.DFlashDraftModel.from_pretrained(trained["dir"], output_loading_info=True, dtype=torch.float32)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set()), info
    ours = DFlashDrafter.load(trained["dir"]).eval()
    c = ours.config
    assert model.block_size == c.block_size and model.mask_token_id == c.mask_token_id
    assert list(model.target_layer_ids) == c.target_layer_ids
    attn = model.layers[0].self_attn
    assert attn.is_causal is False and attn.sliding_window is None  # bidirectional in the block, as trained
    assert model.config.rope_parameters["rope_theta"] == c.rope_theta
    g = torch.Generator().manual_seed(0)
    ctx, feats = 20, torch.randn(1, 20, len(c.target_layer_ids) * c.hidden_size, generator=g)
    block = torch.randn(1, BLOCK, c.hidden_size, generator=g)
    with torch.no_grad():
        theirs = model.eval()(target_hidden=feats, noise_embedding=block,
                              position_ids=torch.arange(ctx + BLOCK)[None])
        mine = ours(block[0], feats[0], torch.arange(ctx, ctx + BLOCK), torch.arange(ctx),
                    torch.ones(BLOCK, ctx + BLOCK, dtype=torch.bool))
    torch.testing.assert_close(theirs[0], mine, rtol=1e-4, atol=1e-4)


def test_reference_decode_loop_matches_dfpipe_eval_cycle_for_cycle(trained) -> None:
    """The reference's `dflash_generate`, greedy, gives the target's greedy output and the acceptance length
    of every cycle that our eval loop measures, prompt by prompt.

    One difference is by construction and bounded here: near the token limit the reference shrinks the
    last block to the tokens left (`verify_size = min(block_size, max_length − start)`), which changes a
    bidirectional drafter's proposals for that block, while our loop (and SGLang's) always drafts a full
    block. So the reference is given B−1 more tokens of budget (every block we draft is full there too),
    and its cycles are compared with ours up to our limit: all but our last equal, our last equal to its
    count cut at the limit (ours stops there)."""
    ref = reference_model_module()
    model = ref.DFlashDraftModel.from_pretrained(trained["dir"], dtype=torch.float32).eval()
    ours = DFlashDrafter.load(trained["dir"]).eval()
    lm, eos = trained["lm"], trained["eos"]
    target = Target(lm, ours.config.target_layer_ids)
    accepted_somewhere = 0
    for prompt in trained["prompts"]:
        plain = greedy(target, prompt, MAX_NEW, set(eos))
        tokens, cycles = speculative(target, ours, prompt, MAX_NEW, set(eos))
        assert tokens == plain
        r = ref.dflash_generate(model, lm, torch.tensor([prompt]), MAX_NEW + BLOCK - 1, eos, return_stats=True)
        theirs = r.output_ids[0, len(prompt):].tolist()
        assert theirs[: len(plain)] == plain, "the reference's output is not the target's greedy output"
        k = len(cycles) - 1
        assert r.acceptance_lengths[:k] == cycles[:k], (prompt, r.acceptance_lengths, cycles)
        assert cycles[-1] == min(r.acceptance_lengths[k], MAX_NEW - 1 - sum(cycles[:k]))
        accepted_somewhere += sum(n > 1 for n in cycles)
    # the comparison means something only if drafts were accepted: the trained drafter does get some
    assert accepted_somewhere > 0


def test_dfpipe_eval_reports_greedy_and_sampled_tau(trained) -> None:
    """The CLI on the same run: greedy τ equals the loop's (checked above against the reference), and a
    sampled run reports τ per seed with its spread."""
    run, env, store = trained["run"], trained["env"], trained["store"]
    ev = subprocess.run([sys.executable, "-m", "shared.cli", "eval", "--run", run], env=env,
                        capture_output=True, text=True, timeout=900)
    assert ev.returncode == 0, ev.stdout + ev.stderr
    report = msgspec.json.decode(store.get_bytes(Keys.eval_report(run)), type=EvalReport)
    ours = DFlashDrafter.load(trained["dir"]).eval()
    target = Target(trained["lm"], ours.config.target_layer_ids)
    cycles = [n for p in trained["prompts"] for n in speculative(target, ours, p, MAX_NEW, set(trained["eos"]))[1]]
    assert report.lossless and report.temperature == 0 and report.prompts == len(trained["prompts"])
    assert report.tau == pytest.approx(sum(cycles) / len(cycles))
    ev = subprocess.run([sys.executable, "-m", "shared.cli", "eval", "--run", run, "--temperature", "0.7",
                         "--top-p", "0.95", "--seeds", "2"], env=env, capture_output=True, text=True, timeout=900)
    assert ev.returncode == 0, ev.stdout + ev.stderr
    sampled = msgspec.json.decode(store.get_bytes(Keys.eval_report(run)), type=EvalReport)
    assert (sampled.temperature, sampled.top_p, sampled.seeds) == (0.7, 0.95, 2)
    assert len(sampled.tau_per_seed) == 2 and all(t >= 1 for t in sampled.tau_per_seed) and sampled.tau >= 1
    assert "± " in ev.stdout and sampled.lossless is None  # not compared token by token, and it says so
    # the same checkpoint and settings again (a restart, compose `up` after `down`): the report is reused, not redone
    def report_object():  # the S3 object itself: a rewrite changes its etag (the report's ts) and last-modified
        return store.client.stat_object(store.bucket, Keys.eval_report(run))

    before = report_object()
    again = subprocess.run([sys.executable, "-m", "shared.cli", "eval", "--run", run, "--temperature", "0.7",
                            "--top-p", "0.95", "--seeds", "2"], env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout + again.stderr
    after = report_object()
    assert (after.etag, after.last_modified) == (before.etag, before.last_modified) and "already evaluated" in again.stdout
    forced = subprocess.run([sys.executable, "-m", "shared.cli", "eval", "--run", run, "--temperature", "0.7",
                             "--top-p", "0.95", "--seeds", "2", "--force"], env=env, capture_output=True, text=True,
                            timeout=900)
    assert forced.returncode == 0 and report_object().etag != before.etag and "already evaluated" not in forced.stdout
    bad = subprocess.run([sys.executable, "-m", "shared.cli", "eval", "--run", run, "--top-p", "1.5"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "top_p" in bad.stderr


@pytest.mark.stack  # pip installs the reference
def test_reference_reports_a_draft_vocabulary_as_unexpected(tmp_path: Path) -> None:
    """Why a drafter with `trainer.draft_vocab` is not a served drafter (docs/serving.md): the reference, like
    SGLang, does not know the `draft_vocab` tensor and would propose over the whole vocabulary."""
    from types import SimpleNamespace

    ref = reference_model_module()
    tc = SimpleNamespace(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=500, num_hidden_layers=12, rms_norm_eps=1e-5, rope_theta=1e5,
                         max_position_embeddings=512)
    d = DFlashDrafter.for_target(tc, num_layers=1, block_size=8, layer_ids=feature_layer_ids(12, 5), mask_token_id=0)
    d.save(tmp_path / "plain")
    d.set_draft_vocab(torch.arange(100))
    d.save(tmp_path / "restricted")
    _, info = ref.DFlashDraftModel.from_pretrained(tmp_path / "plain", output_loading_info=True)
    assert info["unexpected_keys"] == set() and info["missing_keys"] == set()
    _, info = ref.DFlashDraftModel.from_pretrained(tmp_path / "restricted", output_loading_info=True)
    assert info["unexpected_keys"] == {"draft_vocab"}


# --- contract tests: engines we cannot run here ------------------------------------------------------


def _small_checkpoint(tmp_path: Path) -> dict:
    from types import SimpleNamespace

    tc = SimpleNamespace(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=500, num_hidden_layers=12, rms_norm_eps=1e-5, rope_theta=1e5,
                         max_position_embeddings=4096)
    DFlashDrafter.for_target(tc, num_layers=3, block_size=8, layer_ids=[1, 3, 5, 7, 9], mask_token_id=7).save(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def test_contract_sglang_dflash_config_parser_reads_our_keys(tmp_path: Path) -> None:
    """CONTRACT TEST (SGLang needs a GPU; not run here). `parse_dflash_draft_config` in
    sgl-project/sglang python/sglang/srt/speculative/dflash_utils.py (@00731f0b) reads: `num_hidden_layers`
    (top level), `num_target_layers` and `block_size` from `dflash_config` first, then the top level,
    `dflash_config.target_layer_ids` (each in [0, num_target_layers); absent: its own layer rule) and
    `dflash_config.mask_token_id`/`mask_token`. Both places hold the same value, so no engine's order of
    precedence can pick a stale one. (The weights side is test_trainer's SGLang loader contract test.)"""
    cfg = _small_checkpoint(tmp_path)
    check_sglang_contract(cfg)
    dc = cfg["dflash_config"]
    assert cfg["num_hidden_layers"] == 3 and dc["block_size"] == 8 and dc["num_target_layers"] == 12
    assert dc["target_layer_ids"] == [1, 3, 5, 7, 9]


def check_sglang_contract(cfg: dict) -> None:
    dc = cfg["dflash_config"]
    for key in ("block_size", "num_target_layers"):
        assert dc[key] == cfg[key], key
    assert all(0 <= i < dc["num_target_layers"] for i in dc["target_layer_ids"])
    assert isinstance(dc["mask_token_id"], int)


def test_contract_vllm_dflash_model_reads_our_keys(tmp_path: Path) -> None:
    """CONTRACT TEST (vLLM needs a GPU; not run here). As read from vllm-project/vllm
    vllm/model_executor/models/qwen3_dflash.py (@036a00d1) and
    vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py (@0cfdd2e1):
    - causality: `is_causal`, else `dflash_config.causal`, else "sliding layers are causal": ours says false;
    - sliding window: `layer_types` (+ `dflash_config.use_swa`, `swa_window_size` or `sliding_window`): all full;
    - RoPE: `rope_parameters`, with a default theta of 1e6 when none is given (SmolLM2's is 1e5) and
      neox (half-split) layout unless `is_neox_style` says otherwise: ours is half-split;
    - feature layers: `eagle_aux_hidden_state_layer_ids`, else `dflash_config.target_layer_ids` + 1 (it
      captures a layer's input, we take its output: the same tensor); fc input = that many × hidden_size
      (`target_hidden_size` absent);
    - `dflash_config.mask_token_id`; a top-level `draft_vocab_size` different from the target's vocabulary
      makes it expect its own lm_head and a `d2t` tensor: ours has none at the top level;
    - tensors: q/k/v_proj stacked into qkv_proj, gate/up_proj into gate_up_proj, the rest by name, under
      `model.`; an `embed_tokens` or `lm_head` tensor would replace the target's."""
    cfg = _small_checkpoint(tmp_path)
    check_vllm_contract(tmp_path)
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 3, 5, 7, 9] and cfg["head_dim"] == 16


def check_vllm_contract(folder: Path) -> None:
    from safetensors import safe_open

    cfg = json.loads((folder / "config.json").read_text())
    dc = cfg["dflash_config"]
    assert cfg["is_causal"] is False and "causal" not in dc
    assert cfg["layer_types"] == ["full_attention"] * cfg["num_hidden_layers"] and not dc.get("use_swa", False)
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e5}  # SmolLM2's and the tiny one's
    assert cfg.get("is_neox_style", True) is True
    assert "eagle_aux_hidden_state_layer_ids" not in cfg
    assert "target_hidden_size" not in cfg and "draft_vocab_size" not in cfg and not cfg.get("attention_bias")
    assert cfg["hidden_act"] == "silu"
    with safe_open(folder / "model.safetensors", "pt") as f:
        names = set(f.keys())
        D = cfg["hidden_size"]
        assert f.get_slice("fc.weight").get_shape() == [D, len(dc["target_layer_ids"]) * D]
    stacked = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
               "up_proj": "gate_up_proj"}
    theirs = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{n}.weight" for i in range(cfg["num_hidden_layers"]) for n in (
            "input_layernorm", "post_attention_layernorm", "self_attn.qkv_proj", "self_attn.o_proj",
            "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_up_proj", "mlp.down_proj")}
    assert {".".join(stacked.get(part, part) for part in n.split(".")) for n in names} == theirs
    assert not any("embed_tokens" in n or "lm_head" in n or "d2t" in n for n in names)


def test_contracts_hold_on_the_exported_folder(trained) -> None:
    """CONTRACT TEST (engines not run here): the folder `dfpipe export` wrote (the one every test above
    loads) passes both engines' contract checks, and its card states every key they read, with its value."""
    from services.export.serving import engine_keys

    folder = trained["dir"]
    cfg = json.loads((folder / "config.json").read_text())
    check_sglang_contract(cfg)
    check_vllm_contract(folder)
    card = (folder / "README.md").read_text()
    for key, value, _ in engine_keys(cfg):
        assert f"| `{key}` | " + (f"`{json.dumps(value)}`" if value is not None else "(absent)") in card, key
    sums = dict(reversed(line.split("  ", 1)) for line in (folder / "SHA256SUMS").read_text().splitlines())
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= set(sums)


def test_export_after_the_eval_names_the_eval_the_target_and_the_serving_commands(trained, stack, monkeypatch,
                                                                                  capsys, tmp_path: Path) -> None:
    """Exported once the eval has measured the checkpoint: the card carries that eval (τ, histogram, speedup,
    machine), the target's recorded identity (its weights' hash, as `shared.model.target_identity` computes
    it), and the serving commands with the block size; the tokenizer loads from the folder."""
    from transformers import AutoTokenizer

    from shared.model import load_tokenizer, target_identity
    from tests.test_export import _cli

    run, store = trained["run"], trained["store"]
    report = msgspec.json.decode(store.get_bytes(Keys.eval_report(run)), type=EvalReport)
    out = tmp_path / "served"
    code, stdout, err = _cli(stack, monkeypatch, capsys, "export", "--run", run, str(out))
    assert code == 0, err
    assert f"τ {report.tau:.3f} on {report.prompts} held-out prompts" in stdout
    card = (out / "README.md").read_text()
    assert f"= {report.tau:.3f} on {report.prompts} held-out prompts" in card
    assert str(report.acceptance_histogram) in card and report.machine and report.machine in card
    assert target_identity("smollm2")["weights_sha256"] in card
    assert f"--speculative-dflash-block-size {BLOCK}" in card and f'"num_speculative_tokens": {BLOCK - 1}' in card
    assert f"--speculative-draft-model-path {out}" in card and "SGLang 0.5.11" in card
    assert AutoTokenizer.from_pretrained(out).encode("Hello, world") == load_tokenizer("smollm2").encode("Hello, world")
