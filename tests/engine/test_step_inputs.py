"""``ragged_index``: the (row, offset) of every item of ragged rows, flat in row order."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from octavo.model_executor.step_inputs import ragged_index


@given(st.lists(st.integers(0, 6), max_size=8))
def test_ragged_index_numbers_every_item_of_every_row(counts):
    row, offset = ragged_index(np.array(counts, dtype=np.int32))
    expected = [(r, i) for r, n in enumerate(counts) for i in range(n)]
    assert list(zip(row.tolist(), offset.tolist())) == expected
    assert row.dtype == offset.dtype == np.int64
