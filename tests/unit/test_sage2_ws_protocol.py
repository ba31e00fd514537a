"""The warp-specialised kernel's synchronisation, modelled and run under random schedules on the CPU.

Gluon has no CPU interpreter, and a mistake in the kernel's barrier protocol shows on a GPU as a hang (a
lost device session) or as a K/V tile overwritten while a product still reads it. So the protocol of
``benchmarks/sage2_ws_kernel.py`` is written out here step for step, the same barriers, counts and
parities, the same order of waits, arrivals, loads and products in each consumer, and run by a
scheduler that interleaves the two consumers and the TMA copies at random, with mbarriers that behave
as PTX's (a phase completes when its arrivals and its expected bytes are in; ``try_wait.parity P``
passes once the phase of parity P has completed, so a fresh barrier passes parity 1). Checked: every
schedule finishes (no deadlock), every product reads the block it means from a stage whose copy has
landed, and no copy lands in a stage a product may still read. Change the kernel's protocol and this
model together.
"""

from __future__ import annotations

import random

import pytest


class Barrier:
    def __init__(self, count: int):
        self.count, self.pending, self.tx, self.completed = count, count, 0, 0

    def arrive(self, tx: int = 0):
        self.pending -= 1
        self.tx += tx
        assert self.pending >= 0, "more arrivals than the barrier's count in one phase"
        self._complete()

    def land(self, tx: int):
        self.tx -= tx
        self._complete()

    def _complete(self):
        if self.pending == 0 and self.tx == 0:
            self.completed += 1
            self.pending = self.count

    def passes(self, parity: int) -> bool:
        return (self.completed & 1) != parity


class _Passed(Barrier):
    """A wait that always passes: where a consumer waits for its own products (``warpgroup_mma_wait``),
    which only lets the other actors run meanwhile."""

    def __init__(self):
        super().__init__(1)

    def passes(self, parity: int) -> bool:
        return True


PRODUCTS_DONE = _Passed()


class Kernel:
    """One CTA: the barriers, the ring's stage contents, the copies in flight, the stages being read."""

    def __init__(self, n_blocks: int, stages: int):
        self.n, self.stages = n_blocks, stages
        self.q_bar = Barrier(1)
        self.k_ready = [Barrier(1) for _ in range(stages)]
        self.v_ready = [Barrier(1) for _ in range(stages)]
        self.kv_empty = [Barrier(2) for _ in range(stages)]
        self.turn = [Barrier(1), Barrier(1)]
        self.tile = {("K", s): None for s in range(stages)} | {("V", s): None for s in range(stages)}
        self.landed = dict.fromkeys(self.tile, False)
        self.readers = {key: set() for key in self.tile}
        self.copies = []  # (kind, stage, block, barrier)

    def load(self, kind: str, block: int):
        """_load_tile: expect the bytes (an arrival) and start the copy of ``block``'s tile."""
        st = block % self.stages
        assert not self.readers[(kind, st)], f"{kind} block {block} overwrites stage {st} while it is read"
        ready = (self.k_ready if kind == "K" else self.v_ready)[st]
        ready.arrive(tx=1)
        self.tile[(kind, st)], self.landed[(kind, st)] = block, False
        self.copies.append((kind, st, block, ready))

    def prologue(self):
        self.q_bar.arrive(tx=1)
        self.copies.append(("Q", 0, 0, self.q_bar))
        for b in range(min(self.stages, self.n)):
            self.load("K", b)
            self.load("V", b)


