"""``python -m lightlike``: the command line."""

import sys

from lightlike.cli import main

sys.exit(main())
