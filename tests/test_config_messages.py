import msgspec
import pytest

from shared.config import ConfigError, load_config
from shared.messages import (
    SCHEMA_VERSION,
    Alert,
    ChatMessage,
    DeadLetter,
    MessageError,
    PromptTask,
    ShardWritten,
    decode,
    encode,
)


def test_toml_env_precedence_and_aliases(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('run = "r1"\n[generator]\nmax_inflight = 4\n[bus]\nurl = "nats://a:1"\n')
    cfg = load_config(path, env={"DFLASH_GENERATOR__MAX_INFLIGHT": "9", "DFLASH_S3_ENDPOINT": "s3.example:443"})
    assert cfg.run == "r1" and cfg.generator.max_inflight == 9 and cfg.bus.url == "nats://a:1"
    assert cfg.store.endpoint == "s3.example:443" and cfg.tokenizer.max_length == 4096


@pytest.mark.parametrize(
    ("toml", "env", "match"),
    [
        ("[generator]\nmax_inflght = 4\n", {}, "unknown config key 'generator.max_inflght'"),
        ("[genrator]\n", {}, "unknown config key 'genrator'"),
        ('[generator]\nmax_inflight = "many"\n', {}, "'generator.max_inflight'"),
        ("", {"DFLASH_TRAINER__BLOK_SIZE": "8"}, "DFLASH_TRAINER__BLOK_SIZE: unknown config key 'trainer.blok_size'"),
        ("", {"DFLASH_NATSURL": "x"}, "unknown environment variable DFLASH_NATSURL"),
        ('run = "a.b"\n', {}, "invalid run name"),
    ],
)
def test_wrong_keys_and_types_are_named(tmp_path, toml, env, match):
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=match.replace(".", r"\.").replace("(", r"\(")):
        load_config(path, env=env)


def test_every_message_round_trips_and_garbage_is_explained():
    msgs = [
        PromptTask(run="r", prompt_id="p", messages=[ChatMessage(role="user", content="hi")], line=3),
        ShardWritten(run="r", key="k", worker="w", seq=1, num_records=2, prompt_ids=["a", "b"], sha256="x", size_bytes=9),
        Alert(run="r", stage="tokenize", kind="quality_gate", message="87% trivial", examples=["OK."]),
        DeadLetter(run="r", stage="generate", stream="PROMPTS", subject="s", consumer="c", stream_seq=1,
                   num_delivered=5, error="boom", payload=b"\x00\x01"),
    ]
    for m in msgs:
        assert decode(encode(m)) == m
        assert decode(encode(m), type(m)) == m
    with pytest.raises(MessageError, match="not msgpack"):
        decode(b"\xc1\xc1")
    with pytest.raises(MessageError, match="not a dflash-pipeline message"):
        decode(msgspec.msgpack.encode({"hello": 1}))
    with pytest.raises(MessageError, match="invalid 'prompt_task' message"):
        decode(msgspec.msgpack.encode({"type": "prompt_task", "run": "r"}))
    with pytest.raises(MessageError, match="invalid"):
        decode(encode(msgs[1]), PromptTask)
    newer = msgspec.msgpack.encode({**msgspec.to_builtins(msgs[0]), "type": "prompt_task", "v": SCHEMA_VERSION + 1})
    with pytest.raises(MessageError, match="newer than this build"):
        decode(newer)
