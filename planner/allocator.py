"""A model of PyTorch's CUDA caching allocator: replay allocations and frees, get the reserved bytes.

Owns `CachingAllocator` (the model) and `replay(events)`. Pure Python: a plan can replay the allocations
of a step without torch or a GPU.

Rules, from c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.x; constants in the `Constants` namespace of
c10/cuda/CUDAAllocatorConfig.h in recent releases):

- `round_size`: every request is rounded up to a multiple of kMinBlockSize = 512 bytes.
- Pools: requests <= kSmallSize (1 MiB) come from the small pool, the rest from the large pool; each pool
  is split by CUDA stream (a block freed on one stream is reused only by that stream).
- `get_allocation_size`: a new segment (one cudaMalloc) is kSmallBuffer = 2 MiB for a small request,
  kLargeBuffer = 20 MiB for a request below kMinLargeAlloc = 10 MiB, else the request rounded up to
  kRoundLarge = 2 MiB.
- `get_free_block`: best fit, the smallest cached block of the pool and stream at least as large
  (blocks ordered by stream, size, address). With `max_split_size_mb` set, a request below it does not
  take a block at or above it, and a request at or above it takes a block only if that block is less than
  request + kLargeBuffer.
- `should_split`: the block is split when the remainder is >= kMinBlockSize (small pool, and every pool with
  `expandable_segments`) or > kSmallSize (large pool); otherwise the whole block is handed out (and counted
  as allocated: a cached large block up to 1 MiB larger than the request is used whole). A request of
  `max_split_size_mb` or more never splits its block.
- `free_block` merges the freed block with free neighbours of the same segment (`try_merge_blocks`).
  Segments are returned to the driver only on `empty_cache()` or when a cudaMalloc fails: then
  `release_cached_blocks` frees every cached block that is a whole segment, in every pool and stream, and
  the allocation is retried once (`num_alloc_retries`), out of memory if that fails too ("If the cudaMalloc
  fails, the allocator will free all cached blocks that are not split and retry the allocation", the
  file's header). With `capacity` (the device's memory less what else the process holds) the model does
  the same; without it the device has room, and its reserved peak is what `torch.cuda.max_memory_reserved`
  reads on a device the run does not fill. Not modelled: `release_available_cached_blocks` (with
  `max_split_size_mb`, oversize blocks are released first) and an expandable segment's release of its free
  pages (with `expandable_segments` a limit reached is out of memory: the safe side).
- `roundup_power2_divisions` (`round_size`, `alloc_rounding`): requests rounded up to the next of N equal steps
  between two powers of two; `max_non_split_rounding_mb`: how much larger an oversize cached block a request of
  max_split_size or more may take (kLargeBuffer by default).
- `expandable_segments:True` (`ExpandableSegment`): one segment per pool and stream that grows by
  mapping pages of the pool's segment size (2 MiB small, 20 MiB large) at its end, so a request that
  does not fit a cached block maps only what the free tail lacks.

Streams: the caching allocator keeps a pool per stream, and FSDP allocates its communication buffers on
its own streams: FSDP2 (`_fully_shard/_fsdp_collectives.py`) the all-gather buffer on
`all_gather_copy_in_stream` and the reduce-scatter output on `reduce_scatter_stream` (its input on the
compute stream); FSDP1 (`_runtime_utils.py`) the low-precision shard on `_pre_unshard_stream`, the unsharded
flat parameter and the flat gradient (its views' backward) on `_unshard_stream` and the reduced gradient on
`_post_backward_stream`. The probes record each allocation's stream (validate.measure.StreamTags);
`comm_streams` keeps those, or infers them for a trace recorded without them. DDP and
ZeroRedundancyOptimizer allocate on the compute stream.

Speed (every strategy's reserved peak is a replay, so a cold `distplan estimate` makes nine of them): free
lists are sorted ints packing (size, segment id, offset) with a dict to the blocks, blocks are plain
lists, the collector is off inside the loop (about 0.85 us per event on a 2-core VM, 1.3 before);
`replay_peaks` remembers results by the events themselves; `replay(stop_above=)` ends a replay that a
fits-or-not question has answered. tests/test_allocator_speed_equiv.py holds them to the byte against
the previous, plainer model (tests/reference_allocator.py).

Known limitations: cross-stream uses (`record_stream`) that delay a free until the other stream's work
is done are not modelled (events give the order the host frees in; FSDP1 frees its unsharded flat
parameters, low-precision shards and flat gradients so); `garbage_collection_threshold` acts only under
`torch.cuda.set_per_process_memory_fraction` (not modelled; without it the option changes nothing); the
`backend:cudaMallocAsync` allocator is not modelled (`parse_alloc_conf` notes each).
"""

