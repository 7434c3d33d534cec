"""The caching-allocator model as it was before the speed work (planner/allocator.py at cb9c689, rules
unchanged, only this docstring differs): the reference that tests/test_allocator_speed_equiv.py replays
every event stream through, next to the optimized planner/allocator.py, asserting the same bytes.
Not imported by the planner. See planner/allocator.py for the rules and their sources."""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass, field

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(size: int) -> int:
    """CUDACachingAllocator `round_size` (no power-of-two divisions)."""
    return MIN_BLOCK if size < MIN_BLOCK else MIN_BLOCK * -(-size // MIN_BLOCK)


def allocation_size(size: int) -> int:
    """`get_allocation_size`: bytes of the segment a request of `size` (rounded) makes."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-size // ROUND_LARGE)


@dataclass(eq=False, slots=True)
class _Block:
    segment: "_Segment"
    offset: int
    size: int
    allocated: bool = False
    prev: "_Block | None" = None
    next: "_Block | None" = None

    def key(self) -> tuple:
        return (self.size, self.segment.id, self.offset)


@dataclass(eq=False, slots=True)
class _Segment:
    id: int
    size: int
    small: bool
    stream: int
    pool: list = field(default_factory=list)
    """The free list of its pool and stream (shared by the pool's segments)."""


@dataclass
class CachingAllocator:
    """The allocator's state; `malloc` returns a handle, `free` takes it back."""

    expandable_segments: bool = False
    max_split_size: int | None = None
    """`max_split_size_mb` in bytes; None: unlimited (the default)."""
    reserved: int = 0
    allocated: int = 0
    peak_reserved: int = 0
    peak_allocated: int = 0
    segments: int = 0
    _free: dict = field(default_factory=dict)   # (small, stream) -> sorted [(size, seg id, offset, block)]
    _expandable: dict = field(default_factory=dict)  # (small, stream) -> _Segment

    # -- free lists -----------------------------------------------------------------------------
    def _pool(self, small: bool, stream: int) -> list:
        return self._free.setdefault((small, stream), [])

    def _insert(self, b: _Block) -> None:
        insort(b.segment.pool, (b.size, b.segment.id, b.offset, b))

    def _remove(self, b: _Block) -> None:
        pool = b.segment.pool
        i = bisect_left(pool, (b.size, b.segment.id, b.offset))
        assert pool[i][3] is b
        del pool[i]

    def _best_fit(self, size: int, small: bool, stream: int) -> _Block | None:
        """The smallest cached block that serves `size`, taken off its free list; None if none does."""
        pool = self._pool(small, stream)
        i = bisect_left(pool, (size, -1, -1))
        if i == len(pool):
            return None
        b = pool[i][3]
        limit = self.max_split_size
        if limit is not None and not small:
            if size < limit <= b.size:
                return None  # an oversize block is not given to a small request
            if size >= limit and b.size >= size + LARGE_BUFFER:
                return None
        del pool[i]
        return b

    # -- the two calls --------------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: int = 0) -> _Block:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        b = self._best_fit(size, small, stream)
        if b is None:
            b = self._new_block(size, small, stream)
        remaining = b.size - size
        # should_split: any remainder of a whole block in the small pool and with expandable segments; in the
        # large pool more than 1 MiB, for a request below max_split_size
        if small or self.expandable_segments:
            split = remaining >= MIN_BLOCK
        else:
            split = remaining > SMALL_SIZE and (self.max_split_size is None or size < self.max_split_size)
        if split:
            rest = _Block(b.segment, b.offset + size, remaining, prev=b, next=b.next)
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = size
            self._insert(rest)
        b.allocated = True
        self.allocated += b.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return b

    def free(self, b: _Block) -> None:
        assert b.allocated, "double free"
        b.allocated = False
        self.allocated -= b.size
        for nb in (b.prev, b.next):  # try_merge_blocks
            if nb is not None and not nb.allocated:
                self._remove(nb)
                if nb is b.prev:
                    b.offset, b.prev = nb.offset, nb.prev
                    if nb.prev is not None:
                        nb.prev.next = b
                else:
                    b.next = nb.next
                    if nb.next is not None:
                        nb.next.prev = b
                b.size += nb.size
                if self.expandable_segments and self._last.get(id(b.segment)) is nb:
                    self._last[id(b.segment)] = b
        self._insert(b)

    def _new_block(self, size: int, small: bool, stream: int) -> _Block:
        if not self.expandable_segments:
            seg_size = allocation_size(size)
            seg = _Segment(self.segments, seg_size, small, stream, self._pool(small, stream))
            self.segments += 1
            self._grow(seg_size)
            return _Block(seg, 0, seg_size)
        # one growing segment per pool and stream: map pages of the pool's segment size at its end
        page = SMALL_BUFFER if small else LARGE_BUFFER
        seg = self._expandable.get((small, stream))
        if seg is None:
            seg = self._expandable[(small, stream)] = _Segment(self.segments, 0, small, stream,
                                                                            self._pool(small, stream))
            self.segments += 1
        tail = self._tail_free(seg)
        have = tail.size if tail is not None else 0
        grow = page * -(-(size - have) // page)
        self._grow(grow)
        if tail is not None:
            self._remove(tail)
            tail.size += grow
            seg.size += grow
            return tail
        b = _Block(seg, seg.size, grow, prev=self._last.get(id(seg)))
        if b.prev is not None:
            b.prev.next = b
        self._last[id(seg)] = b
        seg.size += grow
        return b

    def _tail_free(self, seg: _Segment) -> _Block | None:
        last = self._last.get(id(seg))
        while last is not None and last.next is not None:  # splits append after the recorded last
            last = last.next
        if last is not None:
            self._last[id(seg)] = last
        return last if last is not None and not last.allocated else None

    def _grow(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def __post_init__(self) -> None:
        self._last: dict = {}  # expandable segment id -> its last block


ALLOC_CONF_KEYS = ("expandable_segments", "max_split_size_mb", "garbage_collection_threshold",
                   "roundup_power2_divisions")


def parse_alloc_conf(conf: str, flag: str = "--alloc-conf") -> tuple[bool, int | None, list[str]]:
    """`PYTORCH_CUDA_ALLOC_CONF` as `CUDAAllocatorConfig::parseArgs` reads it (c10/cuda/CUDAAllocatorConfig.cpp;
    comma-separated `key:value`): (expandable_segments, max_split_size in bytes or None, notes on what
    is accepted but not modelled). Unknown keys and bad values are a one-line ValueError naming `flag`."""
    expandable, max_split, notes = False, None, []
    for item in filter(None, (x.strip() for x in (conf or "").split(","))):
        key, sep, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if key not in ALLOC_CONF_KEYS or not sep:
            raise ValueError(f"{flag}={item!r}: accepted: comma-separated key:value with key one of "
                             f"{', '.join(ALLOC_CONF_KEYS)} (PYTORCH_CUDA_ALLOC_CONF)")
        if key == "expandable_segments":
            if value not in ("True", "False"):
                raise ValueError(f"{flag}: expandable_segments:{value!r}: accepted: True or False")
            expandable = value == "True"
        elif key == "max_split_size_mb":
            # parseMaxSplitSize: a size in MiB above kLargeBuffer / 1 MiB (20); "max" leaves it unlimited
            if value != "max" and not (value.isdigit() and int(value) > LARGE_BUFFER >> 20):
                raise ValueError(f"{flag}: max_split_size_mb:{value!r}: accepted: an integer above "
                                 f"{LARGE_BUFFER >> 20} (MiB)")
            max_split = None if value == "max" else int(value) << 20
        else:
            notes.append(f"{key} is accepted but not modelled by the allocator replay")
    return expandable, max_split, notes


def comm_streams(events) -> list:
    """Events with each allocation that a collective later touches (a ("comm", key, op) event before its
    free) put on that collective's stream: 1 for all_gather/broadcast, 2 for reduce_scatter/all_reduce.
    For FSDP1/FSDP2 traces (see the module docstring); the ("comm", ...) events are dropped."""
    stream: dict[int, int] = {}
    open_: dict = {}
    for i, e in enumerate(events):
        if e[0] == "alloc":
            open_[e[1]] = i
        elif e[0] == "free":
            open_.pop(e[1], None)
        elif e[0] == "comm" and e[1] in open_:
            stream.setdefault(open_[e[1]], 1 if e[2] in ("all_gather", "broadcast") else 2)
    return [(e[0], e[1], e[2], stream.get(i, 0)) if e[0] == "alloc" else e
            for i, e in enumerate(events) if e[0] != "comm"]


def replay(events, *, expandable_segments: bool = False, max_split_size: int | None = None) -> CachingAllocator:
    """Replay `events`: ("alloc", key, nbytes[, stream]) and ("free", key) in order (("comm", ...) events are
    skipped; `comm_streams` turns them into streams). Returns the allocator (peak_reserved,
    peak_allocated: what max_memory_reserved / max_memory_allocated would read)."""
    a = CachingAllocator(expandable_segments=expandable_segments, max_split_size=max_split_size)
    live: dict = {}
    malloc, free, pop = a.malloc, a.free, live.pop
    for ev in events:
        kind = ev[0]
        if kind == "alloc":
            if ev[2] > 0:
                live[ev[1]] = malloc(ev[2], ev[3] if len(ev) > 3 else 0)
        elif kind == "free":
            b = pop(ev[1], None)
            if b is not None:
                free(b)
        elif kind != "comm":
            raise ValueError(f"event {kind!r}: accepted: 'alloc', 'free', 'comm'")
    return a
