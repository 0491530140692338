"""The faces: `spark-pipelines` and its subcommands (main.py parses them, one module each), the demo's
console and run launcher. They stand outside the code location: nothing in it imports them
(pyproject's import contracts)."""
