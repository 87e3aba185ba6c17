"""Per-request sampling parameters, in the shape users know from vLLM."""
import numbers
from dataclasses import dataclass, field

_U64 = 1 << 64
MAX_LOGPROBS = 20  # top alternatives per token at most (vLLM's default max_logprobs)
_F32_MAX = 3.4028234663852886e38  # the kernels compute in float32 at most: z / T must stay finite


def _real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _integral(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    """temperature 0 is greedy. top_k <= 0 and top_p = 1 disable those filters. seed: a request
    with its own seed draws the same tokens on every backend and, under the ar / dflash / fixed /
    threshold policies, wherever it sits in a batch; under sync and async the batch moves the
    verify lengths and so the round boundaries the noise is keyed by (coupled=True removes that
    dependence). max_tokens: the most new tokens; the model's context caps it (a request never
    holds more KV memory than its context needs); None: until the context ends. stop: strings that end the output (not
    included in it; they need the target's tokenizer); stop_token_ids end it after that token.
    logprobs=N (vLLM's meaning): every emitted token's log-probability under the target, with its
    rank, and the N most likely tokens of its row (N = 0: the sampled token only; at most
    MAX_LOGPROBS); True: N = 0; None or False: none. Raw log-probabilities: log_softmax of the
    target's logits before temperature and before top-k / top-p (vLLM's default).
    coupled: Gumbel-coupled acceptance: a seeded request emits exactly what seeded plain decoding
    emits, whatever the batch, policy or drafter; costs acceptance: P(x = y) >= (1 - TV)/(1 + TV)
    instead of 1 - TV (DESIGN §2, coupled sampling; greedy requests are unaffected).
    speculative=False: this request decodes plainly (it drafts nothing and verifies only its own
    token) while it shares the batch with speculating requests; a seeded one then emits what it
    would under mode "ar".
    skip_special_tokens: leave special tokens (<|endoftext|>, ...) out of the text (token_ids
    keep them). Numbers may be any numbers.Real / numbers.Integral (numpy scalars included);
    check() stores them as Python floats and ints.
    """
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool | int | None = None
    coupled: bool = False
    speculative: bool = True
    skip_special_tokens: bool = True
    # the target's raw log-probability of every prompt token given its prefix, and the top N
    # alternatives (RequestOutput.prompt_logprobs, vLLM's shape); None: not computed. A request
    # that asks is prefilled whole: a prefix-cache hit would skip the rows it reads
    prompt_logprobs: int | None = None
    structured_outputs: object = None  # StructuredOutputsParams (dspark_rt.structured) or None
    # logits processors (vLLM's meaning), applied to the target's rows only, which keeps
    # speculative acceptance exact for the processed law (docs/sampling.md): min_p drops tokens
    # less likely than min_p times the most likely one (tempered); min_tokens masks the eos and
    # stop_token_ids until that many tokens are out; allowed_token_ids keeps only those;
    # bad_words bans each word's last token where its other tokens end the output so far
    # (words are tokenized with and without a leading space, update_from_tokenizer)
    min_p: float = 0.0
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)

    def __post_init__(self):
        self._bad_words_token_ids = None  # update_from_tokenizer's (not a field: derived)
        self.check()

    def check(self):
        """Raises ValueError naming the first bad field; also run when a request is added, since
        fields may have been set after construction."""
        def bad(name, why):
            raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        t = self.temperature
        if not _real(t) or not (0.0 <= t <= _F32_MAX):
            bad("temperature", f"must be a finite number in [0, {_F32_MAX:.4g}] (float32)")
        if 0 < t < 1e-3:
            bad("temperature", "must be 0 (greedy) or at least 1e-3")
        self.temperature = float(t)
        if not _real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            bad("top_p", "must lie in (0, 1]")
        self.top_p = float(self.top_p)
        if not _integral(self.top_k) or self.top_k < -1:
            bad("top_k", "must be an int (0 or -1 disables it)")
        self.top_k = int(self.top_k)
        if self.seed is not None:
            if not _integral(self.seed) or not 0 <= self.seed < _U64:
                bad("seed", "must be None or an int in [0, 2**64)")
            self.seed = int(self.seed)
        if self.max_tokens is not None:
            if not _integral(self.max_tokens) or self.max_tokens < 1:
                bad("max_tokens", "must be None (until the context ends) or an int >= 1")
            self.max_tokens = int(self.max_tokens)
        lp = self.logprobs
        if lp is not None and not isinstance(lp, bool):
            if not _integral(lp) or not 0 <= lp <= MAX_LOGPROBS:
                bad("logprobs", f"must be None, a bool, or an int in [0, {MAX_LOGPROBS}] (top "
                    "alternatives per token)")
            self.logprobs = int(lp)
        if self.stop is None:
            self.stop = []
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a string or a list of non-empty strings")
        if any(_has_surrogate(s) for s in self.stop):
            bad("stop", "must be valid Unicode (no lone surrogates)")
        self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)) or \
                not all(_integral(i) and i >= 0 for i in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative ints")
        self.stop_token_ids = [int(i) for i in self.stop_token_ids]
        for name in ("ignore_eos", "coupled", "speculative", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a bool")
        if self.prompt_logprobs is not None:
            if not _integral(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= 20:
                bad("prompt_logprobs", "must be None or an int in [0, 20] (vLLM's max_logprobs)")
            self.prompt_logprobs = int(self.prompt_logprobs)
        from .structured.params import StructuredOutputsParams
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            bad("structured_outputs", "must be a StructuredOutputsParams or None")
        self._check_processors(bad)

    def _check_processors(self, bad):
        if not _real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must lie in [0, 1]")
        self.min_p = float(self.min_p)
        if not _integral(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be at most max_tokens ({self.max_tokens})")
        self.min_tokens = int(self.min_tokens)
        ids = self.allowed_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or not ids or \
                    not all(_integral(i) and i >= 0 for i in ids):
                bad("allowed_token_ids", "must be None or a non-empty list of non-negative ints")
            self.allowed_token_ids = [int(i) for i in ids]
        if self.bad_words is None:
            self.bad_words = []
        if not isinstance(self.bad_words, (list, tuple)) or \
                not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            bad("bad_words", "must be a list of non-blank strings")
        self.bad_words = list(self.bad_words)

    def update_from_tokenizer(self, tokenizer, vocab_size: int):
        """Token ids of bad_words (each word alone and after a space, as vLLM reads them: the
        spaced form counts where it starts with another token and has as many), and the vocab
        range of allowed_token_ids. Raises ValueError naming the field."""
        V = vocab_size
        if self.allowed_token_ids is not None and max(self.allowed_token_ids) >= V:
            raise ValueError(f"SamplingParams.allowed_token_ids must lie in [0, {V}), got "
                             f"{[i for i in self.allowed_token_ids if i >= V][:5]}")
        if not self.bad_words:
            return
        if tokenizer is None:
            raise ValueError("SamplingParams.bad_words needs the target's tokenizer (tokenizer.json)")
        words = []
        for w in self.bad_words:
            bare = tokenizer.encode(w.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + w.lstrip(), add_special_tokens=False)
            words.append(bare)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                words.append(spaced)
        if any(t >= V for w in words for t in w):
            raise ValueError(f"SamplingParams.bad_words: the tokenizer gave ids outside [0, {V})")
        self._bad_words_token_ids = words

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """bad_words as token id sequences (update_from_tokenizer), [] before or without any."""
        return list(self._bad_words_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per token when log-probabilities are asked for (True: 0), else None."""
        lp = self.logprobs
        if lp is None or lp is False:
            return None
        return 0 if lp is True else int(lp)


def _has_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
