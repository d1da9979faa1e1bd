"""rlx.gc_freeze: start-up objects leave the collector's view; later garbage is still collected."""

from __future__ import annotations

import gc
import weakref

from rlx.gc_freeze import collect_after_shutdown, freeze_after_set_up, freeze_startup_objects, in_ray_actor


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_frozen_objects_are_skipped_and_later_garbage_is_collected():
    try:
        before = Node()
        before_ref = weakref.ref(before)
        freeze_startup_objects()
        assert gc.get_freeze_count() > 0
        del before
        gc.collect()
        assert before_ref() is not None  # frozen: a full collection no longer looks at it

        after = Node()
        after_ref = weakref.ref(after)
        del after
        gc.collect()
        assert after_ref() is None  # made after the freeze: collected as usual

        freeze_startup_objects()  # a second set-up unfreezes first: the old garbage goes now
        assert before_ref() is None
    finally:
        gc.unfreeze()


def test_not_in_an_actor_here():
    assert not in_ray_actor()  # a test process: EngineActor in-process must not freeze it


def test_without_the_collection_garbage_waits_for_the_unfreeze():
    """The driver's form: no full pass at the start of a run; what was garbage then is freed
    once the run unfreezes."""
    try:
        garbage = Node()
        garbage_ref = weakref.ref(garbage)
        del garbage
        freeze_startup_objects(collect=False)
        gc.collect()
        assert garbage_ref() is not None  # frozen along with everything else
    finally:
        gc.unfreeze()
    gc.collect()
    assert garbage_ref() is None


def test_a_kept_actor_process_freezes_its_first_set_up_and_collects_later_ones_young(monkeypatch):
    """A trainer rank's or engine's process (rlx.actor_reuse keeps it): its first set-up is frozen
    with everything else; its first shutdown frees that set-up's cycles and freezes the rest; a
    later set-up's objects stay with the collector, freed by the shutdown's pass."""
    import rlx.gc_freeze

    monkeypatch.setattr(rlx.gc_freeze, "_set_up_frozen", None)
    try:
        first = Node()  # the first set-up's model, a cycle
        first_ref = weakref.ref(first)
        freeze_after_set_up()
        frozen = gc.get_freeze_count()
        assert frozen > 0
        del first
        gc.collect()
        assert first_ref() is not None  # frozen: out of the collector's way while the run runs
        collect_after_shutdown()
        assert first_ref() is None  # the shutdown's full pass freed it
        assert gc.get_freeze_count() > 0  # and froze the process's own objects again

        second = Node()  # a later set-up's
        second_ref = weakref.ref(second)
        freeze_after_set_up()  # freezes nothing: the shutdown's pass (no unfreeze) frees it
        del second
        collect_after_shutdown()
        assert second_ref() is None
    finally:
        gc.unfreeze()
