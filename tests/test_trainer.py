"""DFlash trainer on the real SmolLM2 target, real S3 and a real nats-server.

Tiny settings (one drafter layer, block size 8, a few anchors, short sequences) keep it to a
couple of minutes on two cores; the code paths are the production ones.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from services.trainer.blocks import candidate_anchors, estimated_tau, make_blocks
from services.trainer.model import DFlashDrafter, feature_layer_ids
from shared.bus import Bus
from shared.messages import EvalReport, TokenizedShard, TrainerProgress
from shared.records import ChatMessage, CompletionRecord, samples_to_parquet
from shared.store import Store
from shared.topology import Keys, Subjects
from tests.conftest import make_config, new_run

TINY = {"num_layers": 1, "block_size": 8, "anchors_per_sequence": 12, "max_steps": 8, "checkpoint_every": 3,
        "token_budget": 400, "holdout_mod": 6, "lr": 3e-3, "max_length": 160, "wait_for_data_s": 30,
        "eval_prompts": 3, "eval_max_new_tokens": 24}

ANSWERS = [
    "The capital of France is Paris. It is known for the Eiffel Tower, the Louvre and its cafes.",
    "To boil an egg, place it in boiling water for about nine minutes, then cool it in cold water.",
    "Photosynthesis is how plants turn light, water and carbon dioxide into sugar and oxygen.",
    "A haiku has three lines of five, seven and five syllables, and it is often about nature or seasons.",
    "Python lists are ordered and mutable, while tuples are ordered and immutable, so tuples can be dict keys.",
    "Water boils at 100 degrees Celsius at sea level and at lower temperatures at altitude.",
]


# --- the three alignment mistakes, caught without a model ---------------------------------------


def test_blocks_labels_context_and_weights_are_aligned() -> None:
    S, B = 20, 4
    ids = torch.arange(100, 100 + S)
    mask = torch.tensor([0] * 6 + [1] * (S - 6))
    anchors = torch.tensor([6, 11, 18])
    b = make_blocks(ids, mask, anchors, B, mask_token_id=7)
    labels, weights = b.labels.view(3, B), b.weights.view(3, B)
    for j, a in enumerate(anchors.tolist()):
        assert b.block_ids.view(3, B)[j].tolist() == [100 + a, 7, 7, 7]  # anchor, then mask tokens
        for k in range(B):
            if a + k < S:
                assert labels[j, k] == ids[a + k]  # same position: slot k predicts token a+k, not a+k+1
        assert weights[j, 0] == 0  # the anchor is given, not predicted
        row = b.mask[j * B]
        ctx = row[:S]
        assert ctx[:a].all() and not ctx[a:].any()  # context strictly before the anchor
        own = row[S:].view(3, B)
        assert own[j].all() and own.sum() == B  # own block fully, other blocks never
    # slot 1 weight 1, then exp(-(k-1)/γ); beyond the sequence end: 0
    assert weights[0, 1] == pytest.approx(1.0)
    assert weights[0, 2] == pytest.approx(torch.exp(torch.tensor(-1 / (B / 2.3))).item())
    assert weights[2, 2:].sum() == 0  # positions 20, 21 are past S
    assert candidate_anchors(mask).min() == 6 and candidate_anchors(mask).max() == S - 2
    assert estimated_tau([1.0, 1.0]) == 3.0 and estimated_tau([0.0, 1.0]) == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_loss_matches_autograd_cross_entropy(dtype: torch.dtype) -> None:
    import torch.nn.functional as F

    from services.trainer.loss import head_cross_entropy

    g = torch.Generator().manual_seed(0)
    head = (torch.randn(1000, 64, generator=g) * 0.3).to(dtype)
    labels, w = torch.randint(0, 1000, (37,), generator=g), torch.rand(37, generator=g)
    hidden = torch.randn(37, 64, generator=g).to(dtype).requires_grad_()
    loss, hits = head_cross_entropy(hidden, head, labels, w, chunk=8)  # 37 rows: the last chunk is short
    (loss * 0.5).backward()
    fused_grad, hidden.grad = hidden.grad.clone(), None
    logits = (hidden @ head.T).float()
    ref = (F.cross_entropy(logits, labels, reduction="none") * w).sum()
    (ref * 0.5).backward()
    assert loss.dtype == torch.float32 and float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 1e-3  # bf16: the gradient is rounded once, before the head matmul
    assert torch.allclose(fused_grad.float(), hidden.grad.float(), atol=tol, rtol=tol)
    assert torch.equal(hits, logits.argmax(-1) == labels)
    with pytest.raises(ValueError, match="frozen"):
        head_cross_entropy(hidden, head.clone().requires_grad_(), labels, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_loss_with_soft_labels_matches_autograd(dtype: torch.dtype) -> None:
    """Against the teacher's distribution softmax(teacher·headᵀ): Σ w·(−Σ q log p), its gradient w·(p − q)."""
    from services.trainer.loss import head_cross_entropy

    g = torch.Generator().manual_seed(1)
    head = (torch.randn(1000, 64, generator=g) * 0.3).to(dtype)
    labels, w = torch.randint(0, 1000, (37,), generator=g), torch.rand(37, generator=g)
    teacher = torch.randn(37, 64, generator=g).to(dtype)
    hidden = torch.randn(37, 64, generator=g).to(dtype).requires_grad_()
    loss, hits = head_cross_entropy(hidden, head, labels, w, chunk=8, teacher=teacher)
    loss.backward()
    fused_grad, hidden.grad = hidden.grad.clone(), None
    logits = (hidden @ head.T).float()
    q = (teacher @ head.T).float().softmax(-1)
    ref = (-(q * logits.log_softmax(-1)).sum(-1) * w).sum()
    ref.backward()
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-5 if dtype == torch.float32 else 1e-3)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    assert torch.allclose(fused_grad.float(), hidden.grad.float(), atol=tol, rtol=tol)
    assert torch.equal(hits, logits.argmax(-1) == labels)  # accuracy stays against the label token
    same, _ = head_cross_entropy(hidden.detach(), head, labels, w, chunk=8)
    assert float(same) != pytest.approx(float(loss.detach()))  # the teacher did change the loss


