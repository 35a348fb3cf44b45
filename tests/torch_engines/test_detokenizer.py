"""Incremental detokenisation: multi-byte characters split over tokens, stop strings held back and cut."""

from __future__ import annotations

from backends.detokenizer import IncrementalText
from common.tokenizer import byte_tokenizer

TOK = byte_tokenizer()


def stream(text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], bool]:
    inc = IncrementalText(TOK, stop)
    deltas = []
    for t in TOK.encode(text, add_special_tokens=False):
        deltas.append(inc.push(t))
        if inc.stopped:
            return deltas, True
    deltas.append(inc.finish())
    return deltas, inc.stopped


def test_multibyte_characters_are_sent_whole() -> None:
    deltas, stopped = stream("a日本€ é")
    assert len(TOK.encode("日", add_special_tokens=False)) == 3   # one character, three byte tokens
    assert "".join(deltas) == "a日本€ é" and not stopped
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[1:4] == ["", "", "日"]


def test_stop_string_is_held_back_then_cut() -> None:
    deltas, stopped = stream("hello STOP world", stop=("STOP",))
    assert stopped and "".join(deltas) == "hello "
    deltas, stopped = stream("hello STOX world", stop=("STOP",))
    assert not stopped and "".join(deltas) == "hello STOX world"
    assert deltas[6:9] == ["", "", ""]   # "STO" might have become "STOP": held until it could not


def test_invalid_bytes_at_the_end_are_flushed() -> None:
    inc = IncrementalText(TOK)
    first = TOK.encode("日", add_special_tokens=False)[0]
    assert inc.push(first) == ""
    assert inc.finish() == "\ufffd"
