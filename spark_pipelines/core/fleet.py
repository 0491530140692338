"""The fleet file: nodes, pins, launch profile, gateway and bench settings, as validated data.

`load_fleet(path)` is the only way configuration enters spark-pipelines. Every rule of the runbook
that can be checked before touching a node is checked here, and each refusal names the field, the
value and the fix. Unknown keys are errors: a typo must not silently fall back to a default.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from spark_pipelines.core import names
from spark_pipelines.core.fleet_errors import explain, one_line, render_path
from spark_pipelines.core.fleet_yaml import MAX_DEPTH, MAX_FILE_BYTES, MAX_VALUES, HugeNumber, load_yaml
from spark_pipelines.core.fleet_settings import (
    AdoptionSettings,
    BenchSettings,
    ColdDrainSettings,
    NodeOsSettings,
    DistributionSettings,
    VersionSettings,
    GatewayFront,
    HealthSettings,
    NodePair,
    PreflightSettings,
    RetentionSettings,
    RolloutSettings,
    StepRetrySettings,
    check_pairs,
)
from spark_pipelines.core.fleet_types import (
    AbsPath,
    CacheDir,
    ContainerName,
    Float,
    GitRef,
    HfRepo,
    Host,
    ImageRef,
    Int,
    NodeName,
    NodePath,
    Port,
    RepoPath,
    Strict,
    Text,
    Url,
    UserName,
    _check_text,
    _path,
    shaped,
)


# -- hardware ----------------------------------------------------------------------------------

# The six env vars of the 2026-06-18 definitive fix. Without them vLLM captures (instead of
# estimating) CUDA graphs during profiling, ends with num_gpu_blocks=0 and EngineCore is OOM-killed.
FIX_ENV_VARS: tuple[str, ...] = (
    "MAX_JOBS",
    "FLASHINFER_NVCC_THREADS",
    "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS",
    "PYTORCH_CUDA_ALLOC_CONF",
    "VLLM_MARLIN_USE_ATOMIC_ADD",
    "VLLM_USE_FLASHINFER_SAMPLER",
)
# Needed on every node whatever the firmware: unthrottled FlashInfer JIT spawns 20-32 cicc
# processes of 1-4 GB each and the OOM killer takes the node (runbook lesson 1).
JIT_THROTTLE_ENV_VARS: tuple[str, ...] = ("MAX_JOBS", "FLASHINFER_NVCC_THREADS")

# At or below this GMU the request_memory() check passes but CUDA graph capture OOMs: 0.80 leaves
# only 30.4 GiB after the 66.93 GiB model load (runbook lesson 10). Never a fix, only a probe.
MIN_GMU = 0.80


class HardwareProfile(Strict):
    name: Annotated[str, shaped(names.NODE_NAME, "hardware profile name")]
    description: Text = ""
    cuda_total_gib: Float = Field(gt=0, le=4096, description="CUDA-visible total reported by vLLM / mem_get_info")
    max_gmu: Float = Field(gt=0, le=1)
    requires_fix_env: bool = Field(description="whether the six env vars of the 2026-06-18 fix are mandatory")
    clean_boot_free_gib: Float = Field(gt=0, le=4096, description="free CUDA memory expected after Phase 0 and a reboot")


BUILTIN_PROFILES: dict[str, HardwareProfile] = {
    # NVIDIA DGX Spark Founders Edition: 0.90 fails request_memory(); the six env vars are required.
    "founders": HardwareProfile(
        name="founders",
        description="NVIDIA DGX Spark Founders Edition (GB10, 128 GB unified)",
        cuda_total_gib=121.69,
        max_gmu=0.85,
        requires_fix_env=True,
        # memcheck after Phase 0 + reboot: "Free ~117-118 GiB on Founders". (A ~99 GiB reading of the
        # same runbook predates the 2026-06-18 fix, after which 0.85 = 103.44 GiB boots on spark1.)
        clean_boot_free_gib=117.5,
    ),
    # ASUS Ascent GX10: max 0.87 in the hardware table; tolerates missing fix vars (other firmware),
    # but is exposed to the PD-firmware wedge.
    "gx10": HardwareProfile(
        name="gx10",
        description="ASUS Ascent GX10 (GB10, 128 GB unified)",
        cuda_total_gib=121.69,
        max_gmu=0.87,
        requires_fix_env=False,
        # "Expected: Free ~106 GiB on ASUS GX10 (hardware ceiling)", the 0.90 refusal's own figure.
        clean_boot_free_gib=106.0,
    ),
}


# -- pins --------------------------------------------------------------------------------------


class GitPin(Strict):
    url: Url
    commit: GitRef


class ModelPin(Strict):
    repo: HfRepo
    revision: GitRef


_TORCH_VERSION = re.compile(r"^(?P<base>\d+\.\d+\.\d+(?:\.dev\d+)?)\+(?P<abi>cu\d+|cpu|rocm[\d.]+)\Z")


class TorchPins(Strict):
    """The torch triple, installed in BOTH build stages from ONE index (ABI drift between stages
    gives `undefined symbol ...getCurrentCUDABlasHandle`)."""

    torch: str
    torchvision: str
    torchaudio: str
    index_url: Url

    @field_validator("torch", "torchvision", "torchaudio")
    @classmethod
    def _pinned_build(cls, v: str) -> str:
        if not _TORCH_VERSION.fullmatch(v):
            raise ValueError(
                f"{names.shown(v)} is not a pinned local build like '2.12.0+cu130': pin the exact version and its +cuNNN tag"
            )
        return v

    @model_validator(mode="after")
    def _one_abi_one_index(self) -> "TorchPins":
        abis = {k: _TORCH_VERSION.match(getattr(self, k)).group("abi") for k in ("torch", "torchvision", "torchaudio")}
        if len(set(abis.values())) != 1:
            mixed = ", ".join(f"{k}={getattr(self, k)}" for k in abis)
            raise ValueError(f"the torch triple mixes ABIs ({mixed}): use one +cuNNN tag for all three")
        abi = abis["torch"]
        if abi == "cpu":
            raise ValueError("torch is pinned to a +cpu build: the serving image needs a +cu build (libtorch_cuda.so)")
        index_abi = self.index_url.rstrip("/").rsplit("/", 1)[-1]
        if index_abi != abi:
            raise ValueError(
                f"index_url {self.index_url!r} serves {index_abi!r} wheels but the triple is +{abi}: "
                f"use .../whl/{abi}"
            )
        nightly_index = "/nightly/" in self.index_url
        dev = any(".dev" in getattr(self, k) for k in ("torch", "torchvision", "torchaudio"))
        if nightly_index != dev:
            raise ValueError(
                "the torch triple mixes indexes: stable versions must come from the stable index and .dev "
                "nightlies from /whl/nightly/ (the pinned nightly dev20260408 rolled off; use the stable triple)"
            )
        return self

    @property
    def abi(self) -> str:
        return _TORCH_VERSION.match(self.torch).group("abi")


class PatchPin(Strict):
    """A PR diff from the recipe repository, compiled into the base image."""

    name: Annotated[str, shaped(names.NODE_NAME, "patch name")]
    path: RepoPath


class ServingPins(Strict):
    starlette: str
    fastapi: str

    @field_validator("starlette", "fastapi")
    @classmethod
    def _spec(cls, v: str) -> str:
        if not re.fullmatch(r"[<>=!~]=?[0-9][0-9.]*(,[<>=!~]=?[0-9][0-9.]*)*", v):
            raise ValueError(f"{names.shown(v)} is not a version specifier like '>=0.40.0,<1.0'")
        return v


class BuildSettings(Strict):
    base_tag: ImageRef = "vllm-sm121"
    tf5: bool = True
    jobs: Int = Field(default=8, ge=1, le=64)


class Pins(Strict):
    vllm_ref: GitRef
    build_repo: GitPin
    recipe_repo: GitPin
    base_model: ModelPin
    fp8_model: ModelPin
    torch: TorchPins
    serving: ServingPins
    patches: tuple[PatchPin, ...] = ()
    build: BuildSettings = BuildSettings()


# -- launch profile ----------------------------------------------------------------------------


class Mount(Strict):
    host: CacheDir
    container: Annotated[str, _path("container path", "absolute")]


class Speculative(Strict):
    method: Literal["mtp", "eagle", "ngram"] = "mtp"
    num_speculative_tokens: Int = Field(default=2, ge=1, le=8)


# Flags the runbook forbids, with the reason given back to the operator.
FORBIDDEN_FLAGS: dict[str, str] = {
    "--enable-prefix-caching": (
        "crashes Qwen3.5 on vLLM 0.19 (DeltaNet hybrid attention incompatibility); remove it"
    ),
}
# Flags that the profile renders itself: giving them again in extra_flags would conflict.
RENDERED_FLAGS = frozenset(
    {
        "--served-model-name",
        "--port",
        "--max-model-len",
        "--gpu-memory-utilization",
        "--reasoning-parser",
        "--attention-backend",
        "--speculative-config",
    }
)


def _check_env(env: dict[str, str]) -> dict[str, str]:
    for k, v in env.items():
        names.check(names.ENV_NAME, k, "environment variable name")
        names.check(names.ENV_VALUE, v, f"value for {k}")
    return env


def _check_flags(flags: tuple[str, ...]) -> tuple[str, ...]:
    for f in flags:
        if f.startswith("--"):
            flag, eq, value = f.partition("=")
            names.check(names.FLAG, flag, "vLLM flag")
            if eq:
                names.check(names.FLAG_VALUE, value, f"value for {flag}")
            if flag in FORBIDDEN_FLAGS:
                raise ValueError(f"{flag} is refused: {FORBIDDEN_FLAGS[flag]}")
            if flag in RENDERED_FLAGS:
                raise ValueError(f"{flag} is set by the launch profile's own field; set that field instead")
        else:
            names.check(names.FLAG_VALUE, f, "flag value")
    return flags


EnvVars = Annotated[dict[str, str], AfterValidator(_check_env)]
Flags = Annotated[tuple[str, ...], AfterValidator(_check_flags)]


# Far above Qwen3.5's 262144 native context; a bound keeps a typo from reaching vLLM as 1e18.
MAX_MODEL_LEN = 1 << 22


class LaunchOverrides(Strict):
    """Per-node changes to the launch profile (anything left out comes from the profile)."""

    gpu_memory_utilization: Float | None = None
    max_model_len: Int | None = Field(default=None, ge=256, le=MAX_MODEL_LEN)
    env: EnvVars = {}
    extra_flags: Flags = ()
    speculative: Speculative | None = None

    @field_validator("gpu_memory_utilization")
    @classmethod
    def _gmu_floor(cls, v: float | None) -> float | None:
        return None if v is None else _check_gmu_floor(v)


class LaunchProfile(Strict):
    image: ImageRef
    container_name: ContainerName
    models_dir: CacheDir = "~/models"
    model_dir: Annotated[str, _path("model directory name (relative to models_dir)", "relative")]
    served_model_name: Annotated[str, shaped(names.CONTAINER_NAME, "served model name")]
    port: Port = 8000
    max_model_len: Int = Field(ge=256, le=MAX_MODEL_LEN)
    gpu_memory_utilization: Float
    reasoning_parser: Annotated[str, shaped(names.NODE_NAME, "reasoning parser")] | None = "qwen3"
    attention_backend: Literal["FLASHINFER", "FLASH_ATTN", "TRITON_ATTN", "TORCH_SDPA"] | None = "FLASHINFER"
    speculative: Speculative | None = Speculative()
    env: EnvVars = {}
    cache_mounts: tuple[Mount, ...] = ()
    extra_flags: Flags = ()
    health_timeout_s: Int = Field(default=1500, ge=10, le=6 * 3600, description="install.sh waits 1500 s for a cold start")
    # Runbook: "Backup JIT caches after successful first boot ... Restoring these skips the 30-45
    # min compilation entirely on fresh deploys." One folder per cache key, on the build host.
    jit_cache_store: CacheDir = "~/backups/jit-cache"
    # A node about to boot a key another node compiled gets that node's sealed cache, verified,
    # instead of compiling for 25-45 min (runbook/jit_cache.py); false: every node compiles its own.
    ship_jit_cache: bool = True

    @field_validator("gpu_memory_utilization")
    @classmethod
    def _gmu_floor(cls, v: float) -> float:
        return _check_gmu_floor(v)

    def for_node(self, overrides: LaunchOverrides | None) -> "LaunchProfile":
        if overrides is None:
            return self
        data = self.model_dump()
        if overrides.gpu_memory_utilization is not None:
            data["gpu_memory_utilization"] = overrides.gpu_memory_utilization
        if overrides.max_model_len is not None:
            data["max_model_len"] = overrides.max_model_len
        if overrides.speculative is not None:
            data["speculative"] = overrides.speculative.model_dump()
        data["env"] = {**self.env, **overrides.env}
        data["extra_flags"] = tuple(self.extra_flags) + tuple(overrides.extra_flags)
        return LaunchProfile.model_validate(data)


def _check_gmu_floor(v: float) -> float:
    if not math.isfinite(v):  # nan passes every comparison below
        raise ValueError(f"{v} is not a finite number; use 0.85")
    if v <= MIN_GMU:
        raise ValueError(
            f"{v} is at or below {MIN_GMU}: it passes request_memory() but CUDA graph capture OOMs "
            "(runbook lesson 10). Use 0.85 on a clean boot; if free memory is short, reboot to clear residue"
        )
    if v > 1:
        raise ValueError(f"{v} is above 1.0: GMU is a fraction of the CUDA-visible total")
    return v


# -- nodes, gateway, bench ---------------------------------------------------------------------


class SshTarget(Strict):
    host: Host
    port: Port = 22
    user: UserName
    key_path: NodePath | None = Field(default=None, description="private key; None = ssh-agent")
    known_hosts: NodePath = "~/.ssh/known_hosts"
    home: AbsPath | None = Field(default=None, description="the user's home on the node; default /home/USER")

    @property
    def home_dir(self) -> str:
        return self.home or ("/root" if self.user == "root" else f"/home/{self.user}")


class Node(SshTarget):
    name: NodeName
    hardware: str = Field(description="a hardware profile name: founders | gx10 | a profile of this file")
    roles: tuple[Literal["build", "serve"], ...] = ("serve",)
    overrides: LaunchOverrides | None = None
    bench_floor_tok_s: Float | None = Field(default=None, ge=0, le=1e5, description="below this the node is not promoted")


# How the proxy takes a new config, and the argv each way runs in reload_dir by default (a compose
# project). graceful: SIGHUP to LiteLLM's gunicorn master (`litellm --run_gunicorn`): a new worker
# reads the config while the old one finishes its streams (up to the proxy's
# GRACEFUL_SHUTDOWN_TIMEOUT). restart: the proxy stops and starts, dropping every stream in flight
# on every node and answering nothing for its start-up (~15 s); for a proxy not under gunicorn,
# where SIGHUP would end it.
RELOAD_COMMANDS: dict[str, tuple[str, ...]] = {
    "graceful": ("docker", "compose", "kill", "-s", "SIGHUP", "litellm"),
    "restart": ("docker", "compose", "restart", "litellm"),
}


class Gateway(SshTarget):
    """The LiteLLM proxy host."""

    proxy_port: Port = 4000
    config_path: NodePath
    reload: Literal["graceful", "restart"] = Field(
        default="restart",
        description="graceful: the proxy runs under gunicorn and reloads on SIGHUP without dropping streams; "
                    "restart: any proxy, every stream in flight is dropped",
    )
    reload_command: tuple[str, ...] = Field(
        default=(), description="argv run in reload_dir on the gateway host after the config is written "
                                "(default: the reload mode's compose command)")
    reload_dir: NodePath | None = None
    # A graceful reload has no exit status worth trusting (`docker compose kill -s SIGHUP` returns
    # at once): a SIGHUP that ends a proxy not under gunicorn, or a new worker that never starts,
    # leaves clients without a gateway. Not ready this long after it: restart the proxy (streams
    # in flight are dropped, but the gateway serves again).
    graceful_confirm_s: Int = Field(default=30, ge=1, le=600,
                                    description="a graceful reload not ready by then is followed by restart_command")
    restart_command: tuple[str, ...] = Field(default=RELOAD_COMMANDS["restart"],
                                             description="argv run in reload_dir when a graceful reload is not confirmed")
    pools: tuple[Annotated[str, shaped(names.NODE_NAME, "pool name")], ...] = ("fast", "reasoning", "code")
    routing_strategy: Literal[
        "latency-based-routing", "simple-shuffle", "least-busy", "usage-based-routing"
    ] = "latency-based-routing"
    backend_api_key: Annotated[str, shaped(names.ENV_VALUE, "backend api key")] = "dummy"
    model_id_stem: Annotated[str, shaped(names.NODE_NAME, "model id stem")] = "qwen35-122b"
    master_key_env: Annotated[str, shaped(names.ENV_NAME, "environment variable name")] = "LITELLM_MASTER_KEY"
    # The node address the gateway uses to reach a node's vLLM; default: the node's SSH host.
    api_host_overrides: dict[str, Host] = {}
    # A drain (bench, experiment) or gateway step that would leave fewer nodes in the rotation
    # waits or is refused. 0 lets a bench empty the gateway (a one-node fleet); the gateway
    # step never writes an empty rotation whatever this says.
    min_in_rotation: int = Field(default=1, ge=0, le=64, description="nodes that always stay in the gateway's rotation")
    # A drained node's requests in flight end before its container stops, its bench starts or it
    # reboots (vLLM's num_requests_running + waiting read to 0, runbook.rotation.drained); past
    # this the drain is undone and that step refused, nothing changed.
    in_flight_wait_s: Int = Field(default=600, ge=0, le=86400,
                                  description="how long a drained node's requests in flight may take to end")
    front: GatewayFront | None = Field(
        default=None, description="nginx on proxy_port before LiteLLM (on front.litellm_port): no client "
                                  "connection is reset by a graceful reload; none: LiteLLM itself on proxy_port")

    @model_validator(mode="before")
    @classmethod
    def _reload_command_of_its_mode(cls, data: Any) -> Any:
        if isinstance(data, dict) and "reload_command" not in data:  # a bad mode is the field's own error
            data = {**data, "reload_command": RELOAD_COMMANDS.get(data.get("reload", "restart"), ())}
        return data

    @model_validator(mode="after")
    def _front_beside_litellm(self) -> Gateway:
        if self.front is not None and self.front.litellm_port == self.proxy_port:
            raise ValueError(f"front.litellm_port {self.front.litellm_port} is proxy_port, the front's own: give "
                             "LiteLLM another port on the gateway host's loopback (e.g. 4001)")
        return self

    @field_validator("pools")
    @classmethod
    def _pools(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("at least one pool is needed (the runbook uses fast, reasoning, code)")
        if len(set(v)) != len(v):
            raise ValueError(f"pool names repeat: {list(v)}")
        return v


class Fleet(Strict):
    nodes: tuple[Node, ...]
    hardware_profiles: dict[Annotated[str, shaped(names.NODE_NAME, "hardware profile name")], HardwareProfile] = {}
    pins: Pins
    launch: LaunchProfile
    gateway: Gateway
    bench: BenchSettings = BenchSettings()
    preflight: PreflightSettings = PreflightSettings()
    cold_drain: ColdDrainSettings = ColdDrainSettings()
    node_os: NodeOsSettings = NodeOsSettings()
    rollout: RolloutSettings = RolloutSettings()
    distribution: DistributionSettings = DistributionSettings()
    versions: VersionSettings = VersionSettings()
    adoption: AdoptionSettings = AdoptionSettings()
    health: HealthSettings = HealthSettings()
    ssh: StepRetrySettings = StepRetrySettings()
    retention: RetentionSettings = RetentionSettings()
    pairs: tuple[NodePair, ...] = Field(default=(), description="node pairs serving one model at TP=2 (Phase 4-alt)")

    @field_validator("nodes")
    @classmethod
    def _nodes(cls, v: tuple[Node, ...]) -> tuple[Node, ...]:
        if not v:
            raise ValueError("the fleet has no nodes: add at least one under 'nodes'")
        seen: set[str] = set()
        for n in v:
            if n.name in seen:
                raise ValueError(f"node name {n.name!r} appears twice: node names must be unique")
            seen.add(n.name)
        return v

    @model_validator(mode="after")
    def _runbook_rules(self) -> "Fleet":
        profiles = self.profiles
        builders = [n.name for n in self.nodes if "build" in n.roles]
        if len(builders) != 1:
            raise ValueError(
                f"exactly one node needs the 'build' role in its roles (found {builders or 'none'}): "
                "the checkpoint and images are built once and streamed to the serving nodes"
            )
        for i, node in enumerate(self.nodes):
            where = f"nodes[{i}] ({node.name})"
            if node.hardware not in profiles:
                raise ValueError(
                    f"{where}.hardware: unknown profile {node.hardware!r}; use one of {sorted(profiles)} "
                    "or define it under hardware_profiles"
                )
            prof = profiles[node.hardware]
            try:
                launch = self.launch_for(node)
            except ValidationError as e:
                first = e.errors()[0]
                field = ".".join(str(x) for x in first["loc"])
                raise ValueError(f"{where}.overrides: with the launch profile, {field}: {first['msg']}") from None
            gmu = launch.gpu_memory_utilization
            if gmu > prof.max_gmu:
                raise ValueError(
                    f"{where}: gpu_memory_utilization {gmu} is above the {prof.name} profile's max {prof.max_gmu} "
                    f"({gmu} x {prof.cuda_total_gib} GiB = {gmu * prof.cuda_total_gib:.2f} GiB fails request_memory()); "
                    f"use {min(0.85, prof.max_gmu)}"
                )
            required = FIX_ENV_VARS if prof.requires_fix_env else JIT_THROTTLE_ENV_VARS
            missing = [k for k in required if k not in launch.env]
            if missing:
                why = (
                    "the 2026-06-18 fix: without them vLLM ends with num_gpu_blocks=0 and EngineCore is OOM-killed"
                    if prof.requires_fix_env
                    else "unthrottled FlashInfer JIT OOM-kills the node"
                )
                raise ValueError(f"{where}: launch env is missing {', '.join(missing)} ({why}); add them under launch.env")
        if not self.gateway.reload_command:
            raise ValueError("gateway.reload_command is empty: give the argv that reloads LiteLLM, "
                             f"e.g. {list(RELOAD_COMMANDS[self.gateway.reload])}")
        if self.rollout.canary is not None and self.rollout.canary not in {n.name for n in self.serve_nodes}:
            raise ValueError(f"rollout.canary names {self.rollout.canary!r}, which is not a serve node")
        for name in self.cold_drain.smart_plugs:
            if name not in {n.name for n in self.nodes}:
                raise ValueError(f"cold_drain.smart_plugs names unknown node {name!r}")
        for name in self.gateway.api_host_overrides:
            if name not in {n.name for n in self.nodes}:
                raise ValueError(f"gateway.api_host_overrides names unknown node {name!r}")
        check_pairs(self.pairs, self.node_names, [n.name for n in self.serve_nodes])
        return self

    # -- lookups used everywhere --

    @property
    def profiles(self) -> dict[str, HardwareProfile]:
        return {**BUILTIN_PROFILES, **self.hardware_profiles}

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise FleetError(f"no node named {name!r} in the fleet; known nodes: {', '.join(self.node_names)}")

    @property
    def node_names(self) -> list[str]:
        return [n.name for n in self.nodes]

    @property
    def build_node(self) -> Node:
        return next(n for n in self.nodes if "build" in n.roles)

    @property
    def serve_nodes(self) -> list[Node]:
        return [n for n in self.nodes if "serve" in n.roles]

    def profile_of(self, node: Node) -> HardwareProfile:
        return self.profiles[node.hardware]

    def launch_for(self, node: Node) -> LaunchProfile:
        return self.launch.for_node(node.overrides)

    def bench_floor(self, node: Node) -> float:
        return node.bench_floor_tok_s if node.bench_floor_tok_s is not None else self.bench.floor_tok_s


# -- loading -----------------------------------------------------------------------------------


class FleetError(Exception):
    """A fleet file that cannot be used; the message (one line) says which field and what to do."""


MAX_STRING = 4096

def _refuse_hostile(data: Any) -> None:
    """Before the models: no control or invisible characters, binary values, non-text keys,
    cycles or runaway sizes anywhere, whatever field they are in (the message names it)."""
    stack: list[tuple[Any, tuple[Any, ...], frozenset[int]]] = [(data, (), frozenset())]
    seen = 0
    while stack:
        value, loc, ancestors = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise ValueError(f"the fleet holds more than {MAX_VALUES} values (YAML aliases?); write it out plainly")
        where = render_path(loc, data) or "(top level)"
        if isinstance(value, (dict, list, tuple)):
            if id(value) in ancestors:
                raise ValueError(f"{where}: refers to itself (recursive YAML alias); write the value out")
            inner = ancestors | {id(value)}
            if len(loc) > MAX_DEPTH:
                raise ValueError(f"{where}: nested deeper than {MAX_DEPTH} levels; a fleet file is a few levels deep")
            if isinstance(value, dict):
                for k, v in value.items():
                    if not isinstance(k, str):
                        raise ValueError(f"{where}: key {names.shown(k)} is not text; quote it or remove it")
                    stack.append((k, loc + (k,), inner))
                    stack.append((v, loc + (k,), inner))
            else:
                stack.extend((v, loc + (i,), inner) for i, v in enumerate(value))
        elif isinstance(value, str):
            if len(value) > MAX_STRING:
                raise ValueError(f"{where}: a {len(value)}-character value; no fleet field needs more than {MAX_STRING}")
            _check_text_at(value, where)
        elif isinstance(value, (bytes, bytearray, set, frozenset)):
            raise ValueError(f"{where} = {names.shown(value)}: a {type(value).__name__} value (YAML tag?); write plain text")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{where} = {value!r}: write a finite number (.nan and .inf are refused)")


def _check_text_at(value: str, where: str) -> None:
    try:
        _check_text(value)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


# The runbook's own fleet in the clone: what every command reads when neither --fleet nor
# SPARK_FLEET names another file.
SEED_FLEET = "fleets/seed.yaml"


def parse_fleet(data: Any, source: str = "<fleet>") -> Fleet:
    if data is None:
        raise FleetError(f"{source}: the file is empty; start from a copy of fleets/seed.yaml")
    if not isinstance(data, dict):
        raise FleetError(f"{source}: expected a mapping with nodes, pins, launch, gateway at the top level, "
                         f"got {'a list' if isinstance(data, list) else type(data).__name__}")
    try:
        _refuse_hostile(data)
        return Fleet.model_validate(data)
    except ValidationError as e:
        raise FleetError(f"{source}: {explain(e, data)}") from None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as e:
        # _refuse_hostile's own refusals; anything else is a validator bug, still one line.
        raise FleetError(one_line(f"{source}: {e}")) from None


def load_fleet(path: str | os.PathLike[str]) -> Fleet:
    """Read, parse and validate a fleet file. Raises only FleetError, with a one-line message."""
    return load_fleet_text(read_fleet_text(path), path)


def fleet_digest(text: str) -> str:
    """What names one version of a fleet file: the code location records the digest of the text
    it loaded, and a run refuses a file that differs from it."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_fleet_text(path: str | os.PathLike[str]) -> str:
    """The fleet file's text (bounded, UTF-8). Raises only FleetError, with a one-line message."""
    p = Path(path)
    try:
        with p.open("rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise FleetError(f"fleet file {p} does not exist; pass --fleet PATH (e.g. fleets/seed.yaml)") from None
    except OSError as e:
        raise FleetError(f"fleet file {p} cannot be read: {e.strerror}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise FleetError(f"fleet file {p} is over {MAX_FILE_BYTES // 1024} KiB; a fleet file is a few KB: check the path")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise FleetError(f"fleet file {p} is not UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r}); "
                         "save it as UTF-8") from None


def load_fleet_text(text: str, path: str | os.PathLike[str] = "<fleet>") -> Fleet:
    """Parse and validate a fleet file's text (`path` names it in messages)."""
    p = Path(path)
    try:
        data = load_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = str(getattr(e, "problem", None) or e)
        if "constructor for the tag" in problem:
            problem += "; remove the tag: only plain YAML values are read"
        raise FleetError(one_line(f"fleet file {p} is not valid YAML{where}: {problem}")) from None
    except HugeNumber as e:
        raise FleetError(one_line(f"{p}: {render_path(e.loc)} = a number of {e.chars} characters (line {e.line}): "
                                  "write a number in range")) from None
    except (ValueError, RecursionError, MemoryError, OverflowError, TypeError) as e:
        # e.g. an integer of 5000 digits (int() refuses it), an alias bomb, a recursive alias
        why = ("it holds a number with thousands of digits; write a number in range"
               if "integer string conversion" in str(e) else str(e))
        raise FleetError(one_line(f"fleet file {p} cannot be used: {why}")) from None
    return parse_fleet(data, str(p))