def test_training_data_is_the_template_that_appeared_last_whatever_is_announced_later() -> None:
    from services.trainer.data import newest_keys

    shards = {"fp1/a": ("fp1", 1), "fp1/b": ("fp1", 2), "fp2/a": ("fp2", 3), "fp2/b": ("fp2", 4)}
    assert newest_keys(shards) == ["fp2/a", "fp2/b"]
    # a tokenizer still on the old template writes one more shard after the re-tokenization began
    assert newest_keys({**shards, "fp1/c": ("fp1", 9)}) == ["fp2/a", "fp2/b"]
    assert newest_keys({}) == []


def test_feature_layers_follow_the_papers_rule() -> None:
    assert feature_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert feature_layer_ids(30, 5) == [1, 8, 14, 21, 27]  # SmolLM2-135M
    assert feature_layer_ids(64, 5) == [1, 16, 31, 46, 61]


def test_target_features_are_layer_outputs_without_shift(target_dir: Path) -> None:
    from services.trainer.features import Target
    from shared.model import load_causal_lm

    lm = load_causal_lm(str(target_dir))
    target = Target(lm, [1, 8])
    ids = torch.tensor([1, 2, 3, 4, 5])
    feats = target.features(ids)
    ref = lm(input_ids=ids[None], output_hidden_states=True).hidden_states
    D = lm.config.hidden_size
    assert feats.shape == (5, 2 * D)
    assert torch.equal(feats[:, :D], ref[2][0]) and torch.equal(feats[:, D:], ref[9][0])
    # soft labels: the same features, and the final normed hidden state (the LM head's input), batched
    [(f1, top1), (f2, top2)] = target.features_and_final_many([ids, ids[:3]])
    assert torch.allclose(f1, feats, atol=1e-5) and torch.allclose(f2, feats[:3], atol=1e-5)
    assert torch.allclose(top1, ref[-1][0], atol=1e-5) and torch.allclose(top2, ref[-1][0, :3], atol=1e-5)


def test_soft_labels_are_the_targets_own_next_token_distribution(target_dir: Path) -> None:
    """On the target's own greedy answer, the teacher state picked for every labelled slot must put its
    argmax on that slot's label: the final state one position *before* the slot."""
    from services.trainer.blocks import label_states
    from services.trainer.features import Target
    from shared.model import load_causal_lm, load_tokenizer

    lm, tok = load_causal_lm(str(target_dir)), load_tokenizer(str(target_dir))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name three colours."}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)["input_ids"]
    ids = lm.generate(prompt, max_new_tokens=16, do_sample=False)[0]
    mask = torch.zeros(len(ids), dtype=torch.long)
    mask[prompt.shape[1]:] = 1
    target = Target(lm, feature_layer_ids(lm.config.num_hidden_layers, 5))
    [(_, final)] = target.features_and_final_many([ids])
    b = make_blocks(ids, mask, candidate_anchors(mask), 4, 0)
    keep = b.weights > 0
    teacher = label_states(final, b.q_pos[keep])
    assert keep.sum() > 20
    assert torch.equal((teacher @ lm.lm_head.weight.T).argmax(-1), b.labels[keep])
    assert not torch.equal((final[b.q_pos[keep]] @ lm.lm_head.weight.T).argmax(-1), b.labels[keep])  # no shift: wrong


