"""Model downloads at pinned revisions (Hugging Face Hub).

The orchestrator only resolves a revision to its commit sha (the base model's data version); the
~75 GB download itself runs on the build host with the `hf` CLI, as the recipe's install.sh does,
so weights never pass through the orchestrator. The token comes from the environment and travels
to the node as a secret env value (never on a command line, never logged).
"""

from __future__ import annotations

import os

import dagster as dg
from pydantic import Field

from spark_pipelines.core import names


class HubError(Exception):
    pass


class ModelHub(dg.ConfigurableResource):
    token_env: str = Field(default="HF_TOKEN", description="environment variable holding the HF token (optional)")
    endpoint: str | None = Field(default=None, description="HF_ENDPOINT override (a mirror); None = huggingface.co")

    def token(self) -> str | None:
        return os.environ.get(self.token_env) or None

    def secret_env(self) -> dict[str, str]:
        tok = self.token()
        return {"HF_TOKEN": tok} if tok else {}

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
