"""TokenArray behaves like the seed's lists, side by side with a real list, or fails loudly."""

# The point of this file is `+` and `!=` on TokenArrays, which RUF005/SIM202 would rewrite.
# ruff: noqa: RUF005, SIM202

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

import fastio
from fastio import LLMResponse, TokenArray


def pair(values: list[int], dtype: str = "int32") -> tuple[TokenArray, list[int]]:
    return TokenArray(values, dtype=dtype), list(values)


def test_len_index_iterate_like_a_list() -> None:
    t, ref = pair([5, 6, 7, 8])
    assert len(t) == len(ref)
    for i in range(-4, 4):
        assert t[i] == ref[i] and type(t[i]) is int
    for bad in (4, -5):
        with pytest.raises(IndexError):
            t[bad]
        with pytest.raises(IndexError):
            ref[bad]
    assert list(t) == ref and list(reversed(t)) == list(reversed(ref))
    assert [type(x) for x in t] == [int] * 4
    assert (7 in t, 9 in t, "x" in t) == (7 in ref, 9 in ref, "x" in ref)
    assert t.count(7) == ref.count(7) and t.index(8) == ref.index(8)
    assert t.index(8, -2) == ref.index(8, -2)
    with pytest.raises(ValueError):
        t.index(99)
    assert bool(TokenArray([])) is False and bool(t) is True
    assert sum(t) == sum(ref) and max(t) == max(ref) and sorted(t) == sorted(ref)
    f = TokenArray([0.5, -1.25])
    assert f[0] == 0.5 and type(f[0]) is float


def test_index_types() -> None:
    t, _ = pair([1, 2, 3])
    assert t[np.int64(1)] == 2
    with pytest.raises(TypeError, match="integers or slices"):
        t[1.0]  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="integers or slices"):
        t[[0, 1]]  # type: ignore[call-overload]


@pytest.mark.parametrize(
    "s",
    [
        slice(None),
        slice(1, 3),
        slice(None, None, 2),
        slice(-2, None),
        slice(5, 1),
        slice(None, None, -1),
    ],
)
def test_slices_are_list_equal_views(s: slice) -> None:
    t, ref = pair([1, 2, 3, 4, 5])
    part = t[s]
    assert isinstance(part, TokenArray) and part == ref[s]
    assert np.shares_memory(part.array, t.array) or len(part) == 0


def test_equality_like_lists() -> None:
    t, ref = pair([1, 2, 3])
    assert t == ref and ref == t and not (t != ref)
    assert t != [1, 2] and t != [1, 2, 4] and t != (1, 2, 3)  # a list never equals a tuple
    assert t == TokenArray([1.0, 2.0, 3.0]) and t == [1.0, 2.0, 3.0]
    assert t == np.array([1, 2, 3]) and t != np.array([[1, 2, 3]])
    assert (t == "123") is False
    with pytest.raises(TypeError):
        hash(t)


def test_concatenation_like_lists() -> None:
    a, ra = pair([1, 2])
    b, rb = pair([3])
    assert a + b == ra + rb
    assert a + [9, 8] == ra + [9, 8]
    assert [0] + a == [0] + ra
    assert (4, 5) + a == [4, 5, 1, 2]
    assert a + range(3) == ra + list(range(3))
    assert a + [] == ra and [] + a == ra
    assert (a + b).dtype == np.int32  # Python ints that fit keep the dtype
    assert a == ra  # operands unchanged


def test_seed_versions_idiom_side_by_side() -> None:
    versions, ref = pair([3, 3, 4])
    n = 5
    got = [-1] * n + versions
    want = [-1] * n + ref
    assert isinstance(got, TokenArray) and got == want and got.dtype == np.int32
    assert got.tolist() == want
    assert versions + [-1] * n == ref + [-1] * n


def test_mixed_types_widen_instead_of_truncating() -> None:
    t = TokenArray([1, 2], dtype="int32")
    assert (t + [0.5]).tolist() == [1, 2, 0.5]
    assert (t + [2**40]).tolist() == [1, 2, 2**40]
    f = TokenArray([0.5], dtype="float32")
    assert (f + [1]).dtype == np.float64  # an int may not fit float32 exactly
    assert (t + np.array([1], np.int64)).dtype == np.int64  # arrays: numpy's promotion
    assert (TokenArray([True]) + [2]).tolist() == [True + 0, 2]


