"""``python -m bijax.cli``: the same as the ``bijax`` command."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from bijax.cli import main  # noqa: E402

sys.exit(main())
