"""A pure-Python model of PyTorch's CUDA caching allocator (one device, one stream).

The planner prices tensors; what a CUDA run actually holds is what torch's caching allocator
*reserves* for them: requests rounded up, packed into cached segments, split and merged, kept
until ``torch.cuda.empty_cache()``. This module replays a sequence of allocations and frees
through a model of that allocator and reports the figures ``torch.cuda.memory_stats()`` would:
``allocated_bytes.all.current``, ``reserved_bytes.all.current``, their peaks,
``inactive_split_bytes``, ``num_alloc_retries``, ``segment.all.current``.

Source modelled (read from pytorch/pytorch; the function names are the source's, so each rule
below can be checked against it):

- ``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``, an older revision), and
  the later refactor of the same logic into ``c10/core/CachingDeviceAllocator.h``
  (``CachingDeviceAllocatorImpl``), which this follows where they differ (the
  ``max_non_split_rounding_mb`` setting, hard-coded to its default kLargeBuffer before;
  ``release_available_cached_blocks`` skipping expandable blocks):
  ``malloc``, ``round_size``/``get_round_size``, ``roundup_power2_next_division``,
  ``get_pool``, ``get_allocation_size``, ``get_free_block``, ``should_split``,
  ``alloc_found_block``, ``alloc_block``, ``release_available_cached_blocks``,
  ``release_cached_blocks``/``release_blocks``/``release_block``, ``free``/``free_block``/
  ``try_merge_blocks``, ``garbage_collect_cached_blocks``; for expandable segments
  ``find_expandable_block``, ``try_allocate_expandable_block``, ``map_block``,
  ``unmap_block``, ``release_expandable_segment`` and ``ExpandableSegment::map``/``unmap``.
- ``c10/core/AllocatorConfig.{h,cpp}`` (``AcceleratorAllocatorConfig::parseArgs`` and its
  ``ConfigTokenizer``) and ``c10/cuda/CUDAAllocatorConfig.{h,cpp}`` (the CUDA-only keys) for
  ``PYTORCH_CUDA_ALLOC_CONF``.

Modelled exactly: rounding (512 B, and ``roundup_power2_divisions`` in both its forms), the two
pools and their segment sizes, best fit in the (size, address) order of the source's
``std::set`` comparator, the ``max_split_size``/``max_non_split_rounding_size`` rules for
oversize blocks, splitting and the stats of an unsplit block (its whole size is allocated),
merging of free neighbours, the OOM path (``release_available_cached_blocks``, then
``release_cached_blocks`` and a counted retry, then ``AllocatorOOM``), ``empty_cache``,
expandable segments (pages of 2 MiB in the small pool, 20 MiB in the large one, mapped at the
lowest address that fits, unmapped only by ``empty_cache``/the OOM path), and
``garbage_collection_threshold`` (which torch applies only under
``torch.cuda.set_per_process_memory_fraction``: pass ``memory_fraction``).

Not modelled, and why:

- streams and events (``recordStream``, ``process_events``, cross-stream reuse): one stream,
  so a freed block is reusable at once, as it is on the allocating stream;
- CUDA graph private pools and ``MemPool`` (``beginAllocateToPool``, ``use_on_oom_pools``):
  a planner replays eager steps;
- the addresses ``cudaMalloc`` returns: the model hands out increasing addresses and never
  reuses a range, so ties between equal-size free blocks go to the older segment; the driver's
  real placement is not predictable;
- ``trigger_free_memory_callbacks``: no callbacks are registered in a plain training process;
- the driver's own memory (the CUDA context, cuBLAS workspaces, NCCL buffers): they are not the
  caching allocator's; ``device_total`` is what the allocator may reserve, not the card's size
  (an expandable segment's address range, 1 1/8 of the card in torch, is sized from it here).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable
from typing import Any

from finetune.backends.cuda.alloc_config import (  # noqa: F401 (the rules, re-exported beside the allocator)
    _BASE_ADDRESS, _DEFAULT_VA_DEVICE_BYTES, _SIZE_MAX, K_LARGE_BUFFER, K_MIN_BLOCK_SIZE, K_MIN_LARGE_ALLOC,
    K_ROUND_LARGE, K_SMALL_BUFFER, K_SMALL_SIZE, AllocConf, allocation_size, parse_alloc_conf, round_size,
    roundup_power2_next_division, AllocatorOOM,
)


# --- the allocator -----------------------------------------------------------------------------

class _ExpSeg:
    """An ExpandableSegment: a virtual range of ``npages`` pages of ``page`` bytes, of which
    the pages in ``mapped`` are backed by physical memory."""

    __slots__ = ("base", "mapped", "npages", "page")

    def __init__(self, base: int, page: int, npages: int) -> None:
        self.base = base
        self.page = page
        self.npages = npages
        self.mapped: set[int] = set()

    @property
    def size(self) -> int:
        return self.page * self.npages


class _Pool:
    """A BlockPool: its cached free (mapped) blocks ordered as BlockComparatorSize orders them,
    (size, address), and its unmapped expandable ranges ordered by address
    (BlockComparatorAddress)."""

    __slots__ = ("blocks", "gc_calls", "is_small", "unmapped")

    def __init__(self, is_small: bool) -> None:
        self.is_small = is_small
        self.blocks: list[tuple[int, int, _Block]] = []
        self.unmapped: list[tuple[int, _Block]] = []
        self.gc_calls = 0  # get_free_blocks_call_count


class _Block:
    """A Block: ``size`` bytes at ``ptr``; ``prev``/``next`` link the blocks of one segment;
    ``seg`` is the expandable segment (None for a cudaMalloc segment)."""

    __slots__ = (
        "allocated",
        "gc_base",
        "mapped",
        "next",
        "pool",
        "prev",
        "ptr",
        "requested",
        "seg",
        "size",
    )

    def __init__(self, size: int, ptr: int, pool: _Pool, seg: _ExpSeg | None) -> None:
        self.size = size
        self.ptr = ptr
        self.pool = pool
        self.seg = seg
        self.allocated = False
        self.mapped = True
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.requested = 0
        self.gc_base = 0  # gc_count_base


def _remove(pool: _Pool, b: _Block) -> None:
    blocks = pool.blocks
    i = bisect_left(blocks, (b.size, b.ptr))
    if i == len(blocks) or blocks[i][2] is not b:
        raise AssertionError("allocator model: block missing from its pool's free set")
    del blocks[i]


def _remove_unmapped(pool: _Pool, b: _Block) -> None:
    unmapped = pool.unmapped
    i = bisect_left(unmapped, (b.ptr,))
    if i == len(unmapped) or unmapped[i][1] is not b:
        raise AssertionError("allocator model: block missing from its pool's unmapped set")
    del unmapped[i]


def _insert(pool: _Pool, b: _Block) -> None:
    """BlockPool::insert_into_blocks: stamps the gc age base, inserts in (size, address) order."""
    b.gc_base = pool.gc_calls
    insort(pool.blocks, (b.size, b.ptr, b))


class CachingAllocator:
    """The caching allocator of one device and one stream.

    Args:
        conf: the PYTORCH_CUDA_ALLOC_CONF settings.
        device_total: bytes the allocator may reserve in all (cudaMalloc and cuMemCreate fail
            past it); None: unlimited.
        memory_fraction: ``torch.cuda.set_per_process_memory_fraction``: caps reservations at
            ``int(memory_fraction * device_total)`` and turns on
            ``garbage_collection_threshold``. Needs device_total.

    Attributes:
        allocated: bytes in allocated blocks (``allocated_bytes.all.current``).
        reserved: bytes of mapped segments (``reserved_bytes.all.current``).
        peak_allocated, peak_reserved: their peaks since creation or ``reset_peaks``.
        num_alloc_retries: allocations that had to release the whole cache and retry.
        num_ooms: allocations that failed with AllocatorOOM.
        segments: live cudaMalloc segments (``segment.all.current``; torch does not count
            expandable segments there).
        expandable_segment_count: live expandable segments.
        inactive_split_bytes: free bytes in split cudaMalloc segments, which empty_cache
            cannot return (torch leaves expandable segments out of this stat too).
        marks: ``(key, stats())`` recorded by replay's "mark" events.
    """

    def __init__(self, conf: AllocConf = AllocConf(), device_total: int | None = None,
                 *, memory_fraction: float | None = None) -> None:
        if device_total is not None and device_total < 0:
            raise ValueError(f"device_total must be >= 0, got {device_total}")
        if memory_fraction is not None:
            if device_total is None:
                raise ValueError("memory_fraction needs device_total (it is a fraction of it)")
            if not 0.0 <= memory_fraction <= 1.0:
                raise ValueError(f"memory_fraction must be in [0, 1], got {memory_fraction}")
        self.conf = conf
        self.device_total = device_total
        self._set_fraction = memory_fraction is not None
        self._allowed_max = int((memory_fraction or 0.0) * (device_total or 0))
        self._gc = self._set_fraction and conf.garbage_collection_threshold > 0.0
        self._max_split = _SIZE_MAX if conf.max_split_size is None else conf.max_split_size
        self._max_non_split = conf.max_non_split_rounding_size
        self._expandable = conf.expandable_segments
        self._plain_rounding = (isinstance(conf.roundup_power2_divisions, int)
                                and conf.roundup_power2_divisions <= 1)
        self._small = _Pool(True)
        self._large = _Pool(False)
        self._live: dict[int, _Block] = {}  # allocated blocks by address (the handles)
        self._seg_ranges: dict[int, int] = {}  # cudaMalloc segments: base -> size
        self._exp_segs: dict[int, _ExpSeg] = {}  # expandable segments by base
        self._next_addr = _BASE_ADDRESS
        self._allocated = 0
        self._reserved = 0  # also total_allocated_memory: the two never differ here
        self._peak_allocated = 0
        self._peak_reserved = 0
        self._requested = 0
        self._inactive_split_bytes = 0
        self._num_alloc_retries = 0
        self._num_ooms = 0
        self._num_device_alloc = 0
        self._num_device_free = 0
        self.marks: list[tuple[int, dict[str, int]]] = []

    # -- public figures --

    @property
    def allocated(self) -> int:
        return self._allocated

    @property
    def reserved(self) -> int:
        return self._reserved

    @property
    def peak_allocated(self) -> int:
        return self._peak_allocated

    @property
    def peak_reserved(self) -> int:
        return self._peak_reserved

    @property
    def num_alloc_retries(self) -> int:
        return self._num_alloc_retries

    @property
    def num_ooms(self) -> int:
        return self._num_ooms

    @property
    def segments(self) -> int:
        return len(self._seg_ranges)

    @property
    def expandable_segment_count(self) -> int:
        return len(self._exp_segs)

    @property
    def inactive_split_bytes(self) -> int:
        return self._inactive_split_bytes

    def reset_peaks(self) -> None:
        """``resetPeakStats``: each peak becomes its current value."""
        self._peak_allocated = self._allocated
        self._peak_reserved = self._reserved

    def stats(self) -> dict[str, int]:
        """The figures, under names close to ``torch.cuda.memory_stats()``'s.

        Returns:
            allocated_bytes, reserved_bytes, peak_allocated_bytes, peak_reserved_bytes,
            requested_bytes, inactive_split_bytes, num_alloc_retries, num_ooms,
            segment_count (cudaMalloc segments), expandable_segment_count,
            num_device_alloc and num_device_free (cudaMalloc/map and cudaFree/unmap calls).
        """
        return {
            "allocated_bytes": self._allocated,
            "reserved_bytes": self._reserved,
            "peak_allocated_bytes": self._peak_allocated,
            "peak_reserved_bytes": self._peak_reserved,
            "requested_bytes": self._requested,
            "inactive_split_bytes": self._inactive_split_bytes,
            "num_alloc_retries": self._num_alloc_retries,
            "num_ooms": self._num_ooms,
            "segment_count": len(self._seg_ranges),
            "expandable_segment_count": len(self._exp_segs),
            "num_device_alloc": self._num_device_alloc,
            "num_device_free": self._num_device_free,
        }

    def block_size(self, handle: int) -> int:
        """The size of the live block behind ``handle`` (what ``allocated`` counts for it)."""
        return self._live[handle].size

    # -- malloc / free / empty_cache --

    def malloc(self, nbytes: int) -> int:
        """``DeviceCachingAllocator::malloc``: serve a request of ``nbytes``.

        Best fit from the cached free blocks of the request's pool (``get_free_block``); else a
        new segment (``alloc_block``); else release oversize cached blocks
        (``release_available_cached_blocks``) and try again; else release every unsplit cached
        segment (``release_cached_blocks``) and retry (counted in num_alloc_retries); else
        AllocatorOOM. The block found is split when ``should_split`` says so.

        Args:
            nbytes: the request, bytes. 0 allocates nothing and returns 0, as torch's
                ``allocate(0)`` returns a null pointer without calling malloc.

        Returns:
            A handle for ``free`` (the block's model address).

        Raises:
            AllocatorOOM: no memory for the request, even after releasing the cache.
        """
        if nbytes <= 0:
            if nbytes < 0:
                raise ValueError(f"malloc of a negative size: {nbytes}")
            return 0
        if self._plain_rounding:  # round_size, without roundup_power2_divisions
            size = (K_MIN_BLOCK_SIZE if nbytes < K_MIN_BLOCK_SIZE
                    else -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE)
        else:
            size = round_size(nbytes, self.conf)
        pool = self._small if size <= K_SMALL_SIZE else self._large  # get_pool
        block = self._get_free_block(pool, size)
        if block is None:
            alloc_size = allocation_size(size)
            if self._gc:
                self._garbage_collect_cached_blocks()
            block = self._alloc_block(pool, size, alloc_size, False)
            if block is None and self._release_available_cached_blocks(pool, size):
                block = self._alloc_block(pool, size, alloc_size, False)
            if block is None:
                self._release_cached_blocks()  # always "succeeds": the retry always runs
                block = self._alloc_block(pool, size, alloc_size, True)
            if block is None:
                self._num_ooms += 1
                raise AllocatorOOM(nbytes, alloc_size, self._allocated, self._reserved,
                                   self.device_total)
        # should_split
        remaining = block.size - size
        if pool.is_small or self._expandable:
            split = remaining >= K_MIN_BLOCK_SIZE
        else:
            split = size < self._max_split and remaining > K_SMALL_SIZE
        return self._alloc_found_block(block, pool, size, nbytes, split)

    def free(self, handle: int) -> None:
        """``DeviceCachingAllocator::free``: return a block to its pool's cache, merged with
        free neighbours of its segment (``free_block``). Nothing goes back to the device.

        Args:
            handle: what ``malloc`` returned; 0 (the null handle) is a no-op.

        Raises:
            ValueError: a handle that is not live ("invalid device pointer").
        """
        if handle == 0:
            return
        block = self._live.pop(handle, None)
        if block is None:
            raise ValueError(f"invalid device pointer: {handle:#x} is not a live allocation")
        block.allocated = False
        self._allocated -= block.size
        self._requested -= block.requested
        self._free_block(block)

    def empty_cache(self) -> None:
        """``emptyCache`` -> ``release_cached_blocks``: cudaFree every cached segment with no
        live block, and unmap the fully free pages of expandable segments."""
        self._release_cached_blocks()

    # -- internals, in the source's names --

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        """``get_free_block``: the smallest cached block of at least ``size`` (ties: lowest
        address), subject to the oversize rules."""
        if self._gc:
            pool.gc_calls += 1  # "Track block reuse interval only when garbage collection is enabled"
        blocks = pool.blocks
        n = len(blocks)
        i = bisect_left(blocks, (size,))  # lower_bound(search_key)
        if i == n:
            return None
        b = blocks[i][2]
        if b.seg is not None:
            # expandable: for best fit a block's size is what it can grow to (its size plus
            # the unmapped range after it), so a later, larger block may fit better
            def expandable_size(x: _Block) -> int:
                nx = x.next
                return x.size + (nx.size if nx is not None and not nx.mapped else 0)

            j = i + 1
            while b.seg is not None and j < n and expandable_size(blocks[j][2]) < expandable_size(b):
                i = j
                b = blocks[i][2]
                j += 1
        ms = self._max_split
        if size < ms and b.size >= ms:  # "Do not return an oversized block for a large request"
            return None
        if size >= ms and b.size >= size + self._max_non_split:  # oversize, within a limit
            return None
        del blocks[i]
        return b

    def _alloc_found_block(self, block: _Block, pool: _Pool, size: int, nbytes: int,
                           split: bool) -> int:
        """``alloc_found_block``: split off the request's front when asked, mark it allocated."""
        already_split = block.prev is not None or block.next is not None
        if split:
            remaining = block
            block = _Block(size, remaining.ptr, pool, remaining.seg)
            block.prev = remaining.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = remaining
            remaining.prev = block
            remaining.ptr += size
            remaining.size -= size
            _insert(pool, remaining)
            if remaining.seg is None:  # inactive_split leaves expandable segments out
                if already_split:
                    self._inactive_split_bytes -= size
                else:
                    self._inactive_split_bytes += remaining.size
        elif already_split and block.seg is None:
            self._inactive_split_bytes -= block.size
        block.allocated = True
        block.requested = nbytes
        self._live[block.ptr] = block
        self._allocated += block.size  # the whole block, split or not
        self._peak_allocated = max(self._peak_allocated, self._allocated)
        self._requested += nbytes
        return block.ptr

    def _free_block(self, block: _Block) -> None:
        """``free_block``: merge with free neighbours (``try_merge_blocks``), cache the result."""
        pool = block.pool
        net_size = 0
        for cand in (block.prev, block.next):
            subsumed = self._try_merge_blocks(block, cand, pool)
            if subsumed:
                net_size -= subsumed
        _insert(pool, block)
        if block.prev is not None or block.next is not None:
            net_size += block.size
        if block.seg is None:
            self._inactive_split_bytes += net_size

    @staticmethod
    def _try_merge_blocks(dst: _Block, src: _Block | None, pool: _Pool) -> int:
        """``try_merge_blocks``: absorb ``src`` (a free neighbour, mapped alike) into ``dst``;
        returns the bytes absorbed, 0 when it cannot merge."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if src.mapped:
            _remove(pool, src)
        else:
            _remove_unmapped(pool, src)
        if dst.prev is src:  # [src dst]
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int, is_retry: bool) -> _Block | None:
        """``alloc_block``: a new segment of ``alloc_size`` (cudaMalloc), or, with expandable
        segments, more mapped pages (``try_allocate_expandable_block``)."""
        if is_retry:
            self._num_alloc_retries += 1
        if self._set_fraction and self._reserved + alloc_size > self._allowed_max:
            return None
        if self._expandable:
            return self._try_allocate_expandable_block(pool, size)
        if self.device_total is not None and self._reserved + alloc_size > self.device_total:
            return None  # cudaMalloc: cudaErrorMemoryAllocation
        ptr = self._next_addr
        self._next_addr += alloc_size
        self._seg_ranges[ptr] = alloc_size
        self._reserved += alloc_size
        self._peak_reserved = max(self._peak_reserved, self._reserved)
        self._num_device_alloc += 1
        return _Block(alloc_size, ptr, pool, None)

    def _release_block(self, block: _Block) -> None:
        """``release_block``: cudaFree a whole cached segment."""
        _remove(block.pool, block)
        del self._seg_ranges[block.ptr]
        self._reserved -= block.size
        self._num_device_free += 1

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """``release_available_cached_blocks``: with a max_split_size, cudaFree the smallest
        oversize cached block that covers the request, else the largest ones until enough
        bytes are freed. Returns whether enough was freed."""
        ms = self._max_split
        if ms == _SIZE_MAX:
            return False
        blocks = pool.blocks
        key = max(size, ms)
        i = bisect_left(blocks, (key,))
        if i == len(blocks) or blocks[i][2].seg is not None:
            # "No single block is large enough; free multiple oversize blocks, starting with
            # the largest"
            if i == 0:
                return False
            released = 0
            j = i - 1
            while released < key and j >= 0 and blocks[j][0] >= ms:
                b = blocks[j][2]
                j -= 1
                if b.seg is None:
                    self._release_block(b)  # removes index j + 1: lower indices stay valid
                    released += b.size
            return released >= key
        self._release_block(blocks[i][2])
        return True

    def _release_cached_blocks(self) -> None:
        """``release_cached_blocks``: ``release_blocks`` on the large pool, then the small."""
        self._release_blocks(self._large)
        self._release_blocks(self._small)

    def _release_blocks(self, pool: _Pool) -> None:
        """``release_blocks``: cudaFree each unsplit cached segment; unmap the whole free pages
        of expandable blocks, and drop an expandable segment left with nothing mapped."""
        to_unmap: list[_Block] = []
        for _, _, b in list(pool.blocks):
            if b.seg is not None:
                to_unmap.append(b)
            elif b.prev is None and b.next is None:
                self._release_block(b)
        for b in to_unmap:
            self._unmap_block(b)
            if b.prev is None and b.next is None:
                self._release_expandable_segment(b)

    def _garbage_collect_cached_blocks(self) -> None:
        """``garbage_collect_cached_blocks``: above threshold * allowed memory, cudaFree the
        unsplit large-pool cached segments whose age (get_free_block calls since they were
        cached) is at least the average, repeating until enough is reclaimed."""
        gc_threshold = int(self.conf.garbage_collection_threshold * self._allowed_max)
        if self._reserved <= gc_threshold:
            return
        target = self._reserved - gc_threshold
        pool = self._large
        total_age = 0
        count = 0
        for _, _, b in pool.blocks:
            if b.prev is None and b.next is None:
                total_age += pool.gc_calls - b.gc_base
                count += 1
        if count == 0:
            return
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for _, _, b in list(pool.blocks):
                age = pool.gc_calls - b.gc_base
                if b.prev is None and b.next is None and b.seg is None and age >= age_threshold:
                    freed = True
                    reclaimed += b.size
                    total_age -= age
                    count -= 1
                    self._release_block(b)

    # -- expandable segments --

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        """``find_expandable_block``: the lowest address where free and unmapped ranges give
        ``size`` bytes; else a new segment (2 MiB pages in the small pool, 20 MiB in the
        large), all of it unmapped."""
        for _, c in pool.unmapped:
            if c.prev is not None and not c.prev.allocated:
                c = c.prev  # a free block right before the unmapped range counts too
            acc = 0
            b: _Block | None = c
            while acc < size and b is not None and not b.allocated:  # has_available_address_space
                acc += b.size
                b = b.next
            if acc >= size:
                return c
        page = K_SMALL_BUFFER if pool.is_small else K_LARGE_BUFFER
        total = _DEFAULT_VA_DEVICE_BYTES if self.device_total is None else self.device_total
        npages = -(-(total + total // 8) // page)  # numSegments(1 1/8 of the card)
        base = -(-self._next_addr // page) * page
        seg = _ExpSeg(base, page, npages)
        self._next_addr = base + seg.size
        self._exp_segs[base] = seg
        cand = _Block(seg.size, base, pool, seg)
        cand.mapped = False
        insort(pool.unmapped, (base, cand))
        return cand

    def _try_allocate_expandable_block(self, pool: _Pool, size: int) -> _Block | None:
        """``try_allocate_expandable_block``: map pages after the candidate until it holds
        ``size`` bytes; the result, free and mapped, is taken out of the free set."""
        cand = self._find_expandable_block(pool, size)
        if not cand.mapped and not self._map_block(cand, min(cand.size, size)):
            return None
        while cand.size < size:
            nxt = cand.next
            if nxt is None or nxt.mapped:  # the source asserts this never happens
                return None
            if not self._map_block(nxt, min(size - cand.size, nxt.size)):
                return None
            cand = nxt  # map_block merged the candidate into it
        _remove(pool, cand)
        return cand

    def _map_block(self, to_map: _Block, size: int) -> bool:
        """``map_block`` with ``ExpandableSegment::map``: back the pages that cover
        [to_map.ptr, to_map.ptr + size) with memory, all or nothing; merge with free
        neighbours; add the pages to reserved."""
        seg = to_map.seg
        assert seg is not None
        page = seg.page
        begin = (to_map.ptr - seg.base) // page  # segmentLeft
        end = -(-(to_map.ptr + size - seg.base) // page)  # segmentRight
        if begin == end:
            return False
        nbytes = (end - begin) * page
        if self.device_total is not None and self._reserved + nbytes > self.device_total:
            return False  # cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY, the pages made so far released
        seg.mapped.update(range(begin, end))
        pool = to_map.pool
        _remove_unmapped(pool, to_map)
        to_map.mapped = True
        if nbytes < to_map.size:  # to_map -> remaining (unmapped) -> to_map.next
            rest = _Block(to_map.size - nbytes, to_map.ptr + nbytes, pool, seg)
            rest.mapped = False
            rest.prev = to_map
            rest.next = to_map.next
            if to_map.next is not None:
                to_map.next.prev = rest
            to_map.next = rest
            insort(pool.unmapped, (rest.ptr, rest))
            to_map.size = nbytes
        self._try_merge_blocks(to_map, to_map.prev, pool)
        self._try_merge_blocks(to_map, to_map.next, pool)
        _insert(pool, to_map)
        self._reserved += nbytes
        self._peak_reserved = max(self._peak_reserved, self._reserved)
        self._num_device_alloc += 1
        return True

    def _unmap_block(self, block: _Block) -> None:
        """``unmap_block`` with ``ExpandableSegment::unmap``: unmap the whole pages inside a
        free block; the partial pages at either end stay mapped as free blocks."""
        seg = block.seg
        assert seg is not None
        page = seg.page
        begin = -(-(block.ptr - seg.base) // page)  # segmentRight
        end = (block.ptr + block.size - seg.base) // page  # segmentLeft
        if begin >= end:
            return
        pool = block.pool
        _remove(pool, block)
        uptr = seg.base + begin * page
        usize = (end - begin) * page
        before = uptr - block.ptr
        if before > 0:  # prev? -> before_free -> block
            bf = _Block(before, block.ptr, pool, seg)
            bf.prev = block.prev
            if block.prev is not None:
                block.prev.next = bf
            bf.next = block
            block.prev = bf
            _insert(pool, bf)
        after = block.size - before - usize
        if after > 0:  # block -> after_free -> next?
            af = _Block(after, uptr + usize, pool, seg)
            af.next = block.next
            if block.next is not None:
                block.next.prev = af
            af.prev = block
            block.next = af
            _insert(pool, af)
        block.ptr = uptr
        block.size = usize
        block.mapped = False
        self._try_merge_blocks(block, block.prev, pool)
        self._try_merge_blocks(block, block.next, pool)
        insort(pool.unmapped, (block.ptr, block))
        seg.mapped.difference_update(range(begin, end))
        self._reserved -= usize
        self._num_device_free += 1

    def _release_expandable_segment(self, block: _Block) -> None:
        """``release_expandable_segment``: drop a segment whose whole range is unmapped."""
        seg = block.seg
        assert seg is not None and not block.mapped and block.size == seg.size
        _remove_unmapped(block.pool, block)
        del self._exp_segs[seg.base]


def replay(events: Iterable[tuple[str, int, int]], conf: AllocConf = AllocConf(),
           device_total: int | None = None, *,
           memory_fraction: float | None = None) -> CachingAllocator:
    """Run a sequence of allocator events through a fresh CachingAllocator.

    Events are ``(op, key, nbytes)``:

    - ``("alloc", key, nbytes)``: malloc; ``key`` is the caller's id for the block;
    - ``("free", key, 0)``: free the block allocated under ``key``;
    - ``("empty_cache", 0, 0)``: ``torch.cuda.empty_cache()``;
    - ``("reset_peaks", 0, 0)``: ``torch.cuda.reset_peak_memory_stats()``;
    - ``("mark", key, 0)``: record ``(key, stats())`` in the allocator's ``marks`` (a step
      boundary, say).

    Args:
        events: the events, in order.
        conf: the allocator settings.
        device_total: as CachingAllocator's.
        memory_fraction: as CachingAllocator's.

    Returns:
        The allocator after the last event (its peaks, stats() and marks hold the results).

    Raises:
        AllocatorOOM: an allocation failed; its ``event_index`` and ``allocator`` are set.
        ValueError: an unknown op, an alloc under a live key, a free of an unknown key.
    """
    a = CachingAllocator(conf, device_total, memory_fraction=memory_fraction)
    handles: dict[int, int] = {}
    malloc = a.malloc
    free = a.free
    for index, (op, key, nbytes) in enumerate(events):
        if op == "alloc":
            if key in handles:
                raise ValueError(f"event {index}: alloc under key {key}, which is live")
            try:
                handles[key] = malloc(nbytes)
            except AllocatorOOM as exc:
                exc.event_index = index
                exc.allocator = a
                raise
        elif op == "free":
            handle = handles.pop(key, None)
            if handle is None:
                raise ValueError(f"event {index}: free of key {key}, which is not live")
            free(handle)
        elif op == "empty_cache":
            a.empty_cache()
        elif op == "mark":
            a.marks.append((key, a.stats()))
        elif op == "reset_peaks":
            a.reset_peaks()
        else:
            raise ValueError(f"event {index}: unknown op {op!r} "
                             "(alloc, free, empty_cache, reset_peaks, mark)")
    return a


__all__ = [
    "K_LARGE_BUFFER",
    "K_MIN_BLOCK_SIZE",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "K_SMALL_BUFFER",
    "K_SMALL_SIZE",
    "AllocConf",
    "AllocatorOOM",
    "CachingAllocator",
    "allocation_size",
    "parse_alloc_conf",
    "replay",
    "round_size",
    "roundup_power2_next_division",
]
