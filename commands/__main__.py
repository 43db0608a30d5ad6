"""``python -m commands``: the ``pagestream`` CLI without an installed console script."""

import sys

from commands import main

sys.exit(main())
