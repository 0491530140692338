"""The fleet file's value types: names, paths and numbers as pydantic annotations that check
their shape, and `Strict`, the base of every fleet model (unknown keys are errors)."""

from __future__ import annotations

import re
import unicodedata
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from spark_pipelines.core import names


def shaped(pattern: re.Pattern[str], what: str):
    return AfterValidator(lambda v: names.check(pattern, v, what))


NodeName = Annotated[str, shaped(names.NODE_NAME, "node name (lower-case letters, digits, '-')")]
UserName = Annotated[str, shaped(names.USER_NAME, "user name")]
Host = Annotated[str, AfterValidator(lambda v: names.check_host(v))]
ContainerName = Annotated[str, shaped(names.CONTAINER_NAME, "container name")]
ImageRef = Annotated[str, shaped(names.IMAGE_REF, "image reference (repo[:tag], lower-case)")]
def _path(what: str, form: str = "node"):
    return AfterValidator(lambda v: names.check_path(v, what, form=form))


NodePath = Annotated[str, _path("path (absolute or ~/..., no spaces or shell characters)")]
# A directory the deploy, the rollout and the rebuild set aside, relink and wipe: never the OS's.
CacheDir = Annotated[NodePath, AfterValidator(lambda v: names.check_cache_dir(v))]
AbsPath = Annotated[str, _path("absolute path (no spaces or shell characters)", "absolute")]
RepoPath = Annotated[str, _path("path inside a repository", "relative")]
GitRef = Annotated[str, shaped(names.GIT_REF, "git revision")]
HfRepo = Annotated[str, shaped(names.HF_REPO, "Hugging Face repo id (owner/name)")]
Url = Annotated[str, shaped(names.URL, "https:// or file:/// URL")]
# Numbers are strict: YAML already types them, so `true` or "8" where a number belongs is a typo
# (pydantic's lax mode would read true as 1). Floats also refuse .nan/.inf (Strict.model_config).
Int = Annotated[int, Field(strict=True)]
Float = Annotated[float, Field(strict=True)]
Port = Annotated[int, Field(strict=True, ge=1, le=65535)]
_CONTROL = frozenset({"Cc", "Cf", "Cs", "Co", "Zl", "Zp"})


def _check_text(v: str) -> str:
    bad = next((c for c in v if unicodedata.category(c) in _CONTROL), None)
    if bad is not None:
        raise ValueError(f"{names.shown(v)} contains the control or invisible character {bad!r}; remove it")
    return v


Text = Annotated[str, Field(max_length=500), AfterValidator(_check_text)]


class Strict(BaseModel):
    """Every fleet model refuses unknown keys: a typo must be an error, not a silent default."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
