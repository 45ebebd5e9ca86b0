"""Chained hashes of full KV blocks: what makes a block findable by later requests.

A block's hash covers its parent's hash, its token ids and the extra keys that change its KV
(LoRA adapter, multimodal inputs, and the cache salt on the first block), so equal hashes mean
equal KV for the whole prefix. Bytes are packed in a fixed layout (no pickle):

    parent hash | token ids as little-endian int32 | extra keys (tag byte + payload each)

Every block holds exactly ``block_size`` tokens and the parent hash has a fixed width per
algorithm, so the packing is unambiguous. ``sha256`` starts the chain from a fixed root (hashes
are stable across processes); ``fast`` is xxh3-128 keyed with a random per-process seed and root,
so nobody outside the process can aim for a collision.
"""

from __future__ import annotations

import hashlib
import secrets
import struct
import sys
from array import array
from typing import TYPE_CHECKING, Callable, NewType, Optional, Union

from octavo.errors import ConfigError

if TYPE_CHECKING:
    from octavo.request import Request

BlockHash = NewType("BlockHash", bytes)

HASH_ALGOS = ("sha256", "fast")
_LITTLE_ENDIAN = sys.byteorder == "little"
_INT64 = struct.Struct("<q")
_UINT32 = struct.Struct("<I")


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _make_fast_hash() -> tuple[Callable[[bytes], bytes], bytes]:
    try:
        import xxhash
    except ImportError:  # pragma: no cover - xxhash is a core dependency
        raise ConfigError(
            "--prefix-caching-hash-algo fast needs the xxhash package: pip install xxhash, "
            "or use --prefix-caching-hash-algo sha256"
        ) from None
    seed = secrets.randbits(64)
    digest = xxhash.xxh3_128_digest

    def fast_hash(data: bytes) -> bytes:
        return digest(data, seed)

    return fast_hash, secrets.token_bytes(16)


def pack_token_ids(token_ids: list[int]) -> bytes:
    """Token ids as little-endian int32 bytes."""
    packed = array("i", token_ids)
    if not _LITTLE_ENDIAN:  # pragma: no cover - every supported host is little-endian
        packed.byteswap()
    return packed.tobytes()


def _tagged(tag: bytes, payload: bytes) -> bytes:
    return tag + _UINT32.pack(len(payload)) + payload


def lora_key(lora_id: Union[int, str, None]) -> bytes:
    """The extra key of a LoRA adapter id (empty for the base model)."""
    if lora_id is None:
        return b""
    if isinstance(lora_id, int):
        return b"L" + _INT64.pack(lora_id)
    return _tagged(b"l", str(lora_id).encode())


def salt_key(cache_salt: Optional[str]) -> bytes:
    """The extra key of a cache salt (first block only)."""
    return _tagged(b"S", cache_salt.encode()) if cache_salt else b""


def mm_keys(request: "Request", start: int, end: int) -> bytes:
    """The hashes of the multimodal inputs whose placeholder tokens overlap ``[start, end)``."""
    positions = request.mm_positions
    if positions is None:
        return b"".join(_tagged(b"M", h.encode()) for h in request.mm_hashes) if start == 0 else b""
    return b"".join(
        _tagged(b"M", h.encode())
        for h, (offset, length) in zip(request.mm_hashes, positions)
        if offset < end and offset + length > start
    )


def block_extra_keys(request: "Request", block_index: int, block_size: int) -> bytes:
    """Every extra key of one block of ``request``, in the packing order the hasher uses."""
    start = block_index * block_size
    keys = lora_key(request.lora_id) + mm_keys(request, start, start + block_size)
    return keys + salt_key(request.cache_salt) if block_index == 0 else keys


class BlockHasher:
    """Hashes the blocks of a request that became full since the last call.

    ``Request`` calls it at construction and whenever appended tokens fill a block; its result
    extends ``request.block_hashes``. One instance per engine process: with ``fast`` the random
    seed lives in it, so the manager and every request must share the same instance.
    """

    __slots__ = ("block_size", "hash_algo", "root", "_hash")

    def __init__(self, block_size: int, hash_algo: str = "sha256"):
        if hash_algo == "sha256":
            self._hash, self.root = _sha256, bytes(32)
        elif hash_algo == "fast":
            self._hash, self.root = _make_fast_hash()
        else:
            raise ConfigError(
                f"prefix_caching_hash_algo must be one of {', '.join(HASH_ALGOS)}; "
                f"got {hash_algo!r}"
            )
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1; got {block_size!r}")
        self.block_size = block_size
        self.hash_algo = hash_algo

    def hash_block(
        self, parent: Optional[bytes], token_ids: list[int], extra_keys: bytes = b""
    ) -> BlockHash:
        """The hash of one full block given its parent's hash (None for the first block)."""
        assert len(token_ids) == self.block_size, "only full blocks are hashed"
        root = self.root if parent is None else parent
        return BlockHash(self._hash(root + pack_token_ids(token_ids) + extra_keys))

    def __call__(self, request: "Request") -> list[BlockHash]:
        block_size = self.block_size
        hashes = request.block_hashes
        start = len(hashes)
        end = request.num_tokens // block_size
        if end <= start:
            return []
        packed = memoryview(
            pack_token_ids(request.all_token_ids[start * block_size : end * block_size])
        )
        lora = lora_key(request.lora_id)
        has_per_block_keys = bool(request.mm_hashes) or (start == 0 and bool(request.cache_salt))
        parent = hashes[-1] if start else self.root
        stride = 4 * block_size
        hash_fn = self._hash
        new_hashes: list[BlockHash] = []
        for i in range(start, end):
            offset = (i - start) * stride
            extra = block_extra_keys(request, i, block_size) if has_per_block_keys else lora
            parent = hash_fn(parent + packed[offset : offset + stride] + extra)
            new_hashes.append(BlockHash(parent))
        return new_hashes
