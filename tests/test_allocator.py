"""finetune.backends.cuda.allocator: the model of PyTorch's CUDA caching allocator.

Every expected byte count below is worked out by hand from c10/cuda/CUDACachingAllocator.cpp
(round_size, get_allocation_size, get_free_block, should_split, alloc_block,
release_available_cached_blocks, release_cached_blocks, free_block, the expandable-segment
map/unmap) and c10/core/AllocatorConfig.cpp (parseArgs); the comments give the arithmetic.
"""

from __future__ import annotations

import random

import pytest
from allocator_invariants import check

from finetune.backends.cuda.allocator import (
    K_LARGE_BUFFER,
    K_SMALL_BUFFER,
    AllocatorOOM,
    AllocConf,
    CachingAllocator,
    allocation_size,
    parse_alloc_conf,
    replay,
    round_size,
    roundup_power2_next_division,
)

KiB = 1024
MiB = 1024 * 1024
GiB = 1024 * MiB


# --- round_size / allocation_size --------------------------------------------------------------

def test_round_size_512():
    # size < kMinBlockSize -> kMinBlockSize (0 too); else up to a multiple of 512
    assert round_size(1) == 512
    assert round_size(512) == 512
    assert round_size(513) == 1024
    assert round_size(0) == 512
    assert round_size(1000) == 1024
    assert round_size(MiB + 1) == MiB + 512


def test_round_size_power2_divisions():
    conf = AllocConf(roundup_power2_divisions=4)
    # 1200 is not > 512 * 4: plain rounding
    assert round_size(1200, conf) == 1536
    # 5000 > 2048: floor 4096, step 4096 >> 2 = 1024 -> 5120
    assert round_size(5000, conf) == 5120
    # 1 MiB + 1: floor 1 MiB, step 256 KiB
    assert round_size(MiB + 1, conf) == MiB + 256 * KiB
    assert round_size(8 * MiB, conf) == 8 * MiB  # a power of two stays
    # the source's own example: "round-up 1200 ... 4 divisions ... return 1280"
    assert roundup_power2_next_division(1200, 4) == 1280
    # 4500 with 4 divisions: floor 4096, step 1024 -> 5120; 1 division: plain 512 B rounding
    assert round_size(4500, conf) == 5120
    assert round_size(4500, AllocConf(roundup_power2_divisions=1)) == 4608


def test_round_size_per_interval_divisions():
    conf = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,>:4]")
    # 256 -> interval 8 (and 0..7, the first one named), 512 -> interval 9, '>' -> 10..15
    assert conf.roundup_power2_divisions == (1,) * 9 + (2,) + (4,) * 6
    assert round_size(300 * MiB + 1, conf) == 300 * MiB + 512  # 1 division: plain
    assert round_size(600 * MiB + 1, conf) == 768 * MiB  # 2: floor 512 MiB, step 256 MiB
    assert round_size(1536 * MiB + 1, conf) == 1792 * MiB  # 4: floor 1 GiB, step 256 MiB