def test_target_init_starts_from_the_layers_above_the_deepest_feature(target_dir: Path) -> None:
    from services.trainer.features import Target
    from services.trainer.model import resolve_mask_token_id
    from shared.model import load_causal_lm, load_tokenizer

    lm = load_causal_lm(str(target_dir))
    n, layers = lm.config.num_hidden_layers, lm.get_decoder().layers
    ids = feature_layer_ids(n, 5)
    deepest = max(ids)
    mask_id = resolve_mask_token_id(load_tokenizer(str(target_dir)), lm.config.vocab_size)
    d = DFlashDrafter.for_target(lm.config, num_layers=n - deepest, block_size=8, layer_ids=ids, mask_token_id=mask_id)
    untouched = d.layers[-1].self_attn.q_proj.weight.clone()
    d.init_from_target(layers)
    feats = Target(lm, ids).features(torch.tensor([1, 2, 3, 4, 5]))
    D = lm.config.hidden_size
    # the fused context is the deepest layer's output as the layer above it normalises its input
    expected = layers[deepest + 1].input_layernorm(feats[:, -D:])
    assert torch.allclose(d.fuse(feats), expected, atol=1e-5)
    for i, layer in enumerate(d.layers[:-1]):
        source = layers[deepest + 1 + i]
        assert torch.equal(layer.self_attn.k_proj.weight, source.self_attn.k_proj.weight)
        assert torch.equal(layer.mlp.down_proj.weight, source.mlp.down_proj.weight)
        assert torch.equal(layer.post_attention_layernorm.weight, source.post_attention_layernorm.weight)
    assert torch.equal(d.layers[-1].self_attn.q_proj.weight, untouched)  # no target layer left above
    assert torch.equal(d.norm.weight, torch.ones(D))


def test_checkpoint_layout_matches_public_dflash_drafters(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from safetensors import safe_open

    tc = SimpleNamespace(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=500, num_hidden_layers=12, rms_norm_eps=1e-5, rope_theta=1e5,
                         max_position_embeddings=512)
    d = DFlashDrafter.for_target(tc, num_layers=2, block_size=8, layer_ids=[1, 3, 5, 7, 9], mask_token_id=0)
    d.save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 12 and cfg["num_hidden_layers"] == 2
    assert cfg["dflash_config"] == {"mask_token_id": 0, "target_layer_ids": [1, 3, 5, 7, 9], "block_size": 8,
                                    "num_target_layers": 12}  # no draft vocabulary
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "fc.weight" in names and "hidden_norm.weight" in names and "norm.weight" in names
    assert "layers.1.self_attn.q_norm.weight" in names and "layers.0.mlp.gate_proj.weight" in names
    assert not any("embed" in n or "lm_head" in n for n in names)  # the target's, frozen, not stored
    loaded = DFlashDrafter.load(tmp_path)
    x, f = torch.randn(8, 64), torch.randn(5, 5 * 64)
    q, c, m = torch.arange(5, 13), torch.arange(5), torch.ones(8, 13, dtype=torch.bool)
    assert torch.equal(d(x, f, q, c, m), loaded(x, f, q, c, m))


def test_checkpoint_meets_sglangs_dflash_loader_contract(tmp_path: Path, target_dir: Path) -> None:
    """CONTRACT TEST, not a load by SGLang (it needs a GPU; none here). It checks what SGLang's DFlash loader
    requires of a drafter, as read from sgl-project/sglang: `parse_dflash_draft_config` in
    python/sglang/srt/speculative/dflash_utils.py (@00731f0b), `DFlashDraftModel.load_weights` in
    python/sglang/srt/models/dflash.py (@003b23d7), `DFlashWorker._resolve_mask_token_id` in
    speculative/dflash_worker.py (@0468412f), and `_get_and_verify_dtype` in configs/model_config.py
    (@001adf56). SGLang skips unknown tensors and does not check for missing ones, so a name mismatch
    would load silently with random weights: the mapping is checked both ways here."""
    import copy
    from types import SimpleNamespace

    from safetensors import safe_open

    from services.trainer.model import SGLANG_MASK_TOKEN, resolve_mask_token_id
    from shared.model import load_tokenizer

    tc = SimpleNamespace(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=500, num_hidden_layers=12, rms_norm_eps=1e-5, rope_theta=1e5,
                         max_position_embeddings=4096, dtype="float16")
    d = DFlashDrafter.for_target(tc, num_layers=2, block_size=8, layer_ids=[1, 3, 5, 7, 9], mask_token_id=7)
    d.set_draft_vocab(torch.arange(100))
    d.save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"][0] == "DFlashDraftModel"
    assert all(cfg[k] > 0 for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"))
    assert cfg.get("hidden_act", "silu") == "silu" and not cfg.get("attention_bias", False)
    dc = cfg["dflash_config"]
    assert all(0 <= i < cfg["num_target_layers"] == tc.num_hidden_layers for i in dc["target_layer_ids"])
    assert cfg["block_size"] == 8 and 0 <= dc["mask_token_id"] < tc.vocab_size
    # `--dtype auto` serves a float32 config as float16 and a bfloat16 one as bfloat16: the drafter must say the
    # target's dtype, or the target's hidden states meet weights of another dtype.
    assert cfg["torch_dtype"] == "float16"  # the target's (not the default)
    assert cfg["max_position_embeddings"] >= tc.max_position_embeddings  # else the target's context length is refused
    # load_weights stacks q/k/v into qkv_proj and gate/up into gate_up_proj; no embed_tokens/lm_head (the target's)
    L = cfg["num_hidden_layers"]
    theirs = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{n}.weight" for i in range(L) for n in (
            "input_layernorm", "post_attention_layernorm", "self_attn.qkv_proj", "self_attn.o_proj",
            "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_up_proj", "mlp.down_proj")}
    stacked = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
               "up_proj": "gate_up_proj"}
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
        fc_shape = f.get_slice("fc.weight").get_shape()
    ours = {".".join(stacked.get(part, part) for part in n.split(".")) for n in names}
    assert ours - theirs == {"draft_vocab"}  # the one tensor SGLang does not know (skipped: full-vocab drafts)
    assert theirs <= ours  # nothing SGLang builds is left at its random init
    assert fc_shape == [cfg["hidden_size"], len(dc["target_layer_ids"]) * cfg["hidden_size"]]
    # The real target (SmolLM2's config says float32) gives its own dtype; a vocabulary holding <|MASK|> gives
    # that token as the mask (SGLang refuses a different id then).
    from transformers import AutoConfig

    from services.trainer.model import dtype_name

    assert dtype_name(AutoConfig.from_pretrained(target_dir, local_files_only=True)) == "float32"
    tok = copy.deepcopy(load_tokenizer(str(target_dir)))
    assert resolve_mask_token_id(tok, len(tok)) == tok.unk_token_id  # none: SmolLM2's unk
    tok.add_special_tokens({"additional_special_tokens": [SGLANG_MASK_TOKEN]})
    assert resolve_mask_token_id(tok, len(tok)) == tok.convert_tokens_to_ids(SGLANG_MASK_TOKEN) == len(tok) - 1


