"""The suite's own helpers: all_pairs (pairwise coverage of test parameters) and free_port."""

import itertools
import socket

import pytest
from helpers import all_pairs, free_port


def _missing_pairs(axes: list[list], rows: list[tuple]) -> list:
    """(axis i, value, axis j, value) combinations that no row holds."""
    return [(i, a, j, b) for i, j in itertools.combinations(range(len(axes)), 2)
            for a, b in itertools.product(axes[i], axes[j])
            if not any(row[i] == a and row[j] == b for row in rows)]  # fmt: skip


@pytest.mark.parametrize(
    "sizes", [(2, 3, 2, 10), (3, 3, 3, 3), (5, 1, 4), (2, 2, 2), (4, 7), (2, 2, 2, 2, 2, 2, 2)], ids=str
)
def test_all_pairs_covers_every_pair_of_values_in_fewer_rows(sizes):
    # Values that are neither hashable nor ordered, as test parameters may be (tensors, dicts).
    axes = [[{"axis": i, "value": v} for v in range(n)] for i, n in enumerate(sizes)]
    rows = all_pairs(*axes)
    assert all(
        len(row) == len(axes) and all(v in axis for v, axis in zip(row, axes, strict=True)) for row in rows
    )
    assert _missing_pairs(axes, rows) == []
    assert len({repr(row) for row in rows}) == len(rows)  # no row twice
    largest, second = sorted(sizes)[-1], sorted(sizes)[-2]
    assert largest * second <= len(rows) <= max(largest * second, 1) * 2  # near the least possible
    assert rows == all_pairs(*axes)  # the same cases on every run and in every xdist worker


def test_all_pairs_of_layernorms_axes_is_30_of_their_120_combinations():
    assert len(all_pairs([False, True], ["fp32", "fp16", "bf16"], [False, True], list(range(10)))) == 30


def test_all_pairs_of_fewer_than_two_axes():
    assert all_pairs([1, 2, 3]) == [(1,), (2,), (3,)]
    assert all_pairs() == [()]
    assert all_pairs([1, 2], []) == []
    assert all_pairs(["only"], [1, 2]) == [("only", 1), ("only", 2)]


def test_free_port_can_be_bound_and_differs_from_a_port_in_use():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = free_port()
        assert port != held.getsockname()[1]
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
