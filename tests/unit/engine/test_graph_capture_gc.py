"""Graph captures run with Python's cyclic GC off (collected first) and leave it as they found it, also when a
capture fails: a collection inside a capture could free other objects whose CUDA calls must not join it."""

from __future__ import annotations

import gc

import pytest

from loraplex.engine.cuda_graphs import BucketedGraphs, gc_paused


class _Recorder(BucketedGraphs):
    def __init__(self, fail_on=None):
        self.buckets, self.capture_graphs, self._graphs = [1, 2, 4], True, {}
        self.seen, self.fail_on = [], fail_on

    def _capture(self, key, lora_manager):
        self.seen.append((key, gc.isenabled()))
        if key == self.fail_on:
            raise RuntimeError("capture failed")
        self._graphs[key] = object()


@pytest.fixture
def gc_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_capture_all_and_a_later_capture_run_with_gc_off_and_restore_it(gc_on):
    runner = _Recorder()
    runner.capture_all(lora_manager=object())
    assert [k for k, _ in runner.seen] == [(4, False), (4, True), (2, False), (2, True), (1, False), (1, True)]
    assert not any(enabled for _, enabled in runner.seen) and gc.isenabled()
    runner._graphs.pop((2, True))
    runner.capture((2, True), None)
    assert runner.seen[-1] == ((2, True), False) and gc.isenabled()


def test_a_failed_capture_still_restores_gc(gc_on):
    runner = _Recorder(fail_on=(2, False))
    with pytest.raises(RuntimeError, match="capture failed"):
        runner.capture_all()
    assert gc.isenabled()
    gc.disable()
    with gc_paused():  # a GC that was off stays off
        pass
    assert not gc.isenabled()
