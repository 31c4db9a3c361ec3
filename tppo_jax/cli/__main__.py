"""``python -m tppo_jax.cli ...`` = ``tppo ...``."""

import sys

from tppo_jax.cli import main

sys.exit(main())
