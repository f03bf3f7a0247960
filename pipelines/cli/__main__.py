"""`python -m kfvision.pipelines.cli` = `kfvision`."""

import sys

from kfvision.pipelines.cli import main

sys.exit(main())
