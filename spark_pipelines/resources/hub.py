"""Model downloads at pinned revisions (Hugging Face Hub).

The orchestrator only resolves a revision to its commit sha (the base model's data version); the
~75 GB download itself runs on the build host with the `hf` CLI, as the recipe's install.sh does,
so weights never pass through the orchestrator. The token is a `dg.EnvVar` field (Dagster reads
HF_TOKEN when a run starts; the UI shows the variable's name, never its value) and travels to the
node as a secret env value (never on a command line, never logged).
"""

from __future__ import annotations

import os

import dagster as dg
from pydantic import Field

from spark_pipelines.core import names


class HubError(Exception):
    pass


TOKEN_ENV = "HF_TOKEN"


class ModelHub(dg.ConfigurableResource):
    hf_token: str | None = Field(default=None, description=f"the HF token, as dg.EnvVar({TOKEN_ENV!r}); optional")
    endpoint: str | None = Field(default=None, description="HF_ENDPOINT override (a mirror); None = huggingface.co")

    def token(self) -> str | None:
        return self.hf_token or None

    def secret_env(self) -> dict[str, str]:
        tok = self.token()
        return {TOKEN_ENV: tok} if tok else {}

    def resolve(self, repo: str, revision: str) -> str:
        """Revision -> full commit sha. A pinned full sha is its own answer (no network needed)."""
        if names.FULL_SHA.match(revision):
            return revision
        from huggingface_hub import HfApi

        try:
            info = HfApi(endpoint=self.endpoint, token=self.token()).model_info(repo, revision=revision)
        except Exception as e:  # network, auth, unknown revision: all mean "pin by sha instead"
            raise HubError(
                f"cannot resolve {repo}@{revision} on the hub ({type(e).__name__}); "
                "pin the revision as a full 40-character commit sha in the fleet file"
            ) from None
        if not info.sha:
            raise HubError(f"the hub returned no commit sha for {repo}@{revision}; pin a full sha")
        return info.sha

    def download_argv(self, repo: str, sha: str, dest: str) -> list[str]:
        names.check(names.HF_REPO, repo, "Hugging Face repo id")
        return ["hf", "download", repo, "--revision", sha, "--local-dir", dest]


def model_hub() -> ModelHub:
    """The hub resource of the definitions. The token is declared only when HF_TOKEN is set: the
    pinned repos are public, and an EnvVar whose variable is unset fails every run that uses it."""
    return ModelHub(hf_token=dg.EnvVar(TOKEN_ENV) if os.environ.get(TOKEN_ENV) else None)