def test_draft_vocab_restricts_proposals_and_survives_save_load(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from services.trainer.build import draft_vocab_ids
    from shared.records import TokenizedSample

    tc = SimpleNamespace(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, vocab_size=50, num_hidden_layers=8, rms_norm_eps=1e-5, rope_theta=1e4,
                         max_position_embeddings=128)
    d = DFlashDrafter.for_target(tc, num_layers=1, block_size=4, layer_ids=[1, 5], mask_token_id=0)
    # supervised ids: 7 ×3, 3 ×2, 9 ×2, 4 ×1; the unsupervised 1s never count
    samples = [TokenizedSample(prompt_id="a", input_ids=[1, 1, 1, 7, 7, 3, 9], loss_mask=[0, 0, 0, 1, 1, 1, 1],
                               num_tokens=7, num_supervised=4),
               TokenizedSample(prompt_id="b", input_ids=[1, 7, 3, 9, 4], loss_mask=[0, 1, 1, 1, 1],
                               num_tokens=5, num_supervised=4)]
    vocab = draft_vocab_ids(samples, 3, tc.vocab_size)
    assert vocab.tolist() == [3, 7, 9]  # the three most frequent (7, 3, 9), sorted
    d.set_draft_vocab(vocab)
    assert d.vocab_rows(torch.tensor([9, 4, 3, 7])).tolist() == [2, -1, 0, 1]
    head = torch.nn.Linear(32, tc.vocab_size, bias=False)
    hidden = torch.randn(20, 32)
    proposals = d.propose(hidden, head)
    assert set(proposals.tolist()) <= {3, 7, 9}
    assert torch.equal(proposals, vocab[(hidden @ head.weight[vocab].T).argmax(-1)])
    d.save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["dflash_config"]["draft_vocab_size"] == 3
    loaded = DFlashDrafter.load(tmp_path)
    assert torch.equal(loaded.draft_vocab, vocab) and torch.equal(loaded.propose(hidden, head), proposals)
    with pytest.raises(ValueError, match="draft vocabulary"):
        d.set_draft_vocab(torch.arange(tc.vocab_size))


# --- training on the live stack -------------------------------------------------------------------


def _records(run: str, n: int, first: int = 0) -> list[CompletionRecord]:
    lines = (Path(__file__).parents[1] / "services/pipeline/data/prompts.jsonl").read_text().splitlines()[first:first + n]
    prompts = [r["messages"][-1]["content"] if "messages" in r else r["prompt"] for r in map(json.loads, lines)]
    return [CompletionRecord(run=run, prompt_id=f"p{i:04d}", messages=[ChatMessage(role="user", content=p)],
                             completion=ANSWERS[i % len(ANSWERS)], completion_tokens=20)
            for i, p in enumerate(prompts, start=first)]


def publish_tokenized(stack, run: str, n: int = 30, first: int = 0, source_key: str = "-") -> int:
    """Tokenize real records with the real SmolLM2 template, write them as a shard, announce it (as
    built from the completion shard `source_key`)."""
    from services.tokenizer.fingerprint import load_target_tokenizer, template_fingerprint
    from services.tokenizer.samples import SampleBuilder

    cfg = make_config(stack, run, trainer={"block_size": TINY["block_size"]})
    tok = load_target_tokenizer(cfg)
    built = SampleBuilder(tok, cfg).build(_records(run, n, first))
    assert len(built.samples) == n
    fp = template_fingerprint(tok, cfg)
    key = f"runs/{run}/tokenized/{fp}/w0-{first:08d}.parquet"
    data = samples_to_parquet(built.samples)
    Store.open(cfg).put_bytes(key, data)

    async def announce() -> None:
        import hashlib

        async with await Bus.connect(cfg.bus, "pytest", deadline_s=10) as bus:
            await bus.ensure_streams()
            await bus.publish(Subjects.tokenized(run), TokenizedShard(
                run=run, key=key, source_key=source_key, fingerprint=fp, num_samples=n,
                num_tokens=sum(s.num_tokens for s in built.samples),
                num_supervised=sum(s.num_supervised for s in built.samples), sha256=hashlib.sha256(data).hexdigest()),
                msg_id=key)

    asyncio.run(announce())
    return n


def _env(stack_env: dict, **over: object) -> dict:
    env = dict(stack_env)
    env.update({f"DFLASH_TRAINER__{k.upper()}": str(v) for k, v in {**TINY, **over}.items()})
    env["DFLASH_MODEL__DEVICE"] = "cpu"
    return env


def _spawn(env: dict, run: str, log: Path, *cmd: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "shared.cli", *cmd, "--run", run], env=env,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)


