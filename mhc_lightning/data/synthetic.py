"""Generated English-like text: for tests and offline benchmarks (never constant, never zeros)."""

import random

WORDS = (
    "the king speaks of love and honour while a storm rolls over the sea and "
    "every lord in the hall waits for news from the north with fear"
).split()


def english_like_text(n_bytes: int, seed: int = 0) -> str:
    """Sentences of random words, at least n_bytes long."""
    rng = random.Random(seed)
    out, size = [], 0
    while size < n_bytes:
        s = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))).capitalize() + rng.choice(".!?") + " "
        out.append(s)
        size += len(s)
    return "".join(out)
