"""Arguments both ends check the same way (the client before it sends, the daemon and the
in-process engine before they act): exact integers, layer lists, reset flags. Each raises
``ValueError`` naming what was wrong; each side turns it into its own typed error."""

from __future__ import annotations

import operator
import unicodedata

import numpy as np


CARRIED = "[-2**63, 2**64)"  # the integers a request's header carries (msgpack)


def carried_number(name: str, v) -> int:
    """:func:`whole_number` that a request's header can carry (:data:`CARRIED`)."""
    n = whole_number(name, v)
    if not -(1 << 63) <= n < 1 << 64:
        raise ValueError(f"{name} {n} is outside what a request can carry ({CARRIED})")
    return n


def whole_number(name: str, v) -> int:
    """``v`` as a Python int when it is an integer (Python, NumPy, a 0-d integer array:
    anything with ``__index__``), never a bool, float or text: a cast would take 1.9 for
    1 (and a 0-d array as an index selects a copy)."""
    try:
        if type(v).__name__ in ("bool", "bool_"):  # Python's and NumPy's: an int to Python, no number here
            raise TypeError
        return operator.index(v)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {v!r:.40}") from None


def layer_numbers(layers) -> tuple[int, ...]:
    """A request's ``layers`` (not None) as Python ints: a list, tuple or 1-d array of
    integers (:func:`whole_number` each), never bools, floats or text; their range is the
    layout's to check."""
    if isinstance(layers, (str, bytes)):
        raise ValueError(f"layers must be a list of layer numbers, got {layers!r:.40}")
    try:
        items = tuple(layers)
    except TypeError:  # not iterable (an int, a 0-d array)
        raise ValueError(f"layers must be a list of layer numbers, got {layers!r:.40}") from None
    out = []
    for x in items:
        try:
            out.append(whole_number("a layer", x))
        except ValueError:
            raise ValueError(f"layers must be layer numbers (integers), got {x!r:.40}") from None
    return tuple(out)


def layers_in(layers, num_layers: int) -> tuple[int, ...]:
    """A request's ``layers`` (not None: that is every layer) as distinct layer numbers of a
    layout of ``num_layers`` layers (a layer named twice would be copied twice, and a list
    of them could multiply a request's work)."""
    out = layer_numbers(layers)
    if not out:
        raise ValueError("layers must be null (every layer) or a non-empty list of layer numbers")
    if any(not 0 <= x < num_layers for x in out):
        raise ValueError(f"layers must lie in [0, {num_layers}), got {list(out)[:16]}")
    if len(set(out)) != len(out):
        raise ValueError(f"layers names a layer twice: {list(out)[:16]}")
    return out


INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1


def int32_array(name: str, a, ndim: int | None = None, lists: bool = True) -> np.ndarray:
    """``a`` (a NumPy array, a list) as an int32 array (of ``ndim`` dimensions, when
    given): its values integers (floats and bools are refused, a cast would truncate them)
    each within int32 (a cast would wrap it to another row or token). With ``lists``, an
    empty float array is taken as an empty list (NumPy's reading of ``[]``); a file's
    arrays (a trace) pass ``lists=False``."""
    try:
        arr = np.asarray(a)
    except (TypeError, ValueError, OverflowError) as e:  # (a ragged list)
        raise ValueError(f"{name} must be an array of integers: {e}") from None
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {arr.shape}")
    if lists:
        arr = empty_list_as(arr, np.int32)
    if arr.dtype.kind not in "iu":  # (a bool's kind is 'b')
        raise ValueError(f"{name} must hold integers, got {arr.dtype}")
    if arr.dtype != np.int32 and arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < INT32_MIN or hi > INT32_MAX:
            raise ValueError(f"{name} holds {lo if lo < INT32_MIN else hi}, outside int32")
    return arr.astype(np.int32, copy=False)


def repeated(ids: np.ndarray) -> int | None:
    """The smallest value ``ids`` (int [n]) holds more than once, or None: increasing ids
    (a write of whole blocks, a range) cost one pass, others a sort."""
    if ids.size < 2 or (np.diff(ids) > 0).all():
        return None
    s = np.sort(ids)
    twice = np.flatnonzero(s[1:] == s[:-1])
    return int(s[twice[0]]) if twice.size else None