from __future__ import annotations

import gc
from bisect import bisect_left, insort
from contextlib import contextmanager
from functools import lru_cache

from .strategies import FSDP1, FSDP2
from .units import short_repr

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20

# A free block's place in its pool's free list is the int (size << _SIZE_SHIFT) | (segment id << _ID_SHIFT)
# | offset: ordered as the tuple (size, segment id, offset) the allocator's BlockComparatorSize orders by
# (stream, size, address; a segment's id stands for its address), while one int compares and bisects
# several times faster than a tuple. Exact while offsets stay below 2**_ID_SHIFT bytes and segment ids
# below 2**(_SIZE_SHIFT - _ID_SHIFT); `_new_segment` checks the first, the second is 2**64 segments.
_ID_SHIFT = 64
_SIZE_SHIFT = 128


def round_size(size: int, divisions: tuple | None = None) -> int:
    """CUDACachingAllocator `round_size`: 512-byte multiples, or with `roundup_power2_divisions` (`divisions`: the
    16 per-interval values `alloc_rounding` reads) a size above 512 x its interval's divisions rounded up to the
    next of that many equal steps between two powers of two (`roundup_power2_next_division`: 1200 MiB in 4
    divisions -> 1280 MiB)."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    if divisions is not None:
        d = divisions[min(max(size.bit_length() - 1 - 20, 0), 15)]  # AllocatorConfig::roundup_power2_divisions
        if d > 1 and size > MIN_BLOCK * d:
            if size & (size - 1) == 0:
                return size
            floor = 1 << (size.bit_length() - 1)
            step = floor >> (d.bit_length() - 1)
            if step == 0:
                return floor << 1
            low = size & ~(step - 1)
            return size if low == size else low + step
    return MIN_BLOCK * -(-size // MIN_BLOCK)


@lru_cache(maxsize=64)
def alloc_rounding(conf: str, flag: str = "--alloc-conf") -> tuple | None:
    """What `roundup_power2_divisions` and `max_non_split_rounding_mb` of a PYTORCH_CUDA_ALLOC_CONF set:
    (divisions per interval or None, the oversize-reuse limit in bytes), or None when neither is set (the
    default allocator). c10/core/AllocatorConfig.cpp: the divisions are 16 values, one per power-of-two
    interval from 1 MiB (sizes below it take the first, 64 GiB and above the last), read either as one power
    of two for every interval or as a list `[256:1,512:2,>:8]` of interval starts in MiB (powers of two; the
    first value also fills every interval below it; `>` fills from the last named interval on, that one
    included, as `parseRoundUpPower2Divisions` does); `max_non_split_rounding_mb` (at least 20) replaces
    kLargeBuffer in `get_free_block`'s limit on how much larger an oversize block a request of
    max_split_size or more may take."""
    divisions, non_split = None, None
    for item in _conf_items(conf):
        key, _, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if key == "roundup_power2_divisions":
            divisions = _parse_divisions(value, flag)
        elif key == "max_non_split_rounding_mb":
            if not (value.isdigit() and int(value) >= LARGE_BUFFER >> 20):
                raise ValueError(f"{flag}: max_non_split_rounding_mb:{short_repr(value)}: accepted: an integer of at least "
                                 f"{LARGE_BUFFER >> 20} (MiB)")
            non_split = int(value) << 20
    if divisions is None and non_split is None:
        return None
    return divisions, LARGE_BUFFER if non_split is None else non_split


def _parse_divisions(value: str, flag: str) -> tuple:
    def pow2(x: str, what: str, zero: bool = False) -> int:
        if not x.isdigit() or (int(x) & (int(x) - 1)) or (int(x) == 0 and not zero):
            raise ValueError(f"{flag}: roundup_power2_divisions:{short_repr(value)}: {what} {x!r}: accepted: a power of two"
                             + (" or 0" if zero else ""))
        return int(x)
    if not value.startswith("["):
        return (pow2(value, "divisions"),) * 16
    if not value.endswith("]"):
        raise ValueError(f"{flag}: roundup_power2_divisions:{short_repr(value)}: accepted: N or [MiB:N,...,>:N]")
    out, first, last = [0] * 16, True, 0
    for pair in filter(None, (x.strip() for x in value[1:-1].split(","))):
        start, sep, d = (x.strip() for x in pair.partition(":"))
        if not sep:
            raise ValueError(f"{flag}: roundup_power2_divisions:{short_repr(value)}: accepted: N or [MiB:N,...,>:N]")
        n = pow2(d, "divisions", zero=True)
        if start == ">":
            out[last:] = [n] * (16 - last)
            continue
        i = min(pow2(start, "interval").bit_length() - 1, 15)
        if first:
            out[:i] = [n] * i
            first = False
        out[i] = n
        last = i
    return tuple(out)


def allocation_size(size: int) -> int:
    """`get_allocation_size`: bytes of the segment a request of `size` (rounded) makes."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-size // ROUND_LARGE)


