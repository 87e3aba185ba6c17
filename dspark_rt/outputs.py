"""What generate() returns: text, tokens, finish reason, log-probabilities and speculative
metrics under vLLM's names."""
from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    """Speculative statistics of one request. A round verifies `verified` draft tokens and emits
    accepted + 1 tokens (the +1 is the target's own token: correction or bonus)."""
    gamma: int = 0
    num_rounds: int = 0
    num_draft_tokens: int = 0      # drafts sent to verification
    num_accepted_tokens: int = 0
    acceptance_histogram: list[int] = field(default_factory=list)  # rounds by accepted count 0..gamma
    verified_by_position: list[int] = field(default_factory=list)  # rounds that verified position k
    accepted_by_position: list[int] = field(default_factory=list)  # ... and accepted it
    num_nonfinite_drafts: int = 0  # rounds rejected at a draft whose q was NaN / inf (the
                                   # drafter overflowed; the target's token was emitted instead)

    def __post_init__(self):
        if not self.acceptance_histogram:
            self.acceptance_histogram = [0] * (self.gamma + 1)
            self.verified_by_position = [0] * self.gamma
            self.accepted_by_position = [0] * self.gamma

    def record(self, verified: int, accepted: int, nonfinite: bool = False):
        self.num_rounds += 1
        self.num_nonfinite_drafts += bool(nonfinite)
        self.num_draft_tokens += verified
        self.num_accepted_tokens += accepted
        self.acceptance_histogram[accepted] += 1
        for k in range(verified):
            self.verified_by_position[k] += 1
            self.accepted_by_position[k] += k < accepted

    def merge(self, other: "SpecMetrics"):
        if other.gamma != self.gamma:
            raise ValueError("cannot merge metrics of different gamma")
        self.num_rounds += other.num_rounds
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_nonfinite_drafts += other.num_nonfinite_drafts
        for name in ("acceptance_histogram", "verified_by_position", "accepted_by_position"):
            mine = getattr(self, name)
            for i, v in enumerate(getattr(other, name)):
                mine[i] += v

    @classmethod
    def merged(cls, metrics) -> "SpecMetrics":
        """The sum of several requests' metrics (all of one gamma; empty: gamma 0)."""
        metrics = list(metrics)
        out = cls(metrics[0].gamma if metrics else 0)
        for m in metrics:
            out.merge(m)
        return out

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per round, the bonus/correction token included (tau)."""
        return (self.num_accepted_tokens + self.num_rounds) / self.num_rounds if self.num_rounds else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """P(position k accepted | position k verified and k-1 accepted), k = 1..gamma."""
        return [a / v if v else float("nan")
                for a, v in zip(self.accepted_by_position, self.verified_by_position)]

    def as_dict(self) -> dict:
        return {
            "gamma": self.gamma, "num_rounds": self.num_rounds,
            "num_draft_tokens": self.num_draft_tokens, "num_accepted_tokens": self.num_accepted_tokens,
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "acceptance_histogram": list(self.acceptance_histogram),
            "acceptance_by_position": self.acceptance_by_position,
            "num_nonfinite_drafts": self.num_nonfinite_drafts,
        }


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    # "stop": a stop token or string; "length": max_tokens or the model's context; "abort": the
    # request was aborted (Engine.abort, or a closed stream); "error": it failed (NaN or inf in
    # the target's logits, ...), the reason in `error`; the other requests go on
    finish_reason: str
    logprobs: list[float] | None
    metrics: SpecMetrics
    error: str | None = None  # why the request failed, when finish_reason == "error"
    # SamplingParams.prompt_logprobs: per prompt token, None for the first, else {token_id:
    # logprob} of the prompt token and the top N (the target's raw log_softmax, vLLM's shape)
    prompt_logprobs: list[dict[int, float] | None] | None = None
