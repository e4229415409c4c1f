"""Tokenizer service: completions -> exact training samples with loss masks, behind a quality gate."""
