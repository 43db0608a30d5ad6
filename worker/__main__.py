"""``python -m worker``: the ``pagestream`` CLI without an installed console script."""

import sys

from worker.cli import main

sys.exit(main())
