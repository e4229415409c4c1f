"""Loss masks on the real SmolLM2 tokenizer, under its own ChatML template and under Qwen3-style and
Llama-3-style templates written here (set on a copy of the same tokenizer).

Property: decoding the masked tokens gives exactly the assistant's generated text plus the
end-of-turn token; no prompt token is masked; the fast (batched) path equals the reference path.
"""

from __future__ import annotations

import copy
import os
import random

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.tokenizer.render import TemplateError
from services.tokenizer.samples import SampleBuilder
from shared.config import load_config
from shared.messages import ChatMessage
from shared.model import load_tokenizer
from shared.records import CompletionRecord

QWEN3_STYLE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and loop.last %}"
    "{%- set r = message.reasoning_content if message.reasoning_content else '' %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + r.strip('\\n') + '\\n</think>\\n\\n' + message.content.lstrip('\\n')"
    " + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# Like QWEN3_STYLE, but the generation prompt never holds the empty think block: the template inserts it by
# itself when it renders an answer without reasoning (it must get mask 0).
AUTO_THINK = QWEN3_STYLE.replace(
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}",
    "",
)
LLAMA3_STYLE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def smol(target_dir):
    return load_tokenizer(str(target_dir))


@pytest.fixture(scope="module")
def qwen3(smol):
    return qwen3_tokenizer(smol)


@pytest.fixture(scope="module")
def auto_think(smol):
    return qwen3_tokenizer(smol, AUTO_THINK)


@pytest.fixture(scope="module")
def llama3(smol):
    return llama3_tokenizer(smol)


_builders: dict = {}


def builder_for(tok, thinking: bool, train_on_reasoning: bool = True) -> SampleBuilder:
    key = (id(tok), thinking, train_on_reasoning)
    if key not in _builders:
        _builders[key] = SampleBuilder(tok, config(thinking, train_on_reasoning))
    return _builders[key]


def qwen3_tokenizer(base, template=QWEN3_STYLE):
    tok = copy.deepcopy(base)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = template
    return tok


def llama3_tokenizer(base):
    tok = copy.deepcopy(base)
    tok.add_special_tokens({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                            "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"]})
    tok.chat_template = LLAMA3_STYLE
    return tok


def config(thinking: bool, train_on_reasoning: bool = True, **tokenizer):
    cfg = load_config(env={})
    policy = {"min_supervised_tokens": 1, "repetition_min_tail": 10**6, **tokenizer}
    t = msgspec.structs.replace(cfg.tokenizer, train_on_reasoning=train_on_reasoning, **policy)
    s = msgspec.structs.replace(cfg.sampling, enable_thinking=thinking)
    return msgspec.structs.replace(cfg, tokenizer=t, sampling=s)


words = st.text(
    alphabet=st.characters(codec="utf-8", categories=("L", "N", "P", "S", "Zs"), exclude_characters="<>|"),
    min_size=1, max_size=40,
).map(str.strip).filter(bool)
paragraph = st.lists(words, min_size=1, max_size=3).map("\n".join)


@st.composite
def conversations(draw, reasoning: bool):
    msgs = []
    if draw(st.booleans()):
        msgs.append(ChatMessage(role="system", content=draw(paragraph)))
    for _ in range(draw(st.integers(0, 2))):
        msgs.append(ChatMessage(role="user", content=draw(paragraph)))
        msgs.append(ChatMessage(role="assistant", content=draw(paragraph)))
    msgs.append(ChatMessage(role="user", content=draw(paragraph)))
    return msgs, draw(paragraph), (draw(paragraph) if reasoning else None)


