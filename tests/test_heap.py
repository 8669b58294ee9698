"""dspark/heap.py: the frozen heap of the bench and the server, and the collector-pause count."""
import gc
import weakref

from dspark.heap import CollectorPauses, freeze_heap, frozen_heap


class Node:
    def __init__(self):
        self.other = None


def _cycle():
    """Two objects that reference each other (only the cyclic collector frees them) and a weak
    reference that says whether they still exist."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_frozen_objects_stay_out_of_collections_and_come_back_after():
    dropped = _cycle()                # garbage already: freeze_heap's own collect frees it
    keep = [Node()]
    keep[0].other = keep[0]           # a cycle still referenced at the freeze
    held = weakref.ref(keep[0])
    with frozen_heap() as frozen:
        assert dropped() is None
        assert frozen > 0 and gc.get_freeze_count() > 0
        keep.clear()
        gc.collect()
        # the cycle was alive at the freeze: the collector does not look at it any more
        assert held() is not None
        new = _cycle()                # made after the freeze: collected as usual
        gc.collect()
        assert new() is None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert held() is None             # unfrozen: the dropped cycle is collected again


def test_freeze_heap_freezes_until_unfrozen():
    try:
        assert freeze_heap() > 0 and gc.get_freeze_count() > 0
        assert not any(isinstance(o, Node) for o in gc.get_objects())
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_collector_pauses_count_the_collections_inside_the_block():
    with CollectorPauses() as pauses:
        assert pauses.count == 0
        gc.collect()
        gc.collect(0)
    assert pauses.count == 2 and pauses.ms >= 0
    gc.collect()                      # outside: not counted
    assert pauses.count == 2 and pauses not in gc.callbacks
    assert not any(getattr(cb, "__self__", None) is pauses for cb in gc.callbacks)
