"""`python -m offload.cli`: the `offload` command."""

import sys

from offload.cli.main import main

sys.exit(main())
