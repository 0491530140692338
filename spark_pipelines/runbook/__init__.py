"""The runbook's multi-step procedures, framework-free: plain Python over the resources' sessions.

Each procedure that changes a node carries its undo (deploy rolls back, a drain restores, exporters
stopped for preflight come back). Failures are `RunbookError`s whose message names the node and
says what to do; the asset wiring turns them into `dg.Failure`. Nothing here imports dagster.
"""