class _Pool:
    """The free blocks of one pool (small or large) and stream: `keys` sorted, `blocks` key -> block."""

    __slots__ = ("keys", "blocks")

    def __init__(self) -> None:
        self.keys: list = []
        self.blocks: dict = {}


class _Segment:
    __slots__ = ("id", "size", "small", "stream", "pool", "base", "last")

    def __init__(self, id: int, size: int, small: bool, stream: int, pool: _Pool) -> None:
        self.id, self.size, self.small, self.stream, self.pool = id, size, small, stream, pool
        self.base = id << _ID_SHIFT  # the id's part of its blocks' keys
        self.last = None  # expandable segments: its last block (a split may have appended after it)


# A block is a list [size, offset, allocated, prev, next, segment] (a list literal is built several times
# faster than an object with __init__; blocks are made and merged by the thousand per replay).
SIZE, OFFSET, ALLOCATED, PREV, NEXT, SEGMENT = range(6)


class CachingAllocator:
    """The allocator's state; `malloc` returns a handle (a block), `free` takes it back."""

    __slots__ = ("expandable_segments", "max_split_size", "stop_above", "capacity", "retries", "oom", "reserved",
                 "allocated", "peak_reserved", "peak_allocated", "segments", "_pools", "_expandable", "divisions",
                 "max_non_split")

    def __init__(self, expandable_segments: bool = False, max_split_size: int | None = None,
                 stop_above: int | None = None, capacity: int | None = None, rounding: tuple | None = None) -> None:
        self.expandable_segments = expandable_segments
        self.max_split_size = max_split_size
        """`max_split_size_mb` in bytes; None: unlimited (the default)."""
        self.divisions, self.max_non_split = rounding if rounding is not None else (None, LARGE_BUFFER)
        """`alloc_rounding`: roundup_power2_divisions' 16 values (None: 512-byte rounding only) and
        max_non_split_rounding_mb in bytes (default kLargeBuffer)."""
        self.stop_above = stop_above
        """A malloc that takes the reserved bytes above this raises `ReservedAbove` (after growing)."""
        self.capacity = capacity
        """The bytes cudaMalloc can give the allocator (the device's memory less what else the process holds);
        None: unlimited. A new segment beyond it first releases every cached segment that is wholly free
        and retries (`release_cached_blocks`; `retries` counts them, as `num_alloc_retries` does), then
        raises `OutOfMemory`."""
        self.retries = 0
        self.oom = False
        self.reserved = self.allocated = self.peak_reserved = self.peak_allocated = self.segments = 0
        self._pools: dict = {}  # 2 * stream + small -> _Pool
        self._expandable: dict = {}  # (small, stream) -> _Segment

    def __repr__(self) -> str:
        return (f"CachingAllocator(reserved={self.reserved}, allocated={self.allocated}, peak_reserved="
                f"{self.peak_reserved}, peak_allocated={self.peak_allocated}, segments={self.segments})")

    # -- the two calls --------------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: int = 0) -> list:
        if self.divisions is None:
            size = MIN_BLOCK if nbytes < MIN_BLOCK else MIN_BLOCK * -(-nbytes // MIN_BLOCK)  # round_size
        else:
            size = round_size(nbytes, self.divisions)
        small = size <= SMALL_SIZE
        pool = self._pools.get(2 * stream + small)
        if pool is None:
            pool = self._pools[2 * stream + small] = _Pool()
        # get_free_block: best fit, the smallest cached block at least as large (free lists: see _SIZE_SHIFT)
        keys = pool.keys
        b = None
        i = bisect_left(keys, size << _SIZE_SHIFT)
        if i < len(keys):
            k = keys[i]
            b = pool.blocks[k]
            limit = self.max_split_size
            if limit is not None and not small and (size < limit <= b[0]
                                                    or (size >= limit and b[0] >= size + self.max_non_split)):
                b = None  # an oversize block is not given to a small request, nor a far larger one
            else:
                del keys[i]
                del pool.blocks[k]
        if b is None:
            b = self._new_block(size, small, stream, pool)
        remaining = b[0] - size
        if (remaining >= MIN_BLOCK if small or self.expandable_segments else  # should_split
                remaining > SMALL_SIZE and (self.max_split_size is None or size < self.max_split_size)):
            nxt = b[4]
            seg = b[5]
            offset = b[1] + size
            rest = [remaining, offset, False, b, nxt, seg]
            if nxt is not None:
                nxt[3] = rest
            b[4] = rest
            b[0] = size
            k = (remaining << _SIZE_SHIFT) | seg.base | offset
            insort(keys, k)
            pool.blocks[k] = rest
        b[2] = True
        self.allocated += b[0]
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return b

    def free(self, b: list) -> None:
        size, offset, allocated, prev, nxt, seg = b
        assert allocated, "double free"
        b[2] = False
        self.allocated -= size
        pool = seg.pool
        keys, blocks = pool.keys, pool.blocks
        base = seg.base
        if prev is not None and not prev[2]:  # try_merge_blocks, the block before
            k = (prev[0] << _SIZE_SHIFT) | base | prev[1]
            del keys[bisect_left(keys, k)]
            del blocks[k]
            offset = b[1] = prev[1]
            pp = b[3] = prev[3]
            if pp is not None:
                pp[4] = b
            size += prev[0]
            if seg.last is prev:
                seg.last = b
        if nxt is not None and not nxt[2]:  # and the block after
            k = (nxt[0] << _SIZE_SHIFT) | base | nxt[1]
            del keys[bisect_left(keys, k)]
            del blocks[k]
            nn = b[4] = nxt[4]
            if nn is not None:
                nn[3] = b
            size += nxt[0]
            if seg.last is nxt:
                seg.last = b
        b[0] = size
        k = (size << _SIZE_SHIFT) | base | offset
        insort(keys, k)
        blocks[k] = b

    @staticmethod
    def _check_size(size: int) -> None:
        if size >> _ID_SHIFT:
            raise OverflowError(f"a segment of {size} bytes: the allocator model's free-list keys hold "
                                f"offsets below 2**{_ID_SHIFT} bytes")

    def _new_segment(self, size: int, small: bool, stream: int, pool: _Pool) -> _Segment:
        self._check_size(size)
        seg = _Segment(self.segments, size, small, stream, pool)
        self.segments += 1
        return seg

    def _new_block(self, size: int, small: bool, stream: int, pool: _Pool) -> list:
        if not self.expandable_segments:
            seg_size = allocation_size(size)
            if self.capacity is not None and self.reserved + seg_size > self.capacity:
                self._release_cached(seg_size)
            seg = self._new_segment(seg_size, small, stream, pool)
            self._grow(seg_size)
            return [seg_size, 0, False, None, None, seg]
        # one growing segment per pool and stream: map pages of the pool's segment size at its end
        page = SMALL_BUFFER if small else LARGE_BUFFER
        seg = self._expandable.get((small, stream))
        if seg is None:
            seg = self._expandable[(small, stream)] = self._new_segment(0, small, stream, pool)
        tail = self._tail_free(seg)
        have = tail[0] if tail is not None else 0
        grow = page * -(-(size - have) // page)
        if self.capacity is not None and self.reserved + grow > self.capacity:
            # releasing an expandable segment's free pages (unmapping them) is not modelled: out of memory
            raise OutOfMemory(self.reserved + grow)
        self._check_size(seg.size + grow)
        self._grow(grow)
        if tail is not None:  # off the free list, grown by the pages mapped after it
            k = (tail[0] << _SIZE_SHIFT) | seg.base | tail[1]
            del pool.keys[bisect_left(pool.keys, k)]
            del pool.blocks[k]
            tail[0] += grow
            seg.size += grow
            return tail
        b = [grow, seg.size, False, seg.last, None, seg]
        if seg.last is not None:
            seg.last[4] = b
        seg.last = b
        seg.size += grow
        return b

    @staticmethod
    def _tail_free(seg: _Segment) -> list | None:
        last = seg.last
        while last is not None and last[4] is not None:  # splits append after the recorded last
            last = last[4]
        if last is not None:
            seg.last = last
        return last if last is not None and not last[2] else None

    def _release_cached(self, need: int) -> None:
        """A cudaMalloc of `need` bytes failed (beyond `capacity`): `release_cached_blocks` frees every
        cached block that is a whole segment (not split), in every pool and stream, and the allocation is
        retried once; if it fails again, out of memory."""
        for pool in self._pools.values():
            whole = [k for k, b in pool.blocks.items() if b[3] is None and b[4] is None]
            for k in whole:
                self.reserved -= pool.blocks.pop(k)[0]
            if whole:
                gone = set(whole)
                pool.keys[:] = [k for k in pool.keys if k not in gone]
        self.retries += 1
        if self.reserved + need > self.capacity:
            raise OutOfMemory(self.reserved + need)

    def _grow(self, nbytes: int) -> None:
        self.reserved += nbytes
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        if self.stop_above is not None and self.reserved > self.stop_above:
            raise ReservedAbove(self.reserved)


class ReservedAbove(Exception):
    """The replay passed `stop_above` reserved bytes (args[0]: the reserved bytes then)."""


class OutOfMemory(Exception):
    """A segment did not fit in `capacity` even after releasing the cache (args[0]: the bytes it needed
    reserved)."""


ALLOC_CONF_KEYS = ("expandable_segments", "max_split_size_mb", "garbage_collection_threshold",
                   "roundup_power2_divisions", "max_non_split_rounding_mb", "backend", "release_lock_on_cudamalloc",
                   "pinned_use_cuda_host_register", "pinned_num_register_threads", "pinned_use_background_threads")
"""The keys `AllocatorConfig::parseArgs` accepts (c10/core/AllocatorConfig.cpp; PyTorch rejects any other with
"Unrecognized CachingAllocator option")."""

_NO_DEVICE_EFFECT = ("release_lock_on_cudamalloc", "pinned_use_cuda_host_register", "pinned_num_register_threads",
                     "pinned_use_background_threads")
"""Keys that change how the allocator takes its lock or how pinned host memory is registered, not which device
blocks it hands out: the replay is the same with or without them."""


def parse_alloc_conf(conf: str, flag: str = "--alloc-conf") -> tuple[bool, int | None, list[str]]:
    """`PYTORCH_CUDA_ALLOC_CONF` as `AllocatorConfig::parseArgs` reads it (c10/core/AllocatorConfig.cpp, formerly
    c10/cuda/CUDAAllocatorConfig.cpp; comma-separated `key:value`): (expandable_segments, max_split_size in
    bytes or None, notes on what the replay does not follow). Every key PyTorch accepts is accepted (a user's
    environment may set any of them); unknown keys and bad values are a one-line ValueError naming `flag`."""
    expandable, max_split, notes = False, None, []
    for item in _conf_items(conf):
        key, sep, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if key.replace("hip", "cuda") in ALLOC_CONF_KEYS and sep:  # ROCm builds spell them with hip
            key = key.replace("hip", "cuda")
        if key not in ALLOC_CONF_KEYS or not sep:
            raise ValueError(f"{flag}={short_repr(item)}: accepted: comma-separated key:value with key one of "
                             f"{', '.join(ALLOC_CONF_KEYS)} (PYTORCH_CUDA_ALLOC_CONF)")
        if key == "expandable_segments":
            if value not in ("True", "False"):
                raise ValueError(f"{flag}: expandable_segments:{short_repr(value)}: accepted: True or False")
            expandable = value == "True"
        elif key == "max_split_size_mb":
            # parseMaxSplitSize: a size in MiB of at least kLargeBuffer / 1 MiB (20; c10/core/AllocatorConfig.cpp,
            # where c10/cuda/CUDAAllocatorConfig.cpp had asked for more than 20); "max" leaves it unlimited
            if value != "max" and not (value.isdigit() and int(value) >= LARGE_BUFFER >> 20):
                raise ValueError(f"{flag}: max_split_size_mb:{short_repr(value)}: accepted: an integer of at least "
                                 f"{LARGE_BUFFER >> 20} (MiB)")
            max_split = None if value == "max" else int(value) << 20
        elif key == "garbage_collection_threshold":
            try:
                ok = 0.0 < float(value) < 1.0
            except ValueError:
                ok = False
            if not ok:  # parseGarbageCollectionThreshold
                raise ValueError(f"{flag}: garbage_collection_threshold:{short_repr(value)}: accepted: a number between 0 "
                                 f"and 1")
            # CUDACachingAllocator.cpp `malloc`: garbage_collect_cached_blocks runs only when `set_fraction`
            # (torch.cuda.set_per_process_memory_fraction was called): without it the option does nothing
            notes.append("garbage_collection_threshold acts only with torch.cuda.set_per_process_memory_fraction, "
                         "which the replay does not model (without it the replay is exact)")
        elif key == "backend":
            if value not in ("native", "cudaMallocAsync", "hipMallocAsync"):
                raise ValueError(f"{flag}: backend:{short_repr(value)}: accepted: native or cudaMallocAsync")
            if value != "native":
                notes.append("backend:cudaMallocAsync: CUDA's stream-ordered allocator reserves by its own pool's "
                             "rules; the reserved peak shown is the native caching allocator's")
        elif key in _NO_DEVICE_EFFECT:
            pass
        else:  # roundup_power2_divisions, max_non_split_rounding_mb: `alloc_rounding` reads them
            alloc_rounding(item, flag)
    return expandable, max_split, notes


def _conf_items(conf: str) -> list[str]:
    """`key:value` items of a conf string; commas inside roundup_power2_divisions' [..] list stay in its item."""
    items, depth, cur = [], 0, ""
    for ch in conf or "":
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth <= 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    return [x.strip() for x in items if x.strip()]


REDUCTIONS = ("reduce_scatter", "all_reduce")
GATHERS = ("all_gather", "broadcast")


def comm_streams(events, family: str) -> list:
    """Events of an FSDP1 ("fsdp1") or FSDP2 ("fsdp2") trace with each allocation put on the stream the
    implementation allocates it on, told from the collectives that touch it (a ("comm", key, op) event before
    its free; consecutive touches by one op are one call); the ("comm", ...) events are dropped. Streams:
    0 compute, 1 all-gather, 2 reduce-scatter, 3 FSDP1's pre-unshard. Other ops (DTensor's functional
    collectives, a checkpoint save's, send/recv) are the caller's stream's.

    FSDP2 (`_fully_shard/_fsdp_collectives.py`): `foreach_all_gather` makes its one flat buffer (the input is a
    view of the output) under `all_gather_copy_in_stream` -> 1. `foreach_reduce` allocates
    `reduce_scatter_input` on the current (compute) stream, before `with device_handle.stream(
    reduce_scatter_stream)`, and `reduce_output` inside it: of a reduce-scatter's storages the first
    allocated stays on 0, the other -> 2; HSDP's all-reduce is on `reduce_output` (2).

    FSDP1 (`_runtime_utils.py` `_unshard`, `_post_backward_hook`; `_flat_param.py`): what a collective's call
    made for itself is allocated after the last free before it ("fresh"; a collective's other storages were
    made earlier). An all-gather: the padded unsharded flat parameter (`_alloc_padded_unsharded_flat_param`
    under `_unshard_stream`, the last fresh one) -> 1, the low-precision shard (`_use_low_precision_shard`
    under `_pre_unshard_stream`) -> 3; the sharded flat parameter it reads was made at construction: 0. A
    reduction's storages -> 2: the cast to reduce_dtype, `F.pad` and `new_sharded_grad` are made under
    `_post_backward_stream`. Not inferable from the collectives: the flat gradient is made by the views'
    backward on the unshard stream (CUDA autograd runs a backward op on its forward op's stream, and
    `_use_unsharded_views` runs inside `_unshard`'s unshard-stream context), which a trace recorded with its
    streams shows and `alloc_trace` writes; here a reduction that reads it directly puts it with the
    reduction's (2), under a cast it stays on 0.

    Traces recorded with their streams (validate.measure.StreamTags: an alloc event's fourth field) are
    returned as recorded, less their ("comm", ...) events."""
    if family not in (FSDP1, FSDP2):
        raise ValueError(f"comm_streams: family {family!r}: accepted: fsdp1, fsdp2")
    if any(e[0] == "alloc" and len(e) > 3 for e in events):
        # a trace recorded with its streams (validate.measure.StreamTags: each allocation's stream as a GPU
        # would make it, backward nodes included): kept as recorded
        return [e for e in events if e[0] != "comm"]
    stream: dict[int, int] = {}
    open_: dict = {}
    calls: list = []  # [op, allocation indices, index of the last free before the call]
    last_free = -1
    prev = -2
    for i, e in enumerate(events):
        kind = e[0]
        if kind == "alloc":
            open_[e[1]] = i
        elif kind == "free":
            open_.pop(e[1], None)
            last_free = i
        elif kind == "comm" and e[1] in open_ and (e[2] in GATHERS or e[2] in REDUCTIONS):
            j = open_[e[1]]
            if prev == i - 1 and calls[-1][0] == e[2]:
                if j not in calls[-1][1]:
                    calls[-1][1].append(j)
            else:
                calls.append([e[2], [j], last_free])
            prev = i
    for op, idx, before in calls:
        idx.sort()
        if family == FSDP2:
            for j in (idx[1:] if op == "reduce_scatter" and len(idx) > 1 else idx):
                stream.setdefault(j, 1 if op in GATHERS else 2)
        elif op in GATHERS:
            fresh = [j for j in idx if j > before]
            for j in fresh:
                stream.setdefault(j, 1 if j == fresh[-1] else 3)
        else:
            for j in idx:
                stream.setdefault(j, 2)
    return [(e[0], e[1], e[2], stream.get(i, 0)) if e[0] == "alloc" else e
            for i, e in enumerate(events) if e[0] != "comm"]


@contextmanager
def collector_paused():
    """The cyclic garbage collector off inside the block, back as it was after: for loops that make many
    objects holding no cycles to collect (a replay's blocks, a trace's events), which would otherwise trigger
    collections every few hundred allocations and now and then a full one over the whole process."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def replay(events, *, expandable_segments: bool = False, max_split_size: int | None = None,
           stop_above: int | None = None, capacity: int | None = None,
           rounding: tuple | None = None) -> CachingAllocator:
    """Replay `events`: ("alloc", key, nbytes[, stream]) and ("free", key) in order (("comm", ...) events are
    skipped; `comm_streams` turns them into streams). Returns the allocator (peak_reserved,
    peak_allocated: what max_memory_reserved / max_memory_allocated would read). With `stop_above`, the
    replay ends at the first malloc that takes the reserved bytes above it (segments are never released,
    so the reserved peak is above it too): then `a.reserved > stop_above`, and the peaks are the
    partial run's. With `capacity` (CachingAllocator.capacity), a run that does not fit ends with
    `a.oom` set."""
    a = CachingAllocator(expandable_segments=expandable_segments, max_split_size=max_split_size,
                         stop_above=stop_above, capacity=capacity, rounding=rounding)
    live: dict = {}
    malloc, free, pop = a.malloc, a.free, live.pop
    # The blocks link both ways (cycles the collector would walk again and again while they pile up):
    # no collection during the loop; they go in one pass once the caller drops the allocator.
    with collector_paused():
        try:
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
        except ReservedAbove:
            pass
        except OutOfMemory:
            a.oom = True
    return a


class _EventsKey:
    """An event list as a dict key: hashed once (a tuple of tuples is rehashed on every lookup), compared
    whole."""

    __slots__ = ("events", "conf", "hash")

    def __init__(self, events: tuple, conf: tuple) -> None:
        self.events, self.conf, self.hash = events, conf, hash((events, conf))

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other) -> bool:
        return self.hash == other.hash and self.conf == other.conf and self.events == other.events


_PEAKS: dict = {}  # _EventsKey -> (peak_reserved, peak_allocated), oldest first
_PEAKS_EVENTS = [0]  # events held by _PEAKS' keys
PEAKS_CACHE_EVENTS = 400_000
"""Events `replay_peaks` remembers at most (about 40 MB; the oldest results go first)."""


def replay_peaks(events, *, expandable_segments: bool = False, max_split_size: int | None = None,
                 stop_above: int | None = None, rounding: tuple | None = None) -> tuple[int, int] | None:
    """(peak_reserved, peak_allocated) of `replay(events, ...)`, remembered by the events themselves (compared
    whole, so exact): runs that allocate alike under different names (FSDP1 FULL_SHARD and HYBRID_SHARD
    within one node) replay once. Events that are not hashable (lists) are replayed every time. With
    `stop_above`: None when the reserved peak is above it (found by a replay that stops there, not
    remembered), else the peaks."""
    try:
        key = _EventsKey(tuple(events), (expandable_segments, max_split_size, rounding))
    except TypeError:
        key = None
    hit = _PEAKS.get(key) if key is not None else None
    if hit is not None:
        return None if stop_above is not None and hit[0] > stop_above else hit
    a = replay(events, expandable_segments=expandable_segments, max_split_size=max_split_size,
               stop_above=stop_above, rounding=rounding)
    if stop_above is not None and a.reserved > stop_above:
        return None
    if key is None:
        return a.peak_reserved, a.peak_allocated
    hit = (a.peak_reserved, a.peak_allocated)
    _remember_peaks(key, hit)
    return hit


def _remember_peaks(key: _EventsKey, hit: tuple) -> None:
    _PEAKS[key] = hit
    _PEAKS_EVENTS[0] += len(key.events)
    while _PEAKS_EVENTS[0] > PEAKS_CACHE_EVENTS and len(_PEAKS) > 1:
        old = next(iter(_PEAKS))
        del _PEAKS[old]
        _PEAKS_EVENTS[0] -= len(old.events)


def replay_fit(events, capacity: int, *, expandable_segments: bool = False,
               max_split_size: int | None = None, rounding: tuple | None = None) -> tuple[int, int, int] | None:
    """(peak_reserved, peak_allocated, retries) of the run on a device where the allocator can reserve
    `capacity` bytes (CachingAllocator.capacity: the cache is released and the allocation retried before
    an out-of-memory), or None when it runs out of memory. Remembered as `replay_peaks`."""
    try:
        key = _EventsKey(tuple(events), (expandable_segments, max_split_size, capacity, rounding))
    except TypeError:
        key = None
    hit = _PEAKS.get(key) if key is not None else None
    if hit is None:
        a = replay(events, expandable_segments=expandable_segments, max_split_size=max_split_size,
                   capacity=capacity, rounding=rounding)
        hit = () if a.oom else (a.peak_reserved, a.peak_allocated, a.retries)
        if key is not None:
            _remember_peaks(key, hit)
    return hit or None


def _clear_peaks() -> None:
    _PEAKS.clear()
    _PEAKS_EVENTS[0] = 0


replay_peaks.cache_clear = _clear_peaks  # found by api.clear_caches through alloc_trace's namespace
