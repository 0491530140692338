# Quick start targets. Each bootstraps what it needs (Debian packages, virtual environments).
SHELL := /bin/bash
export DAGSTER_HOME ?= $(CURDIR)/.dagster-home
export SPARK_VLLM_VENV ?= /opt/spark-pipelines/vllm
export SPARK_LITELLM_VENV ?= /opt/spark-pipelines/litellm

.PHONY: demo plan test test-fast ui sim-down team-up team-down

# The main job: bring up the simulated GB10 fleet, materialize the whole chain, print bench results.
# `make demo NODES=4` for a bigger fleet (1-32).
NODES ?= 2
demo:
	@scripts/bootstrap.sh base litellm
	.venv/bin/spark-pipelines demo --nodes $(NODES)

# What a deploy of the runbook's fleet would do, touching nothing.
plan:
	@scripts/bootstrap.sh base
	.venv/bin/spark-pipelines plan --fleet fleets/seed.yaml

# The whole suite: unit tests, then the slow tier against real sshd, dockerd, vLLM and LiteLLM.
test:
	@scripts/bootstrap.sh base litellm vllm test team prometheus
	scripts/test-suite.sh

test-fast:
	@scripts/bootstrap.sh base
	.venv/bin/python -m pytest -m "not slow"

# The Dagster UI (`dg dev`) on the demo's instance, fleet file and gateway key, on
# http://127.0.0.1:$(PORT). A console a killed demo left on the instance is stopped first: one daemon
# per instance.
PORT ?= 3000
ui:
	@scripts/bootstrap.sh base
	@.venv/bin/python -c "import sys; from spark_pipelines.cli.demo import ui_command; sys.exit(ui_command(sys.argv[1]))" '$(PORT)'

sim-down:
	.venv/bin/spark-pipelines sim down

# The team instance on this machine (docs/team-instance.md): PostgreSQL, the Dagster daemon and UI on
# http://127.0.0.1:3000, the code server and every run in containers of the offline-built image.
# State under $$SPARK_TEAM_ROOT (default /var/lib/spark-pipelines/team); team-down keeps the database.
team-up:
	@scripts/bootstrap.sh base team
	.venv/bin/spark-pipelines team up

team-down:
	.venv/bin/spark-pipelines team down
