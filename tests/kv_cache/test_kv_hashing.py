"""Chained block hashes and the Request that carries them."""

from __future__ import annotations

import hashlib
import struct

import pytest

from octavo.errors import ConfigError
from octavo.kv_cache.hashing import BlockHasher, block_extra_keys
from octavo.request import Request, RequestStatus

BS = 4


def hashes(tokens, hasher=None, **kwargs):
    hasher = hasher or BlockHasher(BS)
    return Request("r", list(tokens), block_hasher=hasher, **kwargs).block_hashes


def test_sha256_over_the_documented_packing():
    hasher = BlockHasher(BS)
    tokens = [1, 2, 70000, 4]
    expected = hashlib.sha256(bytes(32) + struct.pack("<4i", *tokens)).digest()
    assert hashes(tokens + [5], hasher) == [expected]
    second = hashlib.sha256(expected + struct.pack("<4i", 5, 6, 7, 8)).digest()
    assert hashes(tokens + [5, 6, 7, 8], hasher) == [expected, second]


def test_only_full_blocks_are_hashed_and_chained():
    assert len(hashes(range(3))) == 0
    assert len(hashes(range(11))) == 2
    a, b = hashes([9, *range(1, 8)]), hashes(range(8))
    assert a[0] != b[0] and a[1] != b[1]  # the same second block under another parent


def test_sha256_is_stable_across_hashers_fast_is_seeded_per_hasher():
    assert hashes(range(8), BlockHasher(BS)) == hashes(range(8), BlockHasher(BS))
    fast = BlockHasher(BS, "fast")
    assert hashes(range(8), fast) == hashes(range(8), fast)
    assert hashes(range(8), fast) != hashes(range(8), BlockHasher(BS, "fast"))
    assert len(hashes(range(8), fast)[0]) == 16


def test_salt_keys_only_the_first_block_lora_every_block():
    plain, salted = hashes(range(8)), hashes(range(8), cache_salt="s")
    assert plain[0] != salted[0]
    hasher = BlockHasher(BS)
    request = Request("r", list(range(8)), cache_salt="s")
    assert (
        block_extra_keys(request, 1, BS) == b""
    )  # the salt reaches block 1 only through the chain
    assert salted[1] == hasher.hash_block(salted[0], [4, 5, 6, 7])
    lora = Request("r", list(range(8)), lora_id=3)
    assert block_extra_keys(lora, 0, BS) == block_extra_keys(lora, 1, BS) != b""
    assert hashes(range(8), lora_id=3) != hashes(range(8), lora_id=4) != plain
    assert hashes(range(8), lora_id="adapter") != hashes(range(8), lora_id=3)


def test_multimodal_hashes_key_the_blocks_they_overlap():
    plain = hashes(range(12))
    with_image = hashes(range(12), mm_hashes=["img"], mm_positions=[(5, 2)])  # tokens 5 and 6
    assert with_image[0] == plain[0] and with_image[1] != plain[1]
    other_image = hashes(range(12), mm_hashes=["img2"], mm_positions=[(5, 2)])
    assert other_image[1] != with_image[1]
    unplaced = hashes(range(12), mm_hashes=["img"])
    assert unplaced[0] != plain[0]  # without positions the first block carries every input
    with pytest.raises(ValueError, match="mm_positions"):
        Request("r", [1], mm_hashes=["a", "b"], mm_positions=[(0, 1)])


def test_incremental_hashing_matches_hashing_all_at_once():
    hasher = BlockHasher(BS)
    request = Request("r", [3, 1, 4], block_hasher=hasher, cache_salt="t", lora_id=2)
    for token in [1, 5, 9, 2, 6, 5, 3, 5, 8]:
        request.append_output_token_ids(token)
    request.append_output_token_ids([9, 7])
    full = Request("f", request.all_token_ids, block_hasher=hasher, cache_salt="t", lora_id=2)
    assert request.block_hashes == full.block_hashes and len(full.block_hashes) == 3
    assert request.output_token_ids == [1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
    assert request.num_tokens == 14 and request.num_prompt_tokens == 3


def test_request_fork_copies_progress_without_sharing_lists():
    request = Request("p", list(range(6)), block_hasher=BlockHasher(BS), priority=2)
    request.num_computed_tokens = 5
    child = request.fork("c")
    assert (child.request_id, child.num_computed_tokens, child.priority) == ("c", 5, 2)
    child.append_output_token_ids([1, 2])
    assert (
        request.num_tokens == 6 and len(request.block_hashes) == 1 and len(child.block_hashes) == 2
    )


def test_request_status_and_validation():
    request = Request("r", [1])
    assert request.status is RequestStatus.WAITING and not request.is_finished
    request.status = RequestStatus.FINISHED_ABORTED
    assert request.is_finished and RequestStatus.FINISHED_STOPPED.is_finished
    assert not RequestStatus.SWAPPED.is_finished
    # An empty prompt is refused once, by octavo.inputs.InputProcessor (tests/engine).
    with pytest.raises(ConfigError, match="must be one of"):
        BlockHasher(BS, "crc32")
