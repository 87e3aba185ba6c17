"""Plain PyTorch references: the ground truth that defines every op (DESIGN §2, §5).

The C++ CPU and CUDA kernels must reproduce these: integer outputs exactly, floats within the
tolerances argued in tests/. Randomness comes from ops/philox.py. Scores that decide a sample
(z / T + gumbel) are formed in float64 on every backend so that backends agree on the token
except on float ties of the logits themselves. Argmax ties go to the lowest index.
"""
import math

import torch

from . import philox

HEADS = ("none", "vanilla", "gated", "rnn", "selector")


def _first_argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim, lowest index among equal maxima (NaN never wins)."""
    x = torch.nan_to_num(x.to(torch.float64), nan=-math.inf)
    top = x.max(dim=-1, keepdim=True).values
    hit = x == top
    idx = torch.arange(x.shape[-1], device=x.device).expand_as(x)
    return torch.where(hit, idx, x.shape[-1]).min(dim=-1).values


def allowed(token_bitmask: torch.Tensor, V: int) -> torch.Tensor:
    """The bool [N, V] a token bitmask [N, ceil(V / 32)] int32 allows: bit v % 32 of word v // 32
    set (xgrammar's layout; bit 31 is the sign bit of the int32 word)."""
    v = torch.arange(V, device=token_bitmask.device)
    return ((token_bitmask.to(torch.int64)[:, v // 32] >> (v % 32)) & 1).bool()


def markov_sample(logits, hidden, anchor, head, w1=None, w2=None, gate_w=None, gate_b=None,
                  joint_w=None, joint_b=None, conf_w=None, conf_b=None,
                  temperature=None, seed=None, stream=None, round_=None, coupled=None, top_k=None,
                  token_bitmask=None):
    """Sequential drafting stage for R requests (DESIGN §2 steps 2-3).

    logits [R, gamma, V] base logits U (overwritten with z = U + bias); hidden [R, gamma, d];
    anchor [R] int64 x0; head in HEADS; w1, w2 [V, r]; gate_w [r, d + r], gate_b [r]
    (selector: gate_w [r, d], no gate_b; top_k the candidates per step, 1 <= top_k <= V);
    joint_w [3r, 2r + d], joint_b [3r]; conf_w [d] or [d + r], conf_b [1] (None: no confidence
    head); temperature [R] float32 (0 = greedy); seed [R] int64 (uint64 bits); stream, round_ [R]
    int64; coupled [R] bool or uint8 (None: all false); token_bitmask [R, ceil(V / 32)] int32 or
    None: the tokens a grammar allows at draft position 1 (see allowed).
    Dtypes: the logits dtype C (float32, float64, or a 16-bit type) is the compute dtype; hidden
    and every head weight share one weight dtype W, either C or a 16-bit type narrower than C
    (a bf16 model serves bf16 weights with float32 logits). Weights and hidden enter the head
    upcast to C (exact); every op below runs in C, as torch rounds it. One rounding to W: the
    vector u the projection reads (e, g * e or tanh(out)) is rounded to W first, because the
    kernels feed it to tensor cores in W (a no-op when W = C, and for vanilla, whose u = e is
    already in W); the projection w2 @ u then accumulates and rounds in C.
    For k = 1..gamma, with x_{k-1} the previous token (x0 for k = 1):
        e = w1[x_{k-1}]
        vanilla: bias = w2 @ e
        gated:   g = sigmoid(gate_w @ [h_k; e] + gate_b); bias = w2 @ (g * e)
        rnn:     a = joint_w @ [s; e; h_k] + joint_b split (gate, cand, out) in r-sized thirds;
                 s <- sigmoid(gate) * s + (1 - sigmoid(gate)) * tanh(cand); bias = w2 @ tanh(out)
        selector (DFlash2's candidate selector, models/dflash2.py): C_k = the top_k indices of
                 U_k (NaN ranks as -inf, equal values: the lower index first); g = gate_w @ h_k;
                 bias = w2 @ (g * e) on C_k, and z_k = -inf outside C_k, so q_k is the
                 proposal's softmax over the candidates and zero elsewhere
        z_k = U_k + bias, and at k = 1 under token_bitmask z_1 = -inf where the mask forbids
        (so z, lse and q describe the masked proposal; the selector's C_1 is chosen before the
        mask, so it may keep no allowed token: z_1 all -inf, a draft that is always rejected);
        greedy: x_k = argmax z_k; else x_k = argmax(z_k / T + gumbel) with the
        gumbel of (seed, stream, round, purpose draft, position k, index v); for a coupled
        request (round_ = n0, tokens emitted so far) the gumbel of output index n0 + k:
        (seed, stream, round n0 + k, purpose coupled, position 0, index v) (philox.site).
        lse_k = logsumexp(z_k / T) (T = 1 when greedy), logprob_k = z_k[x_k] / T - lse_k,
        conf_k = conf_w . ([h_k; e] if conf_w has d + r entries else h_k) + conf_b.
    Returns tokens [R, gamma] int64, logprob, lse, conf_logit [R, gamma] (float64 iff logits are).
    """
    R, gamma, V = logits.shape
    out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    dev = logits.device
    tokens = torch.empty(R, gamma, dtype=torch.int64, device=dev)
    logprob = torch.empty(R, gamma, dtype=out_dtype, device=dev)
    lse = torch.empty(R, gamma, dtype=out_dtype, device=dev)
    conf = torch.zeros(R, gamma, dtype=out_dtype, device=dev)
    if R == 0 or gamma == 0:
        return tokens, logprob, lse, conf
    T = temperature.to(torch.float64)
    greedy = T == 0
    Tsafe = torch.where(greedy, torch.ones_like(T), T)
    C, W = logits.dtype, hidden.dtype
    up = lambda t: None if t is None else t.to(C)
    hidden, w1, w2, gate_w, gate_b = up(hidden), up(w1), up(w2), up(gate_w), up(gate_b)
    joint_w, joint_b, conf_w, conf_b = up(joint_w), up(joint_b), up(conf_w), up(conf_b)
    project = lambda u: u.to(W).to(C) @ w2.T  # u rounded to W: the kernels' tensor-core operand
    rank = w1.shape[1] if w1 is not None else 0
    state = torch.zeros(R, rank, dtype=C, device=dev)
    prev = anchor.to(torch.int64)
    vocab = torch.arange(V, device=dev)
    coupled = _coupled(coupled, R, dev)
    for k in range(gamma):
        h = hidden[:, k]
        e = w1[prev] if w1 is not None else None
        if head == "none":
            bias = None
        elif head == "vanilla":
            bias = project(e)
        elif head == "gated":
            g = torch.sigmoid(torch.cat([h, e], -1) @ gate_w.T + gate_b)
            bias = project(g * e)
        elif head == "selector":
            cand = _top_k(logits[:, k], top_k)
            u = (h @ gate_w.T) * e
            bias = (w2[cand] @ u.to(W).to(C)[:, :, None])[..., 0]  # [R, top_k]: on C_k only
            z = torch.full_like(logits[:, k], -math.inf)
            logits[:, k] = z.scatter_(1, cand, logits[:, k].gather(1, cand) + bias)
            bias = None
        elif head == "rnn":
            a = torch.cat([state, e, h], -1) @ joint_w.T + joint_b
            ga, ca, oa = a.split(rank, dim=-1)
            sg = torch.sigmoid(ga)
            state = sg * state + (1 - sg) * torch.tanh(ca)
            bias = project(torch.tanh(oa))
        else:
            raise ValueError(f"markov_sample: unknown head {head!r}")
        if bias is not None:
            logits[:, k] += bias
        if k == 0 and token_bitmask is not None:
            logits[:, 0].masked_fill_(~allowed(token_bitmask, V), -math.inf)
        z = logits[:, k]
        zt = z.to(torch.float64) / Tsafe[:, None]
        rnd, purpose, pos = philox.site(round_, coupled, philox.PURPOSE_DRAFT, k + 1)
        g = philox.gumbel(seed[:, None], stream[:, None], rnd[:, None], purpose[:, None],
                          pos[:, None], vocab[None, :])
        score = torch.where(greedy[:, None], z.to(torch.float64), zt + g)
        x = _first_argmax(score)
        l = torch.logsumexp(zt, dim=-1)
        tokens[:, k] = x
        lse[:, k] = l.to(out_dtype)
        logprob[:, k] = (zt.gather(1, x[:, None])[:, 0] - l).to(out_dtype)
        if conf_w is not None:
            inp = torch.cat([h, e], -1) if conf_w.shape[0] != h.shape[-1] else h
            conf[:, k] = (inp @ conf_w + conf_b).to(out_dtype)
        prev = x
    return tokens, logprob, lse, conf


def _top_k(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of each row (NaN ranks as -inf; among equal values the
    lower index first), ordered by rank."""
    key = torch.nan_to_num(x.to(torch.float64), nan=-math.inf)
    return torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :k]


def _coupled(coupled, R, dev) -> torch.Tensor:
    """coupled [R] (bool / uint8, None = all false) as a bool tensor."""
    if coupled is None:
        return torch.zeros(R, dtype=torch.bool, device=dev)
    return coupled.to(torch.bool)


def rejection_sample(target_logits, cu_rows, draft_tokens, draft_logits, draft_lse,
                     temperature, seed, stream, round_, coupled=None, token_bitmask=None):
    """Lossless acceptance for a batch (DESIGN §2 step 6).

    target_logits [N, V]; request r owns rows cu_rows[r] .. cu_rows[r+1]-1 (int32 [R+1]), one per
    verified position: row k holds the target's logits for the token after chain entry k, so
    l_r = rows - 1 drafts are checked. draft_tokens [R, gamma] int64; draft_logits [R, gamma, V]
    (z, before temperature) and draft_lse [R, gamma] (logsumexp(z / T)) give
    q_k = exp(z_k / T - lse_k). temperature [R] float32, 0 = greedy.
    Greedy: accept x_k while x_k == argmax(row k-1); y = argmax of the first disagreeing row
    (or row l). Sampled, P_k = softmax(row_k / T) in float64: accept x_k iff
    u_k * q_k(x_k) < P_{k-1}(x_k), u_k = uniform(purpose accept, position k, index 0); at the
    first rejection j emit y = argmax(log max(0, P_{j-1} - q_j) + gumbel(emit, position j, v));
    if all l are accepted emit y = argmax(row_l / T + gumbel(emit, position l + 1, v)).
    A draft row whose q is not finite (draft_lse NaN or +-inf, or a draft logit NaN or +inf;
    -inf is a masked entry) is a rejection, never a token: its residual is P_{j-1} itself (q = 0),
    so the output law is the target's whatever the drafter emits (see nonfinite_q).
    Coupled rows (coupled [R] bool / uint8, None = all false; round_ = n0, tokens emitted so
    far), sampled: y_k = argmax(row_{k-1} / T + g_{n0+k}) with g_n the coupled gumbel of output
    index n (philox.site); accept x_k iff x_k == y_k, emit y at the first disagreement, else
    y_{l+1}. The emitted tokens are those of seeded plain decoding, whatever l (DESIGN §2).
    target_logits may be 16-bit under float32 draft_logits (widened exactly, as every row is).
    token_bitmask [N, ceil(V / 32)] int32 (None: no mask) is a grammar's mask per target row
    (see allowed): a forbidden entry is -inf before anything else reads the row, so every rule
    above (argmax, P, the residual, the bonus) runs on P' = P * mask / Z (DESIGN §6); a forbidden
    draft has P' = 0 and is rejected. A row the mask leaves empty fails the request.
    Returns num_accepted [R] int32, out_tokens [R, gamma + 1] int64 (x_1..x_a, y, then -1) and
    failed [R] bool: one of the request's rows holds NaN or +inf (its tokens mean nothing).
    """
    R = cu_rows.shape[0] - 1
    gamma = draft_tokens.shape[1] if draft_tokens is not None else 0
    dev = target_logits.device
    V = target_logits.shape[1]
    num_acc = torch.zeros(R, dtype=torch.int32, device=dev)
    out = torch.full((R, gamma + 1), -1, dtype=torch.int64, device=dev)
    failed = torch.zeros(R, dtype=torch.bool, device=dev)
    vocab = torch.arange(V, device=dev)
    coupled = _coupled(coupled, R, dev)
    ok = None if token_bitmask is None else allowed(token_bitmask, V)
    for r in range(R):
        lo, hi = int(cu_rows[r]), int(cu_rows[r + 1])
        rows = target_logits[lo:hi].to(torch.float64)
        if ok is not None:
            rows = rows.masked_fill(~ok[lo:hi], -math.inf)
        failed[r] = not bool((rows.amax(-1) < float("inf")).all())  # NaN or +inf in a row
        if ok is not None and not bool(ok[lo:hi].any(-1).all()):
            failed[r] = True  # a row the grammar leaves empty
        ell = hi - lo - 1
        T = float(temperature[r])
        key = (seed[r], stream[r], round_[r])
        a, y = 0, None
        if T == 0:
            while a < ell and int(draft_tokens[r, a]) == int(_first_argmax(rows[a])):
                a += 1
            y = int(_first_argmax(rows[a]))
        elif bool(coupled[r]):
            while True:
                rnd, purpose, pos = philox.site(round_[r], True, 0, a + 1)
                y = int(_first_argmax(rows[a] / T + philox.gumbel(seed[r], stream[r], rnd, purpose,
                                                                  pos, vocab)))
                if a == ell or int(draft_tokens[r, a]) != y:
                    break
                a += 1
        else:
            P = torch.softmax(rows / T, dim=-1)
            while a < ell:
                x = int(draft_tokens[r, a])
                zt = draft_logits[r, a].to(torch.float64) / T
                q = torch.exp(zt - float(draft_lse[r, a]))
                u = float(philox.uniform(*key, philox.PURPOSE_ACCEPT, a + 1, 0))
                if nonfinite_q(draft_logits[r, a], draft_lse[r, a]):
                    q = torch.zeros_like(q)  # rejected in full: the residual is P itself
                elif u * float(q[x]) < float(P[a, x]):
                    a += 1
                    continue
                resid = torch.clamp(P[a] - q, min=0.0)
                g = philox.gumbel(*key, philox.PURPOSE_EMIT, a + 1, vocab)
                y = int(_first_argmax(torch.log(resid) + g))
                break
            if y is None:
                g = philox.gumbel(*key, philox.PURPOSE_EMIT, ell + 1, vocab)
                y = int(_first_argmax(rows[ell] / T + g))
        num_acc[r] = a
        if a:
            out[r, :a] = draft_tokens[r, :a]
        out[r, a] = y
    return num_acc, out, failed


def nonfinite_q(z, lse) -> bool | torch.Tensor:
    """Whether a draft row's q = exp(z / T - lse) is not a distribution the acceptance may use:
    lse NaN or +-inf, or z holding NaN or +inf (-inf is a masked entry, q = 0 there). z [..., V],
    lse [...]; a bool tensor over the leading dims (a Python bool for one row)."""
    bad = ~torch.isfinite(lse) | ~(z < math.inf).all(-1)  # NaN < inf is false
    return bool(bad) if bad.dim() == 0 else bad


def prefix_topk(survival, K: int):
    """Per-request verify lengths of the top-K candidates (DESIGN §4).

    survival [R, gamma] float32 a_{r,j} (NaN counts as -inf). Candidates are ranked by a
    descending, ties to the lower position j, then to the lower request index r; the K best form
    the admitted set (K is clamped to [0, R * gamma]). l_r is the longest prefix 1..l of request
    r's candidates that lies entirely in the admitted set; for survivals non-increasing in j (as
    cumulative products are) that is simply how many of r's candidates were admitted.
    Returns lengths [R] int32.
    """
    R, gamma = survival.shape
    K = max(0, min(int(K), R * gamma))
    a = torch.nan_to_num(survival.to(torch.float64), nan=-math.inf)
    flat = a.T.reshape(-1)  # j-major: index j * R + r, so a stable sort breaks ties by (j, r)
    order = torch.sort(flat, descending=True, stable=True).indices[:K]
    admitted = torch.zeros(gamma * R, dtype=torch.bool, device=survival.device)
    admitted[order] = True
    admitted = admitted.view(gamma, R).T  # [R, gamma]
    return admitted.to(torch.int32).cumprod(dim=1).sum(dim=1).to(torch.int32)


def verify_attention(q, cu_q, k_cache, v_cache, block_tables, kv_lens, causal: bool, scale: float,
                     window: int = 0):
    """Ragged attention over a paged KV cache (DESIGN §5).

    q [N, h_q, head_dim]; request r owns rows cu_q[r] .. cu_q[r+1]-1 (int32 [R+1], n_r >= 0);
    rows cu_q[R] .. N-1, if any, belong to no request (padding) and come out zero here.
    k_cache, v_cache [num_pages, page_size, h_kv, head_dim]; block_tables [R, max_pages] int32;
    kv_lens [R] int32: keys of request r, its own chain included (n_r <= kv_len_r). Key l of
    request r lives at page block_tables[r, l // page_size], slot l % page_size. Query head h reads
    KV head h // (h_q / h_kv). Causal: chain entry i sits at position kv_len - n + i and sees keys
    0 .. kv_len - n + i; bidirectional: sees all kv_len keys. window > 0 (sliding layers, as
    z-lab's DFlash models mask them): also only keys j with p - j < window and, bidirectional,
    j - p < window, p = kv_len - n + i the entry's position. softmax(scale * q.k) @ v, formed in
    float64 for float64 inputs and float32 otherwise. Returns out [N, h_q, head_dim] in q's dtype.
    A request whose used block-table entries (the first ceil(kv_len / page_size)) are not all
    page ids in [0, num_pages), or are more than max_pages, gets NaN in all its rows: bad metadata
    on the device (not checked there without a sync) then fails that request, never another.
    """
    N, h_q, hd = q.shape
    h_kv, ps = k_cache.shape[2], k_cache.shape[1]
    group = h_q // h_kv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros_like(q)
    for r in range(cu_q.shape[0] - 1):
        lo, hi = int(cu_q[r]), int(cu_q[r + 1])
        n, L = hi - lo, int(kv_lens[r])
        if n == 0:
            continue
        used = (L + ps - 1) // ps
        pages = block_tables[r, :used].long()
        if used > block_tables.shape[1] or bool(((pages < 0) | (pages >= k_cache.shape[0])).any()):
            out[lo:hi] = math.nan
            continue
        k = k_cache[pages].reshape(-1, h_kv, hd)[:L].to(acc).repeat_interleave(group, dim=1)
        v = v_cache[pages].reshape(-1, h_kv, hd)[:L].to(acc).repeat_interleave(group, dim=1)
        s = torch.einsum("nhd,lhd->hnl", q[lo:hi].to(acc), k) * scale
        qpos = torch.arange(n, device=q.device)[:, None] + (L - n)
        kpos = torch.arange(L, device=q.device)[None, :]
        if causal:
            s = s.masked_fill(kpos > qpos, -math.inf)
        if window > 0:
            far = qpos - kpos >= window
            if not causal:
                far = far | (kpos - qpos >= window)
            s = s.masked_fill(far, -math.inf)
        out[lo:hi] = torch.einsum("hnl,lhd->nhd", torch.softmax(s, dim=-1), v).to(q.dtype)
    return out


def linear(x, w):
    """x [..., K] @ w[N, K].T -> [..., N] in x's dtype, formed in float64 for float64 inputs and
    float32 otherwise (one rounding to the output dtype)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return torch.nn.functional.linear(x.to(acc), w.to(acc)).to(x.dtype)


def append_kv(k, v, k_cache, v_cache, slot_mapping):
    """Writes new tokens' K/V into their cache slots, in place (DESIGN §5).

    k, v [N, h_kv, head_dim]; k_cache, v_cache [num_pages, page_size, h_kv, head_dim];
    slot_mapping [N] int64: slot page * page_size + offset of token n; a negative slot marks a
    padding token that is not written."""
    ok = slot_mapping >= 0
    h_kv, hd = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, h_kv, hd)[slot_mapping[ok]] = k[ok].to(k_cache.dtype)
    v_cache.view(-1, h_kv, hd)[slot_mapping[ok]] = v[ok].to(v_cache.dtype)
