"""``python -m loraplex``: the ``loraplex`` console script (pyproject's ``[project.scripts]``) without it on PATH."""

import sys

from loraplex.cli import main

sys.exit(main())
