"""What of a running request moves from decoder A to decoder B besides its KV, and what
does not yet (the request then stays on A, which finishes it; the reason is logged and
counted).

The cut: the request leaves A's batch after A sampled its k-th output token and before
that token ran. A's pages hold the KV of prompt + outputs[:k-1]; B receives prompt +
outputs as its input ids, the KV of all but the last from A (a MigrationOrder: no token
is recomputed), and runs the last (outputs[k-1]) as its first step: the prefill
hand-off's convention, so B's decode path is the one prefill-fed requests take. With
greedy sampling and a deterministic model B's continuation is exactly A's (the KV is A's,
bit for bit). A sampled request continues its sequence exactly when both decoders run
``--enable-deterministic-inference``: SGLang then draws each token from the request's seed
(``sampling_seed``, 42 when none) and the token's position, which B reproduces (its first
step samples at position prompt + k - 1, as A's next step would have); the temperature,
top-p/top-k/min-p and the seed are carried. Without it SGLang samples from one generator
shared by the batch, which no other decoder can continue: such a request stays on A, and B
refuses a sampled migration unless it runs deterministic inference itself (decode.py).

Because B sees A's outputs as input, what SGLang derives from a request's OUTPUT tokens
would restart at zero on B. Carried by arithmetic: the output budget (max_new_tokens - k),
the minimum (min_new_tokens - k), usage (A's relay adds k completion tokens and reports
A's prompt length); a grammar (JSON schema, regex, EBNF) by replay: B compiles it and
advances it over the k outputs before its first step (room.py carries k, under the MAC),
so it masks the next token as A's would have. A speculative decoder's draft (EAGLE, NEXTN,
STANDALONE) moves as on the prefill hand-off: the draft's KV layers are registered after the
target's, so A writes them in the same plan and B counts them, and B runs the last output
through target and draft (no hidden state crosses); both decoders must run the same draft
(first contact compares it). B's first step is that extend, where A's next step would have
verified a draft: from there B's verify steps accept what a decoder handed the same tokens by
a prefill server accepts (the tokens are A's either way). Not carried yet, each refused with
its reason (REFUSALS): penalties over output tokens, a structural tag, stop strings (one may
straddle the cut), logprobs (B would report them over the wrong span), sampling without
deterministic inference, n > 1, LoRA, custom logit processors, hidden-state returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .source import MigrationRefused

# (attribute path on the Req, predicate true when the request cannot migrate, reason)
REFUSALS: tuple[tuple[str, Any, str], ...] = (
    ("sampling_params.frequency_penalty", lambda v: bool(v), "a frequency penalty counts output tokens"),
    ("sampling_params.presence_penalty", lambda v: bool(v), "a presence penalty counts output tokens"),
    ("sampling_params.repetition_penalty", lambda v: v not in (None, 1.0), "a repetition penalty counts output tokens"),
    ("sampling_params.stop_strs", lambda v: bool(v), "a stop string may straddle the cut"),
    ("sampling_params.stop_regex_strs", lambda v: bool(v), "a stop regex may straddle the cut"),
    ("sampling_params.structural_tag", lambda v: v is not None, "a structural tag's state is not replayed on B yet"),
    ("sampling_params.n", lambda v: v not in (None, 1), "n > 1"),
    ("sampling_params.logit_bias", lambda v: bool(v), "a logit bias is not carried yet"),
    ("sampling_params.custom_params", lambda v: bool(v), "custom sampling parameters are not carried"),
    ("return_logprob", bool, "logprobs would be reported over B's span"),
    ("lora_id", lambda v: v is not None, "LoRA adapters are not carried"),
    ("custom_logit_processor", lambda v: v is not None, "custom logit processors are not carried"),
    ("return_hidden_states", bool, "hidden-state returns are not carried"),
)


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


SAMPLED_NEEDS = ("sampling other than greedy needs --enable-deterministic-inference (without it SGLang samples "
                 "from a generator the batch shares, which no other decoder can continue)")


def sampled(req: Any) -> bool:
    """Whether SGLang samples `req` (it normalizes temperature 0 to top_k 1: greedy is top_k == 1)."""
    return _get(req, "sampling_params.top_k") != 1


def refusals(req: Any, deterministic: bool = False) -> list[str]:
    """Why `req` (an SGLang Req) cannot migrate now from a decoder running deterministic inference
    or not; empty when it can."""
    out = [reason for path, bad, reason in REFUSALS if bad(_get(req, path))]
    if sampled(req) and not deterministic:
        out.append(SAMPLED_NEEDS)
    if not req.output_ids:
        out.append("no output token yet (it migrates after its first)")
    if req.finished():
        out.append("already finished")
    return list(dict.fromkeys(out))


def migration_refused(server_args: Any, req: Any, replay: int = 0) -> None:
    """(decoder B, at intake) A migrated request this decoder cannot continue exactly: SourceError
    with the reason (the client's request then stays on A, which continues it). With `replay`,
    its grammar accepts the last `replay` input tokens (A's outputs) here, or it is refused."""
    from .room import SourceError

    if replay:
        grammar = getattr(req, "grammar", None)
        if grammar is None or replay >= len(req.origin_input_ids):
            raise SourceError(f"a migrated request with {replay} outputs to replay has no grammar here")
        try:
            for token in list(req.origin_input_ids[-replay:]):
                grammar.accept_token(int(token))
        except Exception as e:  # noqa: BLE001 - any grammar backend's refusal, with its reason
            raise SourceError(f"the request's grammar does not accept its outputs here: {str(e)[:200]}") from None

    if sampled(req) and not getattr(server_args, "enable_deterministic_inference", False):
        raise SourceError("a sampled request migrates only to a decoder with --enable-deterministic-inference")


@dataclass(frozen=True, slots=True)
class Carried:
    """The state of a request at the cut, as B needs it."""

    rid: str
    prompt: tuple[int, ...]
    outputs: tuple[int, ...]     # k >= 1 output tokens; the last one has not run yet
    max_new_tokens: int          # the original budget
    min_new_tokens: int
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    no_stop_trim: bool
    # sampling (deterministic inference only; greedy: top_k 1 and the rest unused)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 1
    min_p: float = 0.0
    sampling_seed: int | None = None
    # a grammar (at most one of them, as SGLang takes): B replays the outputs through it first
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @property
    def grammar(self) -> bool:
        return any(g is not None for g in (self.json_schema, self.regex, self.ebnf))

    def __post_init__(self) -> None:
        if not self.outputs:
            raise ValueError("a migrated request has at least one output token")
        if self.max_new_tokens <= len(self.outputs):
            raise ValueError(f"a request with {len(self.outputs)} of {self.max_new_tokens} output tokens is done")

    @classmethod
    def of(cls, req: Any, deterministic: bool = False) -> Carried:
        """The state of SGLang Req `req` at the cut; MigrationRefused naming every reason it cannot move."""
        why = refusals(req, deterministic)
        if why:
            raise MigrationRefused(f"request {req.rid} cannot migrate: " + "; ".join(why))
        sp = req.sampling_params
        return cls(rid=req.rid, prompt=tuple(req.origin_input_ids), outputs=tuple(req.output_ids),
                   max_new_tokens=sp.max_new_tokens, min_new_tokens=sp.min_new_tokens or 0,
                   stop_token_ids=tuple(sorted(sp.stop_token_ids or ())), ignore_eos=bool(sp.ignore_eos),
                   skip_special_tokens=bool(sp.skip_special_tokens),
                   spaces_between_special_tokens=bool(sp.spaces_between_special_tokens),
                   no_stop_trim=bool(sp.no_stop_trim), temperature=float(sp.temperature), top_p=float(sp.top_p),
                   top_k=int(sp.top_k), min_p=float(sp.min_p or 0.0), sampling_seed=sp.sampling_seed,
                   json_schema=sp.json_schema, regex=sp.regex, ebnf=sp.ebnf)

    @property
    def kv_tokens(self) -> int:
        """Tokens whose KV A holds and writes: all but the last output, which B runs first."""
        return len(self.prompt) + len(self.outputs) - 1

    def resume(self) -> dict:
        """B's request: the input ids and sampling parameters that continue where A stopped
        (SGLang's native /generate fields; the relay adds stream and the migration source)."""
        k = len(self.outputs)
        params = {"max_new_tokens": self.max_new_tokens - k, "min_new_tokens": max(0, self.min_new_tokens - k),
                  "temperature": 0.0, "ignore_eos": self.ignore_eos, "skip_special_tokens": self.skip_special_tokens,
                  "spaces_between_special_tokens": self.spaces_between_special_tokens,
                  "no_stop_trim": self.no_stop_trim}
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        for key in ("json_schema", "regex", "ebnf"):
            if getattr(self, key) is not None:
                params[key] = getattr(self, key)
        if self.top_k != 1:  # sampled: the same distribution and seed, at the same positions
            params |= {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p}
            if self.sampling_seed is not None:
                params["sampling_seed"] = self.sampling_seed
        return {"input_ids": [*self.prompt, *self.outputs], "sampling_params": params}
