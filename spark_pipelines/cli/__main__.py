"""`python -m spark_pipelines.cli`: the same as the `spark-pipelines` command."""

import sys

from spark_pipelines.cli.main import main

sys.exit(main())
