"""DFlash 2 drafters: the convolution and the selector against direct computations at tiny size, the
checkpoint layout and the refusals of checkpoints we cannot read, and (on the live stack with the real
SmolLM2 target) a short training run whose checkpoint resumes exactly after kill -9, decodes
losslessly in `dfpipe eval`, and loads in z-lab's reference `DFlash2DraftModel` with equal outputs and
acceptance lengths under the reference's `dflash_generate`.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from transformers import Qwen3Config

from services.trainer.drafters import load_drafter, new_drafter
from services.trainer.loss import head_cross_entropy, head_cross_entropy_top_k
from services.trainer.model import DFlashDrafter
from services.trainer.model_dflash2 import DFlash2Drafter, GroupedDynamicCausalConv
from shared.bus import Bus
from shared.config import TrainerConfig
from shared.messages import EvalReport
from shared.store import Store
from shared.topology import Keys
from tests.conftest import make_config, new_run
from tests.test_trainer import (
    TINY,
    _env,
    _spawn,
    kill9_after_first_checkpoint_then_resume,
    progress_history,
    publish_tokenized,
)

TINY_TARGET = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, vocab_size=120, max_position_embeddings=256)


def tiny_drafter(**over: int) -> DFlash2Drafter:
    kw = {"num_layers": 2, "block_size": 4, "layer_ids": [1, 4], "mask_token_id": 0, "conv_kernel_size": 3,
          "conv_group_size": 8, "selector_rank": 6, "selector_top_k": 5, **over}
    torch.manual_seed(0)
    d = DFlash2Drafter.for_target(TINY_TARGET, **kw)
    with torch.no_grad():  # away from the identity / zero init, so every term of the formulas counts
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return d.eval()


# --- parity with direct computations ----------------------------------------------------------------


def test_convolution_matches_a_direct_loop_and_stays_inside_each_block() -> None:
    d = tiny_drafter()
    conv: GroupedDynamicCausalConv = d.layers[0].attention_conv
    B, D, taps, group = 4, 32, 3, 8
    x, y = torch.randn(3 * B, D), torch.randn(3 * B, D)  # three blocks of four slots
    with torch.no_grad():
        got_x, dyn = conv.prepare(x)
        got_y = conv.finish(y, dyn)
        # direct: out[t, c] = Σ_o (base[o, c] + W[(half, o, c // group)] · x[t]) · x[t − o], within t's block
        W = conv.kernel_projection.weight.view(2, taps, D // group, D)
        want_x, want_y = torch.zeros_like(x), torch.zeros_like(y)
        for q in range(3 * B):
            start = q - q % B
            for o in range(taps):
                if q - o < start:
                    continue
                for c in range(D):
                    k0 = conv.base_kernel[0, o, c] + W[0, o, c // group] @ x[q]
                    k1 = conv.base_kernel[1, o, c] + W[1, o, c // group] @ x[q]  # finish's kernel: from the input
                    want_x[q, c] += k0 * x[q - o, c]
                    want_y[q, c] += k1 * y[q - o, c]
    torch.testing.assert_close(got_x, want_x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_y, want_y, rtol=1e-5, atol=1e-5)
    # a fresh convolution is the identity: an untrained DFlash 2 layer computes what a DFlash layer does
    fresh = GroupedDynamicCausalConv(d.config)
    with torch.no_grad():
        h, dyn = fresh.prepare(x)
        assert torch.equal(h, x) and torch.equal(fresh.finish(y, dyn), y)


def test_selector_walk_and_loss_match_a_direct_computation() -> None:
    d = tiny_drafter()
    sel = d.candidate_selector
    T, K = 3, 5
    hidden, logits, anchor = torch.randn(T, 32), torch.randn(T, 120) * 3, torch.tensor(17)
    with torch.no_grad():
        tokens, candidates, q = sel.walk(hidden, logits, anchor)
        assert q is None
        A, Bc, H = sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight
        previous, want = 17, []
        for t in range(T):
            best, best_score = None, -float("inf")
            for v in logits[t].topk(K).indices.tolist():  # the K best tokens of the slot
                score = float(logits[t, v]) + sum(float(A[previous, i] * (H[i] @ hidden[t]) * Bc[v, i])
                                                  for i in range(A.shape[1]))
                if score > best_score:
                    best, best_score = v, score
            want.append(best)
            previous = best
        assert tokens.tolist() == want
        assert set(candidates[0].tolist()) == set(logits[0].topk(K).indices.tolist())
        # the pair term matters at these weights: the walk is not the plain argmax everywhere
        hidden2 = hidden * 30
        assert sel.walk(hidden2, logits, anchor)[0].tolist() != logits.argmax(-1).tolist()

        # teacher-forced loss: previous = gold of the slot before; a gold outside the top K is left out
        unary, cands = logits.topk(K, -1)
        labels = torch.tensor([int(cands[0, 2]), int(cands[1, 0]), int(logits[2].argmin())])
        previous = torch.tensor([17, int(labels[0]), int(labels[1])])
        w = torch.tensor([1.0, 0.5, 0.25])
        total, hits, found = sel.loss(hidden, previous, unary, cands, labels, w)
        assert found.tolist() == [True, True, False]
        scores = unary + torch.stack([sel.pair_scores(hidden[i:i + 1], previous[i:i + 1], cands[i:i + 1])[0]
                                      for i in range(T)])
        want_total = sum(w[i] * -torch.log_softmax(scores[i], -1)[(cands[i] == labels[i]).nonzero()[0, 0]]
                         for i in range(2))
        torch.testing.assert_close(total, want_total)
        assert hits.tolist() == [bool(scores[0].argmax() == 2), bool(scores[1].argmax() == 0), False]

    # a fresh selector (zero projection) walks exactly DFlash's argmax
    fresh = DFlash2Drafter.for_target(TINY_TARGET, num_layers=1, block_size=4, layer_ids=[1, 4], mask_token_id=0,
                                      conv_group_size=8, selector_rank=6, selector_top_k=5)
    head = torch.nn.Linear(32, 120, bias=False)
    with torch.no_grad():
        assert torch.equal(fresh.propose(hidden, head, anchor=anchor), head(hidden).argmax(-1))


def test_fused_head_loss_returns_the_top_k_of_its_logits() -> None:
    torch.manual_seed(1)
    hidden, head = torch.randn(37, 16, requires_grad=True), torch.randn(90, 16)
    labels, w = torch.randint(0, 90, (37,)), torch.rand(37)
    loss, hits, values, ids = head_cross_entropy_top_k(hidden, head, labels, w, 6, chunk=10)
    want = (hidden @ head.T).topk(6, -1)
    torch.testing.assert_close(values, want.values.detach())
    assert torch.equal(ids, want.indices)
    plain, plain_hits = head_cross_entropy(hidden, head, labels, w, chunk=10)
    assert torch.equal(loss, plain) and torch.equal(hits, plain_hits)


# --- checkpoints: the reference's layout, and what is refused ----------------------------------------


def test_checkpoint_layout_is_the_references_and_unreadable_ones_are_refused_by_name(tmp_path: Path) -> None:
    d = tiny_drafter()
    d.save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert {k: cfg["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                 "selector_top_k")} == {"conv_kernel_size": 3, "conv_group_size": 8,
                                                                        "selector_rank": 6, "selector_top_k": 5}
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert shapes["candidate_selector.predecessor_codebook"] == (120, 6)  # bare tensors, no `.weight`
    assert shapes["candidate_selector.successor_codebook"] == (120, 6)
    assert shapes["candidate_selector.hidden_projection.weight"] == (6, 32)
    assert shapes["layers.1.attention_conv.base_kernel"] == (2, 3, 32)
    assert shapes["layers.1.mlp_conv.kernel_projection.weight"] == (2 * 3 * 4, 32)
    assert not any("embed" in k or "lm_head" in k for k in shapes)
    loaded = load_drafter(tmp_path)
    assert type(loaded) is DFlash2Drafter
    for k, v in d.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k

    def rewrite(change) -> None:
        c = json.loads(json.dumps(cfg))
        change(c)
        (tmp_path / "config.json").write_text(json.dumps(c))

    rewrite(lambda c: c.update(architectures=["EagleDraftModel"]))
    with pytest.raises(ValueError, match=r"architectures \['EagleDraftModel'\] is not one this trainer knows"):
        load_drafter(tmp_path)
    rewrite(lambda c: c["dflash_config"].pop("selector_rank"))
    with pytest.raises(ValueError, match=r"DFlash2DraftModel config lacks dflash_config\.selector_rank"):
        load_drafter(tmp_path)
    rewrite(lambda c: c.update(architectures=["DFlashDraftModel"]) or c["dflash_config"].pop("target_layer_ids"))
    with pytest.raises(ValueError, match=r"DFlashDraftModel config lacks dflash_config\.target_layer_ids"):
        load_drafter(tmp_path)
    # a DFlash checkpoint still opens as one
    DFlashDrafter.for_target(TINY_TARGET, num_layers=1, block_size=4, layer_ids=[1, 4], mask_token_id=0).save(tmp_path)
    assert type(load_drafter(tmp_path)) is DFlashDrafter


def test_trainer_settings_that_dflash2_cannot_take_are_named() -> None:
    kw = {"num_layers": 1, "block_size": 4, "layer_ids": [1, 4], "mask_token_id": 0}
    with pytest.raises(ValueError, match=r"trainer\.conv_group_size = 5 does not divide hidden_size = 32"):
        new_drafter(TrainerConfig(arch="dflash2", conv_group_size=5), TINY_TARGET, **kw)
    with pytest.raises(ValueError, match=r"trainer\.draft_vocab is for trainer\.arch = dflash only"):
        new_drafter(TrainerConfig(arch="dflash2", draft_vocab=10), TINY_TARGET, **kw)
    assert type(new_drafter(TrainerConfig(arch="dflash2", conv_group_size=8), TINY_TARGET, **kw)) is DFlash2Drafter


# --- the live stack: training, exact resume, eval, and the reference ---------------------------------

# the released drafters' convolution (2 taps, groups of 16); a small selector keeps the test quick
DFLASH2 = {"arch": "dflash2", "selector_rank": 32, "selector_top_k": 8, "init": "target"}


@pytest.fixture(scope="module")
def trained(stack, stack_env, tmp_path_factory) -> dict:
    """A tiny DFlash 2 drafter trained for TINY's 8 steps on the real SmolLM2 target, uninterrupted."""
    run = new_run()
    publish_tokenized(stack, run)
    log = tmp_path_factory.mktemp("dflash2") / "a.log"
    a = _spawn(_env(stack_env, **DFLASH2), run, log, "train")
    assert a.wait(timeout=900) == 0, log.read_text()[-3000:]
    return {"run": run, "store": Store.open(make_config(stack, run))}