def consumer(kernel: Kernel, which: int, pingpong: bool, refill_waits: bool = True):
    """One consumer warpgroup's protocol, as ``_consumer`` / ``_steady_block`` issue it. Yields the
    barrier waits ("wait", barrier, parity); everything else happens in order between them. The
    softmax is not modelled: whether it runs before the previous block's retirement (``overlap_pv``
    off) or after it does not change the order of the barrier operations."""
    st, n = kernel.stages, kernel.n
    last = n - 1

    def read(kind, block, who):
        key = (kind, block % st)
        assert kernel.tile[key] == block and kernel.landed[key], f"{kind} of block {block} read from {key}"
        kernel.readers[key].add(who)

    def issue(t, products):  # _issue, the products, _issued
        if pingpong:
            yield ("wait", kernel.turn[which], (t & 1) ^ (1 - which))
        for kind, block in products:
            read(kind, block, (which, kind, block))
        if pingpong:
            kernel.turn[1 - which].arrive()

    def scores_done(block):  # the wait for Q.K^T: K's stage is no longer read
        yield ("wait", PRODUCTS_DONE, 0)
        kernel.readers[("K", block % st)].discard((which, "K", block))

    def retire(b):  # _retire_pv
        yield ("wait", PRODUCTS_DONE, 0)
        kernel.readers[("V", b % st)].discard((which, "V", b))
        kernel.kv_empty[b % st].arrive()

    def refill(b):  # _refill: both consumers wait; consumer 0 loads K, consumer 1 V
        if b + st < n:
            if refill_waits:
                yield ("wait", kernel.kv_empty[b % st], (b // st) & 1)
            kernel.load("K" if which == 0 else "V", b + st)

    yield ("wait", kernel.q_bar, 0)
    yield ("wait", kernel.k_ready[0], 0)
    yield from issue(0, [("K", 0)])
    yield from scores_done(0)
    if last > 0:
        yield ("wait", kernel.k_ready[1 % st], (1 // st) & 1)
        yield ("wait", kernel.v_ready[0], 0)
        yield from issue(1, [("K", 1), ("V", 0)])
        yield from scores_done(1)
        for j in range(1, last):
            yield from retire(j - 1)
            yield from refill(j - 1)
            yield ("wait", kernel.k_ready[(j + 1) % st], ((j + 1) // st) & 1)
            yield ("wait", kernel.v_ready[j % st], (j // st) & 1)
            yield from issue(j + 1, [("K", j + 1), ("V", j)])
            yield from scores_done(j + 1)
        yield from retire(last - 1)
        yield from refill(last - 1)
    yield ("wait", kernel.v_ready[last % st], (last // st) & 1)
    yield from issue(last + 1, [("V", last)])
    yield from retire(last)


def run(n_blocks: int, stages: int, pingpong: bool, rng: random.Random, refill_waits: bool = True) -> None:
    kernel = Kernel(n_blocks, stages)
    kernel.prologue()
    actors = {w: consumer(kernel, w, pingpong, refill_waits) for w in (0, 1)}
    blocked = {w: next(actors[w]) for w in (0, 1)}
    while actors or kernel.copies:
        runnable = [w for w in actors if blocked[w][1].passes(blocked[w][2])]
        choices = runnable + (["copy"] if kernel.copies else [])
        assert choices, f"deadlock: consumers wait on {[blocked[w][1:] for w in actors]} with no copy in flight"
        pick = rng.choice(choices)
        if pick == "copy":
            kind, st, block, ready = kernel.copies.pop(rng.randrange(len(kernel.copies)))
            if kind != "Q":
                assert kernel.tile[(kind, st)] == block
                kernel.landed[(kind, st)] = True
            ready.land(1)
            continue
        try:
            blocked[pick] = next(actors[pick])
        except StopIteration:
            del actors[pick], blocked[pick]
    assert all(not r for r in kernel.readers.values()), kernel.readers


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("pingpong", [True, False])
def test_every_schedule_finishes_with_each_product_reading_its_own_landed_tile(stages, pingpong):
    rng = random.Random(stages * 10 + pingpong)
    for n_blocks in range(1, 11):
        for _ in range(100):
            run(n_blocks, stages, pingpong, rng)


def test_the_model_catches_a_wait_that_passes_too_early(monkeypatch):
    """Waits that pass at once (a wrong parity) read tiles before their copies land: the model must
    say so, or it checks nothing."""
    monkeypatch.setattr(Barrier, "passes", lambda self, parity: True)
    with pytest.raises(AssertionError, match="read from"):
        for seed in range(50):
            run(4, 2, True, random.Random(seed))


def test_the_model_catches_a_refill_before_both_consumers_are_done():
    with pytest.raises(AssertionError, match="overwrites stage"):
        for seed in range(200):
            run(6, 2, True, random.Random(seed), refill_waits=False)


def test_the_model_catches_a_wrong_turn_parity(monkeypatch):
    """Consumer 1 waiting for its first turn with parity 1 (a fresh barrier passes it) issues beside
    consumer 0; with both waiting on parity 0 nobody starts: a deadlock the scheduler reports."""
    monkeypatch.setattr(Barrier, "passes", lambda self, parity: (self.completed & 1) != parity
                        if self.count != 1 or parity == 0 or self.completed else False)
    with pytest.raises(AssertionError, match="deadlock"):
        run(3, 2, True, random.Random(0))
