"""`python -m kimi_mlx ...` is the `kimi-mlx` command."""

import sys

from kimi_mlx.commands.main import main

sys.exit(main())
