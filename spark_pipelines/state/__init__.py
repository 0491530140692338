"""What outlives a run: the markers a step leaves on a node, the ledger of why a node is out of the
gateway, and the records on the Dagster instance. A run can be killed at any line; what it set
aside, which node is out and why, and what a node runs are written here before they matter, so
the next run or sweep can finish or undo what a dead one left."""
