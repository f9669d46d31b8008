"""One JSON loader for every JSON this toolkit reads from a file (safetensors headers, an HF
checkpoint's `config.json` and index, capture meta, statistics files).

`json.loads` alone lets a file decide how much work and which exceptions follow: nesting a
thousand deep raises RecursionError, an integer of 5,000 digits a bare ValueError, `1e999` and
`Infinity` load as infinities, and a repeated key keeps its last value silently. `load_json`
refuses each of these with the caller's error class, naming the source (and the key where one is
known):

- nesting deeper than `max_depth`, found by a scan of the brackets outside strings before any
  parsing (no recursion);
- a key repeated in one object;
- an integer literal longer than MAX_INT_DIGITS digits, and a number that is not finite
  (`NaN`, `Infinity`, `1e999`);
- anything that is not UTF-8.

`field` checks one value's type and names the key when it is wrong (a list where a string
belongs, a bool where an integer belongs).
"""
from __future__ import annotations

import json
import math

import numpy as np

MAX_DEPTH = 64          # no file this toolkit reads nests deeper than a handful of levels
MAX_INT_DIGITS = 40     # a u64 has 20 digits; anything much longer is not a count, size or id


class _Refused(Exception):
    pass


def _no_duplicates(pairs):
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise _Refused(f"key {short_repr(k)} appears twice in one object")
            seen.add(k)
    return out


def _int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {digits} digits (at most {MAX_INT_DIGITS} are read)")
    return int(text)


def _float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise _Refused(f"the number {short_repr(text)} is not finite")
    return v


def _constant(text: str):
    raise _Refused(f"{text} is not a JSON number (non-finite values are refused)")


def short_repr(value, limit: int = 40) -> str:
    """repr(value), cut to about `limit` characters, a long list to its first values (error
    messages quote values, never whole files)."""
    if isinstance(value, list) and len(value) > 6:
        return "[" + ", ".join(short_repr(x, 20) for x in value[:4]) + f", ... ({len(value)} values)]"
    s = repr(value)
    return s if len(s) <= limit else s[:limit] + "..."


def nesting_depth(data: bytes) -> int:
    """The deepest bracket nesting of a JSON text, outside strings: a vectorised scan (no
    recursion, a few passes over the bytes)."""
    b = np.frombuffer(data, dtype=np.uint8)
    if b.size == 0:
        return 0
    quote = b == ord('"')
    # a quote preceded by an odd run of backslashes is escaped (checked one by one: they are rare)
    for i in np.flatnonzero(quote[1:] & (b[:-1] == ord("\\"))) + 1:
        j = i - 1
        while j >= 0 and b[j] == ord("\\"):
            j -= 1
        if (i - 1 - j) % 2:
            quote[i] = False
    inside = (np.cumsum(quote, dtype=np.int32) & 1).astype(bool) | quote    # in a string, quotes included
    opens = ((b == ord("[")) | (b == ord("{"))) & ~inside
    closes = ((b == ord("]")) | (b == ord("}"))) & ~inside
    return int(np.cumsum(opens.astype(np.int8) - closes.astype(np.int8), dtype=np.int32).max(initial=0))


def load_json(data, source: str, error: type[Exception], *, max_depth: int = MAX_DEPTH, what: str = "JSON"):
    """Parse `data` (bytes or str) as strict JSON (module doc); problems raise `error` with a
    message that starts with `source`."""
    if isinstance(data, str):
        raw = data.encode("utf-8", "surrogatepass")
        text = data
    else:
        raw = bytes(data)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(f"{source}: the {what} is not UTF-8 text (byte {exc.start})") from None
    depth = nesting_depth(raw)
    if depth > max_depth:
        raise error(f"{source}: the {what} nests {depth} levels deep, more than the {max_depth} this reader takes")
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_int=_int, parse_float=_float,
                          parse_constant=_constant)
    except _Refused as exc:
        raise error(f"{source}: the {what} is refused: {exc}") from None
    except json.JSONDecodeError as exc:
        raise error(f"{source}: the {what} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except (RecursionError, ValueError, OverflowError, MemoryError) as exc:
        raise error(f"{source}: the {what} cannot be read ({type(exc).__name__}: {str(exc)[:80]})") from None


_TYPE_WORDS = {str: "a string", int: "an integer", float: "a number", list: "a list", dict: "an object",
               bool: "true or false"}


def field(obj: dict, key: str, types, source: str, error: type[Exception], *, required: bool = True,
          default=None, where: str | None = None):
    """obj[key] when it has one of `types` (a bool is never taken for an int or a float; an int
    is taken for a float), else `error` naming the key and what it holds."""
    types = types if isinstance(types, tuple) else (types,)
    if key not in obj:
        if required:
            raise error(f"{source}: key {where or key!r} is missing")
        return default
    v = obj[key]
    ok = any((isinstance(v, t) and not (isinstance(v, bool) and t in (int, float)))
             or (t is float and isinstance(v, int) and not isinstance(v, bool)) for t in types)
    if not ok:
        want = " or ".join(_TYPE_WORDS.get(t, t.__name__) for t in types)
        raise error(f"{source}: key {where or key!r} must be {want}, got {type(v).__name__} {short_repr(v)}")
    return v
