"""Python's cyclic garbage collector on the RL loop: set-up's objects out of its scans, its time
logged.

Everything a run builds before its first RL step (the imported libraries' functions and
classes, Megatron's modules, the engine's tables) ends in the collector's oldest generation,
and every full collection walks all of it again: on the tiny recipe one such walk costs ~0.4 s,
against a 0.1-0.2 s rollout, and it lands wherever the allocation counts say (a partial
rollout's pool of requests and its lists of tokens set it off as readily as any phase: measured,
one full collection inside the rollouts made 23 % of a partial run's rollout time).
:meth:`GcWatch.freeze` collects once and then moves every object alive into the permanent
generation (``gc.freeze()``, what vLLM does after its start-up and SGLang after loading): later
collections walk only what the run created since. The frozen objects are still freed by their
reference counts as usual; only a reference cycle among them is not collected while frozen
(what set-up built stays for the run anyway), and :meth:`GcWatch.close` unfreezes them when the
run ends (a process that goes on, a test session or a notebook, gets them collectable again).

``perf/gc_s``: the seconds the collector ran during the step (every generation, whatever
triggered it), so a step that stalls on it says so.
"""

from __future__ import annotations

import gc
import time


class GcWatch:
    """Times the collector from construction to :meth:`close` (``perf/gc_s`` per
    :meth:`take`); :meth:`freeze` moves what is alive out of its scans."""

    def __init__(self):
        self.seconds = 0.0
        """Collector seconds since the last :meth:`take`."""
        self._started: float | None = None
        self._frozen = False
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None

    def freeze(self) -> int:
        """Collect cycles once, then freeze every live object (``gc.freeze``); returns how many
        objects are frozen in all. Call it once set-up is done, and again after the first step
        (what the engine allocates on its first call: its context and tables); the collection
        here is not counted in ``perf/gc_s``."""
        gc.collect()
        gc.freeze()
        self._frozen = True
        self.seconds = 0.0
        return gc.get_freeze_count()

    def take(self) -> dict[str, float]:
        """``{"perf/gc_s": seconds}`` since the previous call (or construction); resets."""
        seconds, self.seconds = self.seconds, 0.0
        return {"perf/gc_s": seconds}

    def close(self) -> None:
        """Stop timing and, after :meth:`freeze`, unfreeze (``gc.unfreeze``: the run's objects
        collectable again by whatever this process runs next)."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._frozen:
            gc.unfreeze()
            self._frozen = False