def test_dflash2_trains_resumes_exactly_after_kill9_and_evals_losslessly(stack, stack_env, trained,
                                                                         tmp_path: Path) -> None:
    run_a, store = trained["run"], trained["store"]
    run_b = new_run()
    publish_tokenized(stack, run_b)
    env = _env(stack_env, **DFLASH2)
    kill9_after_first_checkpoint_then_resume(stack, env, store, run_b, tmp_path / "b.log", timeout_s=900)

    ha, hb = progress_history(stack, run_a), progress_history(stack, run_b)
    assert sorted(ha) == sorted(hb) == list(range(1, TINY["max_steps"] + 1))
    for step in ha:
        assert hb[step].loss == pytest.approx(ha[step].loss, rel=1e-4, abs=1e-5), step
    losses = [ha[s].loss for s in sorted(ha)]
    assert min(losses[-2:]) < losses[0] * 0.9, losses  # it learns (DFlash loss + selector loss)
    last = ha[TINY["max_steps"]]
    assert len(last.position_accuracy) == TINY["block_size"] - 1
    ckpt = Keys.checkpoint(run_a, TINY["max_steps"])
    hf = json.loads(store.get_bytes(ckpt + "drafter/config.json"))
    assert hf["architectures"] == ["DFlash2DraftModel"]
    assert hf["dflash_config"]["selector_top_k"] == 8 and hf["dflash_config"]["conv_group_size"] == 16

    # a resume under the other arch is refused by name, before any tensor is read
    from services.trainer.loop import Trainer

    async def resume_as(arch: str) -> None:
        cfg = make_config(stack, run_a, trainer={**TINY, **DFLASH2, "arch": arch}, model={"device": "cpu"})
        async with await Bus.connect(cfg.bus, "pytest", deadline_s=10) as bus:
            trainer = await asyncio.to_thread(Trainer, cfg, bus, store)
            await asyncio.to_thread(trainer.load_latest)

    with pytest.raises(ValueError, match=r"is a DFlash2DraftModel, the config \(trainer.arch = dflash\) a DFlashDraftModel"):
        asyncio.run(resume_as("dflash"))

    # eval: the selector's walk drafts, the target verifies; the output is the target's greedy output
    ev = subprocess.run([sys.executable, "-m", "shared.cli", "eval", "--run", run_a], env=env,
                        capture_output=True, text=True, timeout=900)
    assert ev.returncode == 0, ev.stdout + ev.stderr
    report = msgspec.json.decode(store.get_bytes(Keys.eval_report(run_a)), type=EvalReport)
    assert report.lossless and report.mismatches == 0 and report.prompts == TINY["eval_prompts"]
    assert report.tau >= 1.0 and report.acceptance_histogram[0] == 0

    # eval and resume refuse, by name, a checkpoint whose dflash_config lacks a key DFlash 2 needs
    ckpt_b = json.loads(store.get_bytes(f"runs/{run_b}/checkpoints/latest.json"))["key"]
    broken = json.loads(store.get_bytes(ckpt_b + "drafter/config.json"))
    del broken["dflash_config"]["conv_kernel_size"]
    store.put_bytes(ckpt_b + "drafter/config.json", json.dumps(broken).encode(), "application/json")
    ev = subprocess.run([sys.executable, "-m", "shared.cli", "eval", "--run", run_b], env=env,
                        capture_output=True, text=True, timeout=900)
    assert ev.returncode != 0
    assert f"run {run_b}: checkpoint {ckpt_b}: the DFlash2DraftModel config lacks dflash_config.conv_kernel_size" \
        in ev.stderr, ev.stderr[-2000:]
    resumed = subprocess.run([sys.executable, "-m", "shared.cli", "train", "--run", run_b], env=env,
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode != 0 and "lacks dflash_config.conv_kernel_size" in resumed.stderr, resumed.stderr[-2000:]


def test_reference_dflash2_loads_the_checkpoint_and_decodes_as_our_eval(stack, trained, tmp_path: Path) -> None:
    """z-lab's `DFlash2DraftModel.from_pretrained` takes the trained checkpoint with no missing, unexpected or
    mismatched tensor, and its `dflash_generate` (greedy, fp32, CPU, the real SmolLM2 target) gives the
    same tokens and the same per-cycle acceptance lengths as our eval's decoding, prompt by prompt."""
    from services.trainer.eval import greedy, speculative
    from services.trainer.features import Target
    from shared.model import load_causal_lm, load_tokenizer
    from tests.reference import reference_model_module

    ref = reference_model_module()  # imported from the reference's own install, with its CPU timer shim

    run, store = trained["run"], trained["store"]
    tmp_path = tmp_path / "exported"  # the folder `dfpipe export` writes: what a user serves

    async def export() -> None:
        from services.export.drafter import export_drafter

        cfg = make_config(stack, run)
        async with await Bus.connect(cfg.bus, "pytest", deadline_s=10) as bus:
            await export_drafter(cfg, store, bus, str(tmp_path))

    asyncio.run(export())
    # DFlash 2's logit and embedding keys, stated at the values under which the reference computes what was
    # trained: the decode below matching ours is the check that these are those values
    dc = json.loads((tmp_path / "config.json").read_text())["dflash_config"]
    assert (dc["output_multiplier"], dc["final_logit_softcapping"], dc["input_embedding_scale"]) == (1.0, 0.0, 1.0)
    model, info = ref.DFlash2DraftModel.from_pretrained(tmp_path, output_loading_info=True, dtype=torch.float32)
    assert {k: v for k, v in info.items() if v} == {}, info  # missing, unexpected, mismatched, errors: none
    model.eval()

    ours = load_drafter(tmp_path).eval()
    lm = load_causal_lm("smollm2")
    tok = load_tokenizer("smollm2")
    eos = {lm.generation_config.eos_token_id} if isinstance(lm.generation_config.eos_token_id, int) \
        else set(lm.generation_config.eos_token_id)
    target = Target(lm, ours.config.target_layer_ids)
    questions = ["What is the capital of France?", "How do I boil an egg?", "Write a haiku about the sea."]
    max_new = 40
    for q in questions:
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        tokens, cycles = speculative(target, ours, prompt, max_new, eos)
        assert tokens == greedy(target, prompt, max_new, eos)  # ours: lossless
        r = ref.dflash_generate(model, lm, torch.tensor([prompt]), max_new, sorted(eos), temperature=0.0,
                                return_stats=True)
        assert r.output_ids[0, len(prompt):].tolist() == tokens, q
        assert r.acceptance_lengths == cycles, q
