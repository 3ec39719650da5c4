"""The settings and size rules of PyTorch's CUDA caching allocator, as its C++ source states them:
the constants of ``c10/cuda/CUDACachingAllocator.cpp`` (512 B rounding, the 2 MiB small and
20 MiB large segments, the 10 MiB large-allocation threshold), ``PYTORCH_CUDA_ALLOC_CONF`` parsed
as ``c10/core/AllocatorConfig.cpp`` and ``c10/cuda/CUDAAllocatorConfig.cpp`` parse it
(``AllocConf``, ``parse_alloc_conf``), and the rounding of a request and of its segment
(``round_size``, ``allocation_size``), and its out-of-memory error (``AllocatorOOM``). backends/cuda/allocator.py replays allocations through
the allocator these rules configure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# --- constants: c10/cuda/CUDACachingAllocator.cpp (and c10/core/CachingDeviceAllocator.h) ---
K_MIN_BLOCK_SIZE = 512  # bytes: kMinBlockSize, "all sizes are rounded to at least 512 bytes"
K_SMALL_SIZE = 1048576  # bytes (1 MiB): kSmallSize, the largest "small" (small-pool) request
K_SMALL_BUFFER = 2097152  # bytes (2 MiB): kSmallBuffer, a small-pool segment; also the small
# pool's expandable-segment page ("2MB for small pool" in ExpandableSegment)
K_LARGE_BUFFER = 20971520  # bytes (20 MiB): kLargeBuffer (c10/core/AllocatorConfig.h), the
# segment of a 1-10 MiB request, the large pool's expandable page, the default
# max_non_split_rounding_size, and the floor of max_split_size_mb
K_MIN_LARGE_ALLOC = 10485760  # bytes (10 MiB): kMinLargeAlloc, requests below it (and above
# kSmallSize) get a kLargeBuffer segment
K_ROUND_LARGE = 2097152  # bytes (2 MiB): kRoundLarge, larger requests round their segment to it

# c10/core/AllocatorConfig.cpp: roundup_power2_divisions keeps one value per power-of-two
# interval, 16 of them from 1 MiB (kRoundUpPowerOfTwoStart) to 64 GiB (kRoundUpPowerOfTwoEnd)
K_ROUNDUP_POWER2_INTERVALS = 16  # count: kRoundUpPowerOfTwoIntervals
_K_ROUNDUP_START_LOG2 = 20  # log2(bytes) of kRoundUpPowerOfTwoStart (1 MiB)
_MB = 1048576  # bytes: kMB, the unit of the *_mb keys

# std::numeric_limits<size_t>::max(): max_split_size's default, "unlimited"
_SIZE_MAX = (1 << 64) - 1  # bytes

# ExpandableSegment reserves virtual address space for 1 1/8 of the card's memory
# ("we allocate enough address space for 1 1/8 the total memory on the GPU"); without a
# device_total the model assumes this much device memory for that reservation only.
_DEFAULT_VA_DEVICE_BYTES = 1 << 40  # bytes (1 TiB): a model choice, large enough never to bind

_BASE_ADDRESS = 1 << 32  # the model's first device address; nonzero so 0 stays the null handle


@dataclass(frozen=True)
class AllocConf:
    """The allocator settings PYTORCH_CUDA_ALLOC_CONF sets (defaults: torch's).

    Attributes:
        expandable_segments: ``expandable_segments:True``: one growing segment per pool.
        max_split_size: bytes; blocks this large or larger are never split, and a request
            below it never takes one (``max_split_size_mb``). None: unlimited (torch's default).
        roundup_power2_divisions: ``roundup_power2_divisions``: an int applies to every size
            (0 or 1: plain 512 B rounding); a tuple of 16 ints is the bracketed per-interval
            form (interval i covers sizes in [2**(20+i), 2**(21+i)) bytes, the last one
            everything from 32 GiB up, the first one everything below 2 MiB).
        garbage_collection_threshold: fraction in [0, 1) (0: off). torch uses it only when a
            memory fraction is set (``CachingAllocator(memory_fraction=...)``).
        max_non_split_rounding_size: bytes; a request of max_split_size or more may take a
            cached oversize block at most this much larger (``max_non_split_rounding_mb``,
            default kLargeBuffer, 20 MiB).
    """

    expandable_segments: bool = False
    max_split_size: int | None = None
    roundup_power2_divisions: int | tuple[int, ...] = 0
    garbage_collection_threshold: float = 0.0
    max_non_split_rounding_size: int = K_LARGE_BUFFER

    def __post_init__(self) -> None:
        if self.max_split_size is not None and self.max_split_size <= 0:
            raise ValueError(f"max_split_size must be a positive byte count, got {self.max_split_size}")
        if self.max_non_split_rounding_size <= 0:
            raise ValueError("max_non_split_rounding_size must be a positive byte count, "
                             f"got {self.max_non_split_rounding_size}")
        d = self.roundup_power2_divisions
        if isinstance(d, tuple):
            if len(d) != K_ROUNDUP_POWER2_INTERVALS or any(v < 0 for v in d):
                raise ValueError("roundup_power2_divisions as a tuple needs "
                                 f"{K_ROUNDUP_POWER2_INTERVALS} non-negative ints, got {d!r}")
        elif d < 0:
            raise ValueError(f"roundup_power2_divisions must be >= 0, got {d}")
        if not 0.0 <= self.garbage_collection_threshold < 1.0:
            raise ValueError("garbage_collection_threshold must be in [0, 1), got "
                             f"{self.garbage_collection_threshold}")


# --- PYTORCH_CUDA_ALLOC_CONF -----------------------------------------------------------------

# keys the model reads (c10/core/AllocatorConfig.h AcceleratorAllocatorConfig::keys_, less the
# host allocator's pinned_use_background_threads)
_MODELLED_KEYS = ("expandable_segments", "max_split_size_mb", "max_non_split_rounding_mb",
                  "roundup_power2_divisions", "garbage_collection_threshold")
# keys torch accepts that do not change what the device allocator reserves: the host (pinned)
# allocator's, lock release around cudaMalloc, graph-capture stream reuse
# (AcceleratorAllocatorConfig::keys_ and CUDAAllocatorConfig::parseArgs, hip spellings too)
_ACCEPTED_KEYS = ("backend", "release_lock_on_cudamalloc", "release_lock_on_hipmalloc",
                  "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
                  "pinned_num_register_threads", "pinned_reserve_segment_size_mb",
                  "pinned_use_background_threads", "graph_capture_record_stream_reuse")
_VALID_KEYS_MSG = ("valid keys: " + ", ".join(_MODELLED_KEYS) + " (modelled); "
                   + ", ".join(_ACCEPTED_KEYS) + " (accepted, no effect on the model)")


def _tokenize(text: str) -> list[str]:
    """ConfigTokenizer (c10/core/AllocatorConfig.h): ``,`` ``:`` ``[`` ``]`` are tokens of
    their own, whitespace is dropped, everything else runs into words."""
    tokens: list[str] = []
    buf: list[str] = []
    for ch in text:
        if ch in ",:[]":
            if buf:
                tokens.append("".join(buf))
                buf.clear()
            tokens.append(ch)
        elif not ch.isspace():
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


def _conf_error(msg: str) -> ValueError:
    return ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {msg}")


def _token(tokens: list[str], i: int, what: str) -> str:
    if i >= len(tokens):
        raise _conf_error(f"expected {what} at the end of the string")
    return tokens[i]


def _expect(tokens: list[str], i: int, sep: str) -> None:
    tok = _token(tokens, i, repr(sep))
    if tok != sep:
        raise _conf_error(f"expected {sep!r}, got {tok!r}")


def _to_size(tok: str, key: str) -> int:
    """std::stoull as ConfigTokenizer::toSizeT uses it: a non-negative decimal integer."""
    if not tok.isdigit():
        raise _conf_error(f"{key}: expected a non-negative integer, got {tok!r}")
    return int(tok)


def _to_bool(tok: str, key: str) -> bool:
    """ConfigTokenizer::toBool: exactly ``True`` or ``False``."""
    if tok not in ("True", "False"):
        raise _conf_error(f"{key}: expected True or False, got {tok!r}")
    return tok == "True"


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _parse_roundup(tokens: list[str], i: int) -> tuple[int | tuple[int, ...], int]:
    """AcceleratorAllocatorConfig::parseRoundUpPower2Divisions; ``i`` is the value's index.
    Returns (value, index of the value's last token)."""
    key = "roundup_power2_divisions"
    if _token(tokens, i, "a value") != "[":
        value = _to_size(tokens[i], key)
        if not _is_pow2(value):
            raise _conf_error(f"{key}: the divisions have to be a power of 2, got {value}")
        return value, i
    divs = [0] * K_ROUNDUP_POWER2_INTERVALS
    first = True
    last_index = 0
    i += 1
    while _token(tokens, i, "']'") != "]":
        boundary_tok = tokens[i]
        _expect(tokens, i + 1, ":")
        value = _to_size(_token(tokens, i + 2, "a value"), key)
        i += 2
        if value != 0 and not _is_pow2(value):
            raise _conf_error(f"{key}: the divisions have to be a power of 2 or 0, got {value}")
        if boundary_tok == ">":
            # everything above the last interval named (from last_index + 1 on)
            for j in range(last_index + 1, K_ROUNDUP_POWER2_INTERVALS):
                divs[j] = value
        else:
            boundary = _to_size(boundary_tok, key)
            if not _is_pow2(boundary):
                raise _conf_error(f"{key}: the intervals (MB) have to be powers of 2, got {boundary}")
            index = min(boundary.bit_length() - 1, K_ROUNDUP_POWER2_INTERVALS - 1)
            if first:  # the first interval named also covers every interval below it
                for j in range(index):
                    divs[j] = value
                first = False
            divs[index] = value
            last_index = index
        if _token(tokens, i + 1, "']'") != "]":
            _expect(tokens, i + 1, ",")
            i += 1
        i += 1
    return tuple(divs), i


def _skip_value(tokens: list[str], i: int) -> int:
    """ConfigTokenizer::skipKey past the ':': a single token, or a bracketed list."""
    if _token(tokens, i, "a value") != "[":
        return i
    while _token(tokens, i, "']'") != "]":
        i += 1
    return i


def parse_alloc_conf(text: str | None) -> AllocConf:
    """Parse a PYTORCH_CUDA_ALLOC_CONF string the way torch does.

    Follows ``AcceleratorAllocatorConfig::parseArgs`` and ``CUDAAllocatorConfig::parseArgs``:
    ``key:value`` pairs separated by commas, whitespace ignored, list values in brackets
    (``roundup_power2_divisions:[256:1,512:2,>:4]``), later keys override earlier ones. Stricter
    than torch on malformed separators (torch ignores a missing ``:`` or ``,``; this raises).

    Args:
        text: the variable's value; None or blank gives the defaults.

    Returns:
        The settings as an AllocConf.

    Raises:
        ValueError: an unknown key (the message lists the valid ones), a value torch rejects
            (``max_split_size_mb`` below 20, a threshold outside (0, 1), a non-power-of-2
            division, a boolean other than True/False), ``backend:cudaMallocAsync`` (a different
            allocator, not this model), or a malformed string.
    """
    if text is None or not text.strip():
        return AllocConf()
    tokens = _tokenize(text)
    values: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        key = tokens[i]
        if key not in _MODELLED_KEYS and key not in _ACCEPTED_KEYS:
            raise _conf_error(f"unrecognized key {key!r}; {_VALID_KEYS_MSG}")
        _expect(tokens, i + 1, ":")
        i += 2
        if key == "max_split_size_mb" or key == "max_non_split_rounding_mb":
            mb = _to_size(_token(tokens, i, "a value"), key)
            if mb < K_LARGE_BUFFER // _MB:  # parseMaxSplitSize: at least kLargeBuffer / kMB
                raise _conf_error(f"{key} too small, must be >= {K_LARGE_BUFFER // _MB}, got {mb}")
            field_name = "max_split_size" if key == "max_split_size_mb" else "max_non_split_rounding_size"
            values[field_name] = min(mb, _SIZE_MAX // _MB) * _MB
        elif key == "garbage_collection_threshold":
            tok = _token(tokens, i, "a value")
            try:
                threshold = float(tok)
            except ValueError:
                raise _conf_error(f"{key}: expected a number, got {tok!r}") from None
            if not 0.0 < threshold < 1.0:
                raise _conf_error(f"{key} is invalid, set it in (0.0, 1.0), got {tok}")
            values["garbage_collection_threshold"] = threshold
        elif key == "roundup_power2_divisions":
            values["roundup_power2_divisions"], i = _parse_roundup(tokens, i)
        elif key == "expandable_segments":
            values["expandable_segments"] = _to_bool(_token(tokens, i, "a value"), key)
        elif key == "backend":
            backend = _token(tokens, i, "a value")
            if backend == "cudaMallocAsync":
                raise _conf_error("backend:cudaMallocAsync is CUDA's own pool allocator, "
                                  "not the native caching allocator this models")
            if backend != "native":
                raise _conf_error(f"unknown allocator backend {backend!r}, "
                                  "options are native and cudaMallocAsync")
        else:
            i = _skip_value(tokens, i)
        if i + 1 < len(tokens):
            _expect(tokens, i + 1, ",")
            i += 1
        i += 1
    return AllocConf(**values)


# --- sizes -------------------------------------------------------------------------------------

def _divisions_for(size: int, conf: AllocConf) -> int:
    """AcceleratorAllocatorConfig::roundup_power2_divisions(size): the interval's divisions."""
    d = conf.roundup_power2_divisions
    if isinstance(d, int):
        return d
    log_size = size.bit_length() - 1
    index = log_size - _K_ROUNDUP_START_LOG2 if log_size > _K_ROUNDUP_START_LOG2 else 0
    return d[min(index, K_ROUNDUP_POWER2_INTERVALS - 1)]


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: round ``size`` up to the next of ``divisions`` equal
    steps between the powers of two around it (1200 with 4 divisions -> 1280)."""
    if _is_pow2(size):
        return size
    if divisions < 2:
        raise ValueError("Only 2 or more divisions are supported")
    power2_floor = 1 << (size.bit_length() - 1)
    power2_division = power2_floor >> (divisions.bit_length() - 1)
    if power2_division == 0:
        return power2_floor << 1
    round_size_floor = size & ~(power2_division - 1)
    return size if round_size_floor == size else round_size_floor + power2_division


def round_size(nbytes: int, conf: AllocConf = AllocConf()) -> int:
    """``round_size``: the block size a request of ``nbytes`` takes.

    Below kMinBlockSize (0 included) it is 512 B; else a multiple of 512 B, or, where
    ``roundup_power2_divisions`` gives the size's interval more than one division and the size
    exceeds 512 B times that count, the next power-of-two division.

    Args:
        nbytes: the request, bytes.
        conf: the allocator settings (only roundup_power2_divisions matters).

    Returns:
        The rounded size, bytes.
    """
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = _divisions_for(nbytes, conf)
    if divisions > 1 and nbytes > K_MIN_BLOCK_SIZE * divisions:
        return roundup_power2_next_division(nbytes, divisions)
    return -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def allocation_size(nbytes: int) -> int:
    """``get_allocation_size``: the segment a new cudaMalloc takes for a rounded request.

    Small requests (<= 1 MiB) get a 2 MiB segment, requests below 10 MiB a 20 MiB one, larger
    ones their size rounded up to 2 MiB.
    """
    if nbytes <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if nbytes < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-nbytes // K_ROUND_LARGE) * K_ROUND_LARGE


# --- the allocator's failure ---------------------------------------------------------------

class AllocatorOOM(Exception):
    """The model's ``torch.OutOfMemoryError``: a request that no cached block serves and no new
    segment fits, after the cache was released and the allocation retried.

    Attributes:
        requested: the request, bytes.
        alloc_size: the segment it needed (``get_allocation_size``), bytes.
        allocated: bytes allocated when it failed.
        reserved: bytes reserved when it failed (after the cache was released).
        device_total: the allocator's ceiling, bytes.
        event_index: set by ``replay``: the index of the failing event.
        allocator: set by ``replay``: the allocator, in its state at the failure.
    """

    def __init__(self, requested: int, alloc_size: int, allocated: int, reserved: int,
                 device_total: int | None) -> None:
        self.requested = requested
        self.alloc_size = alloc_size
        self.allocated = allocated
        self.reserved = reserved
        self.device_total = device_total
        self.event_index: int | None = None
        self.allocator: Any = None  # a CachingAllocator (backends/cuda/allocator.py)
        total = "unlimited" if device_total is None else f"{device_total} bytes"
        super().__init__(
            f"out of memory (allocator model): tried to allocate {alloc_size} bytes for a "
            f"{requested}-byte request; device total {total}, {allocated} bytes allocated, "
            f"{reserved - allocated} bytes reserved but unallocated")
