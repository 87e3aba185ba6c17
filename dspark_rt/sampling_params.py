"""Per-request sampling parameters, in the shape users know from vLLM."""
from dataclasses import dataclass, field

_U64 = 1 << 64


@dataclass
class SamplingParams:
    """temperature 0 is greedy. top_k <= 0 and top_p = 1 disable those filters. seed: a request
    with its own seed draws the same tokens on every backend and, under the ar / dflash / fixed /
    threshold policies, wherever it sits in a batch; under sync and async the batch moves the
    verify lengths and so the round boundaries the noise is keyed by (coupled=True removes that
    dependence). stop: strings that end the output (not included in it); stop_token_ids end it
    after that token. logprobs=True returns the target's raw log-probability of every emitted
    token: log_softmax of its logits before temperature and before top-k / top-p (vLLM's default).
    coupled: Gumbel-coupled acceptance: a seeded request emits exactly what seeded plain decoding
    emits, whatever the batch, policy or drafter; costs acceptance: P(x = y) >= (1 - TV)/(1 + TV)
    instead of 1 - TV (DESIGN §2, coupled sampling; greedy requests are unaffected).
    speculative=False: this request decodes plainly (it drafts nothing and verifies only its own
    token) while it shares the batch with speculating requests; a seeded one then emits what it
    would under mode "ar".
    """
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    coupled: bool = False
    speculative: bool = True

    def __post_init__(self):
        self.check()

    def check(self):
        """Raises ValueError naming the first bad field; also run when a request is added, since
        fields may have been set after construction."""
        def bad(name, why):
            raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0.0 <= t < float("inf")):
            bad("temperature", "must be a finite number >= 0")
        if 0 < t < 1e-3:
            bad("temperature", "must be 0 (greedy) or at least 1e-3")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            bad("top_p", "must lie in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be an int (0 or -1 disables it)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < _U64):
            bad("seed", "must be None or an int in [0, 2**64)")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "must be an int >= 1")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative ints")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "must be a bool")
        if not isinstance(self.logprobs, bool):
            bad("logprobs", "must be a bool")
        if not isinstance(self.coupled, bool):
            bad("coupled", "must be a bool")
        if not isinstance(self.speculative, bool):
            bad("speculative", "must be a bool")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
