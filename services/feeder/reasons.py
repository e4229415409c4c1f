"""Why a record was rejected, as a code: the feed's summary and manifest count rejects per code, and every
line of rejects.jsonl carries its code beside the detailed reason (which names the field, byte or value)."""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    # the record's bytes (sources.py)
    INVALID_UTF8 = "invalid_utf8"  # not UTF-8 (the reason gives the byte)
    INVALID_JSON = "invalid_json"  # not one RFC 8259 JSON value (the decoder's message, or the array could not resync)
    NUMBER_OUT_OF_RANGE = "number_out_of_range"  # a float beyond double range or an integer over 4300 characters
    TOO_DEEP = "too_deep"  # arrays/objects nested deeper than sources.MAX_NESTING
    TOO_BIG = "record_too_big"  # over feeder.max_record_bytes: not read
    UNREADABLE_VALUE = "unreadable_value"  # a Parquet value Python cannot hold (e.g. a timestamp past year 9999)
    # the record's shape (normalize.py)
    NOT_OBJECT = "not_object"
    UNKNOWN_SHAPE = "unknown_shape"  # none of messages, conversations, prompt, instruction
    BAD_TURNS = "bad_turns"  # the turn list is not a non-empty list of objects
    UNKNOWN_ROLE = "unknown_role"
    MISSING_CONTENT = "missing_content"
    CONTENT_NOT_TEXT = "content_not_text"  # a content that is neither a string nor a list of text parts
    INVALID_UNICODE = "invalid_unicode"  # a lone surrogate escape
    EMPTY_CONTENT = "empty_content"
    NO_USER_TURN = "no_user_turn"
    BAD_LAST_TURN = "bad_last_turn"  # the conversation does not end with a user (or tool) turn
    # the feed (feed.py)
    PROMPT_TOO_LONG = "prompt_too_long"  # over feeder.max_prompt_tokens
