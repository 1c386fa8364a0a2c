"""The one record schema of a protocol run, typed: ``StepRecord`` per generated token and ``RunRecord`` per run,
each with ``to_dict()`` (the JSON the compare CLI, the runner, the reference runs and the ledger read) and a
``schema_version``. ``RunRecord.from_dict`` reads any version (a first-edition ``config.mode`` becomes
``schedule`` + ``parts``; its ``ideal`` meant ``oracle``)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

SCHEMA_VERSION = 2


@dataclass
class StepRecord:
    step: int
    position: int
    query_token: int
    baseline_token: int
    patched_token: int
    match: bool
    linf: float
    tvd: float
    rank_corr: float
    top1_diff: float
    diagnostics: dict
    next_token: int
    baseline_text: str | None = None
    patched_text: str | None = None
    reused: bool | None = None                    # fixed schedule: this step reused step 0's patches
    baseline_argmax_differs: bool | None = None   # batched: full-sequence argmax vs the cached greedy token
    margin: float | None = None                   # the baseline's top-1 minus top-2 logit (a near tie when small)
    logit_scale: float | None = None              # the baseline's largest |logit| (sets one ulp of the logits)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass
class RunRecord:
    prompt: str | None
    prompt_ids: list
    prompt_encoding: str
    generated_ids: list
    generated_text: str | None
    steps: list                                   # StepRecord
    summary: dict
    config: dict
    seconds: float                                # wall time of the protocol (metrics included; loading excluded)
    schema_version: int = SCHEMA_VERSION
    extra: dict = field(default_factory=dict)     # e.g. prompt_id, added by callers

    def to_dict(self) -> dict:
        steps = [s.to_dict() if isinstance(s, StepRecord) else s for s in self.steps]
        return {"schema_version": self.schema_version, "prompt": self.prompt, "prompt_ids": self.prompt_ids,
                "prompt_encoding": self.prompt_encoding, "generated_ids": self.generated_ids,
                "generated_text": self.generated_text, "n_tokens": len(steps),
                "token_match": self.summary["token_match"], "linf": [s["linf"] for s in steps],
                "tvd": [s["tvd"] for s in steps], "summary": self.summary, "seconds": self.seconds, "steps": steps,
                "config": self.config, **self.extra}

    @classmethod
    def from_dict(cls, d: dict) -> "RunRecord":
        d = upgrade_record(d)
        names = {f.name for f in fields(StepRecord)}
        steps = [StepRecord(**{k: v for k, v in s.items() if k in names}) for s in d["steps"]]
        known = {f.name for f in fields(cls)} | {"n_tokens", "token_match", "linf", "tvd"}
        return cls(d.get("prompt"), d.get("prompt_ids", []), d.get("prompt_encoding", ""), d.get("generated_ids", []),
                   d.get("generated_text"), steps, d["summary"], d["config"], d.get("seconds", float("nan")),
                   d["schema_version"], {k: v for k, v in d.items() if k not in known})


def upgrade_record(rec: dict) -> dict:
    """A run record of any schema version, read as this one: a first-edition ``config.mode`` becomes
    (``schedule``, ``parts``), its ``ideal`` becoming ``oracle`` (what it did)."""
    cfg = rec.get("config", {})
    if "mode" in cfg and "schedule" not in cfg:
        from .algorithm import from_legacy_mode
        rec = {**rec, "config": {**cfg}}
        rec["config"]["schedule"], rec["config"]["parts"] = from_legacy_mode(cfg["mode"])
    return {"schema_version": 1, **rec}
