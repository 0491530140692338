"""The runbook's hand-written LiteLLM config (Phase 5, "Config on LITELLM_HOST"), as an operator
has it on the gateway host: the six entries (pools fast / reasoning / code x spark1 / spark2) with
the runbook's comments, its quoting (`api_key: "dummy"`) and no spark-pipelines marks. The
runbook's copy lost its indentation when it was sanitized; `indent` puts the entries where an
operator would (2: under the key; 0: YAML's indentless style)."""

from __future__ import annotations

_ENTRY = """\
{i}- model_name: {pool}
{i}  litellm_params:
{i}    model: openai/qwen35-hybrid-v2
{i}    api_base: http://{ip}:{port}/v1
{i}    api_key: "dummy"
{i}  model_info:
{i}    id: {node}-qwen35-122b-{pool}
"""


def runbook_config(spark1_ip: str = "SPARK1_IP", spark2_ip: str = "SPARK2_IP", *, indent: int = 2,
                   port: int = 8000, tail: str = "") -> str:
    i = " " * indent
    out = "# In LITELLM_CONFIG_PATH (e.g. /home/USER/litellm/config.yaml)\nmodel_list:\n"
    out += f"{i}# spark1 entries\n"
    out += "".join(_ENTRY.format(i=i, pool=p, ip=spark1_ip, port=port, node="spark1") for p in ("fast", "reasoning", "code"))
    out += f"{i}# spark2 entries (identical, different api_base)\n"
    out += "".join(_ENTRY.format(i=i, pool=p, ip=spark2_ip, port=port, node="spark2") for p in ("fast", "reasoning", "code"))
    return out + tail
