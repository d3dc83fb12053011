"""Protobuf's wire encoding of one length-delimited field, for the places that append encoded
fields to a message's bytes instead of building the message: the store's column blocks, the
query API's Tempo responses and the OTLP exporter's attributes."""

from __future__ import annotations


def varint(value: int) -> bytes:
    """`value` (not negative) as a protobuf base-128 varint."""
    if value < 0x80:  # lengths and small numbers: most calls
        return bytes((value,))
    if value < 0x4000:
        return bytes((value & 0x7F | 0x80, value >> 7))
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def length_delimited(field: int, payload: bytes) -> bytes:
    """Field number `field` holding `payload` (wire type 2: a message, string or bytes)."""
    return varint(field << 3 | 2) + varint(len(payload)) + payload
