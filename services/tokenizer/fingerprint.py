"""The target tokenizer a run tokenizes with, and the fingerprint its output lives under.

The fingerprint covers everything that changes a sample's bytes: the chat template text, the
tokenizer's vocabulary and special tokens, the stop ids, and the mask/length policy. It is part
of every output key (`runs/<run>/tokenized/<fingerprint>/...`), so a template fix or a policy
change writes new keys and never overwrites old output. Gate settings and concurrency are not
in it: they decide whether a sample is written, not what it contains.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from shared.config import Config, fingerprint
from shared.model import load_tokenizer

from .checks import min_supervised_tokens
from .render import stop_token_ids

MASK_VERSION = 1  # bump when the mask derivation itself changes


def load_target_tokenizer(cfg: Config) -> Any:
    """The target's tokenizer, with tokenizer.chat_template_file replacing its template when set."""
    tok = load_tokenizer(cfg.model.target)
    if cfg.tokenizer.chat_template_file:
        path = Path(cfg.tokenizer.chat_template_file).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer.chat_template_file {path} does not exist")
        tok.chat_template = path.read_text()
    return tok


def template_fingerprint(tokenizer: Any, cfg: Config) -> str:
    t = cfg.tokenizer
    vocab = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()
    return fingerprint({
        "mask_version": MASK_VERSION,
        "chat_template": tokenizer.chat_template,
        "tokenizer": vocab,
        "special_tokens": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "stop_ids": stop_token_ids(tokenizer),
        "enable_thinking": cfg.sampling.enable_thinking,
        "train_on_reasoning": t.train_on_reasoning,
        "max_length": t.max_length,
        "truncated_policy": t.truncated_policy,
        "min_supervised_tokens": min_supervised_tokens(cfg),
        "repetition": [t.repetition_max_period, t.repetition_min_tail],
    })
