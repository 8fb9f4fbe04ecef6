"""``python -m tokenswift``: the same as the ``tokenswift`` command."""

import sys

from tokenswift.cli import main

sys.exit(main())