def test_allocation_size():
    assert allocation_size(512) == 2 * MiB
    assert allocation_size(MiB) == 2 * MiB  # <= kSmallSize: kSmallBuffer
    assert allocation_size(MiB + 1) == 20 * MiB  # < kMinLargeAlloc: kLargeBuffer
    assert allocation_size(10 * MiB - 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB  # from kMinLargeAlloc: rounded to 2 MiB
    assert allocation_size(10 * MiB + 1) == 12 * MiB
    assert allocation_size(19 * MiB + 512 * KiB) == 20 * MiB
    assert allocation_size(201 * MiB) == 202 * MiB


def test_malloc_zero_is_null():
    a = CachingAllocator()
    assert a.malloc(0) == 0  # allocate(0) returns nullptr without calling malloc
    assert (a.allocated, a.reserved, a.segments) == (0, 0, 0)
    a.free(0)  # free(nullptr) is a no-op
    with pytest.raises(ValueError):
        a.malloc(-1)


# --- splitting, merging, caching ---------------------------------------------------------------

def test_two_small_requests_share_a_2mib_segment():
    a = CachingAllocator()
    h1 = a.malloc(600 * KiB)
    h2 = a.malloc(600 * KiB)
    assert a.segments == 1 and a.reserved == 2 * MiB
    assert a.allocated == 1200 * KiB
    assert h2 == h1 + 600 * KiB  # the second is cut from the first's remainder
    assert a.inactive_split_bytes == 2 * MiB - 1200 * KiB
    check(a)


def test_mid_size_requests_share_a_20mib_segment():
    a = CachingAllocator()
    a.malloc(5 * MiB)  # a 20 MiB segment; 15 MiB left > 1 MiB: split
    a.malloc(4 * MiB)  # best fit: the 15 MiB remainder; 11 MiB left: split
    assert (a.segments, a.reserved, a.allocated) == (1, 20 * MiB, 9 * MiB)
    assert a.inactive_split_bytes == 11 * MiB
    check(a)


def test_large_pool_split_only_above_1mib_remainder():
    a = CachingAllocator()
    a.free(a.malloc(5 * MiB))  # leaves one cached, merged 20 MiB block
    assert a.inactive_split_bytes == 0
    h = a.malloc(19 * MiB + 512 * KiB)  # remainder 0.5 MiB <= kSmallSize: not split
    assert a.block_size(h) == 20 * MiB and a.allocated == 20 * MiB  # the whole block
    assert (a.reserved, a.segments) == (20 * MiB, 1)
    a.free(h)
    h = a.malloc(19 * MiB)  # remainder exactly 1 MiB: "remaining > kSmallSize" is false
    assert a.allocated == 20 * MiB
    a.free(h)
    h = a.malloc(18 * MiB)  # remainder 2 MiB: split
    assert a.allocated == 18 * MiB and a.inactive_split_bytes == 2 * MiB
    check(a)
    # a fresh 19.5 MiB request: its segment is rounded to 20 MiB (kRoundLarge), not split
    b = CachingAllocator()
    b.malloc(19 * MiB + 512 * KiB)
    assert (b.allocated, b.reserved) == (20 * MiB, 20 * MiB)


def test_frees_merge_neighbours_and_the_segment_is_reused():
    a = CachingAllocator()
    h5 = a.malloc(5 * MiB)
    h4 = a.malloc(4 * MiB)
    a.free(h5)  # next is allocated: no merge; a split free block
    assert a.inactive_split_bytes == 5 * MiB + 11 * MiB
    a.free(h4)  # merges with both neighbours: one unsplit 20 MiB block
    assert a.inactive_split_bytes == 0 and a.allocated == 0
    check(a)
    h = a.malloc(20 * MiB)
    assert (a.reserved, a.segments, a.allocated) == (20 * MiB, 1, 20 * MiB)
    assert a.stats()["num_device_alloc"] == 1
    assert h == h5  # the same segment, from its start


def test_merge_in_any_order():
    a = CachingAllocator()
    h = [a.malloc(5 * MiB) for _ in range(3)]  # 5 + 5 + 5 (+ 5 free) in one segment
    a.free(h[1])
    a.free(h[0])
    check(a)
    a.free(h[2])
    check(a)
    assert a.inactive_split_bytes == 0
    a.empty_cache()
    assert (a.reserved, a.segments) == (0, 0)


def test_free_then_malloc_reserves_nothing_new():
    a = CachingAllocator()
    a.free(a.malloc(30 * MiB))
    a.malloc(30 * MiB)
    assert a.reserved == 30 * MiB and a.stats()["num_device_alloc"] == 1
    b = CachingAllocator()
    b.free(b.malloc(30 * MiB))
    b.malloc(25 * MiB)  # best fit in the cached 30 MiB: 5 MiB left > 1 MiB: split
    assert (b.reserved, b.allocated) == (30 * MiB, 25 * MiB)


def test_empty_cache_returns_only_fully_free_segments():
    a = CachingAllocator()
    ha = a.malloc(5 * MiB)
    hb = a.malloc(4 * MiB)  # with ha in one 20 MiB segment
    hc = a.malloc(30 * MiB)  # its own 30 MiB segment
    assert (a.reserved, a.segments) == (50 * MiB, 2)
    a.free(ha)
    a.free(hc)
    a.empty_cache()
    assert (a.reserved, a.segments, a.allocated) == (20 * MiB, 1, 4 * MiB)
    assert a.inactive_split_bytes == 5 * MiB + 11 * MiB  # split: empty_cache cannot return it
    a.free(hb)
    a.empty_cache()
    assert (a.reserved, a.segments, a.inactive_split_bytes) == (0, 0, 0)
    assert a.peak_reserved == 50 * MiB and a.peak_allocated == 39 * MiB
    check(a)


def test_best_fit_ties_go_to_the_lower_address():
    a = CachingAllocator()
    h1 = a.malloc(30 * MiB)
    h2 = a.malloc(30 * MiB)
    a.free(h2)
    a.free(h1)
    assert a.malloc(30 * MiB) == h1  # (size, address) order: the older, lower segment


# --- fragmentation -----------------------------------------------------------------------------

def fragment(a: CachingAllocator) -> tuple[int, int]:
    """Four 5 MiB blocks fill a 20 MiB segment; free the 2nd and 4th; ask for 10 MiB.
    Returns (allocated before the frees, allocated after the 10 MiB request)."""
    h = [a.malloc(5 * MiB) for _ in range(4)]
    before = a.allocated
    a.free(h[1])
    a.free(h[3])
    a.malloc(10 * MiB)
    return before, a.allocated


def test_fragmentation_needs_a_new_segment_while_allocated_is_flat():
    a = CachingAllocator()
    before, after = fragment(a)
    # 10 MiB is free in two 5 MiB holes, but no single block fits: a new 10 MiB segment
    assert before == after == 20 * MiB
    assert (a.reserved, a.segments) == (30 * MiB, 2)
    assert a.inactive_split_bytes == 10 * MiB
    check(a)


def test_fragmentation_across_segments_expandable_reserves_less():
    def run(conf: AllocConf) -> CachingAllocator:
        a = CachingAllocator(conf)
        h = [a.malloc(20 * MiB) for _ in range(3)]
        a.free(h[0])
        a.free(h[2])
        a.malloc(40 * MiB)
        check(a)
        return a

    plain = run(AllocConf())
    # three 20 MiB segments; two free, neither holds 40 MiB: a fourth of 40 MiB
    assert (plain.allocated, plain.reserved, plain.segments) == (60 * MiB, 100 * MiB, 4)
    grow = run(AllocConf(expandable_segments=True))
    # one segment of 20 MiB pages: the free last block grows by one page into the 40 MiB
    assert grow.allocated == 60 * MiB and grow.reserved == 80 * MiB
    assert grow.reserved <= plain.reserved
    assert (grow.segments, grow.expandable_segment_count) == (0, 1)


def test_fragmentation_within_a_segment_expandable_pages_cost_more():
    # the same sequence as test_fragmentation_needs_a_new_segment...: expandable segments
    # grow the free 5 MiB tail by a whole 20 MiB page (25 MiB, split 10 + 15), so they
    # reserve 40 MiB where cudaMalloc segments reserve 30 MiB: the page size is the price
    a = CachingAllocator(AllocConf(expandable_segments=True))
    before, after = fragment(a)
    assert before == after == 20 * MiB
    assert a.reserved == 40 * MiB
    assert a.inactive_split_bytes == 0  # torch leaves expandable segments out of it
    check(a)


# --- device_total: the OOM path ----------------------------------------------------------------

def test_release_cache_and_retry_before_oom():
    a = CachingAllocator(device_total=60 * MiB)
    a.free(a.malloc(30 * MiB))
    a.malloc(40 * MiB)  # 30 cached + 40 > 60: release the cache, retry (counted)
    assert a.num_alloc_retries == 1
    assert (a.reserved, a.segments, a.allocated) == (40 * MiB, 1, 40 * MiB)
    assert a.peak_reserved == 40 * MiB
    assert a.stats()["num_device_free"] == 1
    check(a)


def test_true_oom_raises_after_one_retry():
    a = CachingAllocator(device_total=60 * MiB)
    a.malloc(30 * MiB)
    a.free(a.malloc(20 * MiB))  # cached
    with pytest.raises(AllocatorOOM) as info:
        a.malloc(40 * MiB)
    exc = info.value
    assert (a.num_alloc_retries, a.num_ooms) == (1, 1)
    assert exc.alloc_size == 40 * MiB and exc.requested == 40 * MiB
    # the failed attempt released the cache: only the live 30 MiB stays reserved
    assert (a.reserved, a.allocated) == (30 * MiB, 30 * MiB)
    assert (exc.reserved, exc.allocated) == (30 * MiB, 30 * MiB)
    assert "\n" not in str(exc)
    check(a)
    a.malloc(30 * MiB)  # still usable: 30 + 30 fits
    assert a.reserved == 60 * MiB


def test_release_available_cached_blocks_frees_one_oversize_block():
    # max_split_size 40 MiB: the 50 and 70 MiB cached blocks are oversize
    a = CachingAllocator(AllocConf(max_split_size=40 * MiB), device_total=140 * MiB)
    h50 = a.malloc(50 * MiB)
    h70 = a.malloc(70 * MiB)
    a.free(h50)
    a.free(h70)
    # a 30 MiB request may not take an oversize block; 120 + 30 > 140; the smallest oversize
    # block >= max(30, 40) MiB (the 50) is released and the allocation succeeds, no retry
    a.malloc(30 * MiB)
    assert a.num_alloc_retries == 0
    assert (a.reserved, a.segments) == (100 * MiB, 2)
    check(a)


def test_release_available_cached_blocks_frees_the_largest_first():
    a = CachingAllocator(AllocConf(max_split_size=40 * MiB), device_total=170 * MiB)
    hs = [a.malloc(n * MiB) for n in (30, 50, 60)]
    for h in hs:
        a.free(h)
    assert a.reserved == 140 * MiB
    # no single cached block holds 100 MiB: release oversize blocks from the largest (60, 50)
    # until 100 MiB are freed; the 30 MiB one (not oversize) stays cached
    a.malloc(100 * MiB)
    assert a.num_alloc_retries == 0
    assert (a.reserved, a.segments) == (130 * MiB, 2)
    check(a)


def test_oversize_blocks_serve_requests_within_max_non_split_rounding():
    a = CachingAllocator(AllocConf(max_split_size=40 * MiB))
    a.free(a.malloc(70 * MiB))
    a.malloc(30 * MiB)  # below max_split_size: never an oversize block -> new segment
    assert a.reserved == 100 * MiB
    a.malloc(45 * MiB)  # 70 >= 45 + 20 MiB: refused -> new segment of 46 MiB (kRoundLarge)
    assert a.reserved == 146 * MiB
    h = a.malloc(55 * MiB)  # 70 < 55 + 20: taken whole (oversize is never split)
    assert a.block_size(h) == 70 * MiB and a.reserved == 146 * MiB
    b = CachingAllocator(AllocConf(max_split_size=40 * MiB, max_non_split_rounding_size=30 * MiB))
    b.free(b.malloc(70 * MiB))
    h = b.malloc(45 * MiB)  # 70 < 45 + 30: taken
    assert b.block_size(h) == 70 * MiB and b.reserved == 70 * MiB


def test_memory_fraction_caps_reservations():
    a = CachingAllocator(device_total=100 * MiB, memory_fraction=0.5)
    a.malloc(30 * MiB)
    with pytest.raises(AllocatorOOM):
        a.malloc(30 * MiB)  # 60 > 50 allowed, though the device has room
    assert a.num_alloc_retries == 1


def test_garbage_collection_threshold_needs_a_memory_fraction():
    def run(fraction: float | None) -> CachingAllocator:
        a = CachingAllocator(AllocConf(garbage_collection_threshold=0.5), device_total=4000 * MiB,
                             memory_fraction=fraction)
        ha = a.malloc(300 * MiB)
        hb = a.malloc(300 * MiB)
        a.free(ha)
        hc = a.malloc(320 * MiB)  # no cached block fits: GC first if over 0.5 * allowed
        a.free(hb)
        a.free(hc)
        a.malloc(400 * MiB)
        check(a)
        return a

    # no fraction: garbage collection never runs; every segment stays cached
    assert run(None).reserved == (300 + 300 + 320 + 400) * MiB
    # fraction 0.25: allowed 1000 MiB, GC above 500 MiB: the 300 MiB block (age 1, the average)
    # goes before the 320 MiB one is made; then both 300 and 320 go before the 400 MiB one
    gc = run(0.25)
    assert gc.reserved == 400 * MiB
    assert gc.num_alloc_retries == 0


# --- expandable segments -----------------------------------------------------------------------

EXP = AllocConf(expandable_segments=True)


def test_expandable_reserves_mapped_pages():
    a = CachingAllocator(EXP)
    a.malloc(600 * KiB)
    a.malloc(600 * KiB)
    assert a.reserved == K_SMALL_BUFFER  # one 2 MiB page of the small pool's segment
    a.malloc(5 * MiB)
    assert a.reserved == K_SMALL_BUFFER + K_LARGE_BUFFER  # one 20 MiB page of the large one
    assert (a.segments, a.expandable_segment_count) == (0, 2)
    b = CachingAllocator(EXP)
    b.malloc(25 * MiB)  # two 20 MiB pages; the 15 MiB left is split off (>= 512 B)
    assert (b.reserved, b.allocated) == (40 * MiB, 25 * MiB)
    check(a)
    check(b)


def test_expandable_tail_pages_unmapped_only_by_empty_cache():
    a = CachingAllocator(EXP)
    ha = a.malloc(5 * MiB)  # page 0: [0, 5) allocated, [5, 20) free
    hb = a.malloc(30 * MiB)  # the free 15 MiB grows by page 1: [5, 35) allocated
    assert a.reserved == 40 * MiB
    a.free(hb)
    assert a.reserved == 40 * MiB  # freeing unmaps nothing
    a.empty_cache()
    # the free block [5, 40) holds one whole page, [20, 40): unmapped; [5, 20) stays mapped
    assert (a.reserved, a.allocated) == (20 * MiB, 5 * MiB)
    check(a)
    a.free(ha)
    a.empty_cache()
    assert (a.reserved, a.expandable_segment_count) == (0, 0)
    check(a)


def test_expandable_best_fit_prefers_a_hole_to_the_growable_tail():
    a = CachingAllocator(EXP)
    ha = a.malloc(12 * MiB)  # page 0: [0, 12) and free [12, 20)
    a.malloc(8 * MiB)  # [12, 20): exact, not split
    hc = a.malloc(10 * MiB)  # page 1: [20, 30) and free [30, 40), before the unmapped rest
    a.free(ha)  # free [0, 12)
    # free blocks: 10 MiB at 30 (can grow: its next is unmapped) and 12 MiB at 0. get_free_block
    # counts the tail as 10 MiB + the unmapped range, so it moves on to the 12 MiB hole
    assert a.malloc(9 * MiB) == ha
    assert a.reserved == 40 * MiB
    assert a.malloc(10 * MiB) == hc + 10 * MiB  # the tail was left for a request it fits
    assert a.reserved == 40 * MiB
    check(a)


def test_expandable_oom():
    a = CachingAllocator(EXP, device_total=40 * MiB)
    with pytest.raises(AllocatorOOM):
        a.malloc(50 * MiB)  # three 20 MiB pages > 40 MiB
    assert (a.num_alloc_retries, a.reserved) == (1, 0)
    a.malloc(30 * MiB)  # two pages
    a.malloc(5 * MiB)  # fits the mapped [30, 40)
    with pytest.raises(AllocatorOOM):
        a.malloc(10 * MiB)  # needs page 2; [35, 40) holds no whole page to unmap
    assert (a.num_alloc_retries, a.reserved, a.allocated) == (2, 40 * MiB, 35 * MiB)
    check(a)


# --- random sequences: invariants --------------------------------------------------------------

CONFS = [
    AllocConf(),
    AllocConf(expandable_segments=True),
    AllocConf(max_split_size=64 * MiB),
    AllocConf(roundup_power2_divisions=4),
    AllocConf(expandable_segments=True, max_split_size=64 * MiB),
]


@pytest.mark.parametrize("device_total", [None, 2 * GiB])
@pytest.mark.parametrize("conf", CONFS, ids=["default", "expandable", "max_split", "roundup4",
                                              "expandable_max_split"])
def test_random_sequences_keep_the_invariants(conf, device_total):
    rng = random.Random(1234)
    a = CachingAllocator(conf, device_total)
    live: dict[int, int] = {}  # handle -> block size
    ooms = 0
    for step in range(2500):
        r = rng.random()
        if live and r < 0.45:
            h = rng.choice(list(live))
            del live[h]
            a.free(h)
        elif r < 0.47:
            a.empty_cache()
        else:
            nbytes = int(2 ** rng.uniform(0, 27.65))  # 1 B .. ~200 MiB, log-uniform
            try:
                h = a.malloc(nbytes)
            except AllocatorOOM:
                ooms += 1
            else:
                live[h] = a.block_size(h)
                assert live[h] >= round_size(nbytes, conf)
        assert a.reserved >= a.allocated
        assert a.allocated == sum(live.values())
        assert a.peak_reserved >= a.peak_allocated
        if step % 10 == 0:
            check(a)
    assert device_total is not None or ooms == 0
    for h in list(live):
        a.free(h)
    check(a)
    assert a.allocated == 0 and a.inactive_split_bytes == 0
    a.empty_cache()
    assert (a.reserved, a.segments) == (0, 0)
    # an expandable segment created for a request whose pages then did not fit keeps its
    # address range with nothing mapped (release_blocks only visits mapped free blocks, as in
    # torch); it holds no memory, and without a device_total none is ever left
    assert device_total is not None or a.expandable_segment_count == 0
    check(a)


def test_replay_of_a_long_step_sequence():
    # ~200,000 events shaped like training steps: per layer, activations kept for backward,
    # temporaries freed at once; backward frees the activations in reverse
    rng = random.Random(7)
    events: list[tuple[str, int, int]] = []
    key = 0
    for step in range(20):
        saved = []
        for _layer in range(1000):
            for nbytes in (64 * MiB, 16 * MiB + rng.randrange(1, 4096), 4 * MiB):
                events.append(("alloc", key, nbytes))
                saved.append(key)
                key += 1
            for nbytes in (128 * MiB, 512 * KiB):
                events.append(("alloc", key, nbytes))
                events.append(("free", key, 0))
                key += 1
        for k in reversed(saved):
            events.append(("free", k, 0))
        events.append(("mark", step, 0))
    assert len(events) > 200_000
    a = replay(events, AllocConf())
    assert a.allocated == 0 and len(a.marks) == 20
    assert a.peak_allocated >= 1000 * (64 + 16 + 4) * MiB
    assert a.peak_reserved >= a.peak_allocated
    assert a.marks[-1][1]["reserved_bytes"] == a.reserved
    check(a)


# --- replay --------------------------------------------------------------------------------------

def test_replay_events():
    events = [
        ("alloc", 1, 5 * MiB), ("alloc", 2, 4 * MiB), ("mark", 100, 0),
        ("free", 1, 0), ("free", 2, 0), ("reset_peaks", 0, 0), ("alloc", 3, MiB),
        ("empty_cache", 0, 0), ("mark", 101, 0),
    ]
    a = replay(events)
    (k0, s0), (k1, s1) = a.marks
    assert (k0, s0["allocated_bytes"], s0["reserved_bytes"]) == (100, 9 * MiB, 20 * MiB)
    # 1 MiB (small pool) takes a new 2 MiB segment; empty_cache drops the free 20 MiB one
    assert (k1, s1["allocated_bytes"], s1["reserved_bytes"]) == (101, MiB, 2 * MiB)
    assert s1["peak_reserved_bytes"] == 22 * MiB and s1["peak_allocated_bytes"] == MiB
    assert set(s1) >= {"allocated_bytes", "reserved_bytes", "peak_allocated_bytes",
                       "peak_reserved_bytes", "inactive_split_bytes", "num_alloc_retries",
                       "segment_count"}


def test_replay_errors():
    with pytest.raises(ValueError, match="live"):
        replay([("alloc", 1, 10), ("alloc", 1, 10)])
    with pytest.raises(ValueError, match="not live"):
        replay([("free", 1, 0)])
    with pytest.raises(ValueError, match="unknown op"):
        replay([("realloc", 1, 10)])
    with pytest.raises(AllocatorOOM) as info:
        replay([("alloc", 1, 30 * MiB), ("alloc", 2, 40 * MiB)], device_total=60 * MiB)
    assert info.value.event_index == 1 and info.value.allocator is not None
    assert info.value.allocator.allocated == 30 * MiB


def test_free_of_a_dead_handle_raises():
    a = CachingAllocator()
    h = a.malloc(100)
    a.free(h)
    with pytest.raises(ValueError, match="invalid device pointer"):
        a.free(h)


# --- PYTORCH_CUDA_ALLOC_CONF ---------------------------------------------------------------------

def test_parse_alloc_conf():
    conf = parse_alloc_conf("expandable_segments:True,max_split_size_mb:128")
    assert conf == AllocConf(expandable_segments=True, max_split_size=128 * MiB)
    assert parse_alloc_conf(None) == AllocConf() == parse_alloc_conf("  ")
    assert parse_alloc_conf(" expandable_segments : True , max_split_size_mb : 128 ") == conf
    assert parse_alloc_conf("garbage_collection_threshold:0.6").garbage_collection_threshold == 0.6
    assert parse_alloc_conf("roundup_power2_divisions:4").roundup_power2_divisions == 4
    assert parse_alloc_conf("max_non_split_rounding_mb:30").max_non_split_rounding_size == 30 * MiB
    # keys torch accepts that do not change the device allocator's reservations
    assert parse_alloc_conf("backend:native,pinned_use_cuda_host_register:True,"
                            "pinned_num_register_threads:8,release_lock_on_cudamalloc:True") == AllocConf()
    # later keys override earlier ones
    assert parse_alloc_conf("expandable_segments:True,expandable_segments:False") == AllocConf()


def test_parse_alloc_conf_rejects_an_unknown_key_naming_the_valid_ones():
    with pytest.raises(ValueError) as info:
        parse_alloc_conf("expandable_segments:True,max_split_size:128")
    msg = str(info.value)
    assert "max_split_size'" in msg and "\n" not in msg
    for key in ("expandable_segments", "max_split_size_mb", "roundup_power2_divisions",
                "garbage_collection_threshold"):
        assert key in msg


@pytest.mark.parametrize("text", [
    "max_split_size_mb:10",  # below kLargeBuffer / kMB = 20
    "expandable_segments:true",  # toBool: exactly True or False
    "garbage_collection_threshold:1.0",  # must be in (0.0, 1.0)
    "roundup_power2_divisions:3",  # not a power of two
    "roundup_power2_divisions:[100:2]",  # the interval not a power of two
    "backend:cudaMallocAsync",  # another allocator
    "max_split_size_mb128",  # no ':'
    "max_split_size_mb:128;expandable_segments:True",  # no ','
    "max_split_size_mb:",
])
def test_parse_alloc_conf_rejects_bad_values(text):
    with pytest.raises(ValueError):
        parse_alloc_conf(text)


def test_alloc_conf_from_the_parser_drives_the_allocator():
    conf = parse_alloc_conf("expandable_segments:True")
    a = CachingAllocator(conf)
    a.malloc(25 * MiB)
    assert a.reserved == 40 * MiB
