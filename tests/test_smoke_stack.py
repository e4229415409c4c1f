from shared.messages import ChatMessage, PromptTask, Subjects


async def test_stack_roundtrip(bus, store, cfg):
    ack = await bus.publish(Subjects.prompts(cfg.run), PromptTask(run=cfg.run, prompt_id="p1", messages=[ChatMessage(role="user", content="hi")]), msg_id=f"{cfg.run}:p1")
    again = await bus.publish(Subjects.prompts(cfg.run), PromptTask(run=cfg.run, prompt_id="p1", messages=[ChatMessage(role="user", content="hi")]), msg_id=f"{cfg.run}:p1")
    assert again.duplicate and again.seq == ack.seq
    info = store.put_bytes("x/y", b"hello")
    assert store.get_bytes("x/y") == b"hello" and info.size == 5