def empty_list_as(a: np.ndarray, dtype) -> np.ndarray:
    """``a``, or as ``dtype`` when it is an empty float array: an empty Python list, to
    NumPy, with no value a cast could change."""
    return a.astype(dtype) if a.size == 0 and a.dtype.kind == "f" else a


def reset_flags(reset) -> np.ndarray:
    """A step's ``reset`` as a bool array: bools, or integers 0 and 1 only (a cast would
    wrap 2**32 to 0 and turn 2, NaN or 0.5 into a reset). Its shape is the caller's to check."""
    try:
        r = empty_list_as(np.asarray(reset), bool)
    except (TypeError, ValueError, OverflowError) as e:  # (a ragged list)
        raise ValueError(f"reset must be an array of bools: {e}") from None
    if r.dtype != np.bool_ and (r.dtype.kind not in "iu" or ((r != 0) & (r != 1)).any()):
        raise ValueError(f"reset must be bool (or integers 0 / 1), got {r.dtype} {r.ravel().tolist()[:8]}")
    return r.astype(bool)


MAX_NAME_CHARS = 128


def engine_name(v) -> str:
    """An engine's name: text of 1..128 characters that UTF-8 can carry (the namespace its
    ranks and blocks share), as a plain ``str`` (a subclass, e.g. a str enum, travels as one)."""
    if not isinstance(v, str) or not 1 <= len(v) <= MAX_NAME_CHARS:
        raise ValueError(f"engine must be a name of 1..{MAX_NAME_CHARS} characters, got {v!r:.40}")
    if v == "-":
        raise ValueError("engine must not be \"-\": the operator's tables show an engine of none so")
    _one_cell("engine", "a name", v)
    return str.__str__(v)  # the text itself (a str enum's own str() is "Class.MEMBER")


def hello_text(field: str, v) -> str:
    """A HELLO's ``device`` or ``name``: text of at most 128 characters that UTF-8 can
    carry, without control characters, tabs, line breaks or bidi controls (the daemon's log
    and the operator's tables print it on one line, in order); empty allowed, "-" not (the
    tables show an empty one so)."""
    if not isinstance(v, str) or len(v) > MAX_NAME_CHARS:
        raise ValueError(f"{field} must be a string of at most {MAX_NAME_CHARS} characters, got {v!r:.40}")
    if v == "-":
        raise ValueError(f"{field} must not be \"-\": the operator's tables show an empty {field} so")
    _one_cell(field, "text", v)
    return str.__str__(v)


def _one_cell(field: str, noun: str, v: str) -> None:
    """ValueError naming ``field`` unless ``v`` is text UTF-8 can carry that prints as one
    cell of one line, in order (the operator's tables, the daemon's log)."""
    try:
        v.encode()
    except UnicodeEncodeError:
        raise ValueError(f"{field} must be text UTF-8 can encode, got {v!r:.40}") from None
    if any(breaks_line(ch) or reorders_text(ch) for ch in v):
        raise ValueError(f"{field} must be {noun} without control characters, tabs, line breaks or bidi controls, "
                         f"got {v!r:.40}")


# Bidi classes of the characters that reorder the text after them on screen: embeddings,
# overrides, isolates and their ends (U+202A-U+202E, U+2066-U+2069).
_REORDERING = frozenset({"LRE", "RLE", "PDF", "LRO", "RLO", "LRI", "RLI", "FSI", "PDI"})


def reorders_text(ch: str) -> bool:
    """Whether character ``ch`` makes a terminal show the text after it in another order
    (a bidi embedding, override or isolate): a name holding one could pass for another."""
    return unicodedata.bidirectional(ch) in _REORDERING


def breaks_line(ch: str) -> bool:
    """Whether character ``ch`` could break a tab-separated line of text: a control
    character (tab, newline, DEL, C1) or one ``str.splitlines`` splits at (U+2028, U+2029)."""
    return unicodedata.category(ch) in ("Cc", "Zl", "Zp")
