"""Counter-based randomness in plain PyTorch, bit for bit the same as csrc/philox.h.

    key     = (seed & 0xffffffff, seed >> 32)
    counter = (index >> 2, position | purpose << 16, round, stream)
    word    = Philox4x32-10(counter, key)[index & 3]
    uniform = ((word >> 8) + 0.5) * 2**-24   (float64, strictly inside (0, 1))
    gumbel  = -log(-log(uniform))             (float64)

Coupled sampling (DESIGN §2) keys its Gumbel noise by the output index n alone: the noise of a
request's n-th emitted token is gumbel(seed, stream, round = n, PURPOSE_COUPLED, position 0, v),
shared by the draft and the target (`site` gives the counter fields of either rule).

uint32 arithmetic is emulated in int64 tensors: products of two values below 2**32 wrap modulo
2**64, which keeps the low 64 bits exact, and masking recovers both halves.
"""
import torch

PURPOSE_DRAFT, PURPOSE_ACCEPT, PURPOSE_EMIT, PURPOSE_COUPLED = 1, 2, 3, 4
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK = 0xFFFFFFFF


def _mulhilo(m: int, x: torch.Tensor):
    p = x * m  # exact modulo 2**64
    return (p >> 32) & _MASK, p & _MASK


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on int64 tensors holding uint32 values (broadcast together)."""
    c0, c1, c2, c3, k0, k1 = torch.broadcast_tensors(c0, c1, c2, c3, k0, k1)
    for _ in range(10):
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + _W0) & _MASK
        k1 = (k1 + _W1) & _MASK
    return c0, c1, c2, c3


def site(round_, coupled, purpose: int, k):
    """(round, purpose, position) of the noise for block position k (1-based) of a round.

    Default: (round_, purpose, k). Coupled rows (bool tensor broadcast against round_; round_
    then holds n0, the tokens emitted so far): output index n0 + k, (n0 + k, PURPOSE_COUPLED, 0).
    """
    round_ = torch.as_tensor(round_, dtype=torch.int64)
    coupled = torch.as_tensor(coupled, dtype=torch.bool)
    return (torch.where(coupled, round_ + k, round_),
            torch.where(coupled, PURPOSE_COUPLED, purpose),
            torch.where(coupled, 0, torch.as_tensor(k, dtype=torch.int64)))


def words(seed, stream, round_, purpose, position, index) -> torch.Tensor:
    """32-bit random words (int64 tensor) for broadcastable seed/stream/round/purpose/position/
    index (purpose an int or an int64 tensor).

    `seed` holds uint64 bit patterns in int64 (as torch stores them)."""
    as64 = lambda t: torch.as_tensor(t, dtype=torch.int64)
    seed, stream, round_, purpose, position, index = map(
        as64, (seed, stream, round_, purpose, position, index))
    k0 = seed & _MASK
    k1 = (seed >> 32) & _MASK
    c1 = (position & 0xFFFF) | (purpose << 16)
    out = philox4x32_10((index >> 2) & _MASK, c1, round_ & _MASK, stream & _MASK, k0, k1)
    lane = index & 3
    result = torch.where(lane == 0, out[0], out[1])
    result = torch.where(lane == 2, out[2], result)
    return torch.where(lane == 3, out[3], result)


def uniform(seed, stream, round_, purpose, position, index) -> torch.Tensor:
    w = words(seed, stream, round_, purpose, position, index)
    return ((w >> 8).to(torch.float64) + 0.5) * (1.0 / 16777216.0)


def gumbel(seed, stream, round_, purpose, position, index) -> torch.Tensor:
    return -torch.log(-torch.log(uniform(seed, stream, round_, purpose, position, index)))
