"""The runner's persistent batch: a step's sampling metadata follows the requests in its rows."""

from __future__ import annotations

import numpy as np
import torch

from octavo.model_executor.input_batch import CachedRequestState, InputBatch
from octavo.sampling_params import SamplingParams


def state(req_id: str, params: SamplingParams) -> CachedRequestState:
    generator = None
    if params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)
    return CachedRequestState(req_id, [5, 6, 7], [], params, [0], 0, generator)


def test_sampling_metadata_is_reused_only_while_its_rows_and_requests_stand():
    batch = InputBatch(4, 64, 4, vocab_size=32, device="cpu")
    batch.add_request(state("greedy", SamplingParams(temperature=0.0)))
    seeded = state("seeded", SamplingParams(temperature=0.8, top_k=5, seed=3))
    batch.add_request(seeded)
    both = np.arange(2)
    first = batch.sampling_metadata(both)
    assert first.temperature.tolist() == [0.0, np.float32(0.8)]
    assert not first.all_greedy and not first.all_random and not first.no_top_k
    assert first.generators == {1: seeded.generator}
    assert batch.sampling_metadata(both) is first  # nothing changed: the same tensors

    # Other rows overwrite the staging buffers: the next call for both rows stages again.
    second = batch.sampling_metadata(np.array([0]))
    assert second.all_greedy and second.temperature.tolist() == [0.0]
    again = batch.sampling_metadata(both)
    assert again is not first and again.temperature.tolist() == [0.0, np.float32(0.8)]

    # The greedy request leaves, the seeded one moves to row 0, a plain sampled one comes.
    batch.remove_request("greedy")
    batch.condense()
    one = batch.sampling_metadata(np.arange(1))
    assert one.temperature.tolist() == [np.float32(0.8)] and one.all_random
    assert one.generators == {0: seeded.generator}
    batch.add_request(state("plain", SamplingParams(temperature=1.0, top_p=0.5)))
    now = batch.sampling_metadata(both)
    assert now.temperature.tolist() == [np.float32(0.8), 1.0]
    assert now.top_p.tolist() == [1.0, 0.5] and not now.no_top_p
    assert now.generators == {0: seeded.generator}

    # The same rows asked for again after their requests changed: staged again.
    batch.remove_request("plain")
    batch.add_request(state("greedy again", SamplingParams(temperature=0.0)))  # fills row 1
    assert batch.sampling_metadata(both).temperature.tolist() == [np.float32(0.8), 0.0]
    assert batch.sampling_metadata(np.arange(1)).temperature.tolist() == [np.float32(0.8)]
    batch.remove_request("seeded")
    batch.condense()  # "greedy again" moves to row 0
    moved = batch.sampling_metadata(np.arange(1))
    assert moved.all_greedy and moved.generators == {}
