"""The policy a model pair serves with: a name in the registry (policies.POLICIES), its options,
and the throughput profiles its class declares, given or measured on this machine once and
cached (profiling.py). The Decoder, the CLI tools and the server all resolve policies here."""
from ..policies import POLICIES, FixedPolicy, VerifyPolicy, make_policy, policy_class
from .profiling import load_or_profile_jointly
from .runner import Runner


def policy_needs_confidence(policy) -> bool:
    """Whether a policy (a registry name or an instance) reads the confidence head."""
    if isinstance(policy, str):
        return policy_class(policy).needs_confidence
    return bool(getattr(policy, "needs_confidence", False))


def resolve_policy(policy, runner: Runner, *, sps=None, options: dict | None = None,
                   measure: bool = True) -> VerifyPolicy:
    """policy: a registry name or a VerifyPolicy (returned as it is). Modes other than dspark verify
    every draft: FixedPolicy. sps: the profiles in the order the class declares them (one
    SPSProfile or path for a class that reads one; a tuple for more, None entries to measure);
    measure=False (tensor parallelism: the profiler runs in one process) makes a missing required
    profile an error instead, and leaves optional ones out. options: the class's keywords (e.g.
    threshold=). A policy that reads confidences on a drafter without a head is refused here: it
    would silently run as "fixed"."""
    if not isinstance(policy, VerifyPolicy):
        cls = policy_class(policy)
    if runner.mode != "ar" and policy_needs_confidence(policy) and not runner.has_confidence:
        name = getattr(policy, "name", policy)
        raise ValueError(f"policy {name!r} needs a drafter with a confidence head in dspark mode; "
                         f"this one (mode {runner.mode!r}) has none: use policy='fixed'")
    if runner.mode != "dspark":
        return FixedPolicy()
    if isinstance(policy, VerifyPolicy):
        return policy
    given = list(sps) if isinstance(sps, (tuple, list)) else [sps]
    given = (given + [None] * len(cls.profiles))[: len(cls.profiles)]
    profiles = dict(zip(cls.profiles, given))
    todo = [p for p in cls.profiles if profiles[p] is None]
    if not measure:
        required = [p for p in todo if p not in cls.optional_profiles]
        if required:
            raise ValueError(f"policy {policy!r} with tensor_parallel_size > 1 needs sps= (the "
                             f"profiles {required}: the profiler runs in one process; measure "
                             "them there or pass the tables)")
        todo = []
    if todo:
        # measured together, interleaved: auto decides on their ratios
        plain = Runner(runner.target, None, "ar", runner.page_size, runner.device) \
            if "plain" in todo else None
        items = {"speculative": (runner, "spread"), "plain": (plain, "spread"),
                 "no_drafts": (runner, "no_drafts"), "context": (runner, "context")}
        for name, prof in zip(todo, load_or_profile_jointly([items[p] for p in todo])):
            profiles[name] = prof
    return make_policy(policy, profiles, **(options or {}))


def registry_names() -> list[str]:
    """Every policy name a CLI or request may give."""
    return sorted(POLICIES)
