"""The invariants of backends/cuda/allocator.py's CachingAllocator, asserted by the tests after
each operation (linear in the number of blocks; no production path calls them)."""

from __future__ import annotations

from finetune.backends.cuda.allocator import CachingAllocator, _Block


def check(a: CachingAllocator) -> None:
    """Assert the model's invariants (for tests; linear in the number of blocks).

    Every segment is tiled exactly by its blocks, linked in address order; no two free
    mapped blocks are neighbours; the free sets hold exactly the free blocks, in order;
    allocated is the sum of the live blocks, reserved the sum of segments and mapped
    pages, inactive_split_bytes the free bytes of split cudaMalloc segments.

    Raises:
        AssertionError: an invariant does not hold.
    """
    seen: set[int] = set()
    free_ids: set[int] = set()
    unmapped_ids: set[int] = set()
    inactive = 0
    for pool in (a._small, a._large):
        assert pool.blocks == sorted(pool.blocks, key=lambda t: (t[0], t[1])), "free set order"
        for size, ptr, fb in pool.blocks:
            assert fb.size == size and fb.ptr == ptr and not fb.allocated and fb.mapped
            assert fb.pool is pool
            free_ids.add(id(fb))
        for ptr, ub in pool.unmapped:
            assert ub.ptr == ptr and not ub.mapped and not ub.allocated and ub.pool is pool
            unmapped_ids.add(id(ub))
    heads: list[_Block] = []
    for live in a._live.values():
        assert live.allocated and live.mapped
    candidates = [t[2] for pool in (a._small, a._large) for t in pool.blocks]
    candidates += [t[1] for pool in (a._small, a._large) for t in pool.unmapped]
    candidates += list(a._live.values())
    for cand in candidates:
        head = cand
        while head.prev is not None:
            head = head.prev
        if id(head) not in seen:
            seen.add(id(head))
            heads.append(head)
    malloc_segs = 0
    exp_bases: set[int] = set()
    mapped_bytes = 0
    reached = 0
    for head in heads:
        b: _Block | None = head
        addr = head.ptr
        prev: _Block | None = None
        while b is not None:
            reached += 1
            assert b.prev is prev and b.ptr == addr and b.size > 0, "segment tiling"
            assert b.seg is head.seg and b.pool is head.pool
            if b.allocated:
                assert a._live.get(b.ptr) is b
            elif b.mapped:
                assert id(b) in free_ids, "free block missing from the free set"
                assert prev is None or prev.allocated or not prev.mapped, "unmerged free neighbours"
                if head.seg is None and (b.prev is not None or b.next is not None):
                    inactive += b.size
            else:
                assert id(b) in unmapped_ids, "unmapped block missing from the unmapped set"
                assert prev is None or prev.mapped, "unmerged unmapped neighbours"
            if head.seg is not None:
                page = head.seg.page
                lo = (b.ptr - head.seg.base) // page
                hi = (b.ptr + b.size - head.seg.base + page - 1) // page
                if b.mapped:
                    assert all(p in head.seg.mapped for p in range(lo, hi)), \
                        "a mapped block on an unmapped page"
                    mapped_bytes += b.size
                else:
                    assert (b.ptr - head.seg.base) % page == 0 and b.size % page == 0
                    assert not any(lo <= p < hi for p in head.seg.mapped), \
                        "an unmapped block on a mapped page"
            addr += b.size
            prev = b
            b = b.next
        if head.seg is None:
            assert a._seg_ranges.get(head.ptr) == addr - head.ptr, "segment size"
            malloc_segs += 1
        else:
            assert head.ptr == head.seg.base and addr - head.ptr == head.seg.size
            assert a._exp_segs.get(head.seg.base) is head.seg
            exp_bases.add(head.seg.base)
    assert reached == len(candidates), "a block outside every segment"
    assert malloc_segs == len(a._seg_ranges), "a segment with no blocks"
    assert exp_bases == set(a._exp_segs), "an expandable segment with no blocks"
    assert mapped_bytes == sum(len(s.mapped) * s.page for s in a._exp_segs.values())
    assert a._reserved == sum(a._seg_ranges.values()) + mapped_bytes, "reserved"
    assert a._allocated == sum(b.size for b in a._live.values()), "allocated"
    assert a._inactive_split_bytes == inactive, "inactive_split_bytes"
    assert a._reserved >= a._allocated
    assert a._peak_reserved >= a._reserved and a._peak_allocated >= a._allocated
