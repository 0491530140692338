"""The team instance: PostgreSQL, the Dagster daemon and webserver, the code location and every run
in containers of an image built offline (instance.py brings it up and down)."""
