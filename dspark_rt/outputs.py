"""What generate() returns, in vLLM's shape: a RequestOutput per prompt with its CompletionOutput
(text, tokens, log-probabilities, finish and stop reasons) and the speculative metrics under the
names the HTTP server and vLLM's Prometheus counters use."""
from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    """Speculative statistics of one request. A round verifies `verified` draft tokens and emits
    accepted + 1 tokens (the +1 is the target's own token: correction or bonus). A spec step is
    a round that drafted (verified at least one draft); rounds run plainly (the `speculative`
    switch, the auto policy, no room left for a draft) count in num_rounds only, as in the
    server's counters (docs/vllm.md)."""
    gamma: int = 0
    num_rounds: int = 0                 # every round, drafted or not
    num_draft_tokens: int = 0           # drafts sent to verification
    num_accepted_draft_tokens: int = 0  # ... and accepted
    acceptance_histogram: list[int] = field(default_factory=list)  # rounds by accepted count 0..gamma
    verified_by_position: list[int] = field(default_factory=list)  # rounds that verified position k
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # ... and accepted it
    num_nonfinite_drafts: int = 0  # rounds rejected at a draft whose q was NaN / inf (the
                                   # drafter overflowed; the target's token was emitted instead)

    def __post_init__(self):
        if not self.acceptance_histogram:
            self.acceptance_histogram = [0] * (self.gamma + 1)
            self.verified_by_position = [0] * self.gamma
            self.num_accepted_tokens_per_pos = [0] * self.gamma

    def record(self, verified: int, accepted: int, nonfinite: bool = False):
        self.num_rounds += 1
        self.num_nonfinite_drafts += bool(nonfinite)
        self.num_draft_tokens += verified
        self.num_accepted_draft_tokens += accepted
        self.acceptance_histogram[accepted] += 1
        for k in range(verified):
            self.verified_by_position[k] += 1
            self.num_accepted_tokens_per_pos[k] += k < accepted

    def merge(self, other: "SpecMetrics"):
        if other.gamma != self.gamma:
            raise ValueError("cannot merge metrics of different gamma")
        self.num_rounds += other.num_rounds
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_draft_tokens += other.num_accepted_draft_tokens
        self.num_nonfinite_drafts += other.num_nonfinite_drafts
        for name in ("acceptance_histogram", "verified_by_position", "num_accepted_tokens_per_pos"):
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
    def num_spec_steps(self) -> int:
        """Rounds that drafted (every such round verified position 0)."""
        return self.verified_by_position[0] if self.verified_by_position else 0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per spec step, the target's own token included (tau): 1 + accepted
        drafts / spec steps; 1.0 without spec steps (vLLM's, from its counters)."""
        steps = self.num_spec_steps
        return 1.0 + self.num_accepted_draft_tokens / steps if steps else 1.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """P(position k accepted | position k verified and k-1 accepted), k = 1..gamma."""
        return [a / v if v else float("nan")
                for a, v in zip(self.num_accepted_tokens_per_pos, self.verified_by_position)]

    # the names of release 0.1, read-only, until the next release
    @property
    def num_accepted_tokens(self) -> int:
        """Deprecated: num_accepted_draft_tokens."""
        return self.num_accepted_draft_tokens

    @property
    def accepted_by_position(self) -> list[int]:
        """Deprecated: num_accepted_tokens_per_pos."""
        return self.num_accepted_tokens_per_pos

    def as_dict(self) -> dict:
        return {
            "gamma": self.gamma, "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "acceptance_histogram": list(self.acceptance_histogram),
            "num_spec_steps": self.num_spec_steps, "num_rounds": self.num_rounds,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "acceptance_by_position": self.acceptance_by_position,
            "num_nonfinite_drafts": self.num_nonfinite_drafts,
        }


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability under the target (vLLM's Logprob): rank 1 is the most
    likely token of its row; decoded_token: the token's text (None without a tokenizer)."""
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """The one completion of a request (n = 1), vLLM's fields. logprobs: one dict per token,
    {token id: Logprob}, holding the sampled token and the top-N alternatives of
    SamplingParams.logprobs = N (None when not asked). cumulative_logprob: the sum of the sampled
    tokens' log-probabilities (None when not asked). stop_reason: the stop string or the
    stop_token_ids entry that ended it (None for end-of-sequence, length, abort, error)."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    # "stop": a stop token or string; "length": max_tokens or the model's context; "abort": the
    # request was aborted (Engine.abort, or a closed stream); "error": it failed (NaN or inf in
    # the target's logits, ...), the reason in RequestOutput.error; None: still running
    finish_reason: str | None
    stop_reason: int | str | None = None
    # with structured output, once finished: whether the text is a whole match of the grammar
    # (False: max_tokens or the context ended it first; the text is a prefix of a match)
    grammar_complete: bool | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """vLLM's RequestOutput (request_id is an int here), with shortcuts to outputs[0]: text,
    token_ids, finish_reason, stop_reason, cumulative_logprob, and logprobs as one float per
    token (the sampled token's; release 0.1's shape)."""
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: SpecMetrics
    error: str | None = None  # why the request failed, when finish_reason == "error"
    # SamplingParams.prompt_logprobs: per prompt token, None for the first, else {token_id:
    # logprob} of the prompt token and the top N (the target's raw log_softmax, vLLM's shape)
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason

    @property
    def cumulative_logprob(self) -> float | None:
        return self.outputs[0].cumulative_logprob

    @property
    def logprobs(self) -> list[float] | None:
        """The sampled tokens' log-probabilities (None when not asked)."""
        lps = self.outputs[0].logprobs
        return None if lps is None else [d[t].logprob for d, t in zip(lps, self.token_ids)]
