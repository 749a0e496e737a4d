"""Text the APIs can carry. Protobuf strings are UTF-8, so a str holding a lone surrogate cannot be
sent (encoding it raises): JSON can spell one ("\\ud800", half of a UTF-16 pair), and Python keeps
each byte of a command-line argument that is not UTF-8 as one ("\\udcff" for the byte 0xff).
"""

from __future__ import annotations


def invalid_text(value: str, *, from_bytes: bool = False) -> str | None:
    """None when value can be sent; otherwise why not, for a message that names the field:
    "not valid Unicode: lone surrogate U+D800 at character 3". from_bytes: value was decoded
    from bytes with Python's surrogateescape (argv, file names), so a surrogate U+DC80-U+DCFF
    is named as the byte that was not UTF-8: "not valid UTF-8: the byte 0xff at character 3"."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(value[err.start])
        if from_bytes and 0xDC80 <= code <= 0xDCFF:
            return f"not valid UTF-8: the byte 0x{code - 0xDC00:02x} at character {err.start}"
        return f"not valid Unicode: lone surrogate U+{code:04X} at character {err.start}"
    return None
