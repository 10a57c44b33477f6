"""engine/models/cpu/bf16_products.py: which batch-invariant bf16 product computes which shape class. Mixed per class
only where the operators agree bit for bit; otherwise one operator for every class, by summed relative time. The
timings are given to `_measured` here (a test asserts the rule, never a speed)."""

import pytest
import torch

from engine.models.cpu import bf16_products
from engine.models.cpu import extension as cpu_extension
from engine.models.cpu.linear import pack_bf16
from tests.engine.models.cpu.test_bf16_gemm import HAS_BF16

CLASSES = len(bf16_products.SHAPE_CLASSES)


@pytest.fixture
def fresh(monkeypatch):
    """The module with no choice made yet (restored after)."""
    monkeypatch.setattr(bf16_products, "_current", None)
    monkeypatch.setattr(bf16_products, "_fallback", None)
    return bf16_products


@pytest.mark.parametrize(("rows", "index"), [(1, 0), (2, 1), (8, 1), (9, 2), (64, 2), (65, 3), (4096, 3)])
def test_a_products_rows_pick_its_shape_class(rows, index):
    choice = bf16_products.ProductChoice(("a", "b", "c", "d"), True, "", {})
    assert choice.operator(rows) == "abcd"[index]


def _timer(ms_by_name):
    """A timer answering ms_by_name[name][class] for the class measured at `rows`."""
    classes = {rows: i for i, (_, _, rows) in enumerate(bf16_products.SHAPE_CLASSES)}
    return lambda calls, rows: {name: ms_by_name[name][classes[rows]] for name in calls}


def _packed():
    return pack_bf16(torch.randn(32, 64).bfloat16()), 32


def _matmul(x, packed, n, bias):
    return x.bfloat16().float() @ packed.transpose(1, 2).reshape(-1, packed.shape[1] * 2)[:n].float().t()


def test_operators_that_agree_bit_for_bit_are_mixed_per_class():
    timer = _timer({"tiles": [2.0, 1.0, 1.0, 1.0], "vectors": [1.0, 2.0, 2.0, 2.0]})
    found = {"tiles": _matmul, "vectors": _matmul}  # the same bits
    choice = bf16_products._measured(found, [_packed()], timer)
    assert choice.mixed and choice.by_class == ("vectors", "tiles", "tiles", "tiles")
    assert choice.ms["tiles"] == (2.0, 1.0, 1.0, 1.0)


def test_operators_that_differ_in_their_bits_compute_every_class_with_one():
    def other(x, packed, n, bias):
        return _matmul(x, packed, n, bias) + 1e-3

    # tiles: 2x slower at one row, 4x faster at the rest -> 2 + .25 * 3 = 2.75; vectors 1 + 1 + 1 + 1 = 4
    timer = _timer({"tiles": [2.0, 1.0, 1.0, 1.0], "vectors": [1.0, 4.0, 4.0, 4.0]})
    choice = bf16_products._measured({"tiles": _matmul, "vectors": other}, [_packed()], timer)
    assert not choice.mixed and choice.by_class == ("tiles",) * CLASSES
    # tiles 3x slower at one row and 1.1x faster elsewhere -> 3 + 3 = 6 against vectors 1 + 3.3 = 4.3
    timer = _timer({"tiles": [3.0, 1.0, 1.0, 1.0], "vectors": [1.0, 1.1, 1.1, 1.1]})
    choice = bf16_products._measured({"tiles": _matmul, "vectors": other}, [_packed()], timer)
    assert choice.by_class == ("vectors",) * CLASSES and "differ" in choice.reason


def test_the_dispatcher_calls_each_classs_operator():
    calls = []
    choice = bf16_products.ProductChoice(("a", "b", "b", "a"), True, "", {})
    products = bf16_products.Bf16Products(choice, {"a": lambda x, *_: calls.append(("a", x.shape[0])),
                                                   "b": lambda x, *_: calls.append(("b", x.shape[0]))})
    assert products.product is products
    for rows in (1, 4, 40, 300):
        products.product(torch.zeros(rows, 2), None, 0, None)
    assert calls == [("a", 1), ("b", 4), ("b", 40), ("a", 300)]
    only = bf16_products.ProductChoice(("a",) * CLASSES, False, "", {})
    assert bf16_products.Bf16Products(only, {"a": len}).product is len  # one operator: called directly


@pytest.mark.skipif(not HAS_BF16, reason="the CPU lacks AVX512_BF16")
def test_one_choice_per_process_and_its_stats(fresh, monkeypatch):
    monkeypatch.setenv("SPECSERVE_BF16_PRODUCT", "auto")
    assert fresh.stats() is None
    choice = fresh.choose([_packed()])
    assert fresh.choose([_packed()]) is choice  # the first choice stays
    stats = fresh.stats()
    assert set(stats["by_class"]) == {name for name, _, _ in fresh.SHAPE_CLASSES}
    if cpu_extension.amx_unavailable() is not None:  # nothing to choose: VDPBF16PS, nothing measured, the reason
        assert choice.by_class == ("vdpbf16ps",) * CLASSES and choice.ms == {}
        assert cpu_extension.amx_unavailable() in choice.reason
    else:
        assert set(choice.ms) == {"vdpbf16ps", "amx"} and all(len(v) == CLASSES for v in choice.ms.values())
    x = torch.randn(3, 64)
    packed, n = _packed()
    assert torch.equal(fresh.current()(x, packed, n, None),
                       fresh.operators()[choice.operator(3)](x, packed, n, None))


@pytest.mark.skipif(not HAS_BF16, reason="the CPU lacks AVX512_BF16")
def test_a_fixed_operator_is_used_for_every_class_or_refused_where_absent(fresh, monkeypatch):
    monkeypatch.setenv("SPECSERVE_BF16_PRODUCT", "vdpbf16ps")
    assert fresh.choose([_packed()]).by_class == ("vdpbf16ps",) * CLASSES
    if cpu_extension.amx_unavailable() is not None:
        monkeypatch.setattr(bf16_products, "_current", None)
        monkeypatch.setenv("SPECSERVE_BF16_PRODUCT", "amx")
        with pytest.raises(RuntimeError, match="SPECSERVE_BF16_PRODUCT=amx: not available"):
            fresh.choose([_packed()])