def trainer_progress(stack, run: str) -> list[TrainerProgress]:
    """Every TrainerProgress the run's trainer has published, in order."""
    cfg = make_config(stack, run)

    async def read() -> list[TrainerProgress]:
        async with await Bus.connect(cfg.bus, "pytest", deadline_s=10) as bus:
            return [p async for _, p in bus.read_log("PROGRESS", Subjects.progress(run, "train", "trainer"), 1)
                    if isinstance(p, TrainerProgress)]

    return asyncio.run(read())


def progress_history(stack, run: str) -> dict[int, TrainerProgress]:
    """The last TrainerProgress published for each step (a resumed run publishes the redone steps again)."""
    return {p.step: p for p in trainer_progress(stack, run) if p.state == "running"}


def _latest_step(store: Store, run: str) -> int:
    from services.pipeline.chaos import checkpoint_step

    return checkpoint_step(store, run) or 0


def kill9_after_first_checkpoint_then_resume(stack, env: dict, store: Store, run: str, log: Path, *,
                                             timeout_s: float) -> None:
    """Train `run`, kill -9 it once its first checkpoint (step 3) is in S3 and that step's progress is published
    (the trainer publishes a step's progress after its checkpoint: a kill between the two would lose the step from
    the history the callers compare), start it again, and check that the second process resumed from that
    checkpoint and finished."""
    b = _spawn(env, run, log, "train")
    deadline = time.monotonic() + timeout_s
    while _latest_step(store, run) < 3 or max((p.step for p in trainer_progress(stack, run)), default=0) < 3:
        assert b.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)
    os.killpg(b.pid, signal.SIGKILL)
    b.wait()
    killed_at, checkpoint = time.time(), _latest_step(store, run)
    assert checkpoint < TINY["max_steps"]
    b2 = _spawn(env, run, log, "train")
    assert b2.wait(timeout=timeout_s) == 0, log.read_text()[-3000:]
    after = [p for p in trainer_progress(stack, run) if p.ts > killed_at]
    second = [p.step for p in after if p.state == "running"]
    assert second[0] == checkpoint + 1, second  # the second process went on from the checkpoint, not from step 1
    # its first word says so (the heartbeat's first publish), and every later one counts the resume
    assert after[0].state == "resumed" and after[0].step == checkpoint, after[0]
    assert {p.resumes for p in after} == {1} and after[-1].state == "done", after[-1]


