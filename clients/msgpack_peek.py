"""Read one string field of a msgpack map without decoding the rest of it.

A hostile request entry may hold a readable ``id`` next to something msgspec refuses: invalid
UTF-8 in another string, nesting deeper than its recursion limit. The worker still owes such
an entry an ``error`` event on ``{p}:out:{id}``, so it needs the id. This scanner walks the
top-level map and skips every other value by its length prefixes alone, iteratively (no
recursion, no string decoding), with a bound on the items it looks at.
"""

from __future__ import annotations

MAX_SCANNED_ITEMS = 1_000_000  # a 10 MB payload of one-byte arrays stops here, not at 10 M

# first byte -> (bytes of a length field, extra bytes after it) for sized types
_SIZED: dict[int, tuple[int, int]] = {
    0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0),  # bin 8/16/32
    0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1),  # ext 8/16/32 (+ type byte)
    0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0),  # str 8/16/32
}  # fmt: skip
# first byte -> bytes that follow it, for fixed-size types
_FIXED: dict[int, int] = {
    0xC0: 0, 0xC2: 0, 0xC3: 0,  # nil, false, true
    0xCA: 4, 0xCB: 8,  # float 32/64
    0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,  # uint 8..64
    0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8,  # int 8..64
    0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17,  # fixext 1..16 (+ type byte)
}  # fmt: skip
# first byte -> (bytes of a count field, items per count) for containers
_CONTAINERS: dict[int, tuple[int, int]] = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


class _Malformed(Exception):
    pass


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.num_items = 0

    def take(self, num_bytes: int) -> bytes:
        end = self.pos + num_bytes
        if end > len(self.data):
            raise _Malformed("truncated")
        chunk, self.pos = self.data[self.pos : end], end
        return chunk

    def uint(self, num_bytes: int) -> int:
        return int.from_bytes(self.take(num_bytes), "big")

    def header(self) -> tuple[int, bytes | None]:
        """One item's header: (number of child items, the raw bytes of a str or None)."""
        self.num_items += 1
        if self.num_items > MAX_SCANNED_ITEMS:
            raise _Malformed("too many items")
        first = self.uint(1)
        if first <= 0x7F or first >= 0xE0:  # fixint
            return 0, None
        if first <= 0x8F:  # fixmap
            return 2 * (first & 0x0F), None
        if first <= 0x9F:  # fixarray
            return first & 0x0F, None
        if first <= 0xBF:  # fixstr
            return 0, self.take(first & 0x1F)
        if first in _FIXED:
            self.take(_FIXED[first])
            return 0, None
        if first in _SIZED:
            size_bytes, extra = _SIZED[first]
            raw = self.take(self.uint(size_bytes) + extra)
            return 0, raw if first >= 0xD9 else None
        if first in _CONTAINERS:
            count_bytes, per_count = _CONTAINERS[first]
            return per_count * self.uint(count_bytes), None
        raise _Malformed(f"byte {first:#x} starts no msgpack value")

    def skip(self, num_children: int) -> None:
        """Skip ``num_children`` whole items (nested ones included), without recursion."""
        remaining = num_children
        while remaining:
            children, _ = self.header()
            remaining += children - 1


def peek_str_field(data: bytes, name: str) -> str | None:
    """The value of the string field ``name`` of the msgpack map ``data``, or None when
    ``data`` is not a map, has no such field, or that field is not valid UTF-8 text."""
    reader = _Reader(data)
    wanted = name.encode()
    try:
        num_children, _ = reader.header()
        first = data[0]
        if not (0x80 <= first <= 0x8F or first in (0xDE, 0xDF)):
            return None
        for _ in range(num_children // 2):
            key_children, key = reader.header()
            reader.skip(key_children)
            value_children, value = reader.header()
            if key == wanted:
                return None if value is None else value.decode("utf-8")
            reader.skip(value_children)
    except (_Malformed, UnicodeDecodeError, IndexError):
        return None
    return None
