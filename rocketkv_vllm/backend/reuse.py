"""Which Stage 2 rows of a step reuse their request's page selection
(``rocketkv.reselect_every`` > 1), decided on the host once per step.

Each layer keeps a selection store, int32 [num_slots + 1, Hkv, width]
(``Stage2.decode``'s ``selections``; the last slot is never assigned: the
PyTorch path writes rows without a slot there). A request gets a slot at
its first compressed decode step; a row reuses the slot's pages only when
all of these hold, else it selects afresh and stores its choice:

- its newest token does not open a page and lies at an offset in its page
  that is not a multiple of ``every`` (so a selection serves at most
  ``every`` steps, all in one page of the view: the page count and the
  forced current page it was made for are unchanged);
- the slot's last step was this request's previous token (seq_len - 1):
  nothing else (another request taking the slot, a preemption, a
  recomputed chunk) ran between;
- its selection fits the store (a request's own larger budget may not).

A step that is not a one-token decode of the request (a prompt chunk,
tokens recomputed after a preemption) forgets its slot's history. Each
Stage 2 implementation still checks the entries it would reuse: one that is
not a page of the row's view makes that (row, KV head) select anew
(``Stage2.decode``).
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np


class SelectionReuse:
    def __init__(self, every: int, page_size: int, num_slots: int, width: int) -> None:
        self.every = int(every)
        self.page_size = int(page_size)
        self.width = int(width)
        self.num_slots = int(num_slots)
        self._slot_of: dict[Hashable, int] = {}
        self._owner: list[Hashable | None] = [None] * self.num_slots
        self._last_seq = np.full(self.num_slots, -1, dtype=np.int64)
        self._last_used = np.full(self.num_slots, -1, dtype=np.int64)
        self._step = 0

    def plan(
        self, keys: list[Hashable | None], seq_lens: np.ndarray, num_use: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(sel_slot, reuse) int32 columns for one step's decode rows: their
        requests' keys (None: not known, no slot), seq_lens including the
        token, and pages each attends (selected + forced)."""
        self._step += 1
        n = len(keys)
        slots = np.full(n, -1, dtype=np.int32)
        reuse = np.zeros(n, dtype=np.int32)
        for i, key in enumerate(keys):
            if key is None or num_use[i] > self.width:
                self.forget(key)
                continue
            seq = int(seq_lens[i])
            slot = self._slot_of.get(key)
            if slot is None:
                slot = self._take_slot(key)
            elif self._last_seq[slot] == seq - 1 and (seq - 1) % self.page_size % self.every:
                reuse[i] = 1
            self._last_seq[slot] = seq
            self._last_used[slot] = self._step
            slots[i] = slot
        return slots, reuse

    def forget(self, key: Hashable | None) -> None:
        """The request's stored selection no longer describes its view."""
        slot = self._slot_of.get(key)
        if slot is not None:
            self._last_seq[slot] = -1

    def _take_slot(self, key: Hashable) -> int:
        """A free slot, else the one unused longest (never one of this
        step's: a step has at most num_slots decode rows)."""
        slot = int(np.argmin(self._last_used))
        old = self._owner[slot]
        if old is not None:
            del self._slot_of[old]
        self._owner[slot] = key
        self._slot_of[key] = slot
        self._last_seq[slot] = -1
        return slot