def test_train_kill9_resume_is_exact_and_eval_is_lossless(stack, stack_env, tmp_path: Path) -> None:
    run_a, run_b = new_run(), new_run()
    publish_tokenized(stack, run_a)
    publish_tokenized(stack, run_b)
    store = Store.open(make_config(stack, run_a))

    # Both from the target's layers and with a draft vocabulary smaller than the answers' distinct
    # tokens (64 ids hold 82% of these labels): chosen from the data, restored on resume, used by the
    # eval. (From a random init, eight steps over 64 rows are too noisy to show learning.)
    env = _env(stack_env, draft_vocab=64, init="target")
    # A: uninterrupted
    a = _spawn(env, run_a, tmp_path / "a.log", "train")
    assert a.wait(timeout=600) == 0, (tmp_path / "a.log").read_text()[-3000:]

    # B: kill -9 right after the first checkpoint, then restart
    kill9_after_first_checkpoint_then_resume(stack, env, store, run_b, tmp_path / "b.log", timeout_s=600)

    ha, hb = progress_history(stack, run_a), progress_history(stack, run_b)
    assert sorted(ha) == sorted(hb) == list(range(1, TINY["max_steps"] + 1))
    for step in ha:
        assert hb[step].loss == pytest.approx(ha[step].loss, rel=1e-4, abs=1e-5), step
        assert hb[step].samples_seen == ha[step].samples_seen, step  # counters survive the restart too
    losses = [ha[s].loss for s in sorted(ha)]
    assert min(losses[-2:]) < losses[0] * 0.9, losses  # it learns
    last = ha[TINY["max_steps"]]
    assert len(last.position_accuracy) == TINY["block_size"] - 1
    assert last.tokens_per_s > 0 and 0 < last.target_forward_share < 1
    assert last.checkpoint_key == Keys.checkpoint(run_a, TINY["max_steps"])
    assert store.exists(Keys.checkpoint(run_a, TINY["max_steps"]) + "drafter/model.safetensors")
    drafter_cfg = json.loads(store.get_bytes(Keys.checkpoint(run_a, TINY["max_steps"]) + "drafter/config.json"))
    assert drafter_cfg["dflash_config"]["draft_vocab_size"] == 64
    assert drafter_cfg["torch_dtype"] == "float32"  # SmolLM2's config.json, not a default

    # A resume keeps what the weights were trained with, where today's rules would pick another mask token.
    from services.trainer.loop import Trainer

    async def resume_with_another_mask() -> int:
        cfg = make_config(stack, run_a, trainer={**TINY, "draft_vocab": 64, "init": "target"}, model={"device": "cpu"})
        async with await Bus.connect(cfg.bus, "pytest", deadline_s=10) as bus:
            trainer = await asyncio.to_thread(Trainer, cfg, bus, store)
            trainer.drafter.config.mask_token_id += 1
            assert await asyncio.to_thread(trainer.load_latest)
            return trainer.drafter.config.mask_token_id

    assert asyncio.run(resume_with_another_mask()) == drafter_cfg["dflash_config"]["mask_token_id"]

    # ... and refuses, by name, a config that describes another drafter than the checkpoint holds.
    async def resume_with_another_block_size() -> None:
        cfg = make_config(stack, run_a, trainer={**TINY, "block_size": 4, "draft_vocab": 64, "init": "target"},
                          model={"device": "cpu"})
        async with await Bus.connect(cfg.bus, "pytest", deadline_s=10) as bus:
            trainer = await asyncio.to_thread(Trainer, cfg, bus, store)
            await asyncio.to_thread(trainer.load_latest)

    with pytest.raises(ValueError, match="block_size: 8 → 4"):
        asyncio.run(resume_with_another_block_size())

    # eval: real speculative decoding with the trained drafter, checked against plain greedy
    ev = subprocess.run([sys.executable, "-m", "shared.cli", "eval", "--run", run_a], env=env,
                        capture_output=True, text=True, timeout=600)
    assert ev.returncode == 0, ev.stdout + ev.stderr
    import msgspec

    report = msgspec.json.decode(store.get_bytes(Keys.eval_report(run_a)), type=EvalReport)
    assert report.lossless and report.mismatches == 0 and report.prompts == TINY["eval_prompts"]
    assert report.tau >= 1.0 and sum(report.acceptance_histogram) > 0
    assert report.acceptance_histogram[0] == 0  # every cycle yields at least the bonus token
    assert "τ =" in ev.stdout


def test_torchrun_two_ranks_on_gloo_match_one_process(stack, stack_env, tmp_path: Path) -> None:
    """2 CPU ranks (gloo) with grad_accum 1 take the same optimizer steps as 1 process with grad_accum 2:
    the same micro-batches, the gradients summed across ranks, the same losses."""
    run_one, run_two = new_run(), new_run()
    publish_tokenized(stack, run_one)
    publish_tokenized(stack, run_two)
    # fp32: the test is of the data-parallel arithmetic; bf16 rounding would amplify the different
    # summation order of an all-reduce into loss differences that say nothing about it
    # scheduled by epochs, not max_steps: both schedules must count every rank's micro-batches
    steps = {"max_steps": 0, "epochs": 1, "checkpoint_every": 4, "token_budget": 200, "autocast": "off"}
    one = _spawn(_env(stack_env, grad_accum=2, **steps), run_one, tmp_path / "one.log", "train")
    assert one.wait(timeout=600) == 0, (tmp_path / "one.log").read_text()[-3000:]
    env = {**_env(stack_env, grad_accum=1, **steps), "DFLASH_RUN": run_two}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "shared.cli", "train"], env=env, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, (two.stdout + two.stderr)[-4000:]
    h1, h2 = progress_history(stack, run_one), progress_history(stack, run_two)
    assert sorted(h1) == sorted(h2) == list(range(1, len(h1) + 1)) and len(h1) >= 4
    for step in h1:
        assert h2[step].total_steps == h1[step].total_steps == len(h1), step  # the schedule is the steps taken
        assert h2[step].loss == pytest.approx(h1[step].loss, rel=1e-4), step
        assert h2[step].samples_seen == h1[step].samples_seen
    store = Store.open(make_config(stack, run_two))
    assert store.exists(Keys.checkpoint(run_two, 4) + "drafter/model.safetensors")  # written once, by rank 0