def masked_text(tok, sample) -> str:
    ids = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def check_sample(tok, builder, msgs, content, reasoning, expected: str, thinking: bool):
    rec = CompletionRecord(run="r", prompt_id="p", messages=msgs, completion=content, reasoning=reasoning)
    fast = builder.build([rec])
    assert fast.dropped() == {} and len(fast.samples) == 1
    (sample,) = fast.samples
    assert masked_text(tok, sample) == expected
    # the masked tokens are one contiguous run ending at the end-of-turn token
    first = sample.loss_mask.index(1)
    assert all(sample.loss_mask[first: first + sample.num_supervised])
    assert sample.input_ids[first + sample.num_supervised - 1] in builder.stop_ids
    context = [{"role": m.role, "content": m.content} for m in msgs]
    prompt = tok.apply_chat_template(context, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert sample.input_ids[: len(prompt_ids)] == prompt_ids
    assert not any(sample.loss_mask[: len(prompt_ids)])  # no prompt token is masked in
    assert builder.build([rec], batched=False).samples == fast.samples  # fast path == reference path
    return sample


SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(conv=conversations(reasoning=False))
def test_chatml_smollm2_masks_exactly_the_answer(smol, conv):
    msgs, content, _ = conv
    builder = builder_for(smol, thinking=False)
    sample = check_sample(smol, builder, msgs, content, None, content + "<|im_end|>", False)
    # the template's newline after <|im_end|> is scaffolding: last token, unmasked
    assert sample.loss_mask[-1] == 0 and smol.decode(sample.input_ids[-1:]) == "\n"


@SETTINGS
@given(conv=conversations(reasoning=True))
def test_qwen3_style_thinking_masks_reasoning_and_answer(qwen3, conv):
    msgs, content, reasoning = conv
    tok = qwen3
    builder = builder_for(tok, thinking=True)
    expected = "<think>\n" + reasoning + "\n</think>\n\n" + content + "<|im_end|>"
    check_sample(tok, builder, msgs, content, reasoning, expected, True)


@SETTINGS
@given(conv=conversations(reasoning=True))
def test_qwen3_style_reasoning_not_trained_is_in_context_but_unmasked(qwen3, conv):
    msgs, content, reasoning = conv
    tok = qwen3
    builder = builder_for(tok, thinking=True, train_on_reasoning=False)
    sample = check_sample(tok, builder, msgs, content, reasoning, content + "<|im_end|>", True)
    assert reasoning in tok.decode(sample.input_ids)


@SETTINGS
@given(conv=conversations(reasoning=False), auto=st.booleans())
def test_qwen3_style_empty_think_block_is_scaffolding(qwen3, auto_think, conv, auto):
    """Thinking off: the empty <think></think> block (in the prompt, or inserted by the template) gets mask 0."""
    msgs, content, _ = conv
    tok = auto_think if auto else qwen3
    builder = builder_for(tok, thinking=False)
    sample = check_sample(tok, builder, msgs, content, None, content + "<|im_end|>", False)
    full = tok.decode(sample.input_ids)
    assert full.count("<think>\n\n</think>\n\n" + content) == 1


@SETTINGS
@given(conv=conversations(reasoning=False))
def test_llama3_style_masks_exactly_the_answer(llama3, conv):
    msgs, content, _ = conv
    tok = llama3
    builder = builder_for(tok, thinking=False)
    sample = check_sample(tok, builder, msgs, content, None, content + "<|eot_id|>", False)
    assert sample.input_ids[0] == tok.bos_token_id and sample.loss_mask[-1] == 1  # nothing after <|eot_id|>


def test_template_breaking_the_token_prefix_property_fails_loudly(smol):
    tok = copy.deepcopy(smol)
    # The generation prompt stops inside the template's own "<think>" scaffolding (no <think> token in this
    # vocabulary): the prompt's last tokens are not the conversation's tokens.
    tok.chat_template = AUTO_THINK.replace("'<|im_start|>assistant\\n' }}", "'<|im_start|>assistant\\n<thi' }}")
    assert tok.chat_template != AUTO_THINK
    with pytest.raises(TemplateError, match="prefix property"):
        SampleBuilder(tok, config(thinking=False))


def test_template_breaking_the_string_prefix_property_fails_loudly(smol):
    tok = copy.deepcopy(smol)
    # the generation prompt opens a think block that the rendered conversation never has
    tok.chat_template = smol.chat_template.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>'")
    assert tok.chat_template != smol.chat_template
    with pytest.raises(TemplateError, match="not a prefix"):
        SampleBuilder(tok, config(thinking=False))


def test_thinking_on_with_a_template_that_drops_reasoning_fails_loudly(smol):
    with pytest.raises(TemplateError, match="does not render the assistant's reasoning"):
        SampleBuilder(smol, config(thinking=True))


def test_template_without_a_stop_token_after_the_answer_fails_loudly(smol):
    tok = copy.deepcopy(smol)
    tok.chat_template = smol.chat_template.replace("'<|im_end|>' + '\n'", "'\n\n'")
    assert tok.chat_template != smol.chat_template
    with pytest.raises(TemplateError, match="no stop token"):
        SampleBuilder(tok, config(thinking=False))


# --- one shard on several processes -------------------------------------------------------------------


def mixed_shard(tok, n: int = 240) -> tuple[list[CompletionRecord], dict[str, int]]:
    """Records of every kind a shard holds, and the dedupe state before it (`seen`)."""
    rng = random.Random(7)
    subjects = ["tides", "binary search", "sourdough", "jazz", "compilers", "prime numbers"]
    out = []
    for i in range(n):
        s = subjects[i % len(subjects)]
        msgs = [ChatMessage(role="user", content=f"Tell me about {s} (question {i}).")]
        if i % 3 == 1:
            msgs = [ChatMessage(role="system", content="Be brief."), *msgs]
        if i % 5 == 2:
            msgs = [ChatMessage(role="user", content="Hi"), ChatMessage(role="assistant", content="Hello."), *msgs]
        answer = " ".join(f"{s.capitalize()} fact {rng.randint(1, 999)} is worth knowing." for _ in range(rng.randint(2, 9)))
        kw: dict = {"reasoning": f"The user asks about {s}."}
        if i % 17 == 3:
            answer = "OK."  # below min_supervised_tokens
        elif i % 19 == 4:
            answer = "ha " * 120  # degenerate repetition
        elif i % 23 == 5:
            answer = ""  # empty: dropped before rendering
        if i % 4 == 0:  # token-exact, and every 8th with a non-canonical first token (drift)
            ids = tok(answer, add_special_tokens=False)["input_ids"]
            if i % 8 == 0 and answer:
                ids = tok(answer[0], add_special_tokens=False)["input_ids"] + tok(answer[1:], add_special_tokens=False)["input_ids"]
            kw["output_ids"] = ids
        if i % 29 == 6:
            kw["finish_reason"] = "length"
        out.append(CompletionRecord(run="r", prompt_id=f"p{i:04d}", messages=msgs, completion=answer, **kw))
    out += [out[10], CompletionRecord(run="r", prompt_id="p0011", messages=out[11].messages, completion="Again.",
                                      generation=1)]  # a duplicate in the shard; a regeneration
    seen = {"p0020": 0, "p0021": 0, "p0022": 1}
    out[22] = msgspec.structs.replace(out[22], generation=1)  # as old as what was emitted: a duplicate
    out[21] = msgspec.structs.replace(out[21], generation=1)  # newer than what was emitted: fresh
    return out, seen


@pytest.mark.parametrize("thinking", [False, True])
def test_a_shard_built_on_two_processes_equals_one_built_here(smol, qwen3, thinking):
    import signal

    from services.tokenizer.fingerprint import template_fingerprint
    from services.tokenizer.pool import BuildPool

    tok = qwen3 if thinking else smol
    cfg = config(thinking, min_supervised_tokens=8, repetition_min_tail=64, truncated_policy="keep")
    builder = SampleBuilder(tok, cfg)
    records, seen = mixed_shard(tok)
    here = builder.build(records, seen=seen)
    drops = here.dropped()
    assert {"duplicate", "below_min_supervised", "degenerate_repetition", "empty_answer"} <= set(drops), drops
    assert here.drift and here.exact and len(here.samples) > 150
    # One batched rendering equals rendering record by record.
    items = [(r.messages, r.completion, r.reasoning) for r in records[:40] if r.completion]
    assert builder.renderer.turns(items) == [builder.renderer.turn(*item) for item in items]

    pool = BuildPool(tok, cfg, 2, template_fingerprint(tok, cfg))
    try:
        parts = pool.build(records[:100], builder.build_fresh)
        assert len(parts) == 2 and sum(len(p.samples) for p in parts) == len(builder.build_fresh(records[:100]).samples)
        pooled = builder.build(records, seen=seen, pool=pool)
        assert pooled.samples == here.samples
        assert (pooled.dropped(), pooled.drift, pooled.exact, pooled.outcomes) == (drops, here.drift, here.exact,
                                                                                   here.outcomes)
        # A worker killed (the OOM killer): the shard is built here instead, the same, and so are later ones.
        for proc in list(pool._executor._processes.values()):
            os.kill(proc.pid, signal.SIGKILL)
        assert builder.build(records, seen=seen, pool=pool).samples == here.samples
        assert pool._executor is None
    finally:
        pool.close()


@pytest.mark.parametrize("train_on_reasoning", [True, False])
def test_token_exact_thinking_records_equal_the_text_path(qwen3, train_on_reasoning):
    """A thinking model's engine returns the ids of everything it generated (reasoning, answer, without the
    stop token): the sample is the text path's when those ids are canonical. With reasoning trained on, this
    used to raise KeyError (the answer alone is not a piece then), failing the whole shard."""
    builder = SampleBuilder(qwen3, config(True, train_on_reasoning))
    msgs = [ChatMessage(role="user", content="Why is the sky blue?")]
    rec = CompletionRecord(run="r", prompt_id="p", messages=msgs, completion="Rayleigh scattering of sunlight.",
                           reasoning="Short wavelengths scatter more.")
    (text,) = builder.build([rec]).samples
    prompt_ids = qwen3(qwen3.apply_chat_template([{"role": "user", "content": msgs[0].content}], tokenize=False,
                                                 add_generation_prompt=True, enable_thinking=True),
                       add_special_tokens=False)["input_ids"]
    eot = text.input_ids.index(qwen3.eos_token_id, len(prompt_ids))
    exact = msgspec.structs.replace(rec, output_ids=text.input_ids[len(prompt_ids):eot])
    built = builder.build([exact])
    assert built.samples == [text] and built.exact == 1 and built.drift == 0


# A guard of the kind Llama-2/Mistral/Gemma templates carry: roles must alternate, else raise_exception.
ALTERNATING = (
    "{%- for message in messages %}"
    "{%- if message.role != 'system' and (message.role == 'user') != (loop.index0 % 2 == (1 if messages[0].role"
    " == 'system' else 0)) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{%- endfor %}"
)


def test_a_conversation_the_template_refuses_is_one_drop_not_a_failed_shard(smol):
    """A template that raises for one prompt (two user turns in a row, here) drops that sample with the
    template's message; the shard's other samples are built as before."""
    tok = copy.deepcopy(smol)
    tok.chat_template = ALTERNATING + smol.chat_template
    builder = SampleBuilder(tok, config(False))
    good = [CompletionRecord(run="r", prompt_id=f"p{i}", messages=[ChatMessage(role="user", content=f"Count to {i}.")],
                             completion=" ".join(str(j) for j in range(1, i + 2)) + ".") for i in range(6)]
    bad = CompletionRecord(run="r", prompt_id="bad", completion="Sure.", messages=[
        ChatMessage(role="user", content="Hi."), ChatMessage(role="user", content="Count to three.")])
    with pytest.raises(Exception, match="roles must alternate"):
        builder.renderer.render_many([[{"role": m.role, "content": m.content} for m in bad.messages]],
                                     add_generation_prompt=True)
    built = builder.build([*good[:3], bad, *good[3:]])
    assert built.dropped() == {"template_error": 1}
    assert built.samples == builder.build(good).samples
    assert built.samples == SampleBuilder(smol, config(False)).build(good).samples  # the guard changes no rendering
    (drop,) = [d for d in built.drops if d.prompt_id == "bad"]
    assert drop.reason == "template_error" and "roles must alternate" in drop.example  # listed by `dfpipe drops`
    assert ("bad", "template_error", "Sure.") in built.outcomes  # the gate sees the answer, as for every reason
