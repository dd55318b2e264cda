"""KV block bookkeeping (pure Python, no torch): free list, reference counts, block tables,
copy-on-write, and a prefix cache keyed by a hash chain with LRU eviction.

A block is *free* when no sequence references it. Free blocks that still hold a full cached block keep
their key, so a later request with the same prefix can take them back; a block is only evicted (its key
dropped) when the allocator reuses it. The free list is ordered least- to most-recently useful: blocks
without a key sit at the front, and a finished sequence's blocks are queued tail first, so the start of a
shared prefix is evicted last.
"""

from __future__ import annotations

from collections import OrderedDict

from loraplex.engine.prefix_hash import block_key_seed, hash_full_blocks
from loraplex.engine.request import Request


class KVBlock:
    __slots__ = ("block_id", "ref_count", "block_hash", "lora_id")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        self.lora_id = 0  # adapter whose weights computed the cached contents (with block_hash)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies for the next step
        # counters
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_evictions = 0
        self.num_cow_copies = 0

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_prefix_hit_tokens / self.num_prefix_query_tokens if self.num_prefix_query_tokens else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------------
    def find_cached_prefix(self, req: Request) -> list[int]:
        """Blocks holding the longest cached prefix of ``req`` (at least one token is left to compute,
        so the last position's logits exist). Looks only; :meth:`allocate_slots` takes them."""
        if not self.enable_prefix_caching or req.num_computed_tokens or req.sampling_params.prompt_logprobs is not None:
            return []
        num_full = (req.num_tokens - 1) // self.block_size
        seed = block_key_seed(req.lora_id, req.cache_salt)
        hashes = hash_full_blocks(req.token_ids, self.block_size, seed, req.block_hashes, num_full)
        hits = []
        for h in hashes[:num_full]:
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def register_full_blocks(self, req: Request, token_ids: list[int] | None = None) -> None:
        """Record the keys of the blocks ``req`` has completely computed (first writer wins). ``token_ids``: the
        computed tokens when ``req.token_ids`` does not hold them all yet (accepted draft tokens)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
        if num_full <= req.num_registered_blocks:
            return
        seed = block_key_seed(req.lora_id, req.cache_salt)
        tokens = req.token_ids if token_ids is None else token_ids
        assert len(tokens) >= num_full * self.block_size, "a full block's tokens are missing"
        hashes = hash_full_blocks(tokens, self.block_size, seed, req.block_hashes, num_full)
        for i in range(req.num_registered_blocks, num_full):
            block = self.blocks[req.block_ids[i]]
            if block.block_hash is None and hashes[i] not in self.hash_to_block:
                block.block_hash = hashes[i]
                block.lora_id = req.lora_id
                self.hash_to_block[hashes[i]] = block.block_id
        req.num_registered_blocks = num_full

    # ---- allocation ----------------------------------------------------------------------------
    def _num_shared_tail_blocks(self, req: Request, first_write_pos: int) -> int:
        start = first_write_pos // self.block_size
        return sum(1 for b in req.block_ids[start:] if self.blocks[b].ref_count > 1)

    def allocate_slots(self, req: Request, num_new_tokens: int, cached_block_ids: list[int] = ()) -> bool:
        """Make ``req``'s block table cover its computed tokens, the cached prefix blocks it takes, and
        ``num_new_tokens`` more. Shared blocks that will be written are copied first (copy-on-write).
        Returns False, changing nothing, when there are not enough free blocks."""
        if not cached_block_ids:  # the running-sequence case, first: at most one block is written into
            blocks = req.block_ids
            num_have = len(blocks)
            start = req.num_computed_tokens // self.block_size
            if start >= num_have or (start == num_have - 1 and self.blocks[blocks[-1]].ref_count == 1):
                num_new_blocks = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size) - num_have
                if num_new_blocks > len(self.free):
                    return False
                for _ in range(num_new_blocks):
                    blocks.append(self._pop_free())
                return True
        assert not cached_block_ids or not req.block_ids, "a cached prefix is only taken on admission"
        num_cached_tokens = len(cached_block_ids) * self.block_size
        first_write = req.num_computed_tokens + num_cached_tokens
        total = first_write + num_new_tokens
        num_new_blocks = max(0, self.blocks_for(total) - len(req.block_ids) - len(cached_block_ids))
        num_cow = self._num_shared_tail_blocks(req, first_write)
        num_revived = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        if num_new_blocks + num_cow + num_revived > len(self.free):
            return False
        if cached_block_ids:
            for b in cached_block_ids:
                self._take(b)
            req.block_ids = list(cached_block_ids)
            req.num_registered_blocks = len(cached_block_ids)
            req.num_computed_tokens += num_cached_tokens
        if num_cow:
            start = first_write // self.block_size
            for i in range(start, len(req.block_ids)):
                src = req.block_ids[i]
                if self.blocks[src].ref_count > 1:
                    dst = self._pop_free()
                    self.blocks[src].ref_count -= 1
                    req.block_ids[i] = dst
                    self.pending_copies.append((src, dst))
                    self.num_cow_copies += 1
        for _ in range(num_new_blocks):
            req.block_ids.append(self._pop_free())
        return True

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_prefix_query_tokens += num_query_tokens
        self.num_prefix_hit_tokens += num_hit_tokens

    def fork(self, parent: Request, child: Request) -> None:
        """``child`` shares every block of ``parent`` (reference counted)."""
        for b in parent.block_ids:
            self.blocks[b].ref_count += 1
        child.block_ids = list(parent.block_ids)
        child.num_registered_blocks = parent.num_registered_blocks

    def free_blocks(self, req: Request) -> None:
        """Drop ``req``'s references; tail blocks are queued for eviction before the prefix."""
        for b in reversed(req.block_ids):
            self._release(b)
        req.block_ids = []
        req.num_registered_blocks = 0

    def trim(self, req: Request, num_tokens: int) -> None:
        """Drop ``req``'s blocks beyond the first ``blocks_for(num_tokens)`` (speculative decoding: blocks taken for
        draft tokens that were rejected). They were written this step only, so they hold no cached prefix."""
        keep = self.blocks_for(num_tokens)
        blocks = req.block_ids
        while len(blocks) > keep:
            self._release(blocks.pop())

    def _release(self, b: int) -> None:
        """One reference to block ``b`` dropped; a block nobody holds is free (one without a cached key is
        handed out first)."""
        block = self.blocks[b]
        assert block.ref_count > 0, f"double free of block {b}"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[b] = None
            if block.block_hash is None:
                self.free.move_to_end(b, last=False)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def forget_adapter(self, lora_id: int) -> None:
        """Drop the cached keys of blocks computed with adapter ``lora_id`` (its weights were removed or
        replaced: the keys name the id, not the weights). Blocks in use keep their contents."""
        for block in self.blocks:
            if block.block_hash is not None and block.lora_id == lora_id:
                if self.hash_to_block.get(block.block_hash) == block.block_id:
                    del self.hash_to_block[block.block_hash]
                block.block_hash = None
                if block.ref_count == 0:
                    self.free.move_to_end(block.block_id, last=False)  # reused before cached blocks

    def reset_prefix_cache(self) -> None:
        """Forget every cached key (blocks in use keep their contents)."""
        for block in self.blocks:
            block.block_hash = None
        self.hash_to_block.clear()

    # ---- internals -----------------------------------------------------------------------------
    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.hash_to_block.get(block.block_hash) == block_id:
                del self.hash_to_block[block.block_hash]
            block.block_hash = None
            self.num_evictions += 1
        block.ref_count = 1
        return block_id

    def check_invariants(self, live: list[Request]) -> None:
        """Every reference count equals the number of live block tables holding the block."""
        counts = [0] * self.num_blocks
        for req in live:
            for b in req.block_ids:
                counts[b] += 1
        for block, count in zip(self.blocks, counts):
            assert block.ref_count == count, f"block {block.block_id}: ref {block.ref_count} != {count} holders"
            assert (block.block_id in self.free) == (count == 0), f"block {block.block_id} free-list mismatch"
        for h, b in self.hash_to_block.items():
            assert self.blocks[b].block_hash == h
