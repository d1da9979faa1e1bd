"""rlx.gc_freeze: start-up objects leave the collector's view; later garbage is still collected."""

from __future__ import annotations

import gc
import weakref

from rlx.gc_freeze import freeze_startup_objects, in_ray_actor


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