def test_trainer_started_before_data_takes_it_from_its_durable_consumer(stack, stack_env, tmp_path: Path) -> None:
    """Started with nothing tokenized yet, the trainer waits on its durable consumer `train-<run>`,
    trains once a shard is announced, and acks the announcement only with a checkpoint that holds it."""
    from shared.bus import consumer_for

    run = new_run()
    cfg = make_config(stack, run)
    spec = consumer_for("train", run)

    async def consumer():
        async with await Bus.connect(cfg.bus, "pytest", deadline_s=10) as bus:
            try:
                return await bus.js.consumer_info(spec.stream, spec.durable)
            except Exception:
                return None

    env = {**_env(stack_env, max_steps=4, checkpoint_every=2), "DFLASH_VIEW__LOG_EVERY_S": "0"}  # a line a step
    proc = _spawn(env, run, tmp_path / "t.log", "train")
    deadline = time.monotonic() + 120
    while asyncio.run(consumer()) is None:  # the trainer is up and consuming, with no data yet
        assert proc.poll() is None, (tmp_path / "t.log").read_text()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.5)
    _wait_for_progress(stack, run, proc, tmp_path / "t.log", lambda h: any(p.state == "waiting for data" for p in h))
    assert proc.poll() is None and _latest_step(Store.open(cfg), run) == 0  # waiting, not failed
    publish_tokenized(stack, run)
    assert proc.wait(timeout=600) == 0, (tmp_path / "t.log").read_text()[-3000:]

    info = asyncio.run(consumer())
    assert info.num_pending == 0 and info.num_ack_pending == 0  # taken and acked
    assert info.ack_floor.stream_seq == info.delivered.stream_seq
    store = Store.open(cfg)

    prefix = json.loads(store.get_bytes(Keys.checkpoint_latest(run)))["key"]
    state = torch.load(io.BytesIO(store.get_bytes(prefix + "state.pt")), weights_only=False)
    assert [k.split("/")[2] for k in state["cursor"]["shards"]] == ["tokenized"]  # the shard table, in the checkpoint
    assert state["step"] == 4 and progress_history(stack, run)[4].total_steps == 4
    # a long stage never looks stuck: each report after the first step has its rate and ETA, and the log says them
    history = progress_history(stack, run)
    assert all(history[s].steps_per_s > 0 and history[s].eta_s is not None for s in (2, 3, 4)), history
    assert history[4].eta_s == 0.0 and "step 4 of 4 (epoch" in (tmp_path / "t.log").read_text()


def test_data_arriving_mid_run_joins_the_next_epoch_and_stretches_the_schedule(stack, stack_env, tmp_path: Path) -> None:
    """Scheduled by epochs over the first shard; a second shard announced while the first epochs run joins
    at the next boundary, and the schedule grows to the remaining epochs over all the data instead of
    stopping at the total scheduled for the first shard alone."""
    run = new_run()
    publish_tokenized(stack, run, 30)
    proc = _spawn(_env(stack_env, max_steps=0, epochs=3, token_budget=150, checkpoint_every=100, progress_every=1),
                  run, tmp_path / "t.log", "train")
    deadline = time.monotonic() + 300
    while not (history := progress_history(stack, run)):
        assert proc.poll() is None, (tmp_path / "t.log").read_text()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.5)
    first = history[min(history)]
    publish_tokenized(stack, run, 30, first=30)
    assert proc.wait(timeout=600) == 0, (tmp_path / "t.log").read_text()[-3000:]
    history = progress_history(stack, run)
    last = history[max(history)]
    assert first.epoch == 0 and last.epoch == 2, (first, last)
    assert last.total_steps > first.total_steps and max(history) > first.total_steps, (first, last)
    assert f"total steps {first.total_steps} → {last.total_steps}" in (tmp_path / "t.log").read_text()


def _feed(stack, stack_env: dict, run: str, tmp_path: Path, n: int = 4) -> list[str]:
    """`dfpipe feed` of n prompts (the run's manifest says n accepted); their prompt ids."""
    from shared.messages import PromptTask

    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"Name {i + 2} colours."}) + "\n" for i in range(n)))
    subprocess.run([sys.executable, "-m", "shared.cli", "feed", str(src), "--run", run], env=stack_env, check=True,
                   capture_output=True)

    async def ids() -> list[str]:
        async with await Bus.connect(make_config(stack, run).bus, "pytest", deadline_s=10) as bus:
            return [t.prompt_id async for _, t in bus.read_log("PROMPTS", Subjects.prompts(run), 1, PromptTask)]

    return asyncio.run(ids())


def _publish_generated(stack, run: str, prompt_ids: list[str]) -> str:
    """A completion shard's announcement covering `prompt_ids` (the generator's ShardWritten); its key."""
    from shared.messages import ShardWritten

    key = f"runs/{run}/completions/w0-00000000.parquet"

    async def announce() -> None:
        async with await Bus.connect(make_config(stack, run).bus, "pytest", deadline_s=10) as bus:
            await bus.publish(Subjects.shards(run), ShardWritten(
                run=run, key=key, worker="w0", seq=0, num_records=len(prompt_ids), prompt_ids=prompt_ids,
                sha256="0" * 64, size_bytes=1), msg_id=key)

    asyncio.run(announce())
    return key


def _checkpoint_state(stack, run: str) -> dict:

    store = Store.open(make_config(stack, run))
    prefix = json.loads(store.get_bytes(Keys.checkpoint_latest(run)))["key"]
    return torch.load(io.BytesIO(store.get_bytes(prefix + "state.pt")), weights_only=False)


def _waiting_after_a_pass(history: list[TrainerProgress]) -> bool:
    states = [p.state for p in history]
    return "running" in states and "waiting for data" in states[states.index("running"):]


