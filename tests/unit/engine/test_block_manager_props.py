"""Property test of the block manager: any sequence of allocate / append / fork / free (with LRU eviction
under pressure) keeps reference counts equal to the holders, never leaks and never frees twice."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from loraplex.engine.block_manager import BlockManager
from loraplex.engine.request import Request
from loraplex.engine.sampling_params import SamplingParams

BLOCK = 4
PARAMS = SamplingParams(max_tokens=100)


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 24))
    def setup(self, num_blocks):
        self.bm = BlockManager(num_blocks, BLOCK)
        self.live: list[Request] = []
        self.next_id = 0

    def _new(self, tokens, salt):
        self.next_id += 1
        return Request(str(self.next_id), tokens, PARAMS, cache_salt=salt)

    def _compute(self, req, n):
        if self.bm.allocate_slots(req, n):
            req.num_computed_tokens += n
            self.bm.register_full_blocks(req)
            self.bm.take_pending_copies()
            return True
        return False

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=30), salt=st.sampled_from([None, "a"]))
    def allocate(self, tokens, salt):
        req = self._new(tokens, salt)
        cached = self.bm.find_cached_prefix(req)
        free_before = self.bm.num_free_blocks
        if self.bm.allocate_slots(req, req.num_tokens - len(cached) * BLOCK, cached):
            assert req.num_computed_tokens == len(cached) * BLOCK
            req.num_computed_tokens = req.num_tokens
            self.bm.register_full_blocks(req)
            self.live.append(req)
            assert len(req.block_ids) == self.bm.blocks_for(req.num_tokens)
        else:
            assert self.bm.num_free_blocks == free_before and not req.block_ids

    @precondition(lambda self: self.live)
    @rule(data=st.data(), new=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def append(self, data, new):
        req = data.draw(st.sampled_from(self.live))
        old_len = req.num_tokens
        req.token_ids.extend(new)
        if not self._compute(req, len(new)):
            del req.token_ids[old_len:]
        else:
            for b in req.block_ids[old_len // BLOCK:]:
                assert self.bm.blocks[b].ref_count == 1, "a written block must be private"

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        child = parent.fork(1)
        self.bm.fork(parent, child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        req = data.draw(st.sampled_from(self.live))
        self.live.remove(req)
        self.bm.free_blocks(req)
        assert not req.block_ids

    @invariant()
    def consistent(self):
        if hasattr(self, "bm"):
            self.bm.check_invariants(self.live)
            assert self.bm.num_free_blocks + len({b for r in self.live for b in r.block_ids}) == self.bm.num_blocks

    def teardown(self):
        if hasattr(self, "bm"):
            for req in self.live:
                self.bm.free_blocks(req)
            assert self.bm.num_free_blocks == self.bm.num_blocks


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