def test_extend_append_pop_clear_like_lists() -> None:
    t, ref = pair([1])
    for op, arg in [("append", 2), ("extend", [3, 4]), ("extend", (5,)), ("extend", range(6, 8))]:
        getattr(t, op)(arg)
        getattr(ref, op)(arg)
        assert t == ref
    t.extend(x for x in (8, 9))
    ref.extend(x for x in (8, 9))
    t += [10]
    ref += [10]
    assert t == ref and t.dtype == np.int32
    assert t.pop() == ref.pop() and t.pop(0) == ref.pop(0) and t.pop(-2) == ref.pop(-2)
    assert t == ref
    with pytest.raises(IndexError):
        TokenArray([]).pop()
    with pytest.raises(IndexError):
        t.pop(100)
    t.clear()
    ref.clear()
    assert t == ref == [] and t.dtype == np.int32


def test_iadd_keeps_identity_like_lists() -> None:
    t, ref = pair([1])
    alias, ref_alias = t, ref
    t += [2]
    ref += [2]
    assert alias is t and alias == ref_alias == [1, 2]


def test_extend_is_amortised() -> None:
    t = TokenArray([], dtype="int32")
    buffers = set()
    for i in range(10_000):
        t.append(i)
        buffers.add(id(t._buf))
    assert t == list(range(10_000))
    # Doubling growth: a handful of reallocations, not one per append.
    assert len(buffers) < 20


def test_growth_never_writes_into_a_decoded_frame() -> None:
    resp = LLMResponse(output_tokens=np.arange(3000, dtype=np.int32))
    frames = fastio.encode(resp)
    received = [bytearray(f) for f in frames]  # writable, as zmq.Frame
    snapshot = [bytes(f) for f in received]
    got = fastio.decode(received, LLMResponse)
    before = got.output_tokens
    assert np.shares_memory(before.array, np.frombuffer(received[1], np.uint8))
    view = got.output_tokens[:]
    got.output_tokens.append(-7)
    got.output_tokens.extend([-8, -9])
    got.output_tokens += [-10]
    assert got.output_tokens[-4:] == [-7, -8, -9, -10]
    assert [bytes(f) for f in received] == snapshot  # frame untouched
    assert view == list(range(3000))  # views of the old data unchanged


def test_growth_never_writes_into_a_read_only_frame() -> None:
    frames = [bytes(f) for f in fastio.encode(LLMResponse(output_tokens=np.arange(100)))]
    got = fastio.decode(frames, LLMResponse)
    assert not got.output_tokens.array.flags.writeable
    got.output_tokens.append(100)
    assert got.output_tokens == list(range(101))


def test_growth_never_writes_into_encoded_memory() -> None:
    t = TokenArray(list(range(3000)), dtype="int32")
    t.append(3000)  # now a prefix of an over-allocated private buffer
    frames = fastio.encode(LLMResponse(output_tokens=t))
    sent = bytes(frames[1])
    t.extend(range(3001, 3050))
    t.pop()
    t.append(-1)
    assert bytes(frames[1]) == sent


def test_views_do_not_see_later_appends_after_pop() -> None:
    t = TokenArray(list(range(10)), dtype="int32")
    t.append(10)
    view = t[:]
    t.pop()
    t.append(99)
    assert view == list(range(11))


def test_conversions() -> None:
    a = np.arange(5, dtype=np.int32)
    t = TokenArray(a)
    assert t.array is a and np.asarray(t) is a
    assert np.array(t) is not a and np.array_equal(np.array(t), a)
    assert np.asarray(t, dtype=np.int64).dtype == np.int64
    tensor = t.tensor()
    assert tensor.dtype == torch.int32 and np.shares_memory(tensor.numpy(), a)
    assert torch.as_tensor(t).tolist() == [0, 1, 2, 3, 4]
    assert TokenArray(torch.arange(3)).tolist() == [0, 1, 2]
    assert TokenArray(t).array is a
    assert t.tolist() == [0, 1, 2, 3, 4] and type(t.tolist()) is list
    c = t.copy()  # as list.copy: a plain list (JSON payloads, AReaL's agenerate)
    assert type(c) is list and c == [0, 1, 2, 3, 4]
    assert copy.copy(t) == t and not np.shares_memory(copy.copy(t).array, a)
    assert copy.deepcopy(t) == t and pickle.loads(pickle.dumps(t)) == t
    assert repr(TokenArray([1, 2], dtype="int32")) == "TokenArray([1, 2], dtype=int32)"
    read_only = fastio.decode([bytes(f) for f in fastio.encode(LLMResponse(output_tokens=a))])
    assert read_only.output_tokens.tensor().tolist() == [0, 1, 2, 3, 4]  # copies, no warning


