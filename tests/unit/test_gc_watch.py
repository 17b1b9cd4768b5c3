"""GcWatch (trainer.gc_freeze, perf/gc_s): set-up's objects out of the collector's scans while a
run trains, collectable again after it; the collector's seconds per step."""

import gc
import weakref

from gspo_megatron.gc_watch import GcWatch


class Node:
    """A reference cycle's member (only the cyclic collector frees it)."""

    def __init__(self):
        self.me = self


def scanned(obj) -> bool:
    """Whether a full collection walks ``obj`` (it sits in generations 0-2, not the permanent
    one)."""
    return any(o is obj for o in gc.get_objects())


def test_freeze_takes_set_up_out_of_the_scans_and_close_puts_it_back():
    set_up = Node()
    set_up_ref = weakref.ref(set_up)
    watch = GcWatch()
    try:
        frozen = watch.freeze()
        assert frozen > 1000  # the interpreter's and the libraries' objects, and ours
        assert not scanned(set_up)
        assert len(gc.get_objects(generation=2)) < frozen / 10
        later = Node()  # made during the run: scanned, and collected as a cycle as usual
        later_ref = weakref.ref(later)
        assert scanned(later)
        del later, set_up
        gc.collect()
        assert later_ref() is None
        assert set_up_ref() is not None  # frozen: a cycle is kept while the run trains
    finally:
        watch.close()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert set_up_ref() is None  # the process that goes on gets it collected


def test_perf_gc_s_counts_the_collectors_seconds_once():
    watch = GcWatch()
    try:
        assert watch.take() == {"perf/gc_s": 0.0}
        for _ in range(20000):
            Node()
        gc.collect()
        seconds = watch.take()["perf/gc_s"]
        assert seconds > 0
        assert watch.take() == {"perf/gc_s": 0.0}  # reset by take()
    finally:
        watch.close()
    gc.collect()  # after close: not timed
    assert watch.take() == {"perf/gc_s": 0.0}


def test_close_without_freeze_leaves_others_frozen_objects_alone():
    gc.freeze()  # someone else's (a notebook, a host program)
    try:
        before = gc.get_freeze_count()
        GcWatch().close()
        assert gc.get_freeze_count() == before
    finally:
        gc.unfreeze()