def _wait_for_progress(stack, run: str, proc: subprocess.Popen, log: Path,
                       until: Callable[[list[TrainerProgress]], bool], timeout_s: float = 300) -> None:
    """Until the trainer's published progress satisfies `until` (its heartbeat publishes its state every 10 s);
    the deadline only turns a hang into a failure."""
    deadline = time.monotonic() + timeout_s
    while not until(trainer_progress(stack, run)):
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(1.0)


def test_epochs_are_counted_over_the_whole_data_once_generation_is_done(stack, stack_env, tmp_path: Path) -> None:
    """A trainer started while the run still generates (prompts fed, not all completed) trains on the
    shard there is, but that pass is not an epoch: it then waits for new data instead of finishing its
    epochs on a fraction of the run. Once every prompt is generated and tokenized, the epochs run over
    all of it."""
    run = new_run()
    fed = _feed(stack, stack_env, run, tmp_path)
    publish_tokenized(stack, run, 30)  # tokenized before generation is done
    log = tmp_path / "t.log"
    proc = _spawn(_env(stack_env, max_steps=0, epochs=2, token_budget=150, checkpoint_every=100,
                       wait_for_data_s=600), run, log, "train")
    _wait_for_progress(stack, run, proc, log, _waiting_after_a_pass)  # one pass made, then waiting: not done
    assert proc.poll() is None  # after 2 passes' worth
    partial = progress_history(stack, run)
    assert {p.epoch for p in partial.values()} == {0}, partial

    source = _publish_generated(stack, run, fed)  # every fed prompt completed ...
    publish_tokenized(stack, run, 30, first=30, source_key=source)  # ... and its shard tokenized: complete
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    history = progress_history(stack, run)
    last = history[max(history)]
    cursor = _checkpoint_state(stack, run)["cursor"]
    # The uncounted pass, then 2 epochs over all the data. (A second uncounted pass, over all of it, when
    # the trainer took the last shard between its completeness check and its read of the shard list.)
    assert cursor["partial"] in (1, 2) and cursor["complete"], cursor
    assert {p.epoch for p in history.values()} == set(range(cursor["partial"] + 2)), history
    assert last.total_steps > max(partial) and max(history) == last.total_steps


def test_data_that_stops_growing_unfinished_is_trained_on_after_wait_for_data_s(stack, stack_env, tmp_path: Path) -> None:
    """Generators gone with prompts left: after `wait_for_data_s` without a new shard the trainer says
    so and runs its epochs over the data there is, instead of waiting for ever."""
    run = new_run()
    _feed(stack, stack_env, run, tmp_path)
    publish_tokenized(stack, run, 30)
    log = tmp_path / "t.log"
    proc = _spawn(_env(stack_env, max_steps=0, epochs=1, token_budget=150, checkpoint_every=100, wait_for_data_s=4),
                  run, log, "train")
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    history = progress_history(stack, run)
    assert {p.epoch for p in history.values()} == {0, 1}
    cursor = _checkpoint_state(stack, run)["cursor"]
    # one uncounted pass, then the epoch over the data there is, taken as the whole (the fed prompts were never generated)
    assert cursor["partial"] == 1 and cursor["complete"], cursor


def test_an_unreadable_tokenized_shard_is_a_dead_letter_and_training_goes_on(stack, stack_env, tmp_path: Path) -> None:
    """A tokenized shard announced but not readable (truncated, corrupt, another schema) is dead-lettered by
    the trainer with the reason when it is announced; the good shards are trained on, and the bad key never
    enters the checkpoint's shard table (before, it failed every pass: a crash loop)."""
    import hashlib

    run = new_run()
    cfg = make_config(stack, run)
    publish_tokenized(stack, run)
    bad_key = f"runs/{run}/tokenized/ffff/w9-00000000.parquet"
    garbage = b"PAR1" + bytes(range(64))  # a Parquet file cut short: the magic, then no footer
    Store.open(cfg).put_bytes(bad_key, garbage)

    async def announce_bad() -> None:
        async with await Bus.connect(cfg.bus, "pytest", deadline_s=10) as bus:
            await bus.publish(Subjects.tokenized(run), TokenizedShard(
                run=run, key=bad_key, source_key="bad", fingerprint="ffff", num_samples=3, num_tokens=30,
                num_supervised=12, sha256=hashlib.sha256(garbage).hexdigest()), msg_id=bad_key)

    asyncio.run(announce_bad())
    proc = _spawn(_env(stack_env, max_steps=2, checkpoint_every=2), run, tmp_path / "t.log", "train")
    assert proc.wait(timeout=600) == 0, (tmp_path / "t.log").read_text()[-3000:]

    async def letters():
        async with await Bus.connect(cfg.bus, "pytest", deadline_s=10) as bus:
            return await bus.dead_letters(run, "train")

    dead = [d for _, d in asyncio.run(letters())]
    assert len(dead) == 1 and bad_key in dead[0].error and "not a readable tokenized shard" in dead[0].error
    store = Store.open(cfg)

    prefix = json.loads(store.get_bytes(Keys.checkpoint_latest(run)))["key"]
    state = torch.load(io.BytesIO(store.get_bytes(prefix + "state.pt")), weights_only=False)
    assert state["step"] == 2 and bad_key not in state["cursor"]["shards"] and len(state["cursor"]["shards"]) == 1