def test_constructor_validation() -> None:
    assert TokenArray().dtype == np.int64 and len(TokenArray()) == 0
    assert TokenArray(iter([1, 2])) == [1, 2]
    assert TokenArray([1, 2], dtype="float32").dtype == np.float32
    with pytest.raises(ValueError, match="1-D"):
        TokenArray(np.zeros((2, 2)))
    with pytest.raises(TypeError, match="numeric"):
        TokenArray(np.array(["a"]))
    with pytest.raises(TypeError, match="sequence of numbers"):
        TokenArray("abc")
    with pytest.raises(TypeError, match="sequence of numbers"):
        TokenArray(5)


@pytest.mark.parametrize(
    "op",
    [
        lambda t: t * 2,
        lambda t: 2 * t,
        lambda t: t - 1,
        lambda t: 1 - t,
        lambda t: t / 2,
        lambda t: t + 1,
        lambda t: 1 + t,
        lambda t: t + "ab",
        lambda t: t + np.zeros((2, 2)),
        lambda t: t < 1,
        lambda t: t >= [1],
        lambda t: t.__setitem__(0, "x"),
        lambda t: t.__setitem__(0, [5]),
        lambda t: t.extend(5),
        lambda t: t.extend("ab"),
        lambda t: t.append("x"),
        lambda t: t.append([1]),
    ],
)
def test_ambiguous_operations_fail_loudly(op: object) -> None:
    t = TokenArray([1, 2, 3], dtype="int32")
    with pytest.raises(TypeError) as info:
        op(t)  # type: ignore[operator]
    assert "TokenArray" in str(info.value)
    assert t == [1, 2, 3]  # unchanged


def test_imul_fails_loudly() -> None:
    t = TokenArray([1])
    with pytest.raises(TypeError, match=r"t\.array"):
        t *= 2


def test_item_assignment_like_lists_copy_on_write() -> None:
    t = TokenArray([1, 2, 3, 4], dtype="int32")
    u = t[:]  # a view: assignment to t must not show through
    t[0] = 9
    t[-1] = 8
    assert t == [9, 2, 3, 8] and u == [1, 2, 3, 4]
    t[1:3] = [5, 6, 7]  # length-changing slice assignment, as lists
    assert t == [9, 5, 6, 7, 8]
    t[::2] = [0, 0, 0]
    assert t == [0, 5, 0, 7, 0]
    with pytest.raises(ValueError, match="extended slice"):
        t[::2] = [1]
    del t[0]
    del t[1:3]
    assert t == [5, 0]
    with pytest.raises(IndexError):
        t[5] = 1
    t[0] = 2**40  # beyond int32: widens, as a list keeps any int
    assert t == [2**40, 0] and t.dtype == np.int64
    t.insert(1, 3)
    assert t == [2**40, 3, 0]
    a = np.arange(3, dtype=np.int32)
    w = TokenArray(a)
    w[0] = 7  # an array passed in is never written
    assert a.tolist() == [0, 1, 2] and w == [7, 1, 2]
    arr = w.array
    w[1] = 5  # nor a view handed out before
    assert arr.tolist() == [7, 1, 2]


def test_wrap_shares_the_array_and_copies_on_write_unless_owned() -> None:
    a = np.arange(4, dtype=np.int32)
    t = TokenArray.wrap(a)
    assert t == [0, 1, 2, 3] and t.dtype == np.int32 and np.shares_memory(t.array, a)
    t[0] = 9  # shared: the write goes to a copy
    assert a.tolist() == [0, 1, 2, 3] and t == [9, 1, 2, 3]
    t.append(4)
    assert a.tolist() == [0, 1, 2, 3] and t == [9, 1, 2, 3, 4]
    b = np.arange(4, dtype=np.int32)
    u = TokenArray.wrap(b, owned=True)
    u[0] = 9  # owned: written in place
    assert b.tolist() == [9, 1, 2, 3]


def test_item_assignment_never_writes_a_received_frame() -> None:
    frames = [bytearray(f) for f in fastio.encode(LLMResponse(output_tokens=np.arange(2000)))]
    snapshot = [bytes(f) for f in frames]
    got = fastio.decode(frames, LLMResponse)
    got.output_tokens[0] = -1
    assert got.output_tokens[:2] == [-1, 1]
    assert [bytes(f) for f in frames] == snapshot


def test_ints_beyond_int64() -> None:
    t = TokenArray([2**63])
    assert t.dtype == np.uint64 and t == [2**63]
    with pytest.raises(OverflowError, match="64 bits"):
        TokenArray([2**64])
    with pytest.raises(OverflowError, match="64 bits"):
        t.append(-1)  # uint64 and a negative number: no exact 64-bit dtype
    assert t == [2**63]
